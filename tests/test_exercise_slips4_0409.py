"""Checker slips found in the browser review of notebooks 04 and 09 (nbr0409): wrong answers
that passed, right answers that were refused, and hints that named the wrong mistake."""
import math

import numpy as np
import pytest
import torch

import workbench as wb
from workbench.exercises import checks_fused as F
from workbench.exercises import checks_spmd_pipeline as P
from workbench.exercises.feedback import CheckError, reset_tries
from workbench.parallel.rules import combine

from .exercise_helpers import fails, fresh_cumsum_rule, passes  # noqa: F401 (a fixture)

R, S = wb.Replicate(), wb.Shard


@pytest.fixture(autouse=True)
def _fresh(fresh_cumsum_rule):
    """Tries and the "cumsum" rule restored around each test (exercise_helpers)."""


# ---- 09 exercise 1: the online-softmax update --------------------------------------------------

def _safe(m):
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def tile_max_only(m, l, acc, s, v):
    """m_new = the tile's own max, not max(m_old, rowmax(s)): exact while nothing
    overflows, but a masked tile sets m to -inf and the next tile wipes the earlier terms."""
    m_new = s.max(dim=-1, keepdim=True).values
    r, p = torch.exp(m - _safe(m_new)), torch.exp(s - _safe(m_new))
    return m_new, l * r + p.sum(-1, keepdim=True), acc * r + p @ v


def max_over_all_rows(m, l, acc, s, v):
    """One max shared by every query row (s.max() over the whole tile)."""
    m_new = torch.maximum(m, s.max()).expand_as(m)
    r, p = torch.exp(m - _safe(m_new)), torch.exp(s - _safe(m_new))
    return m_new, l * r + p.sum(-1, keepdim=True), acc * r + p @ v


def in_place(m, l, acc, s, v):
    """A right update that writes into the tensors it was given."""
    m_new = torch.maximum(m, s.max(dim=-1, keepdim=True).values)
    r, p = torch.exp(m - _safe(m_new)), torch.exp(s - _safe(m_new))
    l.mul_(r).add_(p.sum(-1, keepdim=True))
    acc.mul_(r).add_(p @ v)
    m.copy_(m_new)
    return m, l, acc


def l_acc_swapped(m, l, acc, s, v):
    m_new = torch.maximum(m, s.max(dim=-1, keepdim=True).values)
    r, p = torch.exp(m - _safe(m_new)), torch.exp(s - _safe(m_new))
    return m_new, acc * r + p @ v, l * r + p.sum(-1, keepdim=True)


def test_a_tile_max_that_forgets_the_running_max_does_not_pass():
    """Passed before: acc / l came out right on every case (no masked tile in the middle),
    though m was not the running max."""
    fails(r"m is not each row's largest score(.|\n)*running max, max\(m_old, rowmax\(s\)\)",
          F.check_online_softmax, tile_max_only)
    # what the check says happens: a masked tile between two finite ones loses the first
    g = torch.Generator().manual_seed(0)
    s, v = torch.randn(2, 12, generator=g, dtype=torch.float64), torch.randn(12, 3, dtype=torch.float64)
    s[:, 4:8] = -math.inf
    m, l, acc, _ = F._run(tile_max_only, s, v, 4)
    assert not torch.allclose(acc / l, torch.softmax(s, -1) @ v)


def test_one_max_for_all_rows_does_not_pass():
    """Passed before: a max over every row is exact on scores of one scale."""
    fails(r"one max per query row", F.check_online_softmax, max_over_all_rows)


def test_an_in_place_update_is_right(capsys):
    """Refused before with "returns m, l and acc unchanged" (the check compared the
    mutated tensors with themselves)."""
    passes(capsys, F.check_online_softmax, in_place)


def test_l_and_acc_swapped_is_named():
    """Said only "returned l of shape (3, 5); it keeps the shape (3, 1)"."""
    fails(r"l and acc swapped\? Return them in the order \(m, l, acc\)",
          F.check_online_softmax, l_acc_swapped)


# ---- 09 exercise 2: the sliding-window tile count -----------------------------------------------

