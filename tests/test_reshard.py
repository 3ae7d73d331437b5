"""Reshard: exact round trips, torch.chunk shards, plan bytes = collective formulas."""

import pytest
import torch
from hypothesis import given, settings, strategies as st, HealthCheck

import workbench as wb
from workbench.parallel import layout
from workbench.sim_mesh import cost
from tests.strategies import meshes, placements, shapes

SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def expected_local(x, mesh, ps, rank):
    """The shard by repeated torch.chunk, independent of the library's layout code."""
    t = x
    coord = mesh.coordinate(rank)
    for i, p in enumerate(ps):
        if isinstance(p, wb.Shard):
            chunks = torch.chunk(t, mesh.shape[i], dim=p.dim)
            k = coord[i]
            if k < len(chunks):
                t = chunks[k]
            else:
                shape = list(t.shape)
                shape[p.dim] = 0
                t = t.new_empty(shape)
    return t


# the layout whose shards are an all-gather's / reduce-scatter's pieces
GATHERS = {"all_gather": lambda s: s.src, "reduce_scatter": lambda s: s.dst}

@SETTINGS
@given(data=st.data())
def test_shard_tensor_locals_are_torch_chunks(data):
    mesh = data.draw(meshes())
    shape = data.draw(shapes)
    ps = data.draw(placements(len(shape), mesh.ndim, partial=False))
    x = torch.randn(shape)
    t = wb.shard_tensor(x, mesh, ps)
    for r in mesh.ranks:
        assert torch.equal(t.local(r), expected_local(x, mesh, ps, r))
    assert torch.equal(t.full(), x)


@SETTINGS
@given(data=st.data())
def test_reshard_round_trip_and_plan_bytes(data):
    mesh = data.draw(meshes())
    shape = data.draw(shapes)
    src = data.draw(placements(len(shape), mesh.ndim, partial=False))
    dst = data.draw(placements(len(shape), mesh.ndim))
    x = torch.randn(shape)
    t = wb.shard_tensor(x, mesh, src)
    plan = wb.plan_reshard(t, mesh, dst)
    with wb.trace() as tr:
        y = wb.reshard(t, mesh, dst)
    assert tuple(y.placements) == tuple(wb.parallel.placement.normalize_placements(dst, mesh, len(shape)))
    full = y.full()
    if any(isinstance(p, wb.Partial) and p.reduce_op == "avg" for p in dst):
        torch.testing.assert_close(full, x)
    else:
        assert torch.equal(full, x)                       # pure data movement: bitwise
    if not any(p.is_partial() for p in dst):
        for r in mesh.ranks:
            assert torch.equal(y.local(r), expected_local(x, mesh, y.placements, r))
    # every step's bytes are its collective's formula for its buffer
    for s in plan.steps:
        if s.kind.startswith("local"):
            assert s.bytes == 0
        elif s.kind == "all_to_all" and not (layout.is_even(shape, mesh, s.src) and
                                             layout.is_even(shape, mesh, s.dst)):
            # uneven: the busiest rank's bytes, exact (plan16)
            assert s.bytes == layout.all_to_all_sent(tuple(shape), mesh.shape, s.src,
                                                     s.mesh_dim, s.dst[s.mesh_dim].dim, 4)[1]
        elif s.kind in GATHERS and not layout.is_even(shape, mesh, GATHERS[s.kind](s)):
            # uneven: (p-1) x the largest piece, padded (plan17b)
            assert s.bytes == (mesh.shape[s.mesh_dim] - 1) * 4 * layout.local_numel_max(
                shape, mesh, GATHERS[s.kind](s))
        else:
            assert s.bytes == cost.wire_bytes(s.kind, s.buffer_bytes, mesh.shape[s.mesh_dim])
    # and the trace recorded exactly the plan: one event per group per step (an uneven
    # all-to-all's events: each group's busiest rank, the most of them the step's)
    steps = [s for s in plan.steps if not s.kind.startswith("local")]
    assert sum(1 for _ in tr.collectives()) == sum(s.groups for s in steps)
    # (uneven all-gathers / reduce-scatters likewise, plan17b)
    busy = {s.kind for s in steps if s.kind == "all_to_all" or s.kind in GATHERS
            and not layout.is_even(shape, mesh, GATHERS[s.kind](s))}
    a2a = [e.bytes for e in tr.collectives() if e.name in busy]
    assert tr.total_bytes() - sum(a2a) == sum(s.bytes * s.groups for s in steps
                                              if s.kind not in busy)
    assert max(a2a, default=0) == max((s.bytes for s in steps if s.kind in busy), default=0)
    assert sum(a2a) <= sum(s.bytes * s.groups for s in steps if s.kind in busy)


