"""plan17b: an uneven all-gather / reduce-scatter records its busiest rank's bytes, (p-1)
times its group's largest piece (every rank sends p-1 pieces padded to the largest, as
DTensor and sim_mesh/padded.py send them), on both executors, forward and backward, and
the planner prices the same bytes (was: (p-1)/p of the largest buffer, floored: 10 B
where a rank sends 16 B).  The expected bytes come from the shard bounds alone."""
import math

import pytest
import torch

import workbench as wb
from workbench.parallel import dist_uneven, layout
from workbench.sim_mesh import collectives as C
from workbench.sim_mesh import cost

PEER = {"all_gather": "reduce_scatter", "reduce_scatter": "all_gather"}


def _piece(shape, mesh, ps, rank, elem=4):
    return math.prod(n for _, n in layout.shard_bounds(shape, mesh, ps, rank)) * elem


def _want(shape, mesh, step, group):
    """(p-1) x the largest piece of ``group``: an all-gather's source shards, a
    reduce-scatter's target shards (from the global bounds)."""
    ps = step.src if step.kind == "all_gather" else step.dst
    return (len(group) - 1) * max(_piece(shape, mesh, ps, r) for r in group)


# (shape, ranks, names, src, dst); "P" sources start replicated, then go to Partial locally
CASES = [((4,), [0, 1, 2], ["x"], ["S(0)"], ["R"]),
         ((75, 64), [0, 1], ["tp"], ["S(0)"], ["R"]),
         ((5, 7), [0, 1, 2], ["x"], ["S(1)"], ["R"]),
         ((5, 7), [[0, 1, 2], [3, 4, 5]], ["a", "b"], ["S(0)", "S(1)"], ["S(0)", "R"]),
         ((4,), [0, 1, 2], ["x"], ["P"], ["S(0)"]),
         ((75, 64), [0, 1], ["tp"], ["P"], ["S(0)"]),
         ((5, 7), [[0, 1, 2], [3, 4, 5]], ["a", "b"], ["S(0)", "P"], ["S(0)", "S(1)"]),
         ((1,), [0, 1], ["dp"], ["S(0)"], ["R"]),
         # hypothesis's (test_dist_tensor_property): one pp group gathers 1, 0, 0, 0, the
         # other only empty pieces (sends nothing); the plan counts the busiest
         ((1, 1), [[[0, 1, 2, 3], [4, 5, 6, 7]]], ["dp", "tp", "pp"], ["R", "R", "S(0)"],
          ["R", "S(1)", "R"])]
IDS = [f"{c[0]}{c[3]}->{c[4]}" for c in CASES]


def _run(shape, ranks, names, src, dst):
    mesh = wb.Mesh(ranks, names)
    torch.manual_seed(0)
    full = torch.randn(shape, requires_grad=True)
    start = ["R" if p == "P" else p for p in src]
    x = wb.shard_tensor(full, mesh, start)
    if start != src:
        x = wb.reshard(x, mesh, src)                    # R -> P: local, nothing moves
    plan = wb.plan_reshard(x, mesh, dst, profile="a100")
    with wb.trace(profile="a100") as tr:
        y = wb.reshard(x, mesh, dst)
        (y * y).sum().backward()
    assert full.grad is not None
    return mesh, tr, plan


def _step(plan):
    (s,) = [s for s in plan.steps if s.kind in PEER]
    assert all(t.kind.startswith("local") for t in plan.steps if t is not s)
    return s


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_each_group_records_its_busiest_rank_forward_and_backward(case):
    shape, ranks, names, src, dst = case
    mesh, tr, plan = _run(shape, ranks, names, src, dst)
    s = _step(plan)
    label = f"{s.src[s.mesh_dim]}->{s.dst[s.mesh_dim]} on {s.mesh_dim_name}"
    groups = [tuple(g) for g in mesh.groups(s.mesh_dim)]
    fwd = [e for e in tr.events if e.name == s.kind and e.label == label]
    assert sorted(tuple(e.ranks) for e in fwd) == sorted(groups)
    for e in fwd:
        assert e.bytes == _want(shape, mesh, s, tuple(e.ranks)), (e.ranks, e.bytes)
        # priced as that many bytes sent: the padded buffer, p x the largest piece
        assert e.duration == pytest.approx(cost.price(
            s.kind, cost.sent_buffer(s.kind, e.bytes, len(e.ranks)), e.ranks, tr.profile),
            rel=1e-12)
    bwd = [e for e in tr.events if e.name == PEER[s.kind] and e.label == label]
    if s.kind == "reduce_scatter":             # its backward all-gathers the gradient
        assert sorted(tuple(e.ranks) for e in bwd) == sorted(groups)
        for e in bwd:
            assert e.bytes == _want(shape, mesh, s, tuple(e.ranks))
    else:                                      # S -> R's backward: a local slice
        assert bwd == []
    # the plan: the busiest rank anywhere, the slowest group's clock
    assert s.bytes == max(e.bytes for e in fwd)
    assert s.time == pytest.approx(max(e.duration for e in fwd), rel=1e-12)


