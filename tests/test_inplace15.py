"""inplace15: in-place ops and PyTorch habits on DistTensors that answered silently where
torch raises or gives another value, held to torch on one device (values, gradients, error
types and words) over test_inplace14's layouts.

1. ``z = a @ x; a.mul_(2)`` where matmul laid a stacked operand out by a copy (expand,
   then a reshape that cannot be a view) and saved the copy: the write bumped ``a``'s
   counter, not the copy's, and backward gave the old values' gradient (S(0)-R@2d,
   S(0)-S(1)@2d, P(sum)-S(1)@2d xfailed in test_inplace14).  Now the operand is checked
   at the product's backward (versions.saved_check, decided by ops_table/matmul._copies, held
   below to the saved tensors of torch's own graph), and the dispatcher's copies of a
   moved input are reached through a handle the graph keeps (versions.derive: a weak
   reference to the copy was lost where the op kept only a view of it).  Where torch met
   the write at a view made in the simulator's identity Functions, the error now carries
   one device's words ("modified by an inplace operation") first.
2. In-place view ops (unsqueeze_, squeeze_, t_, transpose_, swapdims_) bump the version
   counter, as torch's: a value an op saved raises at backward (they answered silently in
   every layout: 126 of 126 programs x layouts).  Under no_grad on a value that requires
   grad, torch keeps the old history; unsqueeze_ is recorded (torch's gradient), the
   others refuse with the project's NotImplementedError (x lost requires_grad silently);
   as_strided_ stays refused.
3. ``int_x[i] = v`` with v requiring grad where torch records the write (a 0-d value, a
   bool mask): torch gives the integer tensor a grad_fn and its next differentiable op
   raises "Autograd not support dtype: Long"; refused at the write, nothing written.
4. ``retain_grad()`` / ``retains_grad`` (NoRuleError / AttributeError before): torch's.
5. Dropout of a Partial(sum): dropped elements' zero signs differ (documented, pinned).

Not matched (probes in the inplace15 report; the first fixed by inplace16): a write into ``a`` after an op read a VIEW
of it through a dispatcher copy (``torch.bmm(a.unsqueeze(0), ...)``, einsum over
P(sum)-S(1)@2d / S(0)-S(1)@2d): the copy is registered under the view's local tensor,
which the write into ``a`` does not look up (versions.derive is keyed by the tensor read);
and a >= 3-d operand that torch itself copies (``a.expand(2, 4, 4) @ x``: no error on one
device) raises here over R@1d, R-R@2d (as before), S(0)@1d, P(max)@1d (a split dim hides
the expand from one rank's strides: matmul._one_device_copies); matched over those four
by inplace17 (tests/test_inplace17.py), not over a moved operand (S(1)@1d, P(sum)-S(1)@2d,
S(0)-S(1)@2d).
"""
import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from workbench.parallel import Partial, Replicate
from workbench.parallel.ops_table import matmul as MM
from workbench.parallel.placement import parse_placements
from workbench.parallel.validate_inputs import distribute

from tests.test_inplace14 import IDS, LAYOUTS, M1, M2  # the same nine layouts
INPLACE = "modified by an inplace operation"


def _x(shape=(4, 4), seed=14):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(*shape, generator=g, dtype=torch.float64) + 0.25


def _d(x, mesh, ps):
    return distribute(x, mesh, parse_placements(ps), seed=3).detach().requires_grad_()


def _full(t):
    return t.full_tensor() if isinstance(t, wb.DistTensor) else t


def _run(f, x):
    try:
        out = f(x)
        full = _full(out).detach()
        out.sum().backward()
        return None, full, _full(x.grad)
    except Exception as e:          # noqa: BLE001 - compared with torch's below
        return e, None, None


def _then(y, write):
    write(y)
    return y


def _nograd(f):
    with torch.no_grad():
        return f()


def _same_as_torch(f, layout, shape=(4, 4)):
    """f on one device, then on the DistTensor of that layout: the same error type and
    words (the first sentence), or the same values and gradient."""
    err, one, g1 = _run(f, _x(shape).requires_grad_())
    mesh, ps = LAYOUTS[layout]
    got, val, g = _run(f, _d(_x(shape), mesh, ps))
    if err is not None:
        assert type(got) is type(err), (err, got)
        if INPLACE in str(err):
            assert INPLACE in str(got) and "On DistTensors" in str(got), got
        else:
            assert str(err).split(".")[0] in str(got), (err, got)
        return err
    assert got is None, got
    torch.testing.assert_close(val, one, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g, g1, rtol=1e-12, atol=1e-12)
    return None