@SETTINGS
@given(data=st.data())
def test_partial_sources_from_unequal_parts(data):
    mesh = data.draw(meshes(max_ranks=8))
    shape = data.draw(shapes)
    i = data.draw(st.integers(0, mesh.ndim - 1))
    src = [wb.Replicate()] * mesh.ndim
    src[i] = wb.Partial("sum")
    parts = {}
    locals_ = []
    g = torch.Generator().manual_seed(0)
    for r in mesh.ranks:
        c = list(mesh.coordinate(r))
        key = c[i]
        if key not in parts:
            parts[key] = torch.randn(shape, generator=g) * (key + 1)   # deliberately unequal
        locals_.append(parts[key])
    x = sum(parts.values())
    t = wb.from_local(locals_, mesh, src)
    dst = data.draw(placements(len(shape), mesh.ndim, partial=False))
    y = wb.reshard(t, mesh, dst)
    torch.testing.assert_close(y.full(), x)
    for r in mesh.ranks:
        torch.testing.assert_close(y.local(r), expected_local(x, mesh, y.placements, r))


def test_transitions_use_the_named_collective():
    mesh = wb.Mesh.grid(4, ["tp"])
    x = torch.randn(8, 4)
    cases = [("R", "S(0)", []), ("S(0)", "R", ["all_gather"]), ("P(sum)", "R", ["all_reduce"]),
             ("P(sum)", "S(1)", ["reduce_scatter"]), ("S(0)", "S(1)", ["all_to_all"]),
             ("R", "P(sum)", [])]
    for a, b, kinds in cases:
        t = wb.shard_tensor(x, mesh, [a])
        assert wb.plan_reshard(t, mesh, [b]).collectives() == kinds, (a, b)


def test_uneven_chunk_sizes():
    mesh = wb.Mesh.grid(4)
    t = wb.shard_tensor(torch.arange(10.), mesh, [wb.Shard(0)])
    assert [tuple(t.local(r).shape) for r in mesh.ranks] == [(3,), (3,), (3,), (1,)]
    t = wb.shard_tensor(torch.arange(5.), mesh, [wb.Shard(0)])
    assert [t.local(r).numel() for r in mesh.ranks] == [2, 2, 1, 0]
    assert torch.equal(wb.reshard(t, mesh, ["R"]).local(3), torch.arange(5.))


def test_one_dim_sharded_by_two_mesh_dims_left_to_right():
    mesh = wb.Mesh.grid((2, 2), ("dp", "tp"))
    x = torch.arange(8.)
    t = wb.shard_tensor(x, mesh, [wb.Shard(0), wb.Shard(0)])
    assert [t.local(r).tolist() for r in mesh.ranks] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert str(t.notation()) == "f32[I_{dp,tp}]"


def test_cross_mesh_example():
    a = wb.Mesh([0, 1], ["x"])
    b = wb.Mesh([2, 3], ["x"])
    x = torch.randn(6, 4)
    t = wb.shard_tensor(x, a, [wb.Replicate()])
    plan = wb.plan_reshard(t, b, [wb.Shard(0)])
    assert [s.kind for s in plan.steps] == ["local_slice", "send_recv"]
    with wb.trace() as tr:
        y = wb.reshard(t, b, [wb.Shard(0)])
    assert y.mesh == b
    assert torch.equal(y.local(2), x[:3]) and torch.equal(y.local(3), x[3:])
    assert sorted(e.ranks for e in tr.collectives()) == [(0, 2), (1, 3)]
    assert plan.total_bytes == 3 * 4 * 4
    # a mesh of another shape: replicate at the source, each target gets its shard
    c = wb.Mesh([[4, 5], [6, 7]], ["a", "b"])
    z = wb.reshard(y, c, [wb.Shard(0), wb.Shard(1)])
    assert torch.equal(z.full(), x)


def test_notation_and_str():
    mesh = wb.Mesh.grid((2, 2), ("dp", "tp"))
    t = wb.from_local([torch.ones(4, 3)] * 4, mesh, [wb.Partial(), wb.Shard(1)])
    assert t.notation() == "f32[I, J_tp]{U_dp}"
    assert t.shape == (4, 6)
    assert str(wb.Shard(0)) == "S(0)" and repr(wb.Shard(0)) == "Shard(dim=0)"
    assert str(wb.Partial("max")) == "P(max)" and str(wb.Replicate()) == "R"


@pytest.mark.parametrize("placements,match", [
    ([wb.Shard(2)], r"Shard\(2\) on a 2-d tensor: dim must be in \[-2, 1\]"),
    ([wb.Shard(0), wb.Shard(1)], "2 entries for a 1-d mesh"),
    (["Q"], "not understood"),
])
def test_bad_placements(placements, match):
    with pytest.raises(ValueError, match=match):
        wb.shard_tensor(torch.ones(4, 4), wb.Mesh.grid(2), placements)


def test_bad_partial_and_from_local():
    with pytest.raises(ValueError, match="unknown op"):
        wb.Partial("prod")
    mesh = wb.Mesh.grid(2)
    with pytest.raises(ValueError, match="rank 1's local tensor has shape"):
        wb.from_local([torch.ones(2, 2), torch.ones(1, 2)], mesh, [wb.Shard(0)], shape=(4, 2))
    with pytest.raises(ValueError, match="different tensor than its replica"):
        wb.from_local([torch.ones(2), torch.zeros(2)], mesh, [wb.Replicate()])
    with pytest.raises(TypeError, match="different dtypes"):
        wb.from_local([torch.ones(2), torch.ones(2, dtype=torch.float64)], mesh, [wb.Partial()])


