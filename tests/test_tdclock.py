"""The same program on torchrun and on simulated ranks reports the same numbers (task
tdclock): what a process keeps for backward is its own, never a share of a stacked
tensor.  (The torchrun launch that holds the modeled clock of a tp layout to the
simulator's is tests/test_moe_cli.py::test_torchrun_ep_prints_one_devices_losses.)"""
import torch

import workbench as wb
from workbench.plan import meta_run


def test_saved_counter_on_a_process_counts_each_tensor_whole(monkeypatch):
    """On torch.distributed every tensor a process saves is its own: a flattened tensor
    (no lead axes) was divided by the mesh size, and one whose first dim equals the mesh
    size was read as split over it (EP 2 x dp 2 under torchrun counted 0.98 MB where the
    simulated ranks count 2.62).  Failed before: 128 and 128 of 256 and 256 bytes."""
    mesh = wb.Mesh.grid(2, ["dp"])
    x = torch.randn(2, 4, 8, requires_grad=True)      # one process's (B=2, 4, 8)

    def flat():
        a = x * 2                                      # (2, 4, 8): lead dim 2 = mesh
        return a.reshape(8, 8).exp().sum() + a.sin().sum()
    with meta_run.SavedCounter(mesh, [x]).counting() as sim:
        flat()
    # simulated ranks: (2, 4, 8) is read as 2 ranks' (4, 8), the flattened (8, 8) as
    # split over the mesh's 2 ranks
    assert sim.bytes == 8 * 8 * 4 // 2 + 2 * 4 * 8 * 4 // 2
    monkeypatch.setattr(meta_run._B, "is_distributed", lambda m: m is mesh)
    with meta_run.SavedCounter(mesh, [x]).counting() as own:
        flat()
    assert [b for b, *_ in own.items] == [8 * 8 * 4, 2 * 4 * 8 * 4]


def test_saved_counter_on_a_process_counts_a_copy_at_its_own_size(monkeypatch):
    """A copy of a slice (the process's shard of a global batch) is the process's own
    tensor: counted at its size, not its source's (the whole batch).  Failed before:
    the copy was counted as its source's 8 x 64 int64, 4,096 B (halved: 2,048)."""
    mesh = wb.Mesh.grid(2, ["dp"])
    monkeypatch.setattr(meta_run._B, "is_distributed", lambda m: m is mesh)
    batch = torch.zeros(8, 64, dtype=torch.long)
    emb = torch.nn.Embedding(10, 4)
    with meta_run.SavedCounter(mesh, list(emb.parameters())).counting() as c:
        shard = batch.detach()[:2].clone()                 # this rank's 2 sequences
        emb(shard).sum()
    assert c.bytes == 2 * 64 * 8
