"""The checks of notebooks 04 and 07: right answers pass, wrong answers are told what is wrong."""
import pytest

import workbench as wb
from workbench.exercises import checks_spmd_pipeline as ex
from workbench.exercises.checks import CheckError
from workbench.parallel.rules import RULES, combine
from workbench.parallel.ops_table import strategy

S = wb.schedules
R, Sh, P = wb.Replicate(), wb.Shard, wb.Partial()


from tests.exercise_helpers import fails, passes  # noqa: E402


def test_every_check_is_exported_and_raises_the_course_error():
    assert set(ex.__all__) == {"check_mlp_plan", "check_cumsum_rule", "check_hand_schedule",
                               "check_min_microbatches", "check_zb_bubble"}
    assert issubclass(CheckError, AssertionError)


# ---- 04: Megatron's MLP plan ---------------------------------------------------------------------

def test_mlp_plan(capsys):
    col, row = {"0.weight": ["S(0)"], "0.bias": ["S(0)"]}, {"2.weight": ["S(1)"]}
    out = passes(capsys, ex.check_mlp_plan, {**col, **row})
    assert "linear [S(1)] -> relu [S(1)] -> linear [P(sum)]" in out and "{U_tp}" in out
    out = passes(capsys, ex.check_mlp_plan, {"0.weight": ["S(0)"], "2.weight": ["S(1)"]})
    assert ("0.bias stays [R]: every rank stores all 64 values and cuts out its 16"
            in " ".join(out.split()))                     # wrapped at text_width.WIDTH
    passes(capsys, ex.check_mlp_plan, {"0": "colwise", "2": "rowwise"}, styles=True)
    # section 5 of notebook 04 shows the styles: the exercise asks for placements
    fails(r"your plan names styles .*section 5 already wrote", ex.check_mlp_plan,
          {"0": "colwise", "2": "rowwise"})
    fails(r"relu \(layer 1\) inserts reduce_scatter.*layer 0's weight \[S\(1\)\] splits its "
          r"input features", ex.check_mlp_plan, {"0.weight": ["S(1)"], "2.weight": ["S(0)"]})
    fails(r"relu \(layer 1\) inserts reduce_scatter", ex.check_mlp_plan,
          {"0": "rowwise", "2": "rowwise"}, styles=True)
    fails(r"linear \(layer 2\) inserts .*layer 2's weight \[S\(0\)\] splits its output "
          r"features.*Split its input features", ex.check_mlp_plan,
          {"0.weight": ["S(0)"], "2.weight": ["S(0)"]})
    fails(r"layer 2's weight is replicated.*'2.weight'", ex.check_mlp_plan,
          {"0.weight": ["S(0)"]})
    fails(r"layer 0's weight is replicated", ex.check_mlp_plan, {})
    fails("parallelize rejected your plan: plan keys \\['3'\\]", ex.check_mlp_plan,
          {"3": ["S(0)"]})
    fails(r"plan key 0 \(int\): keys are module or parameter names as strings", ex.check_mlp_plan,
          {0: ["S(0)"], 2: ["S(1)"]})
    fails("should be a dict", ex.check_mlp_plan, [["S(0)"], ["S(1)"]])


def test_mlp_plan_leaves_the_global_random_state_alone():
    import torch
    torch.manual_seed(123)
    a = torch.rand(1)
    torch.manual_seed(123)
    ex.check_mlp_plan({"0.weight": ["S(0)"], "2.weight": ["S(1)"]})
    assert torch.equal(torch.rand(1), a)


# ---- 04: a rule for cumsum -----------------------------------------------------------------

@pytest.fixture
def cumsum_slot():
    """Register rules for 'cumsum' inside the test only."""
    before = RULES.get("cumsum")
    yield
    if before is None:
        RULES.pop("cumsum", None)
    else:
        RULES["cumsum"] = before
    strategy._infer_cached.cache_clear()


def rule_from(options):
    """A cumsum rule whose per-mesh-dim options are ``options(x, dim)``."""
    def rule(x, dim):
        return combine(x.mesh.ndim, [options(x, dim)] * x.mesh.ndim, 1)
    return rule


