"""A PyTorch user's habits on the wrappers, round 13 (habits13): reads of views and
detached copies of wrapped parameters.  Each case is held to plain PyTorch on one device
and failed before its fix (or, where one device's answer cannot be given, now raises
naming the fix).

1. ``p.shape`` / ``p.size()`` / ``len(p)`` / ``p[i]`` were the storage's (DDP's rows
   ``(4, 8, 4)`` for ``(8, 4)``: ``p.dim() != len(p.shape)``): now a user's are the
   module's, views of its value;
2. a reduction of a view of a wrapped parameter (``p.T.sum()``, ``p[0].norm()``,
   ``p.transpose(0, 1).abs().max()``) read the storage (DDP: ``p.T.sum()`` -3.1153 for
   -0.7788, ``p[0].norm()`` 1.5614 for 0.6138), silently: now one device's (a view of the
   storage the wrappers take themselves raises naming ``p.full_tensor()`` if a user reduces
   it);
4. ``p.detach().requires_grad_()`` (a "functional copy") was a leaf of the storage, and
   ``torch.autograd.grad`` over such a leaf (or over a view, or ``backward(inputs=)``)
   gave None: now ``requires_grad_()`` of a storage alias raises naming
   ``p.full_tensor()``, and an autograd input that is a view of the module's value gets
   its gradient, as torch's;
3. ``DistributedDataParallel`` over tensor-parallel DistTensors gave its replica storages
   ``(dp, tp, *local)`` as plain tensors: ``sum(p.numel())`` 1376 for 688, ``p.dim()`` 4;
   now a user's reads are the module's (views and penalties raise naming the fix);
5. under torch.distributed ``fully_shard`` over tensor parallelism read each process's
   chunk for a gradient's (and a parameter's) numel and reductions other than the norm:
   now the whole tensor's, gathered, as FSDP2's DTensor (one gloo launch, 2 x 2).
"""
import pytest
import torch
from torch import nn

import workbench as wb  # noqa: F401

from .test_habits6 import wrap
from .test_habits11 import KINDS, close, model


def _weights(w, ref):
    """(wrapped, one device's) 2-d weights, in order."""
    return [(p, q) for p, q in zip(w.parameters(), ref.parameters()) if q.dim() == 2]