def test_failed_reshard_leaves_input_untouched():
    mesh = wb.Mesh.grid(2)
    x = torch.randn(4, 2)
    t = wb.shard_tensor(x, mesh, [wb.Shard(0)])
    before = [l.clone() for l in t.locals()]
    with pytest.raises(ValueError):
        wb.reshard(t, mesh, [wb.Shard(5)])
    with pytest.raises(ValueError):
        wb.reshard(t, wb.Mesh.grid(2), [wb.Replicate(), wb.Replicate()])
    assert t.placements == (wb.Shard(0),)
    assert all(torch.equal(a, b) for a, b in zip(before, t.locals()))


@pytest.mark.parametrize("lead, ps", [((8,), [wb.Shard(0)]),
                                      ((2, 4), [wb.Shard(0), wb.Shard(1)]),
                                      ((4, 2), [wb.Replicate(), wb.Shard(0)])])
def test_zero_pad_then_all_reduce_runs_as_one_gather(lead, ps):
    """A plan's local_pad S(d) -> P(sum) followed by an all_reduce on the same mesh dim runs
    without the padded buffer (reshard.execute pairs them): the same values (a -0.0 turns
    +0.0, as in the sum with zeros), the same gradient, the same trace events as running
    the two steps one after the other."""
    import sys
    R = sys.modules["workbench.parallel.reshard"]
    mesh = wb.Mesh.grid(lead, ["a", "b"][:len(lead)])
    i = len(lead) - 1
    x = torch.randn(8, 12)
    x[0, 0] = -0.0
    x[3, 5] = float("inf")
    g = torch.randn(8, 12)
    g[0, 0] = g[7, 11] = -0.0
    mid = tuple(ps[:i]) + (wb.Partial(),)
    dst = tuple(ps[:i]) + (wb.Replicate(),)
    results = []
    for fused in (True, False):
        t = wb.shard_tensor(x, mesh, ps).requires_grad_()
        spec = t.spec
        pad = R.plan_reshard(t, mesh, mid)
        assert pad.collectives() == [] and pad.steps[-1].kind == "local_pad"
        ar = R.plan_reshard(wb.TensorSpec(spec.shape, mesh, mid), mesh, dst)
        assert ar.collectives() == ["all_reduce"]
        with wb.trace() as tr:
            if fused:
                both = R.Plan(spec.shape, spec.dtype, mesh, tuple(ps), mesh, dst,
                              pad.steps + ar.steps, pad.profile)
                y = R.execute(both, t)
            else:
                y = R.execute(ar, R.execute(pad, t))
            y.backward(g)
        assert y.placements == dst
        results.append((y.full().detach(), t.grad.full(),
                        [(e.name, e.ranks, e.start, e.duration, e.bytes, e.label)
                         for e in tr.events]))
    (y1, g1, e1), (y2, g2, e2) = results
    assert torch.equal(y1, y2) and torch.equal(y1.signbit(), y2.signbit())
    assert torch.equal(y1, x + 0) and not y1[0, 0].signbit()
    assert torch.equal(g1, g2) and torch.equal(g1.signbit(), g2.signbit())
    assert e1 == e2 and [e[0] for e in e1] == ["all_reduce"] * (len(e1))


def test_reshard_plans_once_per_layout_and_profile():
    """reshard() keeps its plan per (layout, placements, profile): the same events as when
    planned afresh, re-planned for another profile, placements given as a list, a tuple
    or strings."""
    import sys
    R = sys.modules["workbench.parallel.reshard"]
    mesh = wb.Mesh.grid((2, 4), ["dp", "tp"])
    t = wb.DistTensor(torch.randn(2, 4, 16), mesh, (wb.Partial(), wb.Shard(0)), (16,))

    def events(dst, prof):
        with wb.trace(prof) as tr:
            y = wb.reshard(t, mesh, dst)
        torch.testing.assert_close(y.full(), t.full())
        return y.placements, [(e.name, e.ranks, e.start, e.duration, e.bytes) for e in tr.events]

    for dst in ([wb.Replicate(), wb.Replicate()], (wb.Shard(0), wb.Replicate()), ["R", "S(0)"]):
        seen = []
        for prof in ("a100", "ascend-910b"):
            R._PLANS.clear()
            first = events(dst, prof)
            assert R._plan_key(t, dst, prof) in R._PLANS
            assert events(dst, prof) == first             # from the kept plan
            assert first[0] == wb.plan_reshard(t, mesh, dst, profile=prof).dst
            seen.append(first[1])
        assert seen[0] != seen[1]                         # each profile prices its own
    with pytest.raises(ValueError, match="placements=None"):
        wb.reshard(t, mesh, None)
