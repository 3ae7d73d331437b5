"""A PyTorch user's habits on the wrappers, round 11 (habits11): reductions over wrapped
parameters.  Each test holds a habit to plain PyTorch on one device (torch's DDP keeps the
module's parameters; FSDP2's DTensor answers the full tensor's numel and reductions) and
failed before its fix.

1. ``sum(p.numel() for p in model.parameters())`` (nanoGPT's ``get_num_params``, HF's
   ``num_parameters``) gave 232 for 58 on simulated DDP (one row per rank), 60 on FSDP /
   fully_shard (the 2-element bias padded to 4); ``p.norm()`` 2x, ``p.sum()`` 4x,
   ``get_total_norm`` 4.0265 for 2.0133 (DDP), the bias's ``p.mean()`` half (FSDP),
   silently.  Now every reduction reads the module's value;
2. an L2 penalty ``sum(p.pow(2).sum())`` in the loss was 4x the penalty with 4x its
   gradient on DDP;
3. ``torch.equal(p, w)`` / ``torch.allclose`` against the module's tensor: False (shapes).
"""
import os

import pytest
import torch
from torch import nn

import workbench as wb  # noqa: F401

from .test_habits6 import wrap

KINDS = ["ddp", "fsdp", "fsdp_units", "fully_shard"]


def model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))   # 58 parameters


def _copy(m):
    import copy
    return copy.deepcopy(m)


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


# ---- 1. numel and reductions of the parameters -------------------------------------------
READS = {
    "norm": lambda p: p.norm(), "sum": lambda p: p.sum(), "mean": lambda p: p.mean(),
    "abs_mean": lambda p: p.abs().mean(), "min": lambda p: p.min(),
    "argmin": lambda p: p.argmin(), "std": lambda p: p.std(),
    "sum_dim0": lambda p: p.sum(0), "amax_last": lambda p: p.amax(-1),
    "torch.norm": lambda p: torch.norm(p), "data_norm": lambda p: p.data.norm(),
    "detach_sum": lambda p: p.detach().sum(), "square_sum": lambda p: p.square().sum(),
    "pow_sum": lambda p: p.pow(2).sum(), "count_nonzero": lambda p: p.count_nonzero(),
    "positive": lambda p: (p > 0).sum(),
}
# what read each layout wrong before: DDP's equal rows (a max, a mean of them is right),
# FSDP's zero padding (a sum, a norm of it is right; the parameters are shifted to be
# positive, so the padding is the smallest element)
ROWS = ["norm", "sum", "std", "sum_dim0", "amax_last", "torch.norm", "data_norm",
        "detach_sum", "square_sum", "pow_sum", "count_nonzero", "positive"]
CHUNKS = ["mean", "abs_mean", "min", "argmin", "std", "sum_dim0", "amax_last"]
CASES = [(k, r) for k in KINDS for r in (ROWS if k == "ddp" else CHUNKS)]


@pytest.mark.parametrize("kind", KINDS)
def test_numel_counts_the_module_parameters(kind):
    """Before: 232 (DDP), 60 (FSDP / fully_shard) for 58."""
    ref = model()
    mesh, w = wrap(kind, model())
    want = sum(p.numel() for p in ref.parameters())
    assert want == 58
    assert sum(p.numel() for p in w.parameters()) == want
    assert sum(p.nelement() for p in w.parameters()) == want
    assert sum(p.numel() * p.element_size() for p in w.parameters()) == 4 * want
    assert sum(p.data.numel() for p in w.parameters()) == want
    # HF's num_parameters(only_trainable=True)
    assert sum(p.numel() for p in w.parameters() if p.requires_grad) == want


@pytest.mark.parametrize("kind,read", CASES)
def test_a_reduction_of_a_parameter_reads_the_module_value(kind, read):
    """Before: DDP's rows read as one tensor (norm 2x, sum 4x, sum(0) over the ranks), FSDP's
    padding as elements (the bias's mean half, min 0), silently."""
    ref = model()
    with torch.no_grad():
        for q in ref.parameters():
            q.abs_().add_(0.1)
    mesh, w = wrap(kind, _copy(ref))
    for (n, p), q in zip(w.named_parameters(), ref.parameters()):
        with torch.no_grad():
            got, want = READS[read](p), READS[read](q)
        assert type(got) is torch.Tensor, n
        close(got, want)


def test_total_norm_of_the_parameters_is_one_devices():
    """Before: 4.0265 for 2.0133 (DDP; FSDP's was right: its padding is zeros)."""
    ref = model()
    mesh, w = wrap("ddp", model())
    want = nn.utils.get_total_norm(list(ref.parameters()))
    assert abs(float(want) - 2.0133) < 1e-4
    close(nn.utils.get_total_norm(list(w.parameters())), want)
    close(nn.utils.get_total_norm(list(w.parameters()), foreach=True), want)
    close(torch.stack([p.norm() for p in w.parameters()]).norm(), want)


