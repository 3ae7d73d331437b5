"""inplace11: in-place writes whose inputs are views of the written tensor, and two
checkpoint / save habits, each held to torch on one device.

1. ``x[1:].add_(x[:-1])``, ``x.add_(x.t())``, ``x.copy_(x.view(6, 4).t())``,
   ``torch.add(x[:-1], 1, out=x[1:])``, ``x.index_add_(0, i, x)``...: torch refuses an input
   that overlaps the written-to tensor ("some elements of the input tensor and the
   written-to tensor refer to a single memory location"); here the op was computed out of
   place and written, silently (probe over 198 calls x 10 layouts on 1-d and 2-d meshes:
   1030 answered where torch raises, 278 answered another number where torch computes in
   its own memory order).  Now torch's error, or (torch's result depends on its loop order:
   ``x[:, 1:].mul_(x[:, :-1])``, ``x.addmm_(x, x)``) a NotImplementedError naming
   ``clone()``; order-free overlaps computed as torch (``parallel/inplace_overlap.py``).
2. ``torch.save(model.state_dict(keep_vars=True))`` of ZeRO-1/2 over tensor parallelism
   raised once the optimizer was built (its zero_grad hook, a closure on each parameter's
   local tensor): now saved as torch saves a Parameter (values and requires_grad).
3. ``checkpoint(fn, x, use_reentrant=True)`` with no input requiring grad: torch warns and
   gives the function's parameters no gradient; here they got theirs.  Now torch's.
"""
import pytest
import torch

import workbench as wb
from workbench.parallel.placement import parse_placements
from workbench.parallel.validate_inputs import distribute

M1 = wb.Mesh([0, 1, 2, 3])
M2 = wb.Mesh([[0, 1], [2, 3]])
# layouts whose full tensor is exact (no Partial sum: its parts round)
EXACT = [(M1, ["R"]), (M1, ["S(0)"]), (M1, ["S(1)"]), (M1, ["P(max)"]),
         (M2, ["S(0)", "S(1)"]), (M2, ["S(1)", "P(max)"]), (M2, ["S(0)", "S(0)"])]
ALL = EXACT + [(M1, ["P(sum)"]), (M2, ["P(sum)", "S(1)"])]
IDS = ["-".join(ps) + f"@{m.ndim}d" for m, ps in ALL]

I0 = torch.tensor([2, 0, 1, 3])
IDX2 = torch.tensor([[1, 0, 3, 2], [0, 2, 1, 3]])
MASK = torch.tensor([[True, False, True, False]] * 4)


def _x(shape=(4, 4), dtype=torch.float64):
    g = torch.Generator().manual_seed(11)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    return torch.rand(shape, generator=g, dtype=dtype) + 0.5


def _d(x, mesh, ps):
    return distribute(x, mesh, parse_placements(ps), seed=3)


# ---- item 1: torch refuses the overlap ----------------------------------------------------
REFUSED = {
    "r1.add_(r0)": lambda t: t[1:].add_(t[:-1]),
    "r0.sub_(r1)": lambda t: t[:-1].sub_(t[1:], alpha=2),
    "x.add_(x.t())": lambda t: t.add_(t.t()),
    "x.t().mul_(x)": lambda t: t.t().mul_(t),
    "x.add_(x[0])": lambda t: t.add_(t[0]),
    "x += x.t()": lambda t: t.__iadd__(t.t()),
    "x.copy_(x.t())": lambda t: t.copy_(t.t()),
    "x.mT.copy_(x)": lambda t: t.mT.copy_(t),
    "r1.addcmul_(r0, r0)": lambda t: t[1:].addcmul_(t[:-1], t[:-1]),
    "x.lerp_(x, x.t())": lambda t: t.lerp_(t, t.t()),
    "x.clamp_(min=x.t())": lambda t: t.clamp_(min=t.t()),
    "x.index_add_(0, i, x)": lambda t: t.index_add_(0, I0, t),
    "x.scatter_add_(0, i, x.t())": lambda t: t.scatter_add_(0, IDX2, t.t()),
    "x.index_put_((i,), x.t())": lambda t: t.index_put_((I0,), t.t()),
    "add(r0, 1, out=r1)": lambda t: torch.add(t[:-1], 1, out=t[1:]),
    "where(m, x.t(), x, out=x)": lambda t: torch.where(MASK, t.t(), t, out=t),
    "x.view(16)[1:].add_(x.view(16)[:-1])": lambda t: t.view(16)[1:].add_(t.view(16)[:-1]),
}