# ---- 1. shape, size, len, indexing; 2. reductions of views ---------------------------------
SHAPES = {
    "shape": lambda p: tuple(p.shape), "size": lambda p: tuple(p.size()),
    "size_1": lambda p: p.size(-1), "len": lambda p: len(p),
    "dim_is_len_shape": lambda p: p.dim() == len(p.shape),
    "numel_is_prod_shape": lambda p: p.numel() == p.shape.numel(),
    "row_shape": lambda p: tuple(p[0].shape), "T_shape": lambda p: tuple(p.T.shape),
    "iter_rows": lambda p: [tuple(r.shape) for r in p],
    "data_shape": lambda p: tuple(p.data.shape),
    "copy_shape": lambda p: tuple(p.detach().clone().shape),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("read", list(SHAPES))
def test_shape_size_len_are_the_module_parameters(kind, read):
    """Before: the storage's (DDP (4, 8, 4) for (8, 4): p.dim() 2 but len(p.shape) 3;
    FSDP (4, 8)), a fan-in p.size(-1) 4 read as 4 (DDP) / 8 (FSDP chunks)."""
    ref = model()
    mesh, w = wrap(kind, model())
    for p, q in zip(w.parameters(), ref.parameters()):
        assert SHAPES[read](p) == SHAPES[read](q)


@pytest.mark.parametrize("kind", ["ddp", "fsdp", "fully_shard"])
def test_a_gradients_shape_and_views_are_the_parameters(kind):
    """p.grad.shape / dim() / len / p.grad[0] / p.grad.T: the module's, as p's and as torch
    DDP's / FSDP2's gradients (before: the rows' or chunks': p.grad.dim() 3 on DDP)."""
    from .test_habits11 import _backward
    ref, (mesh, w) = model(), wrap(kind, model())
    _backward(ref)
    _backward(w)
    for p, q in _weights(w, ref):
        g, h = p.grad, q.grad
        assert tuple(g.shape) == tuple(h.shape) == tuple(p.shape)
        assert (g.dim(), g.ndim, len(g), tuple(g.size())) == \
            (h.dim(), h.ndim, len(h), tuple(h.size()))
        close(g[1], h[1])
        close(g.T.sum(0), h.T.sum(0))


VIEW_READS = {
    "T_sum": lambda p: p.T.sum(), "row_norm": lambda p: p[0].norm(),
    "transpose_abs_max": lambda p: p.transpose(0, 1).abs().max(),
    "narrow_sum": lambda p: p.narrow(1, 1, 2).sum(), "row_numel": lambda p: p[0].numel(),
    "row_scaled_mean": lambda p: (2 * p[1]).mean(), "col_std": lambda p: p[:, 1].std(),
    "unbind_norms": lambda p: torch.stack([r.norm() for r in p.unbind(0)]),
    "iter_norms": lambda p: torch.stack([r.norm() for r in p]),
    "view_sum0": lambda p: p.view(2, -1).sum(0), "tolist": lambda p: torch.tensor(p.tolist()),
    "data_row": lambda p: p.data[1].sum(), "copy_T": lambda p: p.detach().clone().T[0].sum(),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("read", list(VIEW_READS))
def test_a_reduction_of_a_view_of_a_parameter_is_one_devices(kind, read):
    """Before: the storage's elements (DDP's rows, FSDP's chunks), silently (p.T.sum()
    -3.1153 for -0.7788, p[0].norm() 1.5614 for 0.6138 on DDP; 0.7675 on FSDP)."""
    ref = model()
    mesh, w = wrap(kind, model())
    for p, q in _weights(w, ref):
        with torch.no_grad():
            close(torch.as_tensor(VIEW_READS[read](p)).float(),
                  torch.as_tensor(VIEW_READS[read](q)).float())


@pytest.mark.parametrize("kind", KINDS)
def test_a_write_through_a_view_is_one_devices(kind):
    """p[1].mul_(2), p.T[0].zero_(): the module's elements, every rank's copy (before: rank
    1's row alone, which DDP refused, or chunk 1's elements)."""
    ref = model()
    mesh, w = wrap(kind, model())
    (p, q), = _weights(w, ref)[:1]
    with torch.no_grad():
        for t in (p, q):
            t[1].mul_(2.0)
            t.T[0].zero_()
    x = torch.arange(8.0).view(2, 4)
    out = w(x)
    close(out.full() if isinstance(out, wb.DistTensor) else out, ref(x))


def test_a_view_of_a_storage_that_is_no_view_of_the_module_raises():
    """Before: iterating the rows from the wrapper's own view of the storage gave the
    rows' norms; a user's reduction of such a storage view raises naming the fix."""
    from workbench.parallel.strategies.laid_out import _guard_views
    mesh, w = wrap("ddp", model())
    p = next(w.parameters())
    with torch._C.DisableTorchFunctionSubclass():
        row = p[2]
    row = _guard_views(p, row)      # a storage view, as the wrapper's own code takes one
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"view of a wrapped.*full_tensor"):
        row.T.abs().max()
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"view of a wrapped.*full_tensor"):
        row.sum()


@pytest.mark.parametrize("kind", KINDS)
def test_the_module_flat_view_reads_as_one_device(kind):
    """p.view(-1) is the module's flat parameter: its reductions and its views' are one
    device's (a guard: they passed before)."""
    ref = model()
    mesh, w = wrap(kind, model())
    for p, q in zip(w.parameters(), ref.parameters()):
        with torch.no_grad():
            close(p.view(-1).sum(), q.view(-1).sum())
            close(p.view(-1)[:3].norm(), q.view(-1)[:3].norm())
            close(p.view(-1).abs().max(), q.view(-1).abs().max())