# a copy, a cast, a change since a copy: "weight change since init" logging
COPIES = {
    "clone_norm": lambda p, p0: p.detach().clone().norm(),
    "double_sum": lambda p, p0: p.double().sum(),
    "change_norm": lambda p, p0: (p - p0).norm(),
    "change_numel": lambda p, p0: torch.tensor(float((p.detach() - p0).numel())),
}


@pytest.mark.parametrize("read", list(COPIES))
def test_a_reduction_of_a_copy_of_a_ddp_parameter_reads_the_module_value(read):
    """Before: the copy a plain tensor of the rows, its norm 2x, its sum 4x (DDP)."""
    ref = model()
    mesh, w = wrap("ddp", model())
    p0s = [p.detach().clone() for p in w.parameters()]
    q0s = [q.detach().clone() for q in ref.parameters()]
    with torch.no_grad():
        for p, q in zip(w.parameters(), ref.parameters()):
            p.add_(0.5)
            q.add_(0.5)
    for p, p0, q, q0 in zip(w.parameters(), p0s, ref.parameters(), q0s):
        with torch.no_grad():
            close(COPIES[read](p, p0).double(), COPIES[read](q, q0).double())


# ---- 2. a penalty on the parameters in the loss -------------------------------------------
def test_an_l2_penalty_in_the_loss_is_one_devices():
    """Before (DDP): the penalty 16.2 for 4.05 and each gradient off (the rows summed);
    FSDP's was right (its padding is zeros)."""
    kind = "ddp"
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)

    def step(m, params):
        out = m(x)
        out = out.full() if isinstance(out, wb.DistTensor) else out
        penalty = sum(p.pow(2).sum() for p in params)
        (((out - y) ** 2).mean() + 0.1 * penalty).backward()
        return penalty.detach()

    ref = model()
    want = step(ref, list(ref.parameters()))
    mesh, w = wrap(kind, model())
    close(step(w, list(w.parameters())), want)
    for (n, p), q in zip(w.named_parameters(), ref.parameters()):
        close(p.grad.norm(), q.grad.norm())


# ---- 3. comparing a parameter with the module's tensor ------------------------------------
@pytest.mark.parametrize("kind", KINDS[1:])
def test_equal_and_allclose_against_the_module_tensor(kind):
    """Before: False on FSDP / fully_shard (the chunks' shape is not the module's)."""
    ref = model()
    mesh, w = wrap(kind, model())
    for p, q in zip(w.parameters(), ref.parameters()):
        assert torch.equal(p, q.detach()) and torch.allclose(p, q.detach())
        assert not torch.equal(p, q.detach() + 1)


# ---- 4. reductions of the gradients (grad-norm / grad-stat logging) -----------------------
GRAD_READS = {
    "numel": lambda g: torch.tensor(float(g.numel())), "sum": lambda g: g.sum(),
    "mean": lambda g: g.mean(), "abs_mean": lambda g: g.abs().mean(),
    "pow_sum": lambda g: g.pow(2).sum(), "std": lambda g: g.std(),
    "zeros": lambda g: (g == 0).sum(), "sum_dim0": lambda g: g.sum(0),
    # an alias, copy or cast of it: Lightning's grad_norm (p.grad.data.norm()), fairseq's
    # clip (torch.norm(p.grad.detach(), p=2, dtype=torch.float32)), a saved copy
    "data_norm": lambda g: g.data.norm(), "clone_sum": lambda g: g.clone().sum(),
    "detach_norm": lambda g: torch.norm(g.detach(), p=2, dtype=torch.float32),
    "double_norm": lambda g: g.double().norm(), "detach_mean": lambda g: g.detach().mean(),
}


def _backward(m):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
    out = m(x)
    out = out.full() if isinstance(out, wb.DistTensor) else out
    ((out - y) ** 2).mean().backward()


# what read each layout wrong before (a mean of DDP's equal rows, a sum of FSDP's zero
# padding is right)
GRAD_CASES = [("ddp", r) for r in ["numel", "sum", "pow_sum", "std", "sum_dim0", "data_norm",
                                    "clone_sum", "detach_norm", "double_norm"]] + [
    (k, r) for k in ["fsdp", "fully_shard"] for r in ["numel", "mean", "abs_mean", "std",
                                                      "zeros", "sum_dim0", "detach_mean"]]


@pytest.mark.parametrize("kind,read", GRAD_CASES)
def test_a_reduction_of_a_gradient_reads_one_devices_gradient(kind, read):
    """Before: DDP's rows read as one tensor (numel 4x, sum 4x...), FSDP's padding as
    elements (numel 60 for 58, the bias's mean off), silently."""
    ref = model()
    mesh, w = wrap(kind, model())
    _backward(ref)
    _backward(w)
    for (n, p), q in zip(w.named_parameters(), ref.parameters()):
        close(GRAD_READS[read](p.grad).float(), GRAD_READS[read](q.grad).float())


