"""A new shape's decision without pricing every candidate (ops_table/free_choice.py).

The dispatcher decides once per input layout, shapes included; for a new shape the
shortcut takes the first candidate in the rule's order that moves nothing, and prices
the rest only when someone reads them.  Held here: on every call the shortcut makes,
its choice, candidates, reason and plans are the full decision's (random layouts on
five meshes, even and uneven shards, tiny tensors); programs run with and without it
give the same values, placements, gradients and collectives (a TP MLP over batch
sizes, uneven ones included; explain's tables); a shape at which the cost-based choice
changes is decided the full way at both shapes; and the tensor-parallel engine, whose
packed step has a new token count at almost every step, makes no full decision at all
(counted by ``free_choice.COUNTS``, not timed: ``benchmarks/new_shapes.py`` times it).
"""
import random

import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from workbench.parallel import dispatch as D
from workbench.parallel.ops_table import free_choice as FC
from workbench.parallel.ops_table import strategy as ST
from workbench.parallel.placement import Partial, Replicate, Shard
from workbench.serve.engine import Engine


def cold():
    """Forget every decision, prepared op and plan template (a fresh process's dispatcher)."""
    D._PREPARED.clear()
    ST._infer_cached.cache_clear()
    FC._TEMPLATES.clear()


def counted(fn):
    """(fn(), full decisions, shortcut decisions) from cold caches."""
    cold()
    before = dict(FC.COUNTS)
    out = fn()
    return out, FC.COUNTS["full"] - before["full"], FC.COUNTS["free"] - before["free"]


def both(fn):
    """fn() from cold caches with the shortcut off, then on: (off, on) results and counts."""
    with FC.disabled():
        off = counted(fn)
    return off, counted(fn)


class Recorder:
    """Every (op, specs, attrs) the dispatcher decides, and what choose returned."""

    def __init__(self):
        self.calls = []

    def __enter__(self):
        self._orig = FC.choose

        def rec(op, specs, attrs, check=False, grads=()):
            dec = self._orig(op, specs, attrs, check, grads)
            # (the inputs that require grad: the decision prices their reshards' backward
            # too, eager14)
            self.calls.append((op, specs, dict(attrs, _grads=grads), dec))
            return dec
        FC.choose = rec
        return self

    def __exit__(self, *exc):
        FC.choose = self._orig


PLACEMENTS = [Replicate(), Shard(0), Shard(1), Partial("sum")]
MESHES = [((2,), ("tp",)), ((4,), ("tp",)), ((1, 2), ("dp", "tp")), ((2, 2), ("dp", "tp")),
          ((2, 1), ("dp", "tp"))]


def _random_program(g: random.Random, mesh):
    """A few ops on random layouts of random (often uneven, sometimes tiny) shapes."""
    def ps():
        return [g.choice(PLACEMENTS) for _ in range(mesh.ndim)]

    def dt(shape):
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(g.randrange(1 << 30)))
        return wb.shard_tensor(x, mesh, ps())

    m, k, n = g.choice([1, 3, 5, 8, 12]), g.choice([2, 4, 7, 16]), g.choice([1, 4, 6, 9])
    a, b, w = dt((m, k)), dt((m, k)), dt((n, k))
    out = [torch.relu(a), a + b, a * b, a @ w.transpose(0, 1), F.linear(a, w),
           a.sum(0), torch.softmax(a, dim=-1), a.transpose(0, 1), a.reshape(m * k)]
    return [o.full() for o in out]


@pytest.mark.parametrize("seed", range(4))
def test_every_shortcut_decision_is_the_full_decision(seed):
    g = random.Random(seed)
    free = full = 0
    for shape, names in MESHES:
        mesh = wb.Mesh.grid(shape, names)
        for _ in range(3):
            cold()
            with Recorder() as r:
                _random_program(g, mesh)
            for op, specs, attrs, dec in r.calls:
                ref = ST.infer(op, *specs, **attrs)
                assert dec.chosen == ref.chosen, (op, specs)         # strategy, plans, cost
                if isinstance(dec, FC.FreeDecision):
                    free += 1
                    assert dec.chosen.rank_key == (0.0, 0)
                    assert dec.candidates == ref.candidates and dec.reason == ref.reason
                    assert str(dec) == str(ref)
                else:
                    full += 1
                    assert dec == ref
    assert free > 30 and full > 30          # both ways were exercised


