"""Review revL of the fixlist and ddprc merges: silent wrong answers found, each held
to one device's numbers."""
import torch

import workbench as wb
from workbench.models.moe import aux_loss, moe_layers

from tests.test_ddprc import batch, course_model, shard


def _stats(model):
    return [m.last_stats for m in moe_layers(model)]


def test_moe_last_stats_after_a_recomputing_backward_under_ddp_are_the_whole_batchs():
    # recompute="full" reruns each MoE layer in backward, one simulated rank at a time:
    # the recompute must not replace the batch's stats with the last recomputed rank's
    ref = course_model("full", moe_experts=4)
    _, ref_loss = ref(*batch(0))
    ref_loss.backward()
    want, want_aux = _stats(ref), aux_loss(ref)
    mesh = wb.Mesh.grid(2, ["dp"])
    ddp = wb.DistributedDataParallel(course_model("full", moe_experts=4), mesh)
    _, loss = ddp(*shard(mesh, *batch(0)))
    loss.backward()
    got = _stats(ddp.module)
    assert len(got) == len(want) > 0
    for g, w in zip(got, want):
        assert g["routed"] == w["routed"] == 2 * 8 * 8      # B S k: the whole batch
        torch.testing.assert_close(g["tokens_per_expert"], w["tokens_per_expert"])
        assert g["dropped"] == w["dropped"] and g["capacity"] == w["capacity"]
        assert abs(g["aux_loss"] - w["aux_loss"]) < 1e-6
    assert abs(aux_loss(ddp.module) - want_aux) < 1e-6


def test_from_local_of_rows_of_one_stacked_leaf_gives_every_row_its_gradient():
    # each rank's local a view of its own row of one leaf: the same leaves, other memory,
    # so each rank's own input (as each process's DTensor.from_local); was: row 0 alone
    torch.manual_seed(0)
    mesh = wb.Mesh.grid(4, ["dp"])
    x, w = torch.randn(3, 5), torch.randn(3, 5)
    s = torch.stack([x] * 4).requires_grad_()
    d = wb.DistTensor.from_local([s[r] for r in range(4)], mesh, [wb.Replicate()])
    (d.full_tensor() * w).sum().backward()
    for r in range(4):
        torch.testing.assert_close(s.grad[r], w, msg=f"rank {r}")
    # views of the same place (one tensor given for every rank): the gradient once
    t = torch.randn(3, 5, requires_grad=True)
    d = wb.DistTensor.from_local([t[:] for _ in range(4)], mesh, [wb.Replicate()])
    (d.full_tensor() * w).sum().backward()
    torch.testing.assert_close(t.grad, w)