class Standardized(nn.Module):
    """A forward that reduces its own weight (weight standardization)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 4))

    def forward(self, x):
        w = (self.w - self.w.mean(1, keepdim=True)) / self.w.std(1, keepdim=True)
        return x @ w.T


def test_a_forward_reducing_its_weight_on_ddp_is_one_devices():
    """DDP runs each rank's forward on its row: the module's tensor there, so its
    reductions are one device's (a guard for the views' rule: it passed before)."""
    torch.manual_seed(0)
    ref = Standardized()
    import copy
    mesh, w = wrap("ddp", copy.deepcopy(ref))
    x = torch.randn(4, 4)
    out = w(x)
    out = out.full() if isinstance(out, wb.DistTensor) else out
    close(out, ref(x))
    out.pow(2).mean().backward()
    ref(x).pow(2).mean().backward()
    close(next(w.parameters()).grad.norm(), ref.w.grad.norm())


# ---- 3. DDP over tensor-parallel parameters -----------------------------------------------
def _tp_ddp():
    def mk():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 40), nn.ReLU(), nn.Linear(40, 8))     # 688
    ref, m = mk(), mk()
    mesh = wb.Mesh.grid((2, 2), ["dp", "tp"])
    wb.parallelize_module(m, mesh, {"0": wb.ColwiseParallel(), "2": wb.RowwiseParallel()})
    wb.parallelize(m, mesh)
    return ref, mesh, wb.DistributedDataParallel(m, mesh, dim="dp")


TP_READS = {
    "numel": lambda p: p.numel(), "dim": lambda p: p.dim(), "shape": lambda p: tuple(p.shape),
    "len": lambda p: len(p), "norm": lambda p: p.norm(), "sum": lambda p: p.sum(),
    "mean": lambda p: p.mean(), "abs_max": lambda p: p.abs().max(),
    "sum_dim0": lambda p: p.sum(0), "pow_sum": lambda p: p.pow(2).sum(),
    "detach_norm": lambda p: p.detach().norm(), "data_sum": lambda p: p.data.sum(),
    "clone_mean": lambda p: p.clone().mean(),
}


@pytest.mark.parametrize("read", list(TP_READS))
def test_ddp_over_tensor_parallel_parameters_reads_one_device(read):
    """Before: the replica storage (dp, tp, *local): sum(p.numel()) 1376 for 688, p.dim() 4
    for 2, every replica's norm and sum (plain tensors, silently)."""
    ref, mesh, ddp = _tp_ddp()
    if read == "numel":
        assert sum(p.numel() for p in ddp.parameters()) == 688
    for p, q in zip(ddp.parameters(), ref.parameters()):
        with torch.no_grad():
            got, want = TP_READS[read](p), TP_READS[read](q)
        if isinstance(want, torch.Tensor):
            close(got, want)
        else:
            assert got == want


def train_as_one_device(ref, mesh, ddp, after_clip=lambda ps, ref: None):
    """Two AdamW steps of DDP over tensor parallelism (clip_grad_norm_ in each, equal to one
    device's) beside one device's; ``after_clip(ps, ref)`` checks before each step; the
    parameters' norms equal after."""
    ps = list(ddp.parameters())
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
    opt = torch.optim.AdamW(ps, lr=1e-2)
    ro = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        ro.zero_grad()
        out = ddp(wb.shard_tensor(x, mesh, [wb.Shard(0), wb.Replicate()]))
        ((out.full() - y) ** 2).mean().backward()
        ((ref(x) - y) ** 2).mean().backward()
        close(nn.utils.clip_grad_norm_(ps, 1.0), nn.utils.clip_grad_norm_(ref.parameters(), 1.0))
        after_clip(ps, ref)
        opt.step()
        ro.step()
    for p, q in zip(ps, ref.parameters()):
        with torch.no_grad():
            close(p.norm(), q.norm())
    return ps


def test_ddp_over_tensor_parallel_parameters_totals_and_training_are_one_devices():
    """get_total_norm of the parameters (before: 5.9011 for 4.1727); clip_grad_norm_ and two
    AdamW steps still train as one device; a view or a penalty in the loss raises naming
    what to read instead."""
    ref, mesh, ddp = _tp_ddp()
    ps = list(ddp.parameters())
    close(nn.utils.get_total_norm(ps), nn.utils.get_total_norm(list(ref.parameters())))
    train_as_one_device(ref, mesh, ddp)
    with pytest.raises(NotImplementedError, match=r"no view of it"):
        ps[0][0]
    with pytest.raises(NotImplementedError, match=r"autograd recording.*weight_decay"):
        ps[0].pow(2).sum()