@pytest.mark.parametrize("seed", range(2))
def test_random_programs_give_the_same_values_with_and_without(seed):
    for shape, names in MESHES:
        mesh = wb.Mesh.grid(shape, names)

        def run():
            with wb.trace() as tr:
                vals = _random_program(random.Random(seed), mesh)
            return vals, tr.counts(), list(tr.events)
        (off, _, _), (on, _, _) = both(run)
        assert off[1:] == on[1:]
        for x, y in zip(off[0], on[0]):
            assert torch.equal(x, y)


def _tp_mlp_steps(batches, sp=False):
    """Column- then row-parallel MLP (Megatron), a residual and a mean loss, forward and
    backward, for each batch size: outputs, placements, gradients and the trace."""
    torch.manual_seed(0)
    mesh = wb.Mesh.grid((1, 2), ("dp", "tp"))
    mlp = torch.nn.Sequential(torch.nn.Linear(10, 24), torch.nn.GELU(), torch.nn.Linear(24, 10))
    wb.parallelize(mlp, mesh, {"0": "colwise", "2": "rowwise"}, mesh_dim="tp")
    out = []
    with wb.trace() as tr:
        for b in batches:
            x = torch.randn(b, 5, 10, generator=torch.Generator().manual_seed(b))
            xd = wb.shard_tensor(x, mesh, [Replicate(), Shard(1) if sp else Replicate()])
            y = mlp(xd)
            y = y + xd
            loss = (y * y).mean()
            loss.backward()
            grads = [p.grad.full().clone() for p in mlp.parameters()]
            out.append((y.full(), y.placements, loss.full(), grads))
            mlp.zero_grad()
    return out, tr.counts(), list(tr.events)


@pytest.mark.parametrize("sp", [False, True])     # sp: 5 tokens on 2 ranks, uneven shards
def test_tp_mlp_over_batch_sizes_same_values_placements_and_collectives(sp):
    batches = [1, 3, 4, 7, 2]
    (off, full_off, free_off), (on, full_on, free_on) = both(lambda: _tp_mlp_steps(batches, sp))
    assert off[1:] == on[1:]          # every trace event: collectives, bytes, modeled times
    for a, b in zip(off[0], on[0]):
        assert torch.equal(a[0], b[0]) and a[1] == b[1] and torch.equal(a[2], b[2])
        assert all(torch.equal(x, y) for x, y in zip(a[3], b[3]))
    assert free_off == 0 and full_on < full_off
    assert full_on + free_on == full_off          # the same decisions, fewer made in full


def test_explain_reads_the_full_ranking():
    mesh = wb.Mesh.grid((1, 2), ("dp", "tp"))
    a = wb.shard_tensor(torch.randn(6, 8), mesh, [Replicate(), Shard(1)])
    w = wb.shard_tensor(torch.randn(4, 8), mesh, [Replicate(), Shard(1)])

    def run():
        t = wb.explain(lambda a, w: torch.relu(F.linear(a, w)) + 1, a, w)
        return str(t), t.reasons(), t.result.full()
    (off, _, _), (on, full_on, free_on) = both(run)
    assert free_on > 0                            # the shortcut decided, explain priced all
    assert off[:2] == on[:2] and torch.equal(off[2], on[2])
    assert "cheapest of" in on[1]


def test_a_shape_that_changes_the_cost_based_choice_is_decided_in_full():
    """x (M, K) S(0) @ w (K, N) S(1): no candidate moves nothing; gathering x costs M*K
    bytes, gathering w K*N, so the cheaper one changes with M (rows 2 against 64, N 16)."""
    mesh = wb.Mesh.grid(2, ["tp"])
    w = wb.shard_tensor(torch.randn(8, 16), mesh, [Shard(1)])
    chosen = {}
    for m in (2, 64):
        x = wb.shard_tensor(torch.randn(m, 8), mesh, [Shard(0)])
        cold()
        with Recorder() as r:
            y = x @ w
        (op, specs, attrs, dec), = r.calls
        assert not isinstance(dec, FC.FreeDecision) and dec == ST.infer(op, *specs, **attrs)
        assert dec.chosen.rank_key > (0.0, 0)
        chosen[m] = dec.chosen.strategy.inputs
        torch.testing.assert_close(y.full(), x.full() @ w.full())
    assert chosen[2] == ((Replicate(),), (Shard(1),))      # gather the small x
    assert chosen[64] == ((Shard(0),), (Replicate(),))     # gather the smaller w