# ---- 1. matmul's own copy of a stacked operand ---------------------------------------------

def _w(x):
    return x * 0.5 + 1


MATMUL = {
    # torch saves a (b requires grad) and b (a requires grad): a write into either raises
    "a@x.write_a": lambda x: (lambda a: _then(a @ x, lambda _: a.mul_(2)))(x * 1.5),
    "x@a.write_a": lambda x: (lambda a: _then(x @ a, lambda _: a.mul_(2)))(x * 1.5),
    "a@x.nograd_write_a": lambda x: (lambda a: _then(a @ x, lambda _: _nograd(
        lambda: a.add_(1))))(x * 1.5),
    "untracked_a@x.write_a": lambda x: (lambda a: _then(a @ x, lambda _: a.mul_(2)))(
        x.detach() * 1.5),
    "mm.write_a": lambda x: (lambda a: _then(torch.mm(a, x), lambda _: a.mul_(2)))(x * 1.5),
    "a@x.write_x_leaf_nograd": lambda x: _then(_w(x) @ x, lambda _: _nograd(
        lambda: x.mul_(2))),
    # F.linear saves its input and weight (a weight laid out anew: the handle the graph
    # keeps; these answered silently over S(0)-S(1)@2d and others before)
    "linear.write_input": lambda x: (lambda a: _then(F.linear(a, x), lambda _: a.mul_(2)))(
        x * 1.5),
    "linear.write_weight": lambda x: (lambda w: _then(F.linear(x, w), lambda _: w.mul_(2)))(
        x * 1.5),
    # torch saves a only for b's gradient: b without grad, a's write passes
    "a@const.write_a": lambda x: (lambda a: _then(a @ _x(seed=2), lambda _: a.mul_(2)))(
        x * 1.5),
    # a clone written: nothing saved was touched
    "a@x.write_clone": lambda x: (lambda a: _then(a @ x, lambda _: a.clone().mul_(2)))(
        x * 1.5),
}


@pytest.mark.parametrize("layout", range(len(LAYOUTS)), ids=IDS)
@pytest.mark.parametrize("name", sorted(MATMUL))
def test_matmul_saved_operand_written_is_torchs(name, layout):
    err = _same_as_torch(MATMUL[name], layout)
    assert (err is None) == name.startswith(("a@const", "a@x.write_clone"))


def _saved_storages(y, a, b):
    """The storages torch's graph of ``y = torch.matmul(a, b)`` saved for its product
    (the mm / bmm / mv node's operands), found by walking the graph down to a and b."""
    held, todo, seen = set(), [y.grad_fn], set()
    stop = {a.grad_fn, b.grad_fn}
    while todo:
        f = todo.pop()
        if f is None or f in stop or f in seen or type(f).__name__ == "AccumulateGrad":
            continue
        seen.add(f)
        for s in ("_saved_self", "_saved_mat2", "_saved_vec", "_saved_tensor"):
            v = getattr(f, s, None)
            if isinstance(v, torch.Tensor):
                held.add(v.untyped_storage()._cdata)
        todo.extend(g for g, _ in f.next_functions)
    return held


def _operands():
    """Stacked operand pairs of one number of dims, as _matmul_local hands them to torch:
    broadcast and stride-0 lead dims, transposed and sliced layouts, either operand
    requiring grad (3-d pairs whose batch sizes differ take torch's fold path)."""
    g = torch.Generator().manual_seed(0)
    base = [((2, 3, 4), (2, 4, 5)), ((1, 3, 4), (4, 4, 5)), ((4, 3, 4), (1, 4, 5)),
            ((2, 1, 3, 4), (2, 2, 4, 5)), ((2, 2, 3, 4), (1, 2, 4, 5)),
            ((1, 2, 3, 4), (2, 1, 4, 5)), ((2, 2, 2, 3, 4), (2, 2, 1, 4, 5)),
            ((2, 1, 2, 3, 4), (2, 2, 1, 4, 5)), ((2, 2, 0, 4), (2, 1, 4, 3))]
    for sa, sb in base:
        for lay in ("contig", "expand", "transposed"):
            for ra, rb in ((True, True), (True, False), (False, True)):
                a = torch.randn(*sa, generator=g, dtype=torch.float64)
                b = torch.randn(*sb, generator=g, dtype=torch.float64)
                if lay == "transposed":
                    a = a.transpose(-1, -2).contiguous().transpose(-1, -2)
                    b = b.transpose(0, -1).contiguous().transpose(0, -1)
                a, b = a.requires_grad_(ra), b.requires_grad_(rb)
                if lay == "expand":      # a size-1 lead dim held with stride 0
                    a = a.expand(*[max(n, 2) if i < len(sa) - 2 and n == 1 else n
                                   for i, n in enumerate(sa)]) if 1 in sa[:-2] else a
                    if a.shape[:-2] != sa[:-2] and b.shape[:-2] != a.shape[:-2]:
                        continue
                yield a, b