@pytest.mark.parametrize("mesh,ps", ALL, ids=IDS)
@pytest.mark.parametrize("name", list(REFUSED))
def test_overlap_torch_refuses(name, mesh, ps):
    """torch's own error (its message), and the DistTensor untouched; before, the op was
    computed from values read first and written."""
    f = REFUSED[name]
    d = _d(_x(), mesh, ps)
    before = d.full().clone()
    with pytest.raises(RuntimeError, match="single memory location") as want:
        f(before.clone())
    with pytest.raises(RuntimeError, match="single memory location"):
        f(d)
    assert "clone()" in str(want.value)
    torch.testing.assert_close(d.full(), before, rtol=0, atol=0)
    assert d.placements == tuple(parse_placements(ps))


def test_overlap_refused_1d_and_reshaped():
    """A 1-d tensor's shifted views, and ``y = x.view(6, 4); x.copy_(y.t())`` (the brief's
    example: same memory span, other strides)."""
    for mesh, ps in ((M1, ["S(0)"]), (M2, ["S(0)", "S(0)"]), (M2, ["P(sum)", "S(0)"])):
        d = _d(_x((8,)), mesh, ps)
        with pytest.raises(RuntimeError, match="single memory location"):
            d[1:].mul_(d[:-1])
        d = _d(_x((4, 6)), mesh, ps)
        before = d.full().clone()
        with pytest.raises(RuntimeError, match="single memory location"):
            r = before.clone()
            r.copy_(r.view(6, 4).t())
        with pytest.raises(RuntimeError, match="single memory location"):
            d.copy_(d.view(6, 4).t())
        torch.testing.assert_close(d.full(), before, rtol=0, atol=0)


def test_bool_mask_view_of_self():
    """``b.masked_fill_(b.t(), False)``: torch refuses a mask overlapping self in part."""
    for mesh, ps in ((M1, ["S(0)"]), (M2, ["R", "S(1)"])):
        d = _d(_x(dtype=torch.bool), mesh, ps)
        with pytest.raises(RuntimeError, match="single memory location"):
            r = d.full().clone()
            r.masked_fill_(r.t(), False)
        with pytest.raises(RuntimeError, match="single memory location"):
            d.masked_fill_(d.t(), False)


# ---- item 1: torch computes in its own order ----------------------------------------------
ORDERED = {
    "c1.mul_(c0)": lambda t: t[:, 1:].mul_(t[:, :-1]),
    "c1.copy_(c0)": lambda t: t[:, 1:].copy_(t[:, :-1]),
    "x.add_(x[:, :1])": lambda t: t.add_(t[:, :1]),
    "x.add_(x.diagonal())": lambda t: t.add_(t.diagonal()),
    "c1.clamp_(max=c0)": lambda t: t[:, 1:].clamp_(max=t[:, :-1]),
    "add(c0, c0, out=c1)": lambda t: torch.add(t[:, :-1], t[:, :-1], out=t[:, 1:]),
    "x.addmm_(x, x)": lambda t: t.addmm_(t, t),
    "matmul(x, x, out=x)": lambda t: torch.matmul(t, t, out=t),
}


@pytest.mark.parametrize("mesh,ps", EXACT[::2] + ALL[-1:], ids=IDS[:len(EXACT)][::2] + IDS[-1:])
@pytest.mark.parametrize("name", list(ORDERED))
def test_overlap_torch_computes_in_its_order(name, mesh, ps):
    """Neither tensor dense (or not an elementwise op): torch computes, reading elements it
    has already written, a result of its kernel's order (not the out-of-place one, which was
    answered before): refused naming clone(), untouched; the clone() fix is torch's."""
    f = ORDERED[name]
    d = _d(_x(), mesh, ps)
    before = d.full().clone()
    r = before.clone()
    f(r)                                         # torch computes ...
    ref = before.clone()
    g = {"c1.mul_(c0)": lambda t: t[:, 1:].mul_(t[:, :-1].clone()),
         "c1.copy_(c0)": lambda t: t[:, 1:].copy_(t[:, :-1].clone()),
         "x.add_(x[:, :1])": lambda t: t.add_(t[:, :1].clone()),
         "x.add_(x.diagonal())": lambda t: t.add_(t.diagonal().clone()),
         "c1.clamp_(max=c0)": lambda t: t[:, 1:].clamp_(max=t[:, :-1].clone()),
         "add(c0, c0, out=c1)": lambda t: torch.add(t[:, :-1].clone(), t[:, :-1].clone(),
                                                   out=t[:, 1:]),
         "x.addmm_(x, x)": lambda t: t.addmm_(t.clone(), t.clone()),
         "matmul(x, x, out=x)": lambda t: torch.matmul(t.clone(), t.clone(), out=t)}[name]
    g(ref)
    assert not torch.equal(r, ref)               # ... not the values read first
    with pytest.raises(NotImplementedError, match=r"clone\(\)"):
        f(d)
    torch.testing.assert_close(d.full(), before, rtol=0, atol=0)
    g(d)                                         # the fix the message names
    torch.testing.assert_close(d.full(), ref, rtol=1e-12, atol=1e-12)


