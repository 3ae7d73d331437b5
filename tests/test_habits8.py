"""A PyTorch user's habits on the wrappers, fourth sweep (habits8): each test failed
before its fix and holds the wrapper to one device (or torch's documented semantics).

1. A view of a wrapped parameter (``p.view(-1)``, ``p[0]``, ``p.flatten()``,
   ``p.reshape(-1)``, ``p.T``, ``p.narrow(...)``, ``p.unbind()``; of ``p``, ``p.data`` or
   ``p.detach()``) was a plain tensor: ``p.view(-1).normal_()`` / ``nn.init.normal_(
   p[0])`` drew each rank's row or chunk on its own, silently.  Now a random fill through
   any view raises as through ``p`` (parameters untouched); elementwise writes through a
   view still write what it views, DDP's rank-0 row reaching every row at once.
"""
import pytest
import torch
from torch import nn

import workbench as wb
from tests.test_habits7 import mlp, wrap, train_as_one_device

VIEWS = {"view": lambda p: p.view(-1), "getitem": lambda p: p[0],
         "flatten": lambda p: p.flatten(), "reshape": lambda p: p.reshape(-1),
         "T": lambda p: p.mT if p.dim() > 2 else p.T, "narrow": lambda p: p.narrow(0, 0, 1),
         "unbind": lambda p: p.unbind(0)[0], "data_view": lambda p: p.data.view(-1),
         "detach_getitem": lambda p: p.detach()[0], "view_of_view": lambda p: p.view(-1)[2:],
         "view_detach": lambda p: p.view(-1).detach()}
FILLS = {"normal_": lambda t: t.normal_(0.0, 0.2),
         "uniform_": lambda t: t.uniform_(-0.2, 0.2),
         "init.normal_": lambda t: nn.init.normal_(t, std=0.2),
         "init.uniform_": lambda t: nn.init.uniform_(t, -0.2, 0.2)}


def _first_weight(w):
    return next(p for n, p in w.named_parameters() if n.endswith("0.weight"))


@pytest.mark.parametrize("kind", ["ddp", "fsdp", "fully_shard"])
@pytest.mark.parametrize("view", list(VIEWS))
def test_random_fill_through_a_view_raises(kind, view):
    """Before: each rank's row / chunk its own draw (no error); now the error, nothing
    written."""
    mesh, w = wrap(kind, mlp())
    before = {n: p.detach().clone() for n, p in w.named_parameters()}
    p = _first_weight(w)
    for fill in FILLS.values():
        with pytest.raises(RuntimeError, match="in-place init of a parameter after "
                           "wrapping: .*view of it.*Initialize the module before wrapping"):
            with torch.no_grad():
                fill(VIEWS[view](p))
    for n, q in w.named_parameters():
        assert torch.equal(q.detach(), before[n]), n


@pytest.mark.parametrize("kind", ["ddp", "fsdp", "fully_shard"])
def test_elementwise_writes_through_views_train_as_one_device(kind):
    """zero_ / fill_ / mul_ through views (whole-storage views, and DDP's rank-0 row)
    end as the same writes on one device, then train alike."""
    ref, (mesh, w) = mlp(), wrap(kind, mlp())
    with torch.no_grad():
        for model in (w, ref):
            for n, p in model.named_parameters():
                n = n.removeprefix("module.")
                if n == "0.bias":
                    p.view(-1).zero_()
                elif n == "2.bias":
                    p.flatten().fill_(0.25)
                else:
                    p.reshape(-1).mul_(1.5)
        if kind == "ddp":       # a write into row 0 of the weight: every replica's (a
            w.module[2].weight[0].mul_(2.0)     # user's p[0] is the module's row: habits13)
            ref[2].weight[0].mul_(2.0)
    train_as_one_device(kind, w, mesh, ref)


def test_views_still_read_and_backprop_as_torchs():
    """A view reads its elements; a value computed from it is a plain tensor; autograd
    through a view of the parameter reaches p.grad as torch's."""
    mesh, w = wrap("fsdp", mlp())
    p = _first_weight(w)
    v = p.view(-1)
    assert v.requires_grad and v.grad_fn is not None
    assert type(v * 2) is torch.Tensor and type(v.clone()) is torch.Tensor
    (v * torch.arange(v.numel(), dtype=v.dtype)).sum().backward()
    with torch._C.DisableTorchFunctionSubclass():
        torch.testing.assert_close(p.grad.reshape(-1), torch.arange(v.numel(), dtype=v.dtype))


# ---- 2. FSDP's / fully_shard's state_dict(keep_vars=True) -------------------------------
@pytest.mark.parametrize("kind", ["fsdp", "fully_shard"])
def test_keep_vars_gives_the_parameters_themselves(kind):
    """torch FSDP2's keep_vars values are its sharded parameters (the objects
    parameters() gives: a state-dict pre-hook puts them on the module, and
    nn.Module._save_to_state_dict keeps them); here they were DistTensor copies (not
    ``is`` the parameters: no ``.grad``, an optimizer built over them trains nothing);
    a write into the value is a write into the parameter, as torch's."""
    mesh, w = wrap(kind, mlp())
    params = dict(w.named_parameters())
    sd = w.state_dict(keep_vars=True)
    assert set(params) <= set(sd)
    for k, p in params.items():
        assert sd[k] is p, k
    with torch.no_grad():
        sd[next(k for k in params if k.endswith("2.bias"))].zero_()
    ref = mlp()
    with torch.no_grad():
        ref[2].bias.zero_()
    train_as_one_device(kind, w, mesh, ref)


@pytest.mark.parametrize("kind", ["fsdp", "fully_shard"])
def test_a_keep_vars_dict_loads_as_torchs(kind):
    """Another wrapper's keep_vars dict (its parameters) loads as their values, as torch's
    load_state_dict does (a guard: with the parameters as values, the chunks' shape
    failed the size check before load_state_dict read them as module-shaped)."""
    mesh, w = wrap(kind, mlp())
    _, src = wrap(kind, mlp(seed=3))
    w.load_state_dict(src.state_dict(keep_vars=True))
    got = {k: v.full() if isinstance(v, wb.DistTensor) else v for k, v in w.state_dict().items()}
    for k, v in mlp(seed=3).state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=0)