def test_the_briefs_figures():
    # rows 2, 2, 0 of f32 on 3 ranks: a rank sends 2 pieces of 8 B (was 10 B);
    # 75 x 64 f32 on 2 ranks: rank 0 sends its 38 rows (was 9,600 B)
    for shape, ranks, want, old in [((4,), [0, 1, 2], 16, 10), ((75, 64), [0, 1], 9728, 9600)]:
        _, tr, plan = _run(shape, ranks, ["x"], ["S(0)"], ["R"])
        assert [s.bytes for s in plan.steps] == [want]
        assert cost.wire_bytes("all_gather", math.prod(shape) * 4, len(ranks)) == old


def test_distribute_backward_gathers_the_gradient_as_the_rule_says():
    # shard_tensor's R -> S(0) slice: its backward all-gathers the shards' gradients
    mesh = wb.Mesh([0, 1, 2], ["x"])
    full = torch.randn(4, 3, requires_grad=True)
    with wb.trace(profile="a100") as tr:
        x = wb.shard_tensor(full, mesh, ["S(0)"])
        (x * x).sum().backward()
    (e,) = [e for e in tr.events if e.name == "all_gather"]
    assert e.bytes == 2 * max(_piece((4, 3), mesh, ("S(0)",), r) for r in range(3)) == 48
    assert torch.equal(full.grad, 2 * full.detach())


def test_even_keeps_the_ring_formula():
    mesh = wb.Mesh([0, 1, 2], ["x"])
    x = wb.shard_tensor(torch.randn(6, 4, requires_grad=True), mesh, ["S(0)"])
    with wb.trace(profile="a100") as tr:
        wb.reshard(x, mesh, ["R"])
    (e,) = [e for e in tr.events if e.name == "all_gather"]
    assert e.bytes == cost.wire_bytes("all_gather", 96, 3) == 64


class _DistMesh:
    """What ``collectives._dist_gather_sent`` reads of a torch.distributed mesh."""

    def __init__(self, mesh):
        self.ndim, self.shape, self.dim = mesh.ndim, mesh.shape, mesh.dim


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_process_counts_what_the_simulator_counts(case):
    """Each torch.distributed process knows its own shard and the layout's ``sizes``
    (dist_uneven.step_kwargs): the bytes it records for its group (forward; the backward
    records the same) are the simulator's event for that group (no torchrun here)."""
    shape, ranks, names, src, dst = case
    mesh, tr, plan = _run(shape, ranks, names, src, dst)
    s = _step(plan)
    i = s.mesh_dim
    label = f"{s.src[i]}->{s.dst[i]} on {s.mesh_dim_name}"
    want = {tuple(e.ranks): e.bytes for e in tr.events if e.name == s.kind and e.label == label}
    for r in mesh.ranks:
        kw = dist_uneven.step_kwargs(s.kind, shape, torch.float32, mesh, s.src, s.dst, i,
                                     mesh.coordinate(r))
        if s.kind == "all_gather":                  # the input: this rank's shard
            local, dim = layout.local_shape(shape, mesh, s.src, r), s.src[i].dim
        else:                                       # the group's block, summed
            whole = s.dst[:i] + (wb.Replicate(),) + s.dst[i + 1:]
            local, dim = layout.local_shape(shape, mesh, whole, r), s.dst[i].dim
        x = torch.zeros((1,) * mesh.ndim + local)
        got = C._dist_gather_sent(x, _DistMesh(mesh), i, dim, kw["sizes"],
                                  s.kind == "reduce_scatter")
        (g,) = [g for g in want if r in g]
        assert got == want[g], (r, got, want[g])


def test_notebook_03_exercise_3_names_the_plans_figure(capsys):
    """03 exercise 3 said 'the plan reports the mean, 120 B': the plan of u (10, 4) S(0)
    -> R on 4 ranks reports 144 B now; the feedback names both figures."""
    from workbench.exercises import CheckError, check_uneven_receive
    mesh = wb.Mesh([0, 1, 2, 3], ["x"])
    u = wb.shard_tensor(torch.arange(40.0).reshape(10, 4), mesh, [wb.Shard(0)])
    (s,) = wb.plan_reshard(u, mesh, [wb.Replicate()], profile="a100").steps
    check_uneven_receive([112, 112, 112, 144])
    assert f"{s.bytes} B" in capsys.readouterr().out and s.bytes == 144
    for wrong, says in [([120] * 4, "120 B is (p-1)/p n"), ([144] * 4, "144 B is the plan's")]:
        with pytest.raises(CheckError, match=says.replace("(", r"\(").replace(")", r"\)")):
            check_uneven_receive(wrong)
