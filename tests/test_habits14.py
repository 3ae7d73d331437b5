"""A PyTorch user's habits on the wrappers, round 14 (habits14): the gradients' reads of
wrapped tensor-parallel parameters, held to one device.

1. ``DistributedDataParallel`` over tensor-parallel DistTensors on simulated ranks: the
   parameters read as the module's (habits13), but ``p.grad`` was the replica storage's
   (measured, ``Linear(8, 40), ReLU, Linear(40, 8)`` on 2 x 2: ``p.grad.numel()`` 640 for
   320, ``dim()`` 4, ``p.grad.sum()`` twice one device's); now the module's gradient.
2. ``fully_shard`` over tensor parallelism on simulated ranks: parameter and gradient reads
   were the storage's (``Linear(3, 6), GELU, Linear(6, 3)`` on 2 x 2: ``numel()`` [20, 8,
   20, 4] for [18, 6, 18, 3], ``shape`` (2, 2, 5), ``p.grad.abs().min()`` 0, the padding);
   now the rule habits13 built under torch.distributed: the module's, gathered.
"""
import pytest
import torch
from torch import nn

import workbench as wb  # noqa: F401

from .test_habits11 import close
from .test_habits13 import _tp_ddp, train_as_one_device

GRAD_READS = {
    "numel": lambda g: g.numel(), "dim": lambda g: g.dim(), "ndim": lambda g: g.ndim,
    "shape": lambda g: tuple(g.shape), "size": lambda g: tuple(g.size()),
    "size_0": lambda g: g.size(0), "len": lambda g: len(g),
    "norm": lambda g: g.norm(), "sum": lambda g: g.sum(), "mean": lambda g: g.mean(),
    "abs_max": lambda g: g.abs().max(), "sum_0": lambda g: g.sum(0),
    "pow_sum": lambda g: g.pow(2).sum(), "data_sum": lambda g: g.data.sum(),
    "clone_mean": lambda g: g.clone().mean(), "full": lambda g: g.full_tensor()
    if hasattr(g, "full_tensor") and not isinstance(g, nn.Parameter) and
    type(g) is not torch.Tensor else g,
}


def _ddp_backward():
    ref, mesh, ddp = _tp_ddp()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
    out = ddp(wb.shard_tensor(x, mesh, [wb.Shard(0), wb.Replicate()]))
    ((out.full() - y) ** 2).mean().backward()
    ((ref(x) - y) ** 2).mean().backward()
    return ref, ddp


@pytest.mark.parametrize("read", list(GRAD_READS))
def test_ddp_over_tensor_parallel_gradient_reads_one_device(read):
    """Before: the replica storage's gradient (dp, tp, *local): sum(p.grad.numel()) 1376
    for 688, p.grad.dim() 4 for 2, p.grad.sum() every dp copy's (2x)."""
    ref, ddp = _ddp_backward()
    if read == "numel":
        assert sum(p.grad.numel() for p in ddp.parameters()) == 688
    for p, q in zip(ddp.parameters(), ref.parameters()):
        got, want = GRAD_READS[read](p.grad), GRAD_READS[read](q.grad)
        if isinstance(want, torch.Tensor):
            assert tuple(got.shape) == tuple(want.shape)
            close(got, want)
        else:
            assert got == want


def test_ddp_over_tensor_parallel_gradient_view_raises_and_training_is_one_devices():
    """A view of the gathered gradient raises naming p.grad.full_tensor(); clip and two
    AdamW steps still train as one device (the wrappers' own reads stay the storage's)."""
    ref, mesh, ddp = _tp_ddp()

    def grads_sum_as_one_devices(ps, ref):
        for p, q in zip(ps, ref.parameters()):
            close(p.grad.sum(), q.grad.sum())
    ps = train_as_one_device(ref, mesh, ddp, grads_sum_as_one_devices)
    with pytest.raises(NotImplementedError, match=r"p\.grad\.full_tensor\(\)"):
        ps[0].grad[0]
    close(ps[0].grad.full_tensor()[0], next(ref.parameters()).grad[0])


# ---- 2. fully_shard over tensor parallelism, simulated ranks -------------------------------
def _fs_tp():
    def mk():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(3, 6), nn.GELU(), nn.Linear(6, 3))     # padded chunks
    ref, m = mk(), mk()
    mesh = wb.Mesh.grid((2, 2), ["dp", "tp"])
    wb.parallelize_module(m, mesh, {"0": wb.ColwiseParallel(), "2": wb.RowwiseParallel()})
    wb.fully_shard(m, mesh=mesh["dp"])
    return ref, mesh, m


def _fs_step(ref, mesh, m, x, y):
    out = m(wb.shard_tensor(x, mesh, [wb.Shard(0), wb.Replicate()]))
    ((out.full() - y) ** 2).mean().backward()
    ((ref(x) - y) ** 2).mean().backward()


PARAM_READS = dict(GRAD_READS, min_abs=lambda g: g.abs().min(),
                   norm_0=lambda g: torch.linalg.vector_norm(g, 0))
del PARAM_READS["full"]


@pytest.mark.parametrize("read", list(PARAM_READS))
def test_fully_shard_over_tp_simulated_parameter_and_gradient_reads_one_device(read):
    """Before: the storage's (each tp coordinate's dp chunks, padded): numel 20 for 18,
    shape (2, 2, 5) for (6, 3), dim 3, the padding's zeros in abs().min() / norm 0."""
    ref, mesh, m = _fs_tp()
    g = torch.Generator().manual_seed(1)
    _fs_step(ref, mesh, m, torch.randn(8, 3, generator=g), torch.randn(8, 3, generator=g))
    if read == "numel":
        assert sum(p.numel() for p in m.parameters()) == 45
        assert sum(p.grad.numel() for p in m.parameters()) == 45
    for p, q in zip(m.parameters(), ref.parameters()):
        for a, b in ((p, q), (p.grad, q.grad)):
            with torch.no_grad():
                got, want = PARAM_READS[read](a), PARAM_READS[read](b)
            if isinstance(want, torch.Tensor):
                assert tuple(got.shape) == tuple(want.shape)
                close(got, want)
            else:
                assert got == want


def test_fully_shard_over_tp_simulated_training_is_one_devices_and_views_raise():
    """clip_grad_norm_ (also of order -inf: the padding's zeros before) and two AdamW steps
    as one device; a view of the gathered parameter or gradient raises naming the copy."""
    ref, mesh, m = _fs_tp()
    ps = list(m.parameters())
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 3, generator=g), torch.randn(8, 3, generator=g)
    opt = torch.optim.AdamW(ps, lr=1e-2)
    ro = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        ro.zero_grad()
        _fs_step(ref, mesh, m, x, y)
        close(nn.utils.get_total_norm([p.grad for p in ps], -float("inf")),
              nn.utils.get_total_norm([q.grad for q in ref.parameters()], -float("inf")))
        close(nn.utils.clip_grad_norm_(ps, 0.1), nn.utils.clip_grad_norm_(ref.parameters(), 0.1))
        opt.step()
        ro.step()
    for p, q in zip(ps, ref.parameters()):
        close(p.full_tensor(), q.detach())
    with pytest.raises(NotImplementedError, match=r"p\.full_tensor\(\)"):
        ps[0][0]
    with pytest.raises(NotImplementedError, match=r"p\.grad\.full_tensor\(\)"):
        ps[0].grad[0]
    close(ps[0].grad.full_tensor()[0], next(ref.parameters()).grad[0])