def test_matmul_copy_predicate_covers_torchs_copies():
    """``_copies`` says True for every operand torch.matmul saved a copy of (it may say
    True needlessly: the operand is then checked twice, never missed)."""
    n = 0
    for a, b in _operands():
        y = torch.matmul(a, b)
        if y.grad_fn is None:
            continue
        held = _saved_storages(y, a, b)
        ca, cb = MM._copies(a, b)
        for t, copied, other in ((a, ca, b), (b, cb, a)):
            if other.requires_grad and t.numel() and \
                    t.untyped_storage()._cdata not in held:
                assert copied, (tuple(a.shape), a.stride(), tuple(b.shape), b.stride())
                n += 1
    assert n >= 5           # the cases torch copies are among those drawn


def test_a_saved_operand_unpacks_with_torchs_plain_words():
    """The written operand of a 2-d mesh's matmul raises torch's "one of the variables
    needed for gradient computation has been modified by an inplace operation" (not a
    custom Function's view message), with the DistTensor write and the fix."""
    for mesh, ps in [(M2, ["S(0)", "S(1)"]), (M2, ["P(sum)", "S(1)"]), (M1, ["S(1)"])]:
        x = _d(_x(), mesh, ps)
        a = x * 1.5
        z = a @ x
        a.mul_(2)
        with pytest.raises(RuntimeError) as e:
            z.sum().backward()
        msg = str(e.value)
        assert msg.startswith("one of the variables needed for gradient computation") and \
            "clone()" in msg, msg


def test_a_moved_input_whose_op_kept_a_view_raises_after_its_copy_is_gone():
    """The dispatcher's copy of a moved input (P(sum)-S(1): all-reduced and gathered) is
    no longer referenced from Python once the op returns; the op saved a view of it.  A
    write into the input afterwards still raises, as torch's (it answered the old values'
    gradient while the copy's handle was a weak reference)."""
    import gc

    def f(x):
        a = x * 1.5
        z = a @ x
        gc.collect()
        a.mul_(2)
        return z
    for layout in (7, 8):
        _same_as_torch(f, layout)


# ---- 2. in-place view ops on a value saved for backward ------------------------------------

VIEW_OPS = {
    "unsqueeze_": lambda y: y.unsqueeze_(0),
    "squeeze_": lambda y: y.squeeze_(0),
    "t_": lambda y: y.t_(),
    "transpose_": lambda y: y.transpose_(0, 1),
    "swapdims_": lambda y: y.swapdims_(0, 1),
}
VIEW_PROGS = {}
for _k, _op in VIEW_OPS.items():
    # exp saves its output y; y * y saves y; y + 1 saves nothing
    VIEW_PROGS[f"exp.{_k}"] = lambda x, op=_op: _then(x.exp(), op) * 1
    VIEW_PROGS[f"mul_saves.{_k}"] = lambda x, op=_op: (lambda y: (lambda z: _then(
        z, lambda _: op(y)))(y * y))(x * 1.5)
    VIEW_PROGS[f"unsaved.{_k}"] = lambda x, op=_op: _then(x + 1, op) * x.sum()
VIEW_PROGS["t_twice.saved"] = lambda x: (lambda y: (lambda z: _then(
    z, lambda _: y.t_().t_()))(y * x))(x + 1)
VIEW_PROGS["t_then_exp_then_t_"] = lambda x: (lambda y: _then(y.exp(), lambda e: e.t_()))(
    _then(x + 1, lambda y: y.t_()))
