"""Random op graphs (hypothesis, derandomized): compiled equals eager, and the whole-graph
choice is never worse than the greedy one on the modeled step time.

A graph: two or three leaves of shape (n, n) laid out by random placements on a 1-d or
2-d mesh, then ops drawn from :data:`OPS` on any earlier values (a DAG, not only a chain),
the last value returned, sometimes pinned to Replicate.
"""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import workbench as wb

R, S = wb.Replicate, wb.Shard
UNARY = {"relu": torch.relu, "softmax0": lambda t: torch.softmax(t, 0),
         "softmax1": lambda t: torch.softmax(t, 1), "t": lambda t: t.transpose(0, 1),
         "sum1": lambda t: t.sum(1, keepdim=True) + t, "exp": lambda t: torch.exp(t * 0.1)}
BINARY = {"matmul": lambda a, b: (a @ b) * 0.25, "add": torch.add, "mul": torch.mul}


def _program(rng):
    mesh = wb.Mesh.grid(rng.choice([(2,), (4,), (2, 2)]))
    n = 4
    k = rng.randint(2, 3)
    leaves = []
    for i in range(k):
        ps = [rng.choice([R(), S(0), S(1)]) for _ in range(mesh.ndim)]
        x = torch.randn(n, n, generator=torch.Generator().manual_seed(rng.randint(0, 99)))
        leaves.append((x, ps))
    steps = []
    for j in range(rng.randint(2, 6)):
        avail = k + j
        if rng.random() < 0.5:
            steps.append((rng.choice(sorted(UNARY)), (rng.randrange(avail),)))
        else:
            steps.append((rng.choice(sorted(BINARY)), (rng.randrange(avail), rng.randrange(avail))))

    def f(*xs):
        vals = list(xs)
        for op, ins in steps:
            fn = UNARY.get(op) or BINARY[op]
            vals.append(fn(*[vals[i] for i in ins]))
        return vals[-1]
    return mesh, leaves, steps, f


@settings(max_examples=12, derandomize=True, deadline=None,
          suppress_health_check=list(HealthCheck))
@given(st.randoms(use_true_random=False))
def test_random_graphs_compiled_equal_eager_and_never_cost_more_than_greedy(rnd):
    rng = random.Random(rnd.randint(0, 2 ** 30))
    mesh, leaves, steps, f = _program(rng)
    args = [wb.shard_tensor(x, mesh, ps) for x, ps in leaves]
    pin = {"output": [R()] * mesh.ndim} if rng.random() < 0.5 else None
    what = f"mesh {mesh.shape}, leaves {[ps for _, ps in leaves]}, steps {steps}, pin {pin}"
    prog = wb.compile(f, *args, pin=pin, profile="a100", method="trace")
    assert prog.assignment.time <= prog.greedy.time * (1 + 1e-9), f"{what}\n{prog}"
    with wb.trace(profile="a100") as tr:
        out = prog(*args)
    ref = f(*[x for x, _ in leaves])
    torch.testing.assert_close(out.full(), ref, rtol=1e-4, atol=1e-5, msg=lambda m: f"{what}\n{m}")
    assert max(tr.bytes_per_rank().values(), default=0) == prog.bytes, f"{what}\n{prog}"
    # the dispatcher's own run, op by op, costs what greedy was priced at (forward bytes)
    with wb.trace(profile="a100") as tg:
        e = f(*args)
        if pin:
            wb.reshard(e, mesh, pin["output"])
    assert max(tg.bytes_per_rank().values(), default=0) == prog.greedy.bytes, what


def test_search_on_a_chain_finds_the_brute_force_optimum():
    """On a chain the search is dynamic programming over one live tensor: with no beam
    limit it must find the cheapest of every combination of the ops' candidates."""
    from workbench.compile.capture import capture
    from workbench.compile.propagate import _Pricer, initial, propagate
    mesh = wb.Mesh.grid((2, 2))
    x = wb.shard_tensor(torch.randn(8, 8), mesh, [S(1), S(0)])
    w = wb.shard_tensor(torch.randn(8, 8), mesh, [R(), S(1)])
    f = lambda a, b: torch.softmax(torch.relu(a @ b), 0).sum(1)       # noqa: E731
    g, pl = capture(f, (x, w), "trace")
    pins = {g.output_vids()[0]: (R(), R())}
    pr = _Pricer(g, mesh, "a100")
    best = [float("inf")]

    def walk(k, place, cost):
        if k == len(g.nodes):
            out = g.output_vids()[0]
            best[0] = min(best[0], cost + pr.pin_cost(out, place[out], pins[out]))
            return
        n = g.nodes[k]
        specs, dec = pr.decision(n, tuple(None if v is None else place[v] for v in n.inputs))
        for c in dec.candidates:
            new = dict(place)
            new.update(zip(n.outs, (tuple(p) for p in c.strategy.outputs)))
            walk(k + 1, new, cost + pr.price(n, specs, c).total)
    walk(0, initial(g, pl, mesh), 0.0)
    a = propagate(g, pl, mesh, "a100", pins, beam=10 ** 6, per_op=10 ** 6)
    assert a.time == pytest.approx(best[0], rel=1e-12)
    assert propagate(g, pl, mesh, "a100", pins).time >= a.time * (1 - 1e-12)