# ---- 4. a detached copy as a leaf ("functional copy") -------------------------------------
LEAVES = {
    "detach": lambda p: p.detach(), "data": lambda p: p.data,
    "clone": lambda p: p.detach().clone(),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("leaf", list(LEAVES))
def test_requires_grad_of_a_storage_alias_raises_naming_the_fix(kind, leaf):
    """Before: a leaf of the storage (its gradient the rows' or the padded chunks'; with
    torch.autograd.grad or backward(inputs=) None for the copy and the row).  The fix it
    names (p.full_tensor().requires_grad_()) is one device's leaf."""
    ref = model()
    mesh, w = wrap(kind, model())
    p, q = _weights(w, ref)[0]
    with pytest.raises(RuntimeError, match=r"requires_grad_\(\).*p\.full_tensor\(\)"):
        LEAVES[leaf](p).requires_grad_()
    assert not p.grad_fn and p.requires_grad        # nothing changed
    d = p.full_tensor().requires_grad_()
    e = q.detach().clone().requires_grad_()
    g, = torch.autograd.grad((d * d.sum(1, keepdim=True)).sum(), d)
    h, = torch.autograd.grad((e * e.sum(1, keepdim=True)).sum(), e)
    close(g, h)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("how", ["grad", "inputs"])
def test_a_view_of_the_module_value_as_an_autograd_input_gets_its_gradient(kind, how):
    """Before: None (the input was handed to autograd as a fresh alias no loss went
    through).  p.view(-1) and a leaf made of it, as torch's."""
    ref = model()
    mesh, w = wrap(kind, model())
    p, q = _weights(w, ref)[0]
    for make in (lambda t: t.view(-1), lambda t: t.view(-1).detach().requires_grad_(),
                 lambda t: t[1], lambda t: t.T[0].detach().requires_grad_()):
        v, u = make(p), make(q)
        got, want = [], []
        for t, out in ((v, got), (u, want)):
            loss = (t * t.detach().cumsum(0)).sum()
            if how == "grad":
                out.append(torch.autograd.grad(loss, [t])[0])
            elif t.is_leaf:
                loss.backward(inputs=[t])
                out.append(t.grad)
            else:
                t.retain_grad()
                loss.backward(inputs=[t])
                out.append(t.grad)
        assert got[0] is not None
        close(got[0], want[0])


# ---- 5. fully_shard over tensor parallelism under torch.distributed (gloo, 2 x 2) ----------
def _flat(v):
    return [x for e in v for x in _flat(e)] if isinstance(v, list) else [v]


@pytest.mark.slow
def test_fully_shard_over_tp_gradient_reads_on_gloo_are_fsdp2s(tmp_path_factory):
    """4 gloo processes (dp x tp = 2 x 2), ``Sequential(Linear(3, 6), GELU, Linear(6, 3))``
    colwise / rowwise (each (3, 3) local weight in dp chunks of 5 and 4, padded), against
    torch's parallelize_module + FSDP2 fully_shard and one device.  Before (measured):
    ``p.grad.numel()`` [5, 2, 5, 2] for [18, 6, 18, 3], ``sum`` / ``mean`` / ``std`` /
    ``max`` / ``min`` / ``sum(0)`` / ``g.data.norm()`` (0.1949 for 0.3791) / ``clone``
    this process's chunk's, ``get_total_norm`` of order 0 raised; the parameters' numel,
    mean, shape ([1, 1, 5]) and dim (3) the chunk's too.  Now the whole tensor's, as FSDP2's
    DTensor answers (only the norms were right before)."""
    from tests.torchrun_support import json_rows, tp_2x2
    out, text = tp_2x2(tmp_path_factory, "habits13_check.py")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {r["case"]: r for r in json_rows(text)}
    assert rows["numel"]["wb"] == [18, 6, 18, 3]
    assert rows["p_shape"]["wb"] == [[6, 3], [6], [3, 6], [3]]
    assert len(rows) == 21
    for c, r in rows.items():
        one, theirs, mine = (_flat(r[k]) for k in ("one", "torch", "wb"))
        assert all(isinstance(v, (int, float)) for v in mine), r      # no error text
        assert len(mine) == len(one) == len(theirs), r
        assert mine == pytest.approx(one, abs=1e-5), r
        assert theirs == pytest.approx(one, abs=1e-5), r