def test_a_numpy_integer_count_is_an_int(capsys):
    """np.int64(21) (a count summed over a numpy grid) was refused: 'give ... an int'."""
    passes(capsys, F.check_window_tiles, np.int64(21))
    fails(r"your count is 36", F.check_window_tiles, np.int64(36))
    fails(r"an int\), got 21.0: give it as an int, int\(x\)", F.check_window_tiles, 21.0)
    fails(r"give it as an int, int\(x\)", F.check_window_tiles, torch.tensor(21))
    fails(r"an int\), got True$", F.check_window_tiles, True)
    fails(r"an int\), got '21'$", F.check_window_tiles, "21")


# ---- 04 exercise 2: the cumsum rule -------------------------------------------------------------

def _register(options):
    @wb.register_rule("cumsum", override=True)
    def rule(x, dim):
        return options(x, dim % x.ndim)
    return rule


def _base(x, dim):
    return ([((R,), (R,), "replicated")]
            + [((S(d),), (S(d),), "passes") for d in range(x.ndim) if d != dim]
            + [((wb.Partial(),), (wb.Partial(),), "linear")])


def test_a_mean_of_partials_passes_cumsum(capsys):
    """Refused before: "cumsum is linear, so it commutes with a sum, but not with avg"; a
    mean is linear too (PyTorch DTensor keeps P(avg) through its linear pointwise ops)."""
    avg = wb.Partial("avg")
    rule = _register(lambda x, d: combine(
        x.mesh.ndim, [_base(x, d) + [((avg,), (avg,), "linear")]] * x.mesh.ndim, 1))
    passes(capsys, P.check_cumsum_rule, rule)
    mx = wb.Partial("max")
    rule = _register(lambda x, d: combine(
        x.mesh.ndim, [_base(x, d) + [((mx,), (mx,), "no")]] * x.mesh.ndim, 1))
    fails(r"accepts P\(max\)(.|\n)*not with max", P.check_cumsum_rule, rule)


def test_a_malformed_combine_is_not_blamed_on_the_signature():
    """A TypeError from combine (options not tuples, no list per mesh dim) was answered
    "The dispatcher calls rule(x, dim=...)"; an IndexError (combine's input count 2)
    got no hint at all."""
    rule = _register(lambda x, d: combine(
        x.mesh.ndim, [[(R, R, "r")] + _base(x, d)[1:]] * x.mesh.ndim, 1))
    with pytest.raises(CheckError) as err:
        P.check_cumsum_rule(rule)
    assert "calls rule(x, dim=...)" not in str(err.value)
    assert "each a tuple even for one placement" in str(err.value)
    reset_tries()
    rule = _register(lambda x, d: combine(x.mesh.ndim, [_base(x, d)] * x.mesh.ndim, 2))
    fails(r"IndexError(.|\n)*the last argument counts the tensor inputs \(cumsum has 1\)",
          P.check_cumsum_rule, rule)
    rule = _register(lambda x, d: None)
    fails(r"Does your rule return anything\?", P.check_cumsum_rule, rule)

    @wb.register_rule("cumsum", override=True)
    def no_dim(x):
        return combine(x.mesh.ndim, [[((R,), (R,), "r")]] * x.mesh.ndim, 1)
    fails(r"calls rule\(x, dim=...\)", P.check_cumsum_rule, no_dim)


def test_a_tensor_method_on_the_spec_names_what_a_spec_has():
    """x.dim() on the TensorSpec: a bare AttributeError before."""
    @wb.register_rule("cumsum", override=True)
    def rule(x, dim):
        return combine(x.mesh.ndim, [_base(x, dim % x.dim())] * x.mesh.ndim, 1)
    fails(r"x.shape, x.ndim, x.mesh and x.placements", P.check_cumsum_rule, rule)


# ---- printed lines within text_width.WIDTH (JupyterLab breaks longer ones mid-word) --------------

def _widest(text: str) -> int:
    return max(len(line) for line in text.replace("\x1b[1;31m", "").replace("\x1b[0m", "")
               .splitlines())