def test_a_reduction_of_an_unsynchronized_ddp_gradient_raises():
    """Before: inside no_sync() the rows differ (each rank's own gradient) and p.grad.sum()
    was their sum, silently; torch.distributed would give each rank its own."""
    mesh, w = wrap("ddp", model())
    with w.no_sync():
        _backward(w)
    p = next(w.parameters())
    with pytest.raises(RuntimeError, match="rows differ.*finish_gradient_synchronization"):
        p.grad.sum()
    with pytest.raises(RuntimeError, match="rows differ"):
        p.grad.abs().mean()


# ---- 5. nanoGPT's configure_optimizers, parameters_to_vector ------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_dim_is_the_module_parameters(kind):
    """nanoGPT's weight-decay groups (``p.dim() >= 2``).  Before: every DDP bias 2-d (rows),
    every FSDP parameter 2-d (chunks): the biases decayed, silently."""
    ref = model()
    mesh, w = wrap(kind, model())
    want = [n for n, p in ref.named_parameters() if p.dim() >= 2]
    assert [n.removeprefix("module.") for n, p in w.named_parameters() if p.dim() >= 2] == want
    assert [p.ndim for p in w.parameters()] == [p.ndim for p in ref.parameters()]
    assert [p.data.dim() for p in w.parameters()] == [p.dim() for p in ref.parameters()]


@pytest.mark.parametrize("kind", KINDS)
def test_parameters_to_vector_is_one_devices(kind):
    """Before: 232 elements (DDP: every row), 60 (FSDP: the padding)."""
    ref = model()
    mesh, w = wrap(kind, model())
    want = nn.utils.parameters_to_vector(ref.parameters())
    got = nn.utils.parameters_to_vector(w.parameters())
    assert type(got) is torch.Tensor
    close(got, want)
    # p.view(-1) is a view of the parameter: a write reaches it (every rank's copy)
    p = next(w.parameters())
    with torch.no_grad():
        p.view(-1).mul_(2.0)
    close(p.sum(), 2 * next(ref.parameters()).sum())
    out = w(torch.ones(2, 4))
    ref[0].weight.data.mul_(2.0)
    close(out.full() if isinstance(out, wb.DistTensor) else out, ref(torch.ones(2, 4)))


# ---- 6. fully_shard under torch.distributed (one gloo launch) ------------------------------
# the launch test_habits12 shares (its gradients' reads), one a session: the 2-process
# parts (torchrun_support.TWO_PROC)


@pytest.mark.slow
def test_fully_shard_reads_on_gloo_are_fsdp2s(tmp_path_factory):
    """``wb.fully_shard`` on 2 gloo processes against torch's FSDP2 ``fully_shard``.  Before:
    each process's chunk read as the parameter: numel 29 for 58, dims [1, 1, 1, 1], norms,
    means and the total norm of the chunk (1.3647 / 1.4802 for 2.0133), silently.  Now the
    module's (a gathered read); with autograd recording, or ``parameters_to_vector``, it
    raises naming what to call."""
    from tests.torchrun_support import json_rows, two_proc
    out, text = two_proc(tmp_path_factory, "habits11_check.py")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {r["case"]: r for r in json_rows(text)}
    for k in ["numel", "dims", "norm", "mean", "abs_max", "total_norm"]:
        r = rows[k]
        assert r["wb"] == pytest.approx(r["one"], abs=1e-6), r
        assert r["torch"] == pytest.approx(r["one"], abs=1e-6), r
    assert rows["numel"]["wb"] == 58
    assert "NotImplementedError: a reduction of a fully_shard parameter (under " \
        "torch.distributed, or over tensor parallelism) with autograd recording" in \
        rows["raises"]["grad_norm"]
    assert "p.full_tensor()" in rows["raises"]["p2v"]


@pytest.mark.parametrize("kind", KINDS)
def test_vector_to_parameters_raises_naming_the_fix_and_copy_writes(kind):
    """Before: torch's shape error naming the storage's shape ("shape '[4, 8, 4]' is
    invalid for input of size 32", DDP) or, on FSDP's chunks, nothing said what to do.
    The fix it names (p.copy_ of the module's shape) gives one device's parameters."""
    ref = model(1)
    vec = nn.utils.parameters_to_vector(ref.parameters()).detach()
    mesh, w = wrap(kind, model())
    before = nn.utils.parameters_to_vector(w.parameters()).clone()
    with pytest.raises(RuntimeError, match=r"vector_to_parameters.*p\.copy_"):
        nn.utils.vector_to_parameters(vec, w.parameters())
    close(nn.utils.parameters_to_vector(w.parameters()), before)     # nothing written
    i = 0
    with torch.no_grad():
        for p, q in zip(w.parameters(), ref.parameters()):
            p.copy_(vec[i:i + q.numel()].view(q.shape))
            i += q.numel()
    close(nn.utils.parameters_to_vector(w.parameters()), vec)
    out = w(torch.ones(2, 4))
    close(out.full() if isinstance(out, wb.DistTensor) else out, ref(torch.ones(2, 4)))