VIEW_PROGS["view_of_it.t_"] = lambda x: (lambda y: (lambda v: _then(
    v, lambda _: y.t_()) * y.sum())(y[0]))(x + 1)
VIEW_PROGS["t_then_write"] = lambda x: _then(x + 1, lambda y: y.t_().add_(x)) * x
VIEW_PROGS["unsqueeze_squeeze"] = lambda x: _then(
    x * 2, lambda y: y.unsqueeze_(1).squeeze_(1)) * x
VIEW_PROGS["nograd_unsqueeze_"] = lambda x: _then(
    x * 2, lambda y: _nograd(lambda: y.unsqueeze_(0))) * x
VIEW_PROGS["nograd_unsqueeze_saved"] = lambda x: _then(
    x.exp(), lambda y: _nograd(lambda: y.unsqueeze_(0))) * x
VIEW_PROGS["leaf.t_"] = lambda x: _then(x, lambda y: y.t_()) * 1


@pytest.mark.parametrize("layout", range(len(LAYOUTS)), ids=IDS)
@pytest.mark.parametrize("name", sorted(VIEW_PROGS))
def test_inplace_view_op_is_torchs(name, layout):
    err = _same_as_torch(VIEW_PROGS[name], layout)
    saved = name.startswith(("exp.", "mul_saves.", "t_twice", "t_then_exp",
                             "nograd_unsqueeze_saved", "leaf."))
    assert (err is not None) == saved, err


@pytest.mark.parametrize("op", ["squeeze_", "t_", "transpose_", "swapdims_"])
@pytest.mark.parametrize("leaf", [False, True], ids=["nonleaf", "leaf"])
def test_inplace_view_op_under_no_grad_refuses_where_torch_keeps_the_old_history(op, leaf):
    """torch keeps a non-leaf's history of the old shape (a square t_()'s gradient then
    passes unpermuted; a squeeze_'s raises at backward) and a leaf a leaf of the new
    shape; a DistTensor lost requires_grad instead, silently.  Refused, naming the fix;
    nothing changed.  A view op that changes nothing passes."""
    args = (0,) if op == "squeeze_" else (0, 1) if op in ("transpose_", "swapdims_") else ()
    x = _d(_x((1, 4, 4) if op == "squeeze_" else (4, 4)), M1, ["S(1)"])
    y = x if leaf else x * 2
    before = y.shape
    with torch.no_grad(), pytest.raises(NotImplementedError, match=r"no_grad.*outside"):
        getattr(y, op)(*args)
    assert y.shape == before and y.requires_grad
    z = _d(_x((4, 4)), M1, ["S(0)"]) * 2
    with torch.no_grad():
        z.squeeze_()              # no size-1 dim: nothing moves, as torch's
        z.transpose_(1, 1)
    assert z.requires_grad and tuple(z.shape) == (4, 4)


@pytest.mark.parametrize("layout", range(len(LAYOUTS)), ids=IDS)
def test_as_strided_inplace_stays_refused(layout):
    x = _d(_x(), *LAYOUTS[layout])
    y = x.exp()
    with pytest.raises(NotImplementedError, match="as_strided_"):
        y.as_strided_((4, 4), (1, 4))
    torch.testing.assert_close(y.full_tensor(), _x().exp())      # nothing written


@pytest.mark.parametrize("method", ["auto", "trace"])
def test_compile_breaks_at_a_view_op_on_a_saved_value(method):
    mesh = wb.Mesh.grid((2,))
    x = _x()
    kw = {} if method == "auto" else {"method": "trace"}

    def saved(a, b):
        y = a.exp()
        y.t_()
        return y * b

    def unsaved(a, b):
        y = a + 1
        y.t_()
        return y * b
    mk = lambda: [wb.distribute_tensor(x, mesh, [wb.Shard(0)]).requires_grad_(),  # noqa: E731
                  wb.distribute_tensor(x, mesh, [Replicate()]).requires_grad_()]
    args = mk()
    prog = wb.compile(saved, *args, level="O0", **kw)
    assert prog.breaks and "saved for backward" in prog.breaks[0].reason
    with pytest.raises(RuntimeError, match=INPLACE):
        prog(*args).sum().backward()
    args = mk()
    prog = wb.compile(unsaved, *args, level="O0", **kw)
    assert prog.breaks == []
    prog(*args).sum().backward()
    ref = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    unsaved(*ref).sum().backward()
    for a, r in zip(args, ref):
        torch.testing.assert_close(a.grad.full_tensor(), r.grad, rtol=1e-12, atol=1e-12)