def solution(x, dim):
    dim = dim % x.ndim
    opts = [((R,), (R,), "replicated")]
    opts += [((Sh(d),), (Sh(d),), "passes") for d in range(x.ndim) if d != dim]
    return opts + [((P,), (P,), "linear")]


def register(fn):
    return wb.register_rule("cumsum", override=True)(fn)


def test_cumsum_rule_right(capsys, cumsum_slot):
    out = passes(capsys, ex.check_cumsum_rule, register(rule_from(solution)))
    assert "strategies computed right" in out


@pytest.mark.parametrize("options,match", [
    (lambda x, dim: solution(x, dim)[:-1],                   # no P(sum) -> P(sum)
     r"x \[P\(sum\)\].*needs reduce_scatter.*\[P\(sum\)\] -> \[P\(sum\)\] needs 0 B"),
    (lambda x, dim: [o for o in solution(x, dim) if not o[0][0].is_shard()],   # no S passes
     r"x \[S\(0\)\].*dim=1.*your rule's cheapest strategy \[R\] -> \[R\] needs all_gather"
     r".*\[S\(0\)\] -> \[S\(0\)\] needs 0 B"),
    (lambda x, dim: solution(x, dim) + [((Sh(dim % x.ndim),), (Sh(dim % x.ndim),), "bad")],
     r"scanned dim stay sharded \(\[S\(1\)\] -> \[S\(1\)\]\).*dim 1.*must be whole"),
    (lambda x, dim: [((R,), (R,), "r")] + [((Sh(d),), (Sh(d),), "p")
                                           for d in range(x.ndim) if d != dim]
     + [((P,), (P,), "l")],
     r"dim -1.*normalise it with dim % x.ndim"),                 # forgot dim % x.ndim
    (lambda x, dim: solution(x, dim)[:-1] + [((P,), (R,), "bad")],
     r"\[P\(sum\)\] -> \[R\] announces Replicate.*compute different values"),
    (lambda x, dim: [((Sh(d),), (R,), "bad") for d in range(x.ndim) if d != dim % x.ndim]
     + [((R,), (R,), "r")],
     r"\[S\(0\)\] -> \[R\] announces the output \[R\].*shape of its input shard"),
    (lambda x, dim: solution(x, dim) + [((wb.Partial("max"),), (wb.Partial("max"),), "bad")],
     r"accepts P\(max\).*not with max"),
    (lambda x, dim: solution(x, dim)[::-1],                  # P(sum) first, R last: a tie
     r"x \[R\].*offers \[R\] -> \[R\], but lists it after \[P\(sum\)\] -> \[P\(sum\)\]"
     r".*x is kept on one rank, zeros on the others.*before the Partial one"),    (lambda x, dim: solution(x, dim)[1:],                    # no R -> R: x [R] is cut
     r"x \[R\] of shape \(4, 8\).*offers no strategy that uses x as it is.*cumsum comes out "
     r"\[S\(0\)\], sharded where x was replicated.*Offer \[R\] -> \[R\] too"),
    (lambda x, dim: solution(x, dim)[1:-1] + solution(x, dim)[:1] + solution(x, dim)[-1:],
     r"x \[R\].*offers \[R\] -> \[R\], but lists it after \[S\(0\)\] -> \[S\(0\)\]"
     r".*each rank cuts its slice of x.*keep x as it is first"),    # S before R: a tie
])
def test_cumsum_rule_wrong(options, match, cumsum_slot):
    fails(match, ex.check_cumsum_rule, register(rule_from(options)))