# ---- item 1: overlaps torch computes whatever its order -----------------------------------
FREE = {
    "x.add_(x)": lambda t: t.add_(t),
    "x.addcdiv_(x, x)": lambda t: t.addcdiv_(t, t, value=0.5),
    "x[0].add_(x[:, 0])": lambda t: t[0].add_(t[:, 0]),
    "x[0].mul_(x[1])": lambda t: t[0].mul_(t[1]),
    "x.t().add_(x.t())": lambda t: t.t().add_(t.t()),
    "x.add_(x.view(16).view(4, 4))": lambda t: t.add_(t.view(16).view(4, 4)),
    "x.copy_(x.t().t())": lambda t: t.copy_(t.t().t()),
    "x.masked_fill_(m, x[0, 1])": lambda t: t.masked_fill_(MASK, t[0, 1]),
    "x.index_fill_(0, i, x[0, 0])": lambda t: t.index_fill_(0, I0[:3], t[0, 0]),
    "x[:2].scatter_(1, i, x[2:])": lambda t: t[:2].scatter_(1, IDX2, t[2:]),
    "x[:2].index_add_(0, i, x[2:])": lambda t: t[:2].index_add_(0, torch.tensor([1, 0]), t[2:]),
    "x.fill_(x[1, 1])": lambda t: t.fill_(t[1, 1]),
    "x[2:] += x[:2]": lambda t: t[2:].__iadd__(t[:2]),
    "exp(x[0], out=x[1])": lambda t: torch.exp(t[0], out=t[1]),
}


@pytest.mark.parametrize("mesh,ps", EXACT, ids=IDS[:len(EXACT)])
def test_overlap_order_free_as_torch(mesh, ps):
    """Full overlaps (the same elements at the same indices), disjoint views and inputs
    read as numbers first: computed, equal to torch's bit for bit."""
    for name, f in FREE.items():
        d = _d(_x(), mesh, ps)
        r = d.full().clone()
        f(r)
        f(d)
        torch.testing.assert_close(d.full(), r, rtol=0, atol=0, msg=name)


# ---- item 2: torch.save(state_dict(keep_vars=True)) of ZeRO-1/2 over tensor parallelism ----
@pytest.mark.parametrize("kind", ["zero_tp", "zero2_tp"])
def test_keep_vars_dict_of_zero_over_tp_saves_and_loads_back(kind):
    """Once the optimizer is built, each DistTensor parameter's local tensor carries its
    zero_grad hook (a closure): pickling raised "Can't pickle local object
    '..._zero_shard_hook.<locals>.hook'" where torch saves its parameters (values and
    requires_grad, no hooks: ``Parameter.__reduce_ex__``).  Now the dict saves, loads
    (weights_only too) with the values and requires_grad, loads into another wrapper, and
    the saved-from wrapper trains on as one device."""
    import io

    from .test_habits10 import same_model
    from .test_habits15 import Wrapped, batches, full_state, mk
    from .test_habits18 import train_step
    ref, wr = mk(), Wrapped(kind)
    ref.eval()
    wr.w.eval()
    ro, opt = torch.optim.SGD(ref.parameters(), lr=0.5), wr.optimizer(cls=torch.optim.SGD,
                                                                     lr=0.5)
    data = batches(2)
    train_step(wr, opt, ref, ro, *data[0])
    want = ref.state_dict()
    buf = io.BytesIO()
    torch.save(wr.w.state_dict(keep_vars=True), buf)
    for weights_only in (False, True):
        buf.seek(0)
        saved = torch.load(buf, weights_only=weights_only)
        assert list(saved) == list(want)
        for k, v in saved.items():
            assert isinstance(v, wb.DistTensor) and v.requires_grad, k
            torch.testing.assert_close(v.full().detach(), want[k], rtol=1e-6, atol=1e-6)
    other = Wrapped(kind, mk(seed=3))
    other.w.load_state_dict(saved)
    got = full_state(other.m.state_dict())
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-6)
    train_step(wr, opt, ref, ro, *data[1])      # the live parameters kept their wiring
    same_model(wr, ref)


# ---- item 3: checkpoint(fn, x, use_reentrant=True) with no input that requires grad -------
def _tp_pair():
    """(one device's module, the same module tensor-parallel on 2 ranks, the mesh)."""
    from torch import nn
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 6), nn.GELU(), nn.Linear(6, 3)).double()
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 6), nn.GELU(), nn.Linear(6, 3)).double()
    mesh = wb.Mesh([0, 1])
    wb.parallelize_module(m, mesh, {"0": wb.ColwiseParallel(), "2": wb.RowwiseParallel()})
    return ref, m, mesh


def _full(t):
    return t.full() if isinstance(t, wb.DistTensor) else t