def test_tiny_tensors_take_the_full_decision():
    """Under 2 * mesh.size bytes a collective may send 0 bytes (1 int8 on 2 ranks): the
    shortcut's ranking argument needs every collective to send one."""
    mesh = wb.Mesh.grid(4, ["tp"])
    spec = wb.TensorSpec((1,), mesh, [Replicate()], torch.int8)
    dec = FC.choose("relu", (spec,), {})
    assert not isinstance(dec, FC.FreeDecision) and dec == ST.infer("relu", spec)
    big = wb.TensorSpec((8,), mesh, [Replicate()], torch.int8)
    assert isinstance(FC.choose("relu", (big,), {}), FC.FreeDecision)


def test_validator_mode_checks_the_shortcut_against_the_full_decision(monkeypatch):
    mesh = wb.Mesh.grid(2, ["tp"])
    spec = wb.TensorSpec((6, 4), mesh, [Shard(0)])
    dec = FC.choose("relu", (spec,), {}, check=True)
    assert isinstance(dec, FC.FreeDecision)
    wrong = ST.infer("relu", wb.TensorSpec((6, 4), mesh, [Replicate()]))    # another choice
    monkeypatch.setattr(FC.FreeDecision, "full", lambda self: wrong)
    with pytest.raises(AssertionError, match="the full decision"):
        FC.choose("relu", (spec,), {}, check=True)


def test_the_tp_engine_makes_no_full_decision_for_new_token_counts():
    cfg = wb.models.get_config("tiny", vocab_size=76)
    one = wb.models.build_model(cfg, seed=0).eval()
    model = wb.serve.serve_model(cfg, tp=2, state_dict=one.state_dict()).model
    g = torch.Generator().manual_seed(0)
    lens, news = [3, 9, 5, 14, 7, 2], [6, 3, 8, 4, 5, 7]
    prompts = [torch.randint(0, 76, (n,), generator=g).tolist() for n in lens]

    def run():
        e = Engine(model, num_blocks=16, block_size=4, max_batch=4)
        with wb.trace() as tr:
            out = e.generate_all(prompts, news)
        return out, [r.tokens for r in e.log], tr.counts(), list(tr.events)
    (off, full_off, free_off), (on, full_on, free_on) = both(run)
    assert on == off                                  # tokens, steps, every trace event
    assert len(set(off[1])) > 5                       # many token counts: many new shapes
    assert free_off == 0 and full_off > 100
    assert full_on == 0 and free_on == full_off       # every decision by the shortcut


def test_the_fast_planner_search_is_the_readable_one_step_for_step():
    """reshard_search.plan_steps against reshard._plan_same_mesh: random layouts of random
    shapes (uneven, size-1 dims, dtypes without some Partial ops) on 1-3-d meshes with
    size-1 dims, on three profiles."""
    import sys
    from workbench.parallel import reshard_search
    from workbench.sim_mesh.profiles import get_profile
    RS = sys.modules["workbench.parallel.reshard"]
    g = random.Random(0)
    meshes = [wb.Mesh.grid(s, n) for s, n in [((2,), ("a",)), ((4,), ("a",)), ((1, 2), ("x", "y")),
                                             ((2, 2), ("x", "y")), ((3, 1), ("x", "y")),
                                             ((2, 1, 2), ("x", "y", "z"))]]
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.bool]
    steps = 0
    for _ in range(400):
        mesh, dt = g.choice(meshes), g.choice(dtypes)
        ndim = g.randint(0, 3)
        shape = tuple(g.choice([1, 2, 3, 5, 8, 1000]) for _ in range(ndim))
        pops = reshard_search._pops(dt)
        opts = [Replicate()] + [Shard(d) for d in range(ndim)] + [Partial(o) for o in pops]
        src, dst = (tuple(g.choice(opts) for _ in range(mesh.ndim)) for _ in range(2))
        prof = get_profile(g.choice(["a100", "ascend-910b", "h100"]))
        ref = RS._plan_same_mesh(shape, dt, mesh, src, dst, prof)
        fast = reshard_search.plan_steps(shape, dt, mesh, src, dst, prof, RS._price_step,
                                         RS._EXACT)
        assert fast == ref, (shape, dt, mesh, src, dst)
        steps += len(ref) > 1
    assert steps > 100                       # multi-step plans: the order of steps is held