# ---- 3. x[idx] = v, v a float requiring grad, x an integer tensor --------------------------

SET_LAYOUTS = [i for i, (_, ps) in enumerate(LAYOUTS) if "P(max)" not in ps]
SET_INDEX = {"int": 0, "slice": (slice(None), 1), "ellipsis": ..., "None": None,
             "bool_rows": torch.tensor([True, False, True, False]),
             "mask2d": torch.eye(4, dtype=torch.bool), "True": True,
             "tensor": torch.tensor([0, 2])}
SET_VALUE = {"0d": lambda: torch.tensor(2.7, dtype=torch.float64, requires_grad=True),
             "row": lambda: torch.tensor([1.7, 2.2, -3.5, 4.9], dtype=torch.float64,
                                         requires_grad=True)}


def _set(x, index, value):
    try:
        x[index] = value
        return None
    except Exception as e:          # noqa: BLE001 - compared with torch's below
        return e


@pytest.mark.parametrize("layout", SET_LAYOUTS, ids=[IDS[i] for i in SET_LAYOUTS])
@pytest.mark.parametrize("value", sorted(SET_VALUE))
@pytest.mark.parametrize("index", sorted(SET_INDEX))
def test_tracked_float_into_an_int_tensor_is_torchs(index, value, layout):
    """torch writes (values cast), raises (index_put_'s dtype check), or records the write
    on the integer tensor (x.requires_grad True; its next differentiable op raises
    "Autograd not support dtype: Long"): the DistTensor writes the same values, raises the
    same error, or refuses the write naming torch's error, nothing written."""
    idx = SET_INDEX[index]
    x1 = torch.arange(16).reshape(4, 4)
    err = _set(x1, idx, SET_VALUE[value]())
    mesh, ps = LAYOUTS[layout]
    x0 = torch.arange(16).reshape(4, 4)
    d = distribute(x0, mesh, parse_placements(ps), seed=3)
    v = SET_VALUE[value]()
    dv = wb.distribute_tensor(v.detach(), mesh, [Replicate()] * mesh.ndim).requires_grad_()
    for val in (v, dv):
        got = _set(d, idx, val)
        if err is not None:
            assert type(got) is type(err) and str(err)[:40] in str(got), (err, got)
            assert torch.equal(d.full_tensor(), x0)
        elif x1.requires_grad:                  # torch recorded the write
            with pytest.raises(RuntimeError, match="Autograd not support dtype: Long"):
                x1 + 1
            assert type(got) is RuntimeError and \
                "Autograd not support dtype: Long" in str(got) and "detach()" in str(got)
            assert torch.equal(d.full_tensor(), x0)
            assert _set(d, idx, val.detach()) is None          # the fix it names
            assert torch.equal(d.full_tensor(), x1.detach())
            d = distribute(x0, mesh, parse_placements(ps), seed=3)
        else:
            assert got is None, got
            assert torch.equal(d.full_tensor(), x1) and not d.requires_grad
            d = distribute(x0, mesh, parse_placements(ps), seed=3)
    with torch.no_grad():                           # nothing recorded: written
        x1 = torch.arange(16).reshape(4, 4)
        err = _set(x1, idx, SET_VALUE[value]())
        got = _set(d, idx, SET_VALUE[value]())
    assert (err is None) == (got is None), (err, got)
    if err is None:
        assert torch.equal(d.full_tensor(), x1)


# ---- 4. retain_grad / retains_grad -----------------------------------------------------------

def _grad_ps(ps):
    return tuple(Replicate() if p.is_partial() and p.reduce_op == "sum" else
                 Partial("sum") if p.is_partial() else p for p in ps)


