"""The search's memory term: at equal time the assignment holding less memory wins, and
``memory_limit`` keeps every op's outputs and re-laid-out inputs under a bound."""
from __future__ import annotations

import itertools

import pytest
import torch

import workbench as wb
from workbench.compile.capture import capture
from workbench.compile.propagate import _Pricer, initial, propagate
from workbench.compile.search import _rank

R, S = wb.Replicate, wb.Shard


def _chain():
    mesh = wb.Mesh.grid((2, 2))
    x = wb.shard_tensor(torch.randn(8, 8), mesh, [S(1), S(0)])
    w = wb.shard_tensor(torch.randn(8, 8), mesh, [R(), S(1)])
    f = lambda a, b: torch.softmax(torch.relu(a @ b), 0).sum(1)       # noqa: E731
    g, pl = capture(f, (x, w), "trace")
    return mesh, g, pl


def _every_assignment(mesh, g, pl):
    """(time, memory) of every combination of the ops' candidates on the chain."""
    pr = _Pricer(g, mesh, "a100")
    out = []

    def walk(k, place, cost, mem):
        if k == len(g.nodes):
            out.append((cost, mem))
            return
        n = g.nodes[k]
        specs, dec = pr.decision(n, tuple(None if v is None else place[v] for v in n.inputs))
        for c in dec.candidates:
            new = dict(place)
            new.update(zip(n.outs, (tuple(p) for p in c.strategy.outputs)))
            nc = pr.price(n, specs, c)
            walk(k + 1, new, cost + nc.total, mem + nc.memory)
    walk(0, initial(g, pl, mesh), 0.0, 0)
    return out


def test_search_takes_the_least_memory_at_the_least_time_and_the_fastest_under_a_limit():
    mesh, g, pl = _chain()
    every = _every_assignment(mesh, g, pl)
    assert len({m for _, m in every}) > 1               # memory tells assignments apart
    best = min(every, key=lambda tm: _rank(*tm))
    a = propagate(g, pl, mesh, "a100", beam=10 ** 6, per_op=10 ** 6)
    assert (a.time, a.memory) == (pytest.approx(best[0], rel=1e-12), best[1])
    mems = sorted({m for _, m in every})
    for limit in mems[: len(mems) // 2 + 1]:
        fits = min((tm for tm in every if tm[1] <= limit), key=lambda tm: _rank(*tm))
        a = propagate(g, pl, mesh, "a100", beam=10 ** 6, per_op=10 ** 6, memory_limit=limit)
        assert a.memory <= limit
        assert (a.time, a.memory) == (pytest.approx(fits[0], rel=1e-12), fits[1]), limit
    with pytest.raises(ValueError, match=rf"memory_limit={mems[0] - 1:,d} B per rank.*"
                                         rf"leanest assignment the search finds needs "
                                         rf"{mems[0]:,d} B"):
        propagate(g, pl, mesh, "a100", memory_limit=mems[0] - 1)
    # the least memory fits with a narrow beam too (the lean path is searched for)
    a = propagate(g, pl, mesh, "a100", beam=1, per_op=10 ** 6, memory_limit=mems[0])
    assert a.memory == mems[0]


def test_the_figure_a_memory_limit_error_names_is_a_limit_that_works():
    """A beam that drops the lean paths must not turn into an error naming a partial
    state's bytes (a student raising the limit to it got the error again, step by step)."""
    mesh = wb.Mesh.grid((2, 2), ("dp", "tp"))
    g = torch.Generator().manual_seed(0)
    ids, tg = (torch.randint(0, 75, (4, 32), generator=g) for _ in range(2))
    x = wb.shard_tensor(ids, mesh, [S(0), R()])
    y = wb.shard_tensor(tg, mesh, [S(0), R()])
    with pytest.raises(ValueError, match="leanest assignment the search finds needs") as e:
        wb.compile(_llama(mesh), x, y, profile="a100", method="trace", memory_limit=1000)
    need = int(str(e.value).split("finds needs ")[1].split(" B")[0].replace(",", ""))
    held = wb.compile(_llama(mesh), x, y, profile="a100", method="trace", memory_limit=need)
    assert held.assignment.memory <= need
    _, ref = _llama(mesh)(x, y)
    torch.testing.assert_close(held(x, y)[1].full(), ref.full())


def _llama(mesh):
    from workbench.models import build_model, get_config
    m = build_model(get_config("tiny"), seed=0)
    wb.parallelize(m, mesh, m.tp_plan(2), mesh_dim="tp")
    return m


def test_tiny_llama_under_greedys_memory_is_faster_than_greedy_and_gives_its_loss():
    mesh = wb.Mesh.grid((2, 2), ("dp", "tp"))
    g = torch.Generator().manual_seed(0)
    ids, tg = (torch.randint(0, 75, (4, 32), generator=g) for _ in range(2))
    x = wb.shard_tensor(ids, mesh, [S(0), R()])
    y = wb.shard_tensor(tg, mesh, [S(0), R()])
    free = wb.compile(_llama(mesh), x, y, profile="a100", method="trace")
    # time alone: the search gathers the batch and weights to compute replicated
    assert free.assignment.memory > free.greedy.memory
    limit = free.greedy.memory
    m = _llama(mesh)
    held = wb.compile(m, x, y, profile="a100", method="trace", memory_limit=limit)
    assert held.assignment.memory <= limit
    assert free.assignment.time <= held.assignment.time <= held.greedy.time
    assert f"activations {held.assignment.memory:,d} B per rank" in str(held)
    _, ref = _llama(mesh)(x, y)
    torch.testing.assert_close(held(x, y)[1].full(), ref.full())
    with pytest.raises(ValueError, match="memory_limit=1,000 B per rank: no assignment"):
        wb.compile(_llama(mesh), x, y, profile="a100", method="trace", memory_limit=1000)


def test_memory_limit_bad_values_are_refused_with_the_fix():
    mesh = wb.Mesh.grid((2,))
    x = wb.shard_tensor(torch.randn(4, 4), mesh, [S(0)])
    for bad in (0, -5, 1.5, True, "1MB"):
        with pytest.raises(ValueError, match=rf"memory_limit={bad!r}\).*int >= 1"):
            wb.compile(torch.relu, x, memory_limit=bad)
    with pytest.raises(ValueError, match="O0 keeps the dispatcher's own choice"):
        wb.compile(torch.relu, x, level="O0", memory_limit=10 ** 6)


def test_a_view_holds_no_memory_of_its_own():
    mesh = wb.Mesh.grid((2,))
    x = wb.shard_tensor(torch.randn(8, 4), mesh, [S(0)])
    prog = wb.compile(lambda a: torch.exp(a).transpose(0, 1), x, method="trace")
    by_op = {n.op: prog.assignment.costs[n.nid].memory for n in prog.graph.nodes}
    assert by_op["transpose"] == 0 and by_op["exp"] == 4 * 4 * 4     # (4, 4) f32 per rank