def test_the_librarys_own_rule_passes_negative_dims_included(capsys):
    """The library's cumsum rule (the op table's) passes the exercise's check, whose cases
    ask infer with dim=-1: a rule must wrap a negative dim itself, as infer hands it the
    user's dim (the dispatcher's parse wraps it before a run).  Softmax, on the same helper,
    decides alike for dim=-1 and dim=1."""
    passes(capsys, ex.check_cumsum_rule, RULES["cumsum"])
    spec = wb.TensorSpec((4, 8), wb.Mesh.grid(4, ["x"]), ["S(1)"])
    for op in ("softmax", "cumsum"):
        neg, pos = (wb.spmd.infer(op, spec, dim=d) for d in (-1, 1))
        assert [c.strategy for c in neg.candidates] == [c.strategy for c in pos.candidates], op
        assert neg.inputs[0] != (Sh(1),), op        # the scanned dim is never left sharded


def test_cumsum_rule_mistakes_in_the_code(cumsum_slot):
    def unregistered(x, dim):
        return []
    RULES.pop("cumsum", None)
    fails(r"no rule is registered for 'cumsum'.*@wb.register_rule\('cumsum', override=True\)",
          ex.check_cumsum_rule, unregistered)
    register(rule_from(solution))
    fails("not your function", ex.check_cumsum_rule, unregistered)
    fails("pass your rule function", ex.check_cumsum_rule, "cumsum")

    def no_dim(x):
        return combine(x.mesh.ndim, [[((R,), (R,), "r")]] * x.mesh.ndim, 1)
    fails(r"your rule takes \(x\); the dispatcher calls rule\(x, dim=...\)", ex.check_cumsum_rule,
          register(no_dim))

    def no_combine(x, dim):
        return solution(x, dim)
    fails(r"AttributeError.*Strategy objects.*combine", ex.check_cumsum_rule,
          register(no_combine))

    def nothing(x, dim):
        return []
    fails(r"no valid placement.*offer \(\(R,\), \(R,\), ...\)", ex.check_cumsum_rule,
          register(nothing))

    def one_mesh_dim(x, dim):                    # right on a 1-d mesh, too short on a 2-d one
        return combine(1, [solution(x, dim % x.ndim)], 1)
    fails(r"x \[R, R\].*one placement per mesh dim \(this mesh has 2\).*x\.mesh\.ndim",
          ex.check_cumsum_rule, register(one_mesh_dim))


# ---- 07: a schedule by hand ---------------------------------------------------------------------

BEST = ["F0 F1 B0 F2 B1 B2", "F0 F1 B0 F2 B1 B2", "F0 B0 F1 B1 F2 B2"]


def test_hand_schedule(capsys):
    out = passes(capsys, ex.check_hand_schedule, S.Schedule.from_text(BEST))
    assert "12 time units" in out and "at most 2" in out and "1F1B: 10 units" in out
    fails("(?s)takes 18 time units.*a faster one exists within 2 activations", ex.check_hand_schedule,
          S.Schedule.from_text(["F0 B0 F1 B1 F2 B2"] * 3))
    # the slow or too-full schedule's own timeline is in the message, where it idles
    fails(r"takes 14 time units \(bubble 57%\):\nrank 0 \|FF\.\.\.\.BF\.\.\.\.BB\|\n"
          r"rank 1 .*\nrank 2 \|\.\.FFB\.\.\.\.FBB\.\.\|\nbubble: .*\na faster one",
          ex.check_hand_schedule, S.Schedule.from_text(["F0 F1 B0 F2 B1 B2"] * 3))
    fails(r"holds too much:\nrank 0 \|FFF\.\.B\.B\.B\|\n(.*\n){3}rank 0 holds 3",
          ex.check_hand_schedule, S.one_f_one_b(3, 3))
    fails(r"cannot run: B0 on rank 0 needs B0 from rank 1.*deadlock", ex.check_hand_schedule,
          S.Schedule.from_text(["F0 F1 B0 F2 B1 B2", "F0 B0 F1 B1 F2 B2",
                                "F0 F1 B0 B1 F2 B2"]))
    fails("cannot run: rank 1 runs B2 before F2", ex.check_hand_schedule,
          S.Schedule.from_text(["F0 F1 B0 F2 B1 B2", "F0 F1 B0 B2 B1 F2", BEST[2]]))
    fails("cannot run: rank 2 never runs B2", ex.check_hand_schedule,
          S.Schedule.from_text(BEST[:2] + ["F0 B0 F1 B1 F2"]))
    fails("has 2 rows; the exercise has p=3", ex.check_hand_schedule,
          S.Schedule.from_text(BEST[:2]))
    fails("runs m=2 micro-batches", ex.check_hand_schedule,
          S.Schedule.from_text(["F0 F1 B0 B1", "F0 F1 B0 B1", "F0 B0 F1 B1"]))
    fails("give a Schedule, got list", ex.check_hand_schedule, BEST)