def test_decisions_and_reasons_print_within_the_width():
    """04 printed wb.spmd.infer's decision and explain's reasons in lines of up to 158
    characters (JupyterLab broke 'cheapes|t', '14|4 B')."""
    from workbench.text_width import WIDTH
    mesh = wb.Mesh.grid(4, ["x"])
    a, b = wb.TensorSpec((8, 12), mesh, [R]), wb.TensorSpec((12, 6), mesh, [S(0)])
    dec = wb.spmd.infer("matmul", a, b)
    assert _widest(str(dec)) <= WIDTH
    assert " ".join(str(dec).split()).startswith(" ".join(f"matmul: {dec.reason}".split()))
    x = wb.shard_tensor(torch.randn(8, 12), mesh, [R])
    y = wb.shard_tensor(torch.randn(12, 6), mesh, [S(0)])
    table = wb.explain(lambda p, q: torch.softmax(torch.relu(p @ q), dim=-1).sum(), x, y)
    assert _widest(table.reasons()) <= WIDTH
    assert " ".join(table.reasons().split()) == " ".join(
        " ".join(f"{r.op}: {r.reason}" for r in table.rows).split())


def test_feedback_prints_within_the_width(capsys):
    """A wrong answer's "Not yet: ..." (up to 400 characters on one line) and 04/09's
    "Correct: ..." lines (up to 300) now wrap at spaces."""
    from workbench.text_width import WIDTH
    with pytest.raises(CheckError) as err:
        P.check_mlp_plan({"0.weight": ["S(1)"], "2.weight": ["S(0)"]})
    (shown,) = err.value._render_traceback_()
    assert _widest(shown) <= WIDTH and shown.startswith("\x1b[1;31mNot yet:\x1b[0m with your plan")
    for check, answer in ((P.check_mlp_plan, {"0.weight": ["S(0)"], "2.weight": ["S(1)"]}),
                          (F.check_window_tiles, 21)):
        check(answer)
        out = capsys.readouterr().out
        assert out.startswith("Correct: ") and _widest(out) <= WIDTH, out
    F.check_online_softmax(in_place)
    out = capsys.readouterr().out
    assert out.startswith("Correct: ") and _widest(out) <= WIDTH, out


def test_reveal_alone_in_a_cell_shows_its_line_once(capsys):
    """reveal(...) as a cell's last line printed its text, then IPython showed the
    returned str again as Out[n] ('check_window_tiles expects 21 tiles' twice)."""
    from IPython.core.formatters import DisplayFormatter
    from workbench.exercises.feedback import reveal
    with pytest.raises(CheckError):
        F.check_window_tiles(36)
    text = reveal("check_window_tiles")
    assert capsys.readouterr().out == "check_window_tiles expects 21 tiles\n"
    assert text == "check_window_tiles expects 21 tiles" and isinstance(text, str)
    assert DisplayFormatter().format(text) == ({}, {})       # nothing more under the cell


def test_a_plan_that_cannot_shard_a_parameter_names_it():
    """04 exercise 1 with "0.bias": ["S(1)"]: "parallelize rejected your plan: Shard(1) on a
    1-d tensor: dim must be in [-1, 0]" did not say which parameter was 1-d."""
    fails(r"plan for '0.bias' \(shape \(64,\)\): Shard\(1\) on a 1-d tensor", P.check_mlp_plan,
          {"0.weight": ["S(0)"], "0.bias": ["S(1)"], "2.weight": ["S(1)"]})
    fails(r"plan for '0.weight' \(shape \(64, 16\)\): Shard\(2\)", P.check_mlp_plan,
          {"0.weight": ["S(2)"], "2.weight": ["S(1)"]})


def _right(m, l, acc, s, v):
    m_new = torch.maximum(m, s.max(dim=-1, keepdim=True).values)
    r, p = torch.exp(m - _safe(m_new)), torch.exp(s - _safe(m_new))
    return m_new, l * r + p.sum(-1, keepdim=True), acc * r + p @ v


def test_numpy_and_float32_updates_are_told_why():
    """numpy arrays were told "returned m of shape (3, 1); it keeps the shape (3, 1)";
    float32 tensors, "m is not each row's largest score" (or a formula for an error of
    4e-8)."""
    fails(r"returned m as numpy.ndarray: return torch tensors", F.check_online_softmax,
          lambda *a: tuple(t.numpy() for t in _right(*a)))
    fails(r"returned m in torch.float32, given torch.float64: keep the inputs' dtype",
          F.check_online_softmax, lambda *a: tuple(t.float() for t in _right(*a)))

    def acc_through_float32(*a):
        m, l, acc = _right(*a)
        return m, l, acc.float().double()
    fails(r"close, but not to float64's precision", F.check_online_softmax,
          acc_through_float32)