@pytest.mark.parametrize("layout", range(len(LAYOUTS)), ids=IDS)
def test_retain_grad_keeps_a_non_leafs_gradient_as_torch(layout):
    def f(x, keep):
        y = x * 1.5
        keep.append(y)
        assert not y.retains_grad
        y.retain_grad()
        assert y.retains_grad
        z = (y.exp() * (x + 2)).sum()
        x.retain_grad()             # a leaf: nothing to do, as torch's
        assert not x.retains_grad
        return z
    ref = _x().requires_grad_()
    kept = []
    f(ref, kept).backward()
    mesh, ps = LAYOUTS[layout]
    d = _d(_x(), mesh, ps)
    got = []
    f(d, got).backward()
    y = got[0]
    assert isinstance(y.grad, wb.DistTensor)
    assert tuple(y.grad.placements) == _grad_ps(y.placements)
    torch.testing.assert_close(y.grad.full_tensor(), kept[0].grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(d.grad.full_tensor(), ref.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layout", [0, 1, 3, 7, 8], ids=[IDS[i] for i in (0, 1, 3, 7, 8)])
def test_retain_grad_follows_an_inplace_write_and_accumulates(layout):
    """``y.retain_grad(); y.add_(1)``: y.grad is the new value's gradient (torch moves the
    retention with the write); two backward passes accumulate it."""
    def f(x):
        y = x * 2
        y.retain_grad()
        y.add_(1)
        z = (y * y).sum()
        z.backward(retain_graph=True)
        z.backward()
        return y
    y1 = f(_x().requires_grad_())
    y = f(_d(_x(), *LAYOUTS[layout]))
    assert y.retains_grad
    torch.testing.assert_close(y.grad.full_tensor(), y1.grad, rtol=1e-12, atol=1e-12)


def test_retain_grad_without_grad_raises_as_torch():
    with pytest.raises(RuntimeError) as one:
        torch.ones(2).retain_grad()
    d = wb.distribute_tensor(torch.ones(4), M1, [wb.Shard(0)])
    with pytest.raises(RuntimeError) as got:
        d.retain_grad()
    assert str(got.value) == str(one.value)
    with torch.no_grad():
        w = _d(_x(), M1, ["S(0)"]) * 2
    with pytest.raises(RuntimeError, match="requires_grad=False"):
        w.retain_grad()


def test_retained_grad_reaches_a_module_activation():
    """The habit the method serves: an activation's gradient inspected after backward
    (a forward hook's retain_grad), over a tensor-parallel MLP, equal to one device's."""
    def mk():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(),
                                   torch.nn.Linear(6, 4)).double()
    ref, m = mk(), mk()
    mesh = wb.Mesh.grid((2,))
    wb.parallelize_module(m, mesh, {"0": wb.ColwiseParallel(), "2": wb.RowwiseParallel()})
    acts = {}

    def keep(name):
        def hook(mod, inp, out):
            out.retain_grad()
            acts[name] = out
        return hook
    ref[1].register_forward_hook(keep("ref"))
    m[1].register_forward_hook(keep("tp"))
    x = _x((3, 4))
    F.mse_loss(ref(x), torch.zeros(3, 4, dtype=torch.float64)).backward()
    out = m(wb.distribute_tensor(x, mesh, [Replicate()]))
    F.mse_loss(out, wb.distribute_tensor(torch.zeros(3, 4, dtype=torch.float64), mesh,
                                         [Replicate()])).backward()
    assert acts["tp"].retains_grad
    torch.testing.assert_close(_full(acts["tp"].grad), acts["ref"].grad, rtol=1e-12,
                               atol=1e-12)


# ---- 5. signed zeros of a Partial(sum) under dropout (documented in ops_table/dropout.py) ----

@pytest.mark.parametrize("mesh,ps", [(wb.Mesh([0, 1]), ["P(sum)"]), (M2, ["S(0)", "P(sum)"])])
def test_dropout_of_a_partial_sum_differs_from_one_device_only_in_dropped_zero_signs(mesh, ps):
    """Known, not matched: a dropped element is the parts' sum times 0 (+0 where the
    parts' signs differ; one device's -0 for a negative value).  Values equal one device's
    (the parts' rounding aside); a sign differs nowhere but at a dropped negative value."""
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    d = distribute(x, mesh, parse_placements(ps), seed=3)
    torch.manual_seed(5)
    want = F.dropout(x, 0.5)
    torch.manual_seed(5)
    got = F.dropout(d, 0.5)
    assert any(p.is_partial() for p in got.placements)       # the partial passed
    g = got.full_tensor()
    torch.testing.assert_close(g, want, rtol=0, atol=1e-14)
    differ = torch.signbit(g) != torch.signbit(want)
    assert bool((differ <= ((want == 0) & (x < 0))).all())