def test_best_makespan_is_the_exhaustive_optimum():
    assert ex._best_makespan(3, 3, 2) == 12
    assert ex._best_makespan(3, 3, 3) == S.simulate(S.one_f_one_b(3, 3)).makespan


# ---- 07: micro-batches for a small bubble --------------------------------------------------------

def test_min_microbatches(capsys):
    out = passes(capsys, ex.check_min_microbatches, 64, 32)
    assert "m=64 (9.86%)" in out and "m=32 (9.86%)" in out
    assert "crossing pv-1 = 15 stage boundaries each way instead of p-1 = 7" in out
    fails("1F1B: your m is 63.*exactly 10%", ex.check_min_microbatches, 63, 32)
    fails(r"1F1B: your m is 71.*did you use \(p-1\)/m", ex.check_min_microbatches, 71, 32)
    fails("1F1B: your m is 56.*measures 11.11%", ex.check_min_microbatches, 56, 32)
    fails(r"interleaved 1F1B \(v=2\): your m is 40.*did you use \(p-1\)/\(v m\), the bubble "
          r"over the ideal time", ex.check_min_microbatches, 64, 40)
    # too many, but not the ideal-time answer: no guess at (p-1)/m, the rule to find it
    fails(r"1F1B: your m is 65: .*a smaller m also is: find the first m at which "
          r"\(p-1\)/\(m\+p-1\) drops below 10%(?!.*did you use)", ex.check_min_microbatches, 65, 32)
    fails(r"interleaved 1F1B \(v=2\): your m is 48: .*find the first m at which "
          r"\(p-1\)/\(v m\+p-1\) drops below 10% \(m a multiple of p\)", ex.check_min_microbatches,
          64, 48)
    fails(r"interleaved 1F1B \(v=2\): your m is 24.*12.73%", ex.check_min_microbatches, 64, 24)
    fails(r"your m is 64: .* the one plain 1F1B needs: with v=2 chunks .*\(p-1\)/\(v m\+p-1\)",
          ex.check_min_microbatches, 64, 64)                 # v left out of the formula
    fails("not a multiple of p=8", ex.check_min_microbatches, 64, 30)
    fails("at least one micro-batch", ex.check_min_microbatches, 0, 32)
    fails("should be a whole number", ex.check_min_microbatches, 64.5, 32)
    fails("should be a whole number", ex.check_min_microbatches, True, 32)


def test_min_microbatches_takes_a_whole_float(capsys):
    # 06's and 11's checks of a count take 1.0 / 2.0; 07's refused 64.0 ("should be an int")
    out = passes(capsys, ex.check_min_microbatches, 64.0, 32.0)
    assert "64" in out


# ---- 07: the zero-bubble saving -------------------------------------------------------------

def test_zb_bubble(capsys):
    assert S.simulate(S.zb_h1(4, 8), f=2, b=2, w=1).bubble_time == (9.0,) * 4
    out = passes(capsys, ex.check_zb_bubble, 9)
    assert "1F1B idles (p-1)(f+b+w) = 15" in out
    passes(capsys, ex.check_zb_bubble, 9.0)
    fails("1F1B's bubble", ex.check_zb_bubble, 15)
    fails("leaves W out", ex.check_zb_bubble, 12)
    fails("ZB-H2", ex.check_zb_bubble, 6)
    fails("share of the step", ex.check_zb_bubble, 9 / 49)
    fails(r"ZB-H1 idles \(p-1\)\(f\+b-w\) per rank, with p=4", ex.check_zb_bubble, 5)
    fails("should be a number", ex.check_zb_bubble, "9")