@settings(max_examples=12, derandomize=True, deadline=None,
          suppress_health_check=list(HealthCheck))
@given(st.randoms(use_true_random=False))
def test_random_graphs_at_o2_give_torchs_gradients_with_the_schedules_buckets(rnd):
    """Leaves that require grad: at O2 their gradient reductions run in the bucket pass's
    buckets (a leaf read twice by one op too), and the gradients are torch's."""
    rng = random.Random(rnd.randint(0, 2 ** 30))
    mesh, leaves, steps, f = _program(rng)
    args = [wb.shard_tensor(x, mesh, ps).requires_grad_() for x, ps in leaves]
    what = f"mesh {mesh.shape}, leaves {[ps for _, ps in leaves]}, steps {steps}"
    prog = wb.compile(f, *args, level="O2", profile="a100", method="trace")
    with wb.trace(profile="a100") as tr:
        prog(*args).sum().backward()
    refs = [x.clone().requires_grad_() for x, _ in leaves]
    f(*refs).sum().backward()
    for k, (a, r) in enumerate(zip(args, refs)):
        if r.grad is None:
            assert a.grad is None, f"{what}: leaf {k}"
            continue
        torch.testing.assert_close(a.grad.full(), r.grad, rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{what}: leaf {k}\n{m}")
    buckets = [it for it in prog.schedule.items if it.kind == "comm" and it.grad]
    ran = [e for e in tr.events if e.label.startswith("grad bucket") and 0 in e.ranks]
    assert len(ran) == len(buckets), f"{what}\n{prog.schedule}"
    assert sorted(e.args["buffer_bytes"] for e in ran) == \
        sorted(it.nbytes for it in buckets), f"{what}\n{prog.schedule}"


def test_an_op_whose_result_nothing_returns_has_no_backward_on_the_clock():
    """Dead code (found by the test above on one draw): the forward runs it, but no
    gradient flows through it, so the schedule and the search price no backward kernel
    and no gradient all-reduce for it, as the run makes none."""
    mesh = wb.Mesh.grid((2, 2))
    g = torch.Generator().manual_seed(0)
    w = wb.shard_tensor(torch.randn(4, 4, generator=g), mesh, [R(), S(1)]).requires_grad_()
    x = wb.shard_tensor(torch.randn(4, 4, generator=g), mesh, [S(0), R()]).requires_grad_()

    def f(w, x):
        torch.softmax((x @ w) * 0.25, 0)          # read by nothing
        return x.sum(1, keepdim=True) + x
    prog = wb.compile(f, w, x, level="O2", profile="a100", method="trace")
    sched = prog.schedule
    dead = {n.name for n in prog.graph.nodes if n.op in ("matmul", "softmax")}
    assert len(dead) == 2
    assert not [it for it in sched.items if it.phase == "backward" and it.name in dead]
    assert not [it for it in sched.items if it.kind == "comm" and it.grad], str(sched)
    assert all(prog.assignment.costs[n.nid].bwd_comm == 0 for n in prog.graph.nodes
               if n.name in dead)
    with wb.trace(profile="a100") as tr:
        prog(w, x).sum().backward()
    assert w.grad is None
    assert not [e for e in tr.events if e.label.startswith("grad bucket")]


def test_a_value_used_twice_in_two_layouts_runs_as_priced():
    """matmul(x, x) with x sharded by rows: the search may keep the left operand sharded
    and gather only the right one; the run must then hand each use its own layout (it
    once gave both uses the first layout and the dispatcher gathered again: 96 bytes run
    where 64 were priced)."""
    mesh = wb.Mesh.grid((2,))
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    y = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))
    steps = [("softmax1", (0,)), ("exp", (1,)), ("exp", (3,)), ("relu", (4,)),
             ("matmul", (0, 0))]

    def f(*xs):
        vals = list(xs)
        for op, ins in steps:
            vals.append((UNARY.get(op) or BINARY[op])(*[vals[i] for i in ins]))
        return vals[-1]
    args = [wb.shard_tensor(t, mesh, [S(0)]) for t in (x, y)]
    prog = wb.compile(f, *args, pin={"output": [R()]}, profile="a100", method="trace")
    with wb.trace(profile="a100") as tr:
        out = prog(*args)
    torch.testing.assert_close(out.full(), f(x, y), rtol=1e-4, atol=1e-5)
    assert max(tr.bytes_per_rank().values()) == prog.bytes
