"""plan17: an uneven all-to-all records its busiest rank's bytes on both executors, forward
and backward.  The simulator (cells) and a torch.distributed process (its own shard and
the layout's ``sizes``) count them with the one rule, ``grid.all_to_all_sent``; the
backward all-to-all (the gradient cut along the forward's concat dim) records its own
busiest rank, not the forward's buffer (was: (p-1)/p of the forward's largest shard,
floored: 10 B where a rank sends 16 B)."""

import pytest
import torch

import workbench as wb
from workbench.parallel import dist_uneven, layout
from workbench.sim_mesh import collectives as C
from workbench.sim_mesh import cost

from .test_plan16 import _sent as _sent16


def _sent(shape, mesh, src, dst, rank, elem=4):
    """test_plan16's rule (a rank's shard less the part it keeps), 4-byte elements."""
    return _sent16(shape, mesh, src, dst, rank, elem)


CASES = [((4, 3), [0, 1, 2], ["x"], ["S(1)"], ["S(0)"]),
         ((5, 7), [0, 1, 2], ["x"], ["S(0)"], ["S(1)"]),
         ((5, 6), [0, 1], ["tp"], ["S(0)"], ["S(1)"]),
         ((3, 5), [[0, 1, 2], [3, 4, 5]], ["a", "b"], ["S(0)", "S(1)"], ["S(1)", "S(0)"]),
         ((5, 7), [[0, 1, 2], [3, 4, 5]], ["a", "b"], ["S(0)", "S(1)"], ["S(1)", "S(0)"]),
         # even pieces in every group (sizes None on torch.distributed), uneven groups:
         # rows 3 / 2 over a, so the two groups over b send 48 and 32 B
         ((5, 4, 4), [[0, 1], [2, 3]], ["a", "b"], ["S(0)", "S(1)"], ["S(0)", "S(2)"])]


def _run(shape, ranks, names, src, dst):
    mesh = wb.Mesh(ranks, names)
    torch.manual_seed(0)
    full = torch.randn(shape, requires_grad=True)
    x = wb.shard_tensor(full, mesh, src)
    with wb.trace(profile="a100") as tr:
        y = wb.reshard(x, mesh, dst)
        (y * y).sum().backward()
    assert torch.allclose(full.grad, 2 * full.detach())
    return mesh, tr, wb.plan_reshard(x, mesh, dst, profile="a100")


@pytest.mark.parametrize("case", CASES, ids=[str(c[0]) + str(c[3]) for c in CASES])
def test_backward_all_to_all_records_its_own_busiest_rank(case):
    shape, ranks, names, src, dst = case
    mesh, tr, plan = _run(shape, ranks, names, src, dst)
    (s,) = [s for s in plan.steps if s.kind == "all_to_all"]
    a2a = [e for e in tr.events if e.name == "all_to_all"]
    groups = [tuple(g) for g in mesh.groups(s.mesh_dim) if len(g) > 1]
    assert len(a2a) == 2 * len(groups)                      # forward, then backward
    fwd, bwd = a2a[:len(groups)], a2a[len(groups):]
    for e in fwd:                                           # the forward: src -> dst
        assert e.bytes == max(_sent(shape, mesh, s.src, s.dst, r) for r in e.ranks)
    for e in bwd:                                           # the gradient: dst -> src
        assert e.bytes == max(_sent(shape, mesh, s.dst, s.src, r) for r in e.ranks)
        # priced as that many bytes sent (cost.sent_buffer), the largest gradient shard
        # as its buffer
        assert e.duration == pytest.approx(cost.price(
            "all_to_all", cost.sent_buffer("all_to_all", e.bytes, len(e.ranks)), e.ranks,
            tr.profile), rel=1e-12)
        assert e.args["buffer_bytes"] == layout.local_numel_max(shape, mesh, s.dst) * 4


def test_backward_was_the_forwards_floored_buffer():
    # (4, 3) S(1) -> S(0) on 3 ranks: shards 4x1 go to rows 2, 2, 0; the gradient's shards
    # 2x3, 2x3, 0x3 go back to columns: rank 0 keeps 2 of its 6 and sends 4 floats, 16 B.
    # Recorded before: (p-1)/p of the forward's 16 B shard, floored: 10 B.
    _, tr, _ = _run((4, 3), [0, 1, 2], ["x"], ["S(1)"], ["S(0)"])
    fwd, bwd = [e.bytes for e in tr.events if e.name == "all_to_all"]
    assert (fwd, bwd) == (16, 16)
    assert cost.wire_bytes("all_to_all", 16, 3) == 10                   # the old record


class _DistMesh:
    """What ``collectives._dist_a2a_sent`` reads of a torch.distributed mesh."""

    def __init__(self, mesh):
        self.ndim, self.shape, self.dim = mesh.ndim, mesh.shape, mesh.dim


@pytest.mark.parametrize("case", CASES, ids=[str(c[0]) + str(c[3]) for c in CASES])
def test_a_process_counts_what_the_simulator_counts(case):
    """Each process of a torch.distributed run knows only its shard and the layout's
    ``sizes`` (dist_uneven.step_kwargs): its group's busiest rank, forward and backward,
    is the simulator's event for that group (no torchrun here: test_tdreshard runs one)."""
    shape, ranks, names, src, dst = case
    mesh, tr, plan = _run(shape, ranks, names, src, dst)
    (s,) = [s for s in plan.steps if s.kind == "all_to_all"]
    i = s.mesh_dim
    a2a = [e for e in tr.events if e.name == "all_to_all"]
    ng = len(a2a) // 2
    want = {tuple(e.ranks): (e.bytes, b.bytes) for e, b in zip(a2a[:ng], a2a[ng:])}
    for r in mesh.ranks:
        coord = mesh.coordinate(r)
        kw = dist_uneven.step_kwargs("all_to_all", shape, torch.float32, mesh, s.src, s.dst,
                                     i, coord)
        local = torch.zeros((1,) * mesh.ndim + layout.local_shape(shape, mesh, s.src, r))
        got = C._dist_a2a_sent(local, _DistMesh(mesh), i, s.dst[i].dim, s.src[i].dim,
                               kw["sizes"])
        (g,) = [g for g in want if r in g]
        assert got == want[g], (r, got, want[g])
        assert kw["grad_nbytes"] == layout.local_numel_max(shape, mesh, s.dst) * 4


def test_even_all_to_all_keeps_the_ring_formula():
    mesh = wb.Mesh([0, 1, 2], ["x"])
    x = wb.shard_tensor(torch.randn(6, 6, requires_grad=True), mesh, ["S(1)"])
    with wb.trace(profile="a100") as tr:
        y = wb.reshard(x, mesh, ["S(0)"])
        y.full().sum().backward()
    got = [(e.bytes, e.args["buffer_bytes"]) for e in tr.events if e.name == "all_to_all"]
    assert got == [(cost.wire_bytes("all_to_all", 48, 3), 48)] * 2 == [(32, 48)] * 2