def _checkpointed(call, x, reentrant, extra):
    """``checkpoint(call, x)``'s output, and the gradients a loss of it (plus ``extra()``)
    leaves, or the error its backward raises; with the warnings raised."""
    from torch.utils.checkpoint import checkpoint
    import warnings
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = checkpoint(call, x, use_reentrant=reentrant)
        loss = _full(out.sum()) + (_full(extra()) if extra else 0)
        try:
            loss.backward()
            err = None
        except RuntimeError as e:
            err = e
    warned = any("None of the inputs have requires_grad=True" in str(m.message) for m in w)
    return out.requires_grad, warned, err


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("x_grad", [False, True])
@pytest.mark.parametrize("extra", [False, True])
def test_checkpoint_of_a_tp_module_gives_torchs_gradients(reentrant, x_grad, extra):
    """use_reentrant=True and no input requiring grad: torch runs the function under
    no_grad (and warns), its parameters get no gradient (a loss of the output alone has
    nothing to backpropagate: RuntimeError); before, the non-reentrant checkpoint ran and
    gave them theirs.  The other cases were and stay torch's."""
    ref, m, mesh = _tp_pair()
    x0 = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    x = wb.shard_tensor(x0, mesh, [wb.Replicate()])
    xr = x0.clone()
    if x_grad:
        x.requires_grad_()
        xr.requires_grad_()
    want = _checkpointed(ref, xr, reentrant, (lambda: ref[2].bias.sum()) if extra else None)
    got = _checkpointed(m, x, reentrant, (lambda: m[2].bias.sum()) if extra else None)
    assert got[:2] == want[:2]
    assert (got[2] is None) == (want[2] is None)
    for (k, p), r in zip(m.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (r.grad is None), k
        if r.grad is not None:
            torch.testing.assert_close(_full(p.grad), r.grad, rtol=1e-12, atol=1e-12)
    if x_grad and want[2] is None:
        torch.testing.assert_close(_full(x.grad), xr.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpoint_of_a_dist_tensor_program_without_grad_inputs(reentrant):
    """A plain DistTensor program ``tanh(x @ W)`` over a Shard(1) weight: torch's
    gradients (none from the checkpointed part under use_reentrant=True)."""
    g = torch.Generator().manual_seed(4)
    w0, x0 = torch.randn(4, 3, dtype=torch.float64, generator=g), torch.randn(
        5, 4, dtype=torch.float64, generator=g)
    mesh = wb.Mesh([0, 1])
    wd = wb.shard_tensor(w0, mesh, [wb.Shard(1)]).requires_grad_()
    wr = w0.clone().requires_grad_()
    xd = wb.shard_tensor(x0, mesh, [wb.Replicate()])
    got = _checkpointed(lambda x: torch.tanh(x @ wd), xd, reentrant, lambda: (wd * wd).sum())
    want = _checkpointed(lambda x: torch.tanh(x @ wr), x0, reentrant, lambda: (wr * wr).sum())
    assert got == want[:2] + (None,) and want[2] is None
    torch.testing.assert_close(_full(wd.grad), wr.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["fsdp_tp", "zero3_tp"])
def test_a_loss_term_on_a_no_grad_forwards_copy_raises(kind):
    """FSDP / Zero3 over tensor parallelism: a forward under no_grad (an evaluation, or the
    use_reentrant=True checkpoint above with no input requiring grad) left the module
    holding a gathered copy made in no_grad mode; a loss term on ``model[2].bias`` then
    put its gradient nowhere, silently (torch's parameter gets it: 3.0 for ``bias.sum()``
    of 3 elements).  Now it raises, as the template does before any forward; the next
    forward with grad enabled trains as one device."""
    from torch.utils.checkpoint import checkpoint

    from .test_habits10 import same_model
    from .test_habits15 import Wrapped, batches, mk
    from .test_habits18 import train_step
    ref, wr = mk(), Wrapped(kind)
    ref.eval()
    wr.w.eval()
    (x, y), (x2, y2) = batches(2)
    with torch.no_grad():
        wr.w(wr.inp(x))
    with pytest.raises(RuntimeError, match=r"torch\.no_grad\(\)"):
        wr.m[2].bias.sum().full().backward()
    with pytest.warns(UserWarning, match="None of the inputs"):
        out = checkpoint(wr.w, wr.inp(x), use_reentrant=True)
    with pytest.raises(RuntimeError, match=r"torch\.no_grad\(\)"):
        (((out.full() - y) ** 2).mean() + wr.m[2].bias.sum().full()).backward()
    ro, opt = torch.optim.SGD(ref.parameters(), lr=0.5), wr.optimizer(cls=torch.optim.SGD,
                                                                     lr=0.5)
    train_step(wr, opt, ref, ro, x2, y2)
    same_model(wr, ref)
