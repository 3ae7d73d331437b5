"""PyTorch DTensor as an independent oracle for ``wb.reshard``.

Every rank of a real DTensor program is simulated in this one process by
``torch.distributed._local_tensor.LocalTensorMode`` over the "fake" process
group (the way PyTorch's own ``LocalDTensorTestBase`` runs DTensor tests): a
``LocalTensor`` holds one tensor per rank and every collective DTensor issues
is carried out on them exactly.  For one (mesh, shape, src, dst) we build the
same source on both sides, run ``DTensor.redistribute`` and ``wb.reshard``, and
compare the local shard of every rank:

* bitwise for pure data movement (no Partial in the source),
* ``assert_close`` where a reduction runs (a Partial source),
* by the full value only where the target holds a Partial: our R -> P(sum)
  keeps the value on the first rank and zeros elsewhere, DTensor divides it by
  the group size; both are valid layouts of the same value.

Partial sources are built identically on both sides with ``from_local`` from
deliberately unequal per-rank parts.  A third, tiny reference (nested
``torch.chunk``) checks the source layouts of both libraries.

DTensor limits that shape the valid space (not workbench bugs): it has no
Shard -> Partial step, forbids mixing Partial ops in one tensor, and allows a
Partial target only through its internal ``Redistribute`` (the public method
raises "redistributing to Partial is for internal use only").

Communication: for a handful of cases the collectives DTensor really issues
(recorded by a dispatch mode below LocalTensorMode, and counted by
``CommDebugMode``) are priced with our cost-model convention
(:func:`workbench.sim_mesh.cost.wire_bytes` on the buffer DTensor passes,
padding included) and compared with ``plan_reshard(...).total_bytes``.

The process group lives in a module fixture and is destroyed at the end; if
another test left one initialized, the module is skipped rather than broken.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings, strategies as st

import workbench as wb
from workbench.parallel.placement import normalize_placements
from workbench.sim_mesh import cost as wb_cost

from tests.dtensor_support import (  # noqa: E402
    CommDebugMode, DTensor, LocalTensor, LocalTensorMode, Redistribute, TorchDispatchMode, distribute_tensor)

R, S, P = wb.Replicate, wb.Shard, wb.Partial
MESHES = [(2,), (3,), (4,), (2, 2), (2, 3), (2, 2, 2)]


from tests.dtensor_support import oracle  # noqa: E402,F401  (the fixture)

# ---- helpers -----------------------------------------------------------------------------

from tests.dtensor_support import coords, partial_locals, ref_local, to_dt  # noqa: E402


def bits(t):
    t = t.detach().contiguous()
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def assert_bitwise(a, b, what):
    assert tuple(a.shape) == tuple(b.shape), f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    assert torch.equal(bits(a), bits(b)), f"{what}: values differ\n{a}\nvs\n{b}"


def has_partial(ps):
    return any(isinstance(p, wb.Partial) for p in ps)


def dt_redistribute(d, mesh, dst):
    """DTensor.redistribute, reaching the internal path for a Partial target."""
    if any(p.is_partial() and d.placements[i] != p for i, p in enumerate(dst)):
        dt = d._local_tensor.dtype
        opts = {"op_dtype": dt, "out_dtype": dt,
                "backward_options": {"op_dtype": dt, "out_dtype": dt}}
        return Redistribute.apply(d, mesh, tuple(dst), False, opts)
    return d.redistribute(mesh, dst)


def per_rank(t, world):
    if isinstance(t, LocalTensor):
        return {r: v for r, v in t._local_tensors.items()}
    assert world == 1, f"expected a LocalTensor (one tensor per rank), got {type(t).__name__}"
    return {0: t}


_COMM_NS = {"_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "_dtensor"}
_KIND = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
         "all_reduce": "all_reduce", "shard_dim_alltoall": "all_to_all",
         "all_to_all_single": "all_to_all"}


class CommRecorder(TorchDispatchMode):
    """Records each collective DTensor issues: kind, group size, the largest
    per-rank input buffer (bytes), priced with our cost-model convention."""

    def __init__(self):
        super().__init__()
        self.log = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name().split("::")[-1].split(".")[0]
        if func.namespace in _COMM_NS and name in _KIND:
            kind = _KIND[name]
            group = dist.distributed_c10d._resolve_process_group(args[-1])
            p = group.size()
            inp = per_rank(args[0], 1)
            nb = max(t.numel() for t in inp.values()) * args[0].element_size()
            buffer = nb * p if kind == "all_gather" else nb   # all_gather: the gathered buffer
            self.log.append((kind, p, buffer, wb_cost.wire_bytes(kind, buffer, p)))
        return func(*args, **(kwargs or {}))


# ---- one case ----------------------------------------------------------------------------

def run_case(oracle, mesh_shape, shape, src, dst, seed=0, comm=False):
    src, dst = tuple(src), tuple(dst)
    world = math.prod(mesh_shape)
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-8, 9, shape, generator=g).to(torch.float32)   # exact sums
    wmesh = wb.Mesh.grid(mesh_shape)
    dmesh = oracle.mesh(mesh_shape)
    dsrc, ddst = [to_dt(p) for p in src], [to_dt(p) for p in dst]

    # sources, built independently (or from the same unequal parts for Partial)
    if has_partial(src):
        parts = partial_locals(x, mesh_shape, src)
        ours = wb.from_local(parts, wmesh, src, shape=shape)
    else:
        parts = [ref_local(x, mesh_shape, src, c) for c in coords(mesh_shape)]
        ours = wb.shard_tensor(x, wmesh, src)
    rec, cdm = CommRecorder(), CommDebugMode()
    with LocalTensorMode(world):
        if has_partial(src):
            lt = LocalTensor({r: parts[r].clone() for r in range(world)})
            d = DTensor.from_local(lt, dmesh, dsrc, shape=torch.Size(shape), stride=x.stride())
        else:
            # a LocalTensor input, not a plain one: inside LocalTensorMode a plain tensor
            # is one value for all ranks and its collectives go to the no-op fake group
            # (R -> P -> R would silently come back divided by the group size)
            xl = LocalTensor({r: x.clone() for r in range(world)})
            try:
                d = distribute_tensor(xl, dmesh, dsrc)
            except AssertionError:
                # DTensor's own scatter asserts when nested shards leave a rank with an
                # empty chunk (e.g. (3, 1) as [S(0), S(1), S(0)] on 2x2x2): no oracle here
                from hypothesis import reject
                reject()
        src_theirs = per_rank(d.to_local(), world)
        if comm:
            with cdm, rec:
                e = dt_redistribute(d, dmesh, ddst)
        else:
            try:
                e = dt_redistribute(d, dmesh, ddst)
            except (RuntimeError, AssertionError):
                # DTensor itself fails on some nested uneven layouts that leave a rank an
                # empty chunk; only random cases reach here (explicit ones pass comm=True)
                from hypothesis import reject
                reject()
        theirs = per_rank(e.to_local(), world)
        theirs_full = per_rank(e.full_tensor(), world)[0] if has_partial(dst) else None
    for r, c in enumerate(coords(mesh_shape)):
        assert_bitwise(src_theirs[r], parts[r], f"DTensor source, rank {r}")
        assert_bitwise(ours.local(r), parts[r], f"workbench source, rank {r}")

    out = wb.reshard(ours, wmesh, dst)
    tag = f"mesh {mesh_shape} shape {shape} {[str(p) for p in src]} -> {[str(p) for p in dst]}"
    assert out.placements == normalize_placements(dst, wmesh, len(shape))
    for r in range(world):                                   # the input is left untouched
        assert_bitwise(ours.local(r), parts[r], f"{tag}: input after reshard, rank {r}")
    if has_partial(dst):
        torch.testing.assert_close(out.full(), theirs_full, msg=lambda m: f"{tag}: full value\n{m}")
    else:
        for r in range(world):
            a, b = out.local(r), theirs[r]
            if has_partial(src):
                assert tuple(a.shape) == tuple(b.shape), f"{tag}, rank {r}: shape"
                torch.testing.assert_close(a, b, msg=lambda m: f"{tag}, rank {r}\n{m}")
            else:
                assert_bitwise(a, b, f"{tag}, rank {r}")
        if not has_partial(src):
            for r, c in enumerate(coords(mesh_shape)):   # DTensor itself vs the reference
                assert_bitwise(theirs[r], ref_local(x, mesh_shape, dst, c), f"{tag}: reference")
    if comm:
        plan = wb.plan_reshard(ours, wmesh, dst)
        return plan, rec.log, cdm.get_total_counts()
    return out


# ---- explicit cases --------------------------------------------------------------------

CASES = [
    # 1-d meshes, even and uneven (10 rows on 4 ranks: 3, 3, 3, 1; 1 row: 1, 0, 0, 0)
    ((4,), (10, 3), [S(0)], [R()]),
    ((4,), (10, 3), [S(0)], [S(1)]),
    ((4,), (10, 3), [S(1)], [S(0)]),
    ((4,), (10, 3), [R()], [S(0)]),
    ((4,), (1, 3), [S(0)], [R()]),
    ((4,), (5, 6), [S(1)], [S(0)]),
    ((4,), (10, 3), [P("sum")], [R()]),
    ((4,), (10, 3), [P("sum")], [S(0)]),
    ((4,), (10, 3), [P("avg")], [S(1)]),
    ((4,), (10, 3), [P("max")], [S(0)]),
    ((4,), (10, 3), [R()], [P("sum")]),
    ((2,), (8,), [S(0)], [R()]),
    ((2,), (7, 2), [P("min")], [S(0)]),
    ((3,), (5, 7), [S(0)], [S(1)]),
    ((3,), (5, 7), [P("sum")], [S(1)]),
    ((3,), (4, 4, 4), [S(2)], [S(0)]),
    # 2x2: one tensor dim sharded by both mesh dims, uneven
    ((2, 2), (10, 6), [S(0), S(0)], [R(), R()]),
    ((2, 2), (10, 6), [S(0), S(0)], [R(), S(0)]),
    ((2, 2), (10, 6), [S(0), S(0)], [S(1), S(0)]),
    ((2, 2), (10, 6), [S(0), S(0)], [S(0), S(1)]),
    ((2, 2), (10, 6), [S(0), S(1)], [S(1), S(0)]),
    ((2, 2), (10, 6), [R(), S(0)], [S(0), S(0)]),
    ((2, 2), (10, 6), [S(1), S(0)], [S(0), S(0)]),
    ((2, 2), (10, 6), [P("sum"), S(0)], [S(0), R()]),
    ((2, 2), (10, 6), [P("sum"), P("sum")], [R(), S(1)]),
    ((2, 2), (10, 6), [P("sum"), P("sum")], [S(0), S(0)]),
    ((2, 2), (10, 6), [R(), R()], [P("sum"), S(1)]),
    ((2, 2), (10, 6), [P("sum"), R()], [P("sum"), S(0)]),
    # 2x3
    ((2, 3), (7, 5), [S(0), S(1)], [S(1), S(0)]),
    ((2, 3), (7, 5), [S(0), S(0)], [R(), R()]),
    ((2, 3), (7, 5), [S(1), S(1)], [S(0), S(0)]),
    ((2, 3), (7, 5), [P("max"), S(1)], [S(0), R()]),
    ((2, 3), (12, 5), [P("avg"), P("avg")], [S(0), S(0)]),
    # 2x2x2
    ((2, 2, 2), (10, 4, 6), [S(0), S(0), S(0)], [R(), R(), R()]),
    ((2, 2, 2), (10, 4, 6), [S(0), S(0), S(0)], [S(2), S(1), S(0)]),
    ((2, 2, 2), (10, 4, 6), [S(0), S(1), S(2)], [S(2), S(1), S(0)]),
    ((2, 2, 2), (10, 4, 6), [R(), S(0), S(0)], [S(0), S(0), R()]),
    ((2, 2, 2), (10, 4, 6), [P("sum"), S(0), S(0)], [S(0), S(0), R()]),
    ((2, 2, 2), (10, 4, 6), [P("avg"), P("avg"), R()], [S(1), R(), S(0)]),
    ((2, 2, 2), (3, 5), [S(1), S(1), S(1)], [S(0), R(), S(1)]),
]


def _id(c):
    m, shape, src, dst = c
    return (f"{'x'.join(map(str, m))}-{'x'.join(map(str, shape))}-"
            f"{''.join(map(str, src))}-to-{''.join(map(str, dst))}")


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_explicit_cases_match_dtensor(oracle, case):
    mesh_shape, shape, src, dst = case
    run_case(oracle, mesh_shape, shape, src, dst)


# ---- hypothesis over the valid space ------------------------------------------------------

@st.composite
def reshard_cases(draw):
    mesh_shape = draw(st.sampled_from(MESHES))
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.sampled_from([1, 2, 3, 4, 5, 6, 7, 8, 10, 12]),
                                min_size=ndim, max_size=ndim)))
    op = draw(st.sampled_from(["sum", "sum", "avg", "max", "min"]))
    base = [R()] + [S(d) for d in range(ndim)]
    src = [draw(st.sampled_from(base + [P(op)])) for _ in mesh_shape]
    # DTensor has no Shard -> Partial step: a Partial target needs R or the same P
    dst = [draw(st.sampled_from(base + ([] if isinstance(s, wb.Shard) else [P(op)])))
           for s in src]
    seed = draw(st.integers(0, 2**16))
    return mesh_shape, shape, src, dst, seed


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reshard_cases())
def test_random_reshards_match_dtensor(oracle, case):
    mesh_shape, shape, src, dst, seed = case
    run_case(oracle, mesh_shape, shape, src, dst, seed)


# ---- communication: our plan moves no more bytes than DTensor's ---------------------------
#
# Each case: (mesh, shape, src, dst, our collectives, DTensor's collectives with torch 2.13).  Bytes are
# per rank with our cost-model convention, on the buffers DTensor really passes (it pads
# uneven shards: 10 rows on 4 ranks are gathered as 4 x 3 rows).  A sweep of 900 random
# valid cases (the space of reshard_cases) found none where our plan sends more bytes.
# It found 12 where ours issues MORE collectives (never more bytes); the last three rows
# are of that kind:
# * 3-1000-P->R: RS + AG (5,332 B) instead of one all_reduce (5,333 B).  Both are
#   2(p-1)/p n on the ring and take the same modeled time; wire_bytes floors each
#   collective, so the split saves one rounding byte and wins the planner's bytes
#   tie-break, at the price of one more launch (a planner quirk, reported, not a bug).
# * 2x3 P(max)P(max)->RR and 2x2x2 S(0)P P->S(2)S(1)R: reduce-scatter on one mesh dim
#   first, so the other dim reduces 1/n of the data (the hierarchical "RS, AR, AG"):
#   one more collective, far fewer bytes (80 vs 112, 540 vs 840).

COMM_CASES = [
    ((4,), (8, 16), [S(0)], [R()], 1, 1),
    ((4,), (8, 16), [P("sum")], [R()], 1, 1),
    ((4,), (8, 16), [P("sum")], [S(0)], 1, 1),
    ((4,), (8, 16), [S(0)], [S(1)], 1, 1),
    ((4,), (10, 3), [S(0)], [R()], 1, 1),                   # uneven: 90 B vs DTensor's padded 108
    ((2, 2), (8, 8), [S(0), S(1)], [R(), R()], 2, 2),
    ((2, 2), (8, 8), [S(0), S(0)], [R(), S(0)], 2, 2),
    ((2, 2), (8, 8), [S(0), S(1)], [S(1), S(0)], 2, 2),
    ((2, 2), (8, 8), [P("sum"), P("sum")], [S(0), S(1)], 2, 2),
    ((2, 2), (8, 8), [P("sum"), S(0)], [R(), R()], 2, 2),   # ours reduces the shard first: 256 vs 384
    ((2, 2, 2), (8, 8, 8), [S(0), S(1), S(2)], [S(2), S(1), S(0)], 2, 2),
    ((2, 2, 2), (8, 8, 8), [S(0), S(0), S(0)], [R(), S(0), R()], 3, 3),
    ((3,), (1000,), [P("sum")], [R()], 2, 1),
    ((2, 3), (12,), [P("max"), P("max")], [R(), R()], 3, 2),
    ((2, 2, 2), (2, 12, 10), [S(0), P("sum"), P("sum")], [S(2), S(1), R()], 4, 3),
]


@pytest.mark.parametrize("case", COMM_CASES, ids=[_id(c[:4]) for c in COMM_CASES])
def test_plan_moves_no_more_bytes_than_dtensor(oracle, case):
    mesh_shape, shape, src, dst, n_ours, n_theirs = case
    plan, log, n_dt = run_case(oracle, mesh_shape, shape, src, dst, comm=True)
    assert len(log) == n_dt, f"recorder saw {log}, CommDebugMode counted {n_dt}"
    dt_bytes = sum(w for *_, w in log)
    # DTensor's collectives priced on the clock our plan is priced on (every mesh here fits
    # in one node, so a group of p ranks prices as ranks 0..p-1)
    dt_time = sum(wb_cost.price(k, buf, tuple(range(p)), plan.profile) for k, p, buf, _ in log)
    what = (f"{_id(case[:4])}: our plan sends {plan.total_bytes} B/rank in "
            f"{plan.total_time * 1e6:.3f} us ({plan.collectives()}), DTensor {dt_bytes} B/rank "
            f"in {dt_time * 1e6:.3f} us ({[k for k, *_ in log]})\n{plan}")
    # the planner minimises modeled time and breaks ties by bytes: never slower than
    # DTensor's plan on the same clock, and more bytes only where they buy time
    assert plan.total_time <= dt_time * (1 + 1e-9), what
    assert plan.total_bytes <= dt_bytes or plan.total_time < dt_time * (1 - 1e-9), what
    # the counts above are documentation; only an increase on our side is a regression
    # (DTensor's count belongs to the installed torch and may change with it)
    assert len(plan.collectives()) <= n_ours, (
        f"{_id(case[:4])}: our plan now issues {plan.collectives()} (was {n_ours} "
        f"collectives; DTensor {[k for k, *_ in log]})")
