"""fsdpdata17: a write through ``p.data`` between forward and backward (no version bump,
torch's too) under the sharded wrappers: backward reads the written weights, as one
device's saved weight does.  The root kept gathered read its old copy, silently."""
import pytest
import torch
from torch import nn

import workbench as wb
from workbench.parallel.strategies.zero3 import Zero3


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5))


def _fully_shard_blocks(m, mesh):
    wb.fully_shard(m[0], mesh=mesh)
    wb.fully_shard(m[2], mesh=mesh)
    return wb.fully_shard(m, mesh=mesh)


WRAPS = {
    "fsdp-root": lambda m, mesh: wb.FullyShardedDataParallel(m, mesh),
    "fsdp-root-bf16": lambda m, mesh: wb.FullyShardedDataParallel(
        m, mesh, compute_dtype=torch.bfloat16),
    "fsdp-units": lambda m, mesh: wb.FullyShardedDataParallel(m, mesh, units=[m[0], m[2]]),
    "fsdp-unit0": lambda m, mesh: wb.FullyShardedDataParallel(m, mesh, units=[m[0]]),
    "fully_shard-root": lambda m, mesh: wb.fully_shard(m, mesh=mesh),
    "fully_shard-blocks": _fully_shard_blocks,
}

WRITES = {
    "data.mul_": lambda p: p.data.mul_(2),
    "data.view.add_": lambda p: p.data.view(-1)[:7].add_(1.5),
    "data.copy_": lambda p: p.data.copy_(torch.full(p.shape, 0.25)),
}


def _xy():
    g = torch.Generator().manual_seed(1)
    return torch.randn(6, 6, generator=g), torch.randn(6, 5, generator=g)


def _loss(m, mesh, place=None):
    x, y = _xy()
    if mesh is not None:
        x, y = (wb.shard_tensor(t, mesh, place or [wb.Shard(0)]) for t in (x, y))
    return ((m(x) - y) ** 2).mean()


def _one_device(which, write):
    ref = _mlp()
    loss = _loss(ref, None)
    WRITES[write](ref[which].weight)
    loss.backward()
    return ref


def _grad(p):
    g = p.grad
    return g.full_tensor() if hasattr(g, "full_tensor") else g


@pytest.mark.parametrize("write", sorted(WRITES))
@pytest.mark.parametrize("wrap", sorted(WRAPS))
def test_data_write_between_forward_and_backward_matches_one_device(wrap, write):
    """``m[2].weight.data.mul_(2)`` after forward: one device's backward reads the new
    weight (``0.weight``'s gradient through it); the kept root's copy gave the old one's
    (off by 0.17), a resharded unit's re-gather the new one."""
    ref = _one_device(2, write)
    mesh = wb.Mesh.grid(3, ["dp"])
    m = _mlp()
    w = WRAPS[wrap](m, mesh)
    loss = _loss(w, mesh)
    WRITES[write](m[2].weight)
    loss.backward()
    want = dict(ref.named_parameters())
    tol = dict(rtol=2e-2, atol=2e-2) if "bf16" in wrap else dict(rtol=1e-5, atol=1e-6)
    for name, p in w.named_parameters():
        torch.testing.assert_close(_grad(p), want[name].grad, msg=name, **tol)
        torch.testing.assert_close(p.full_tensor(), want[name].detach(), msg=name)


@pytest.mark.parametrize("wrap", ["fsdp-root", "fully_shard-root"])
def test_unwritten_kept_root_gathers_once(wrap):
    """The check costs no collective where nothing was written: one all-gather for the
    root (forward), none again in backward; a ``.data`` write adds one re-gather."""
    for write, want in ((False, 0), (True, 1)):
        mesh = wb.Mesh.grid(3, ["dp"])
        m = _mlp()
        w = WRAPS[wrap](m, mesh)
        with wb.trace() as tr:
            loss = _loss(w, mesh)
            if write:
                m[2].weight.data.mul_(2)
            loss.backward()
        labels = [e.label for e in tr.collectives() if e.label.startswith("fsdp")]
        assert labels.count("fsdp re-gather root") == want, labels
        assert labels.count("fsdp params root") == 1, labels


@pytest.mark.parametrize("kind", ["fsdp", "zero3"])
def test_data_write_over_disttensors_matches_one_device(kind):
    """The DistTensor modes (FSDP over a dp x tp mesh, ZeRO-3) with the same write."""
    ref = _one_device(2, "data.mul_")
    mesh = wb.Mesh.grid((3, 1), ["dp", "tp"])
    m = _mlp()
    wb.parallelize(m, mesh)
    w = Zero3(m, mesh, "dp") if kind == "zero3" else wb.FullyShardedDataParallel(m, mesh, "dp")
    loss = _loss(w, mesh, ["S(0)", "R"])
    m[2].weight.data.mul_(2)
    loss.backward()
    if kind == "fsdp":
        w.finish_gradient_synchronization()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
    torch.testing.assert_close(torch.nn.utils.clip_grad_norm_(w.parameters(), 1e9), want)


@pytest.mark.slow
def test_on_torch_distributed_processes(tmp_path_factory):
    """The same ``.data`` write on gloo processes: written on every rank, or on rank 0's
    chunk alone (rank 1's kept copy holds that chunk too: both ranks gather again)."""
    from tests.torchrun_support import json_rows, two_proc
    out, text = two_proc(tmp_path_factory, "fsdpdata17_check.py")   # one launch
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {(r["rank"], r["case"]): r for r in json_rows(text)}
    for (rank, case), row in rows.items():
        assert row["diff"] < 1e-6, row
        assert row["regather"] == 1, row
    assert len(rows) == 4


@pytest.mark.parametrize("wrap", ["fsdp-root", "fully_shard-root"])
def test_second_backward_after_a_data_write_matches_one_device(wrap):
    """``retain_graph=True``, then ``.data.mul_(3)``, then a second backward: the first
    backward's check found the copy unchanged; the second finds the write and re-gathers."""
    ref = _mlp()
    loss = _loss(ref, None)
    loss.backward(retain_graph=True)
    ref[2].weight.data.mul_(3)
    ref.zero_grad()
    loss.backward()
    mesh = wb.Mesh.grid(3, ["dp"])
    m = _mlp()
    w = WRAPS[wrap](m, mesh)
    loss = _loss(w, mesh)
    loss.backward(retain_graph=True)
    m[2].weight.data.mul_(3)
    w.zero_grad()
    loss.backward()
    for (name, p), q in zip(w.named_parameters(), ref.parameters()):
        torch.testing.assert_close(_grad(p), q.grad, rtol=1e-5, atol=1e-6, msg=name)
