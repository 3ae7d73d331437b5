"""Property test: random meshes (1-3 dims, up to 8 ranks, random rank order), tensors
(0-4 dims, sizes 0-9, float32/float64/int32/int64/bool), source layouts built from
unequal parts (nested shards, Partial with every reduce op), target layouts on the same
or another mesh.  Every reshard round-trips bitwise against the one-device tensor, and
its plan's bytes and time equal what the trace recorded.

Values are small integers (also in floating point) so every partial sum, max, min and
average is exact: a bitwise comparison leaves no room for a coincidence."""
import math

import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import workbench as wb
from workbench.parallel import layout
from tests.strategies import meshes
from tests.test_reshard import expected_local

SETTINGS = settings(max_examples=300, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

DTYPES = [torch.float32, torch.float64, torch.int32, torch.int64, torch.bool]


def ops_for(dtype):
    """The Partial ops a dtype has (see placement.check_partial_dtype)."""
    if dtype == torch.bool:
        return ["max", "min"]
    return ["sum", "avg", "max", "min"] if dtype.is_floating_point else ["sum", "max", "min"]


@st.composite
def layouts(draw, ndim, mesh, dtype, partial=True):
    """One placement per mesh dim; every Partial shares one op (mixes are refused)."""
    op = draw(st.sampled_from(ops_for(dtype)))
    opts = [wb.Replicate()] + [wb.Shard(d) for d in range(ndim)] + \
        ([wb.Partial(op)] if partial else [])
    return [draw(st.sampled_from(opts)) for _ in range(mesh.ndim)]


def parts_of(x, mesh, ps, gen):
    """Unequal per-rank parts whose reduction over the Partial mesh dims is exactly x,
    and every partial reduction along one of those dims is again such a Partial."""
    pdims = [i for i, p in enumerate(ps) if p.is_partial()]
    if not pdims:
        return [x] * mesh.size
    op = ps[pdims[0]].reduce_op
    out = []
    # per partial mesh dim: an integer weight per coordinate and a random pattern
    w, pat = {}, {}
    for i in pdims:
        n = mesh.shape[i]
        if op in ("sum", "avg"):             # weights that sum to zero along the dim
            v = torch.randint(-3, 4, (n,), generator=gen)
            v[-1] -= v.sum()
        else:                                 # nonnegative, zero at coordinate 0
            v = torch.randint(0, 4, (n,), generator=gen)
            v[0] = 0
        w[i] = v
        pat[i] = torch.randint(0, 3, tuple(x.shape), generator=gen)
    for r in mesh.ranks:
        c = mesh.coordinate(r)
        first = all(c[i] == 0 for i in pdims)
        if x.dtype == torch.bool:
            noise = torch.zeros(x.shape, dtype=torch.bool)
            for i in pdims:
                noise |= (pat[i] * w[i][c[i]]) > 0
            out.append(x & ~noise if op == "max" else x | noise)
            continue
        d = sum(pat[i] * w[i][c[i]] for i in pdims).to(x.dtype)
        if op == "sum":
            out.append((x if first else torch.zeros_like(x)) + d)
        elif op == "avg":
            out.append(x + d)
        elif op == "max":
            out.append(x - d)
        else:
            out.append(x + d)
    return out


def make(x, mesh, ps, gen):
    parts = parts_of(x, mesh, ps, gen)
    locs = [expected_local(parts[mesh.index(r)], mesh, ps, r) for r in mesh.ranks]
    return wb.from_local(locs, mesh, ps, shape=x.shape)


def check_plan_matches_trace(plan, tr):
    steps = [s for s in plan.steps if not s.kind.startswith("local")]
    assert sum(1 for _ in tr.collectives()) == sum(s.groups for s in steps)
    # an uneven all-to-all's step bytes are the busiest rank's over the mesh; each group's
    # event carries its own busiest rank's (plan16): no more, the most of them equal
    # (an uneven all-gather's / reduce-scatter's likewise, (p-1) x its group's largest
    # piece: plan17b)
    mesh, shape = plan.src_mesh, plan.shape
    busy = {s.kind for s in steps if s.kind == "all_to_all" or s.kind in (
        "all_gather", "reduce_scatter") and not layout.is_even(
            shape, mesh, s.src if s.kind == "all_gather" else s.dst)}
    a2a = [e.bytes for e in tr.collectives() if e.name in busy]
    assert sum(e.bytes for e in tr.collectives() if e.name not in busy) == sum(
        (s.buffer_bytes if s.kind == "send_recv" else s.bytes) * s.groups
        for s in steps if s.kind not in busy)
    assert max(a2a, default=0) == max((s.bytes for s in steps if s.kind in busy), default=0)
    assert sum(a2a) <= sum(s.bytes * s.groups for s in steps if s.kind in busy)
    assert plan.total_bytes == max(tr.bytes_per_rank().values(), default=0)
    assert math.isclose(plan.total_time, tr.time(), rel_tol=1e-9, abs_tol=1e-15)


@SETTINGS
@given(data=st.data())
def test_random_reshards_are_exact_and_priced_as_traced(data):
    mesh = data.draw(meshes(max_ranks=8), "mesh")
    shape = tuple(data.draw(st.lists(st.integers(0, 9), min_size=0, max_size=4), "shape"))
    dtype = data.draw(st.sampled_from(DTYPES), "dtype")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), "seed"))
    x = torch.randint(-20, 21, shape, generator=gen).to(dtype) if dtype != torch.bool else \
        torch.randint(0, 2, shape, generator=gen).bool()
    src = data.draw(layouts(len(shape), mesh, dtype), "src")
    t = make(x, mesh, src, gen)
    assert t.dtype == dtype
    assert torch.equal(t.full(), x)                      # built from unequal parts, exactly x
    if data.draw(st.booleans(), "cross"):
        other = data.draw(meshes(max_ranks=8), "dst mesh")
        off = data.draw(st.integers(0, 8), "rank offset")
        dmesh = wb.Mesh(torch.tensor(other.tolist()) + off, other.dim_names)
    else:
        dmesh = mesh
    dst = data.draw(layouts(len(shape), dmesh, dtype, partial=dmesh == mesh), "dst")
    if any(p.is_partial() for p in dst) and any(p.is_partial() for p in src):
        op = next(p.reduce_op for p in src if p.is_partial())
        dst = [wb.Partial(op) if p.is_partial() else p for p in dst]
    before = [loc.clone() for loc in t.locals()]
    plan = wb.plan_reshard(t, dmesh, dst)
    with wb.trace() as tr:
        y = wb.reshard(t, dmesh, dst)
    check_plan_matches_trace(plan, tr)
    assert y.dtype == dtype and y.mesh == dmesh
    assert all(loc.dtype == dtype for loc in y.locals())
    assert torch.equal(y.full(), x)
    if not any(p.is_partial() for p in dst):
        for r in dmesh.ranks:
            assert torch.equal(y.local(r), expected_local(x, dmesh, y.placements, r))
    # the input is untouched
    assert all(torch.equal(a, b) for a, b in zip(before, t.locals()))
