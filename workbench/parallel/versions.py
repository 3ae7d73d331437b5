"""torch's version counter for in-place writes into DistTensors.

On one device an in-place op bumps its tensor's version counter; a value an op saved for
backward (``exp`` and ``sigmoid`` save their output, ``mul`` and ``matmul`` their inputs)
remembers the version it was saved at, and backward raises torch's RuntimeError "one of the
variables needed for gradient computation has been modified by an inplace operation" where
it differs (torch/csrc/autograd/saved_variable.cpp, ``SavedVariable::unpack``).

Here a write that autograd records gives the DistTensor new local tensors (its old ones
keep the old values: ``parallel/inplace.py``), so nothing bumped their counters and
backward used the old values, silently unlike torch.  Now every write bumps the old local
tensors' counters (:func:`bump`, ``torch.autograd.graph.increment_version``: views of them,
replicated copies held as stride-0 views, share the counter, as torch's views do), and the
op's own out-of-place computation reads ``x`` under a counter of its own
(:func:`unversioned`), as torch saves an in-place op's original ``self`` apart (``y.mul_(w)``
and ``F.leaky_relu(y, inplace=True)`` keep working).  :func:`explained` adds to torch's
error which DistTensor write it was and the fix.  inplace15: a local kernel that saved a copy
of an operand where one device saves the operand (torch.matmul's broadcast of stacked
operands) checks the operand at backward (:func:`saved_check`); in-place view ops bump too
(``inplace._view_inplace``).  inplace16: the copies :func:`derive` records are keyed by the
source's root base (``t._base``: a view shares its base's counter) and :func:`bump` follows
``DistTensor.detach``'s aliases (``DETACHED``: detach() shares the counter too), so a write
into ``a``, a view of it or ``a.detach()`` bumps the copies an op read of any of them
(``torch.bmm(a.unsqueeze(0), ...); a.mul_(2)`` over P(sum)-S(1)@2d answered silently).
Cost (``valgrind --tool=callgrind --instr-atstart=no benchmarks/sim_instr.py gpt 3``, base
3b0a3b89 then inplace16, measured here): 221.78M -> 221.63M instructions (73.93M -> 73.88M
a step: within noise; derive reads one ``_base`` a source tensor).
inplace18: ``a.detach_()`` raises torch's "saved tensor detached in-place" at the backward
of an op that one device's torch would have saved ``a`` itself for, where this op saved a
copy the dispatcher moved or a view its kernel made (:func:`detached` sets a token that
:func:`detach_check`, :func:`guard_detach` and :func:`guard_kernel` read; which inputs one
device saves is asked of torch on meta stand-ins, :func:`_saves_itself`); a write through
``a.data`` reads such a copy again (:func:`_refresh`) instead of raising; the kernel can
ask for a moved copy's source (:func:`source_of`: an expand's stride 0 a gather dropped).
"""
from __future__ import annotations

import re
import weakref

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.weak import WeakIdKeyDictionary

from . import storage

__all__ = ["bump", "derive", "unversioned", "explained", "saved_check", "data_of",
           "param_written", "plain_forward", "OWN_FIX", "detached", "detach_check",
           "guard_detach", "guard_kernel", "check_detached", "moved", "source_of"]

# The hint of an error that names its fix itself (FSDP's version check of a gathered
# weight, strategies/fsdp_units.check_version): :class:`explained` adds nothing to it
OWN_FIX = ("Hint: a write into a parameter between forward and backward (under no_grad, "
           "through detach(), nn.init) changes the weights backward needs")

_WRITES: dict = {}      # (node name, output nr, local shape) -> "y.add_() on R[4, 4]"
_KEEP = 256             # the most recent writes remembered for the message


def _key(t: torch.Tensor):
    fn = t.grad_fn
    name = "" if fn is None else re.sub(r"Backward\d*$", "", type(fn).__name__)
    return name, (t.output_nr if fn is not None else None), tuple(t.shape)


def bump(ts, what: str) -> None:
    """Bump the version counter of each tensor in ``ts`` (old local tensors of a DistTensor
    written in place; ``what`` names the write for :func:`explained`)."""
    from .dist_tensor import DETACHED
    _SEQ[0] += 1
    _SEQ[1] = _SEQ[0]       # a DistTensor write: older parameter writes are not the error's
    seen, ts = set(), list(ts)
    for t in list(ts):
        data = False
        for _ in range(8):
            # the copies derived from any tensor sharing t's counter: keyed by the root
            # base (a view shares its base's counter), then through detach() (shares it
            # too: DistTensor.detach's DETACHED) to the tensor detached, and its root
            r = t._base
            if r is None:
                r = t
            if data:
                # written through ``.data`` (own counter): what a kernel copied of r for a
                # saved_check is stale now; the dispatcher's copies are read again
                _stale(r)
            got = _DERIVED.get(id(r))
            if got is not None and got[0]() is r:
                cs = [c for c in (h() for h in got[1]) if c is not None]
                ts += [c for c in cs if not (data and _refresh(c))]
            d = DETACHED.get(id(r))
            if d is None:
                d = _DATA_OF.get(id(r))
                data = data or d is not None
            t = d[1]() if d is not None and d[0]() is r else None
            if t is None:
                break
    for t in ts:
        if id(t) in seen or t.is_inference():
            continue
        seen.add(id(t))
        try:
            key = _key(t) if t.requires_grad else None
        except RuntimeError:    # a view made in a custom Function whose base was written
            key = None          # (its grad_fn cannot be read any more): bumped, not named
        torch.autograd.graph.increment_version(t)
        if key is not None:
            _WRITES.pop(key, None)
            _WRITES[key] = what
            while len(_WRITES) > _KEEP:
                del _WRITES[next(iter(_WRITES))]


_PARAMS_WRITTEN = WeakIdKeyDictionary()     # a wrapper's parameter -> (version, what, seq)
# writes and plain-module forwards counted; the count at the last DistTensor write (bump);
# the count at the last forward of a plain module on simulated ranks (plain_forward)
_SEQ = [0, 0, 0]


def plain_forward() -> None:
    """A wrapper ran a plain module on simulated ranks (DDP's / FSDP's forward: each rank's
    plain tensors).  A version error that no DistTensor write since explains is then a
    write into one of those tensors: :class:`explained` gives torch's own fix for it, not
    the DistTensor hint (it said "an in-place write into a DistTensor")."""
    _SEQ[0] += 1
    _SEQ[2] = _SEQ[0]


def param_written(p, layout: str) -> None:
    """A wrapper's laid-out parameter ``p`` (DDP's rows, FSDP's chunks) was written in
    place (``p.mul_`` under no_grad, ``p.detach().zero_()``, ``p[0].fill_``): where a
    backward then raises torch's version error for it (autograd saved a view of ``p``,
    sharing its counter), :class:`explained` names that write and its fix, not a
    DistTensor's (it said "an in-place write into a DistTensor" for DDP's rows)."""
    shape = getattr(p, "_wb_shape", None)
    what = f"of the module's shape {tuple(shape)}: {layout}" if shape is not None else layout
    _SEQ[0] += 1
    with torch._C.DisableTorchFunctionSubclass():
        _PARAMS_WRITTEN[p] = (p._version, what, _SEQ[0])


def _param_hint(msg: str):
    """The hint for torch's version error ``msg`` where its version is that of a wrapper's
    parameter written in place since (:func:`param_written`); None where none is."""
    m = re.search(r"is at version (\d+); expected version (\d+)", msg)
    if m is None:
        return None
    now = int(m.group(1))
    with torch._C.DisableTorchFunctionSubclass():
        # written since the last plain-module forward and the last DistTensor write (bump),
        # at the version torch names
        hit = [lay for p, (v, lay, seq) in list(_PARAMS_WRITTEN.items())
               if seq > max(_SEQ[1], _SEQ[2]) and v == now and p._version == now]
    if not hit:
        return None
    return (f"{msg}\nOn a wrapper's parameter: the value backward needs is a parameter "
            f"written in place since forward (one {hit[-1]}); as on one device, the write changed "
            "the weights backward needs. Fix: write after backward (e.g. after "
            "optimizer.step()), or run forward again after the write")


_DATA_OF: dict = {}     # id(a ``.data`` alias's local tensor) -> (weakref to it, to its source)


def data_of(alias, src) -> None:
    """``alias`` is ``src.data`` (a DistTensor's local tensor): torch's ``.data`` has a
    version counter of its own, so a write through it leaves what an op saved of ``src``
    usable (and read with the new values).  A copy an op read of ``src`` (the dispatcher's
    move: :func:`derive`) would keep the old values, silently: :func:`bump` follows the
    alias to those copies (only), so that backward raises there instead."""
    k = id(alias)
    _DATA_OF[k] = (weakref.ref(alias, lambda _: _DATA_OF.pop(k, None)), weakref.ref(src))


def derive(src_loc, loc, outs, redo=None) -> None:
    """``loc`` (an op's input laid out anew by the dispatcher: an all-reduced or all-to-all
    copy) is ``src_loc``'s value for that op, whose local results are ``outs``: a later
    write into the source bumps the copy too, so that what the op saved of it raises as
    torch's saved input does (``z = a @ x; a.mul_(2)`` with ``a`` moved by an all_to_all).
    Recorded under the source's root base (a view shares its base's version counter, so
    a write into the base or any view of it reaches the copy: inplace16).

    The copy is reached through a handle sharing its version counter and none of its
    memory (``detach()`` shares the counter; ``.data =`` an empty tensor drops the
    memory and keeps the counter), held by the results' autograd node for as long as
    the graph that may have saved the copy lives.  (A weak reference to the copy itself
    was lost where the op kept only a view of it: ``z = (x * 1.5) @ x`` over P(sum)-S(1)
    answered the old values' gradient.)  Nothing is kept where no result has a node:
    then nothing was saved.

    ``redo`` (inplace18): a function laying the source out anew (the dispatcher's move, run
    again; None where the source changed since), for a write through the source's
    ``.data``: torch's saved tensor then reads the new values, and so does the copy
    (:func:`_refresh`) instead of raising."""
    node = _node(outs)
    if node is None:
        return
    hs = [_handle(t) for t in storage.tensors(loc) if not t.is_inference()]
    node.metadata.setdefault("wb_versions", []).extend(hs)
    if redo is not None and type(loc) is torch.Tensor and len(hs) == 1:
        k, root = id(hs[0]), loc if loc._base is None else loc._base
        _REDO[k] = (weakref.ref(hs[0], lambda _: _REDO.pop(k, None)), weakref.ref(root), redo)
    outs = [weakref.ref(h) for h in hs]
    for s in storage.tensors(src_loc):
        b = s._base             # a view shares its base's counter: keyed by the root base
        if b is not None:
            s = b
        got = _DERIVED.get(id(s))
        if got is None or got[0]() is not s:
            got = _DERIVED[id(s)] = (weakref.ref(s, _forget(id(s))), [])
        got[1][:] = [r for r in got[1] if r() is not None] + outs


_REDO: dict = {}        # id(a copy's handle) -> (weakref to it, to the copy's root, redo)


def _refresh(h) -> bool:
    """The dispatcher's copy behind handle ``h`` read again from its source, written into
    its memory under a counter of its own (``.data``: what an op saved of it reads the new
    values, as torch's saved source would, and does not raise).  False where it cannot be
    (no ``redo``, the source changed, another layout came back): then it is bumped and
    raises at backward, never the old values' gradient."""
    e = _REDO.get(id(h))
    if e is None or e[0]() is not h:
        return False
    root = e[1]()
    if root is None:            # gone with its views, though a kernel's own copy of it may
        return False            # be saved (matmul's reshape): bumped (saved_check raises)
    try:
        with torch.no_grad():
            new = e[2]()
            if new is None:
                return False
            nr = new if new._base is None else new._base
            if nr.shape != root.shape or nr.stride() != root.stride() or \
                    nr.dtype != root.dtype or nr.storage_offset() != root.storage_offset():
                return False
            root.data.copy_(nr)
    except RuntimeError:        # (an overlapping root cannot be written)
        return False
    _stale(root)
    return True


_STALE: dict = {}       # id(a tensor written without a bump) -> (weakref to it, [count])


def _stale_token(t):
    k = id(t)
    got = _STALE.get(k)
    if got is None or got[0]() is not t:
        got = _STALE[k] = (weakref.ref(t, lambda _: _STALE.pop(k, None)), [0])
    return got[1]


def _stale(root) -> None:
    """``root``'s values changed without a version bump (a ``.data`` write, a refreshed
    copy): a kernel's own copy of it that :func:`saved_check` watches is stale."""
    got = _STALE.get(id(root))
    if got is not None and got[0]() is root:
        got[1][0] += 1


def _node(outs):
    """The autograd node of the first local result that has one."""
    if isinstance(outs, torch.Tensor):
        return outs.grad_fn
    for o in (outs.items if isinstance(outs, storage.Cells) else
              outs if isinstance(outs, (list, tuple)) else ()):
        fn = _node(o)
        if fn is not None:
            return fn
    return None


_EMPTY: dict = {}


def _handle(t):
    h = t.detach()
    e = _EMPTY.get(t.dtype)
    if e is None or e.device != t.device:
        e = _EMPTY[t.dtype] = torch.empty(0, dtype=t.dtype, device=t.device)
    h.data = e
    return h


def _forget(k):
    return lambda _: _DERIVED.pop(k, None)


_DERIVED: dict = {}     # id(local tensor) -> (weakref to it, [weakrefs to copies' handles])


# ---- detach_() -----------------------------------------------------------------------

DETACHED_SAVED = ("Trying to use a saved tensor that has been detached in-place, i.e. with "
                  ".detach_().This is not supported, please use out-of-place `.detach()` "
                  "instead")     # torch/csrc/autograd/saved_variable.cpp, SavedVariable::unpack

_TOKENS: dict = {}      # id(an operand watched by detach_check) -> (weakref to it, [set
#                         by detached()])


def _token(t):
    k = id(t)
    got = _TOKENS.get(k)
    if got is None or got[0]() is not t:
        got = _TOKENS[k] = (weakref.ref(t, lambda _: _TOKENS.pop(k, None)), [False])
    return got[1]


def detached(t) -> None:
    """``t`` (a DistTensor's local tensor with history) is being detached in place
    (``inplace._detach_``).  On one device an op that saved the tensor itself as an input
    then raises torch's "Trying to use a saved tensor that has been detached in-place" at
    backward (SavedVariable::unpack finds no grad_fn); one that saved a view of it, or its
    own output (``exp``), does not.  Here an op may have saved a copy the dispatcher moved
    (an all-reduced / gathered operand) or a view its kernel made, which keep their
    history: backward answered where torch raises (inplace17's 12 strict xfails, e.g.
    ``a = x.sigmoid(); z = a * x; a.detach_()`` over P(max)).  Sets ``t``'s token, which
    the checks that :func:`detach_check` and :func:`guard_detach` made read at backward
    (also where ``t`` is a view, which ``inplace._detach_`` replaces by a new tensor)."""
    tok = _TOKENS.get(id(t))
    if tok is not None and tok[0]() is t:
        tok[1][0] = True


def _detached_error(where: str) -> RuntimeError:
    return RuntimeError(
        f"{DETACHED_SAVED}\nOn DistTensors: {where} saved this tensor for backward (torch "
        "raises the same on one device). Fix: use out-of-place x = x.detach() instead of "
        "x.detach_()")


def detach_check(ts):
    """A check of ``ts`` (an op's local operands, each with history) for the op's
    backward, for a kernel that saved a view of an operand where one device saves the
    operand itself (``torch.matmul`` of stacked operands: expand and reshape views where
    one device's ``mm`` saves the matrix): after ``a.detach_()`` torch raises at backward,
    the view kept its history and answered.  Raises torch's RuntimeError where an operand
    was detached in place since (:func:`detached`).
    A copy the dispatcher moved (:func:`moved`) is checked by its source.  Each operand
    is watched through a token :func:`detached` sets (the operand itself may be gone by
    backward, where the kernel kept only a view of a copy: torch's saved variable would
    have kept it)."""

    # a copy the dispatcher moved (:func:`moved`): its source is the tensor detached
    kept = [_token(s if s is not None and s.grad_fn is not None else t)
            for t, s in ((t, source_of(t)) for t in ts)]

    def check():
        for tok in kept:
            if tok[0]:
                raise _detached_error("an op")
    return check


def guard_detach(outs, call, x, src_loc) -> None:
    """The dispatcher read DistTensor input ``x`` (local ``src_loc``, with history) through
    a copy it moved, for the op ``call`` (func, args, kwargs) whose local results are
    ``outs``: after ``x.detach_()`` the op's backward raises torch's error where one
    device's op saves ``x`` itself (the copy the local op saved keeps its history).
    Whether it does is asked of torch at backward, on meta stand-ins of the call, and only
    once ``x`` was detached in place (:func:`detached`): ``mul`` saves its operands, ``x * 2``
    nothing of x, ``exp`` its output, ``F.linear`` a view of its weight (``w.t()``).  No
    call known (validate.py): raised, as torch would for an input it saves."""
    srcs = [t for t in storage.tensors(src_loc) if t.grad_fn is not None]
    node = _node(outs) if srcs else None
    if node is None:
        return
    toks = [_token(t) for t in srcs]
    spec = None if call is None else _spec((call[1], call[2]), x)

    def pre(grads):
        for tok in toks:
            if tok[0]:
                if call is None or _saves_itself(call[0], spec):
                    raise _detached_error(f"{getattr(call[0], '__name__', 'the op')}")
                break
        return None
    node.register_prehook(pre)


def guard_kernel(out, func, ins) -> None:
    """A kernel ran one device's ``func`` on local operands ``ins`` ((local tensor or None,
    its global shape) per positional argument of ``func``) in its own way (a custom
    Function, views: ``F.linear``'s row-parallel ``_RankLinear``, which torch's
    ``detach_()`` check does not reach: custom Functions' saved inputs are not checked):
    after an operand's ``detach_()`` the local result ``out``'s backward raises torch's
    error where one device's ``func`` saves that operand itself (asked of torch on meta
    stand-ins, once per call shape)."""
    fn = getattr(out, "grad_fn", None)
    if fn is None:
        return
    # (perf18) the call shape read once into one key, whose answer (the operands with
    # history one device's func saves itself) is kept: per call a key and one lookup,
    # where each call built torch's spec and asked _SAVES once per operand with history
    key = [func]
    for t, g in ins:
        key.append(None if t is None else (tuple(g), t.dtype, t.requires_grad,
                                           t.grad_fn is not None))
    key = tuple(key)
    idx = _GUARDS.get(key)
    if idx is None:
        idx = _GUARDS[key] = _guarded(func, ins)
        if len(_GUARDS) > 4096:
            _GUARDS.clear()
    if not idx:
        return
    toks = []
    for i in idx:
        t = ins[i][0]
        s = source_of(t)
        toks.append(_token(s if s is not None and s.grad_fn is not None else t))
    if getattr(fn, "wb_detach_tokens", False) is None:
        # a kernel's own Function whose backward checks them (check_detached: no
        # hook registered, torch's Python _register_hook and a RemovableHandle a call)
        fn.wb_detach_tokens = (toks, func)
        return

    def pre(grads):
        for tok in toks:
            if tok[0]:
                raise _detached_error(getattr(func, "__name__", "the op"))
        return None
    fn.register_prehook(pre)


def check_detached(ctx) -> None:
    """In the backward of a kernel's own Function whose forward set
    ``ctx.wb_detach_tokens = None``: raises torch's error where :func:`guard_kernel`
    watched an operand (its hook's check, run here instead)."""
    got = ctx.wb_detach_tokens
    if got is not None:
        for tok in got[0]:
            if tok[0]:
                raise _detached_error(getattr(got[1], "__name__", "the op"))


_GUARDS: dict = {}      # guard_kernel's call shape -> _guarded's answer


def _guarded(func, ins) -> tuple:
    """The positions of ``ins`` (guard_kernel's) with history that one device's ``func``
    saves itself (asked of torch on meta stand-ins: a view of a 3-d input is not)."""
    spec = tuple(None if t is None else ("\0t", tuple(g), t.dtype, t.requires_grad, False)
                 for t, g in ins)
    return tuple(i for i, (t, _) in enumerate(ins) if t is not None and t.grad_fn is not None
                 and _saves_itself(func, (spec[:i] + (spec[i][:4] + (True,),) +
                                          spec[i + 1:], ())))


def _spec(a, x):
    """``a`` (an op's args, kwargs) with each tensor as (kind, shape, dtype, requires_grad,
    is ``x``), the rest as it is (hashable where the call's constants are)."""
    from .dist_tensor import DistTensor
    if isinstance(a, DistTensor):
        return ("\0t", tuple(a.shape), a.dtype, a.requires_grad, a is x)
    if isinstance(a, torch.Tensor):
        return ("\0t", tuple(a.shape), a.dtype, a.requires_grad, False)
    if isinstance(a, (list, tuple)):
        return type(a)(_spec(v, x) for v in a) if type(a) in (list, tuple) else a
    if isinstance(a, dict):
        return tuple((k, _spec(v, x)) for k, v in a.items()) + ("\0d",)
    return a


_SAVES: dict = {}


def _saves_itself(func, spec) -> bool:
    """Whether one device's ``func`` of tensors laid out as ``spec`` saves the marked
    input itself for backward: run on meta stand-ins under a saved-tensors hook (once
    per call shape).  Unsure (the meta run failed): True (raise, never answer)."""
    try:
        hit = _SAVES.get((func, spec))
    except TypeError:           # an unhashable constant: asked each time
        hit = None
    if hit is not None:
        return hit
    mark = []

    def build(a):
        if isinstance(a, tuple) and len(a) == 5 and isinstance(a[0], str) and a[0] == "\0t":
            t = torch.empty(a[1], dtype=a[2], device="meta")
            if a[3] and (a[2].is_floating_point or a[2].is_complex):
                t.requires_grad_()
            if a[4]:
                mark.append(t)
            return t
        if type(a) is tuple and a[-1:] == ("\0d",):
            return {k: build(v) for k, v in a[:-1]}
        if type(a) in (list, tuple):
            return type(a)(build(v) for v in a)
        return a
    got = []
    try:
        # (outside the caller's dispatch modes: a dry run's meta_run provenance mode
        # counted the probe's tensors as the program's activations)
        with _disable_current_modes(), torch.enable_grad(), \
                torch.autograd.graph.saved_tensors_hooks(lambda t: got.append(t) or t,
                                                         lambda t: t):
            args, kwargs = build(spec[0]), build(spec[1]) if spec[1] else {}
            func(*args, **kwargs)
        out = any(t is m for t in got for m in mark)
    except Exception:           # noqa: BLE001 - unsure: raise as torch would if saved
        out = True
    try:
        _SAVES[(func, spec)] = out
        if len(_SAVES) > 4096:
            _SAVES.clear()
    except TypeError:
        pass
    return out


# ---- a copy the dispatcher moved, before the op runs -----------------------------------

_SOURCE: dict = {}      # id(a moved copy's local tensor) -> (weakref to it, to its source)


def moved(src_loc, loc) -> None:
    """``loc`` (an op's input laid out anew by the dispatcher) was read from ``src_loc``
    (the DistTensor's local tensors): :func:`source_of` answers the kernel that runs on
    the copy (one device's operand had the source's strides: an expand's stride 0, which a
    gather drops)."""
    ss, cs = storage.tensors(src_loc), storage.tensors(loc)
    if len(ss) != len(cs):
        return
    for s, c in zip(ss, cs):
        if c is not s and c.dim() == s.dim():
            k = id(c)
            _SOURCE[k] = (weakref.ref(c, lambda _, k=k: _SOURCE.pop(k, None)), weakref.ref(s))


def source_of(t):
    """The local tensor the moved copy ``t`` was read from (:func:`moved`), else None."""
    got = _SOURCE.get(id(t))
    if got is None or got[0]() is not t:
        return None
    return got[1]()


class _Unversioned(torch.autograd.Function):
    """``t``'s values and gradient path under a version counter of its own (``t.data``
    shares the memory, not the counter)."""

    @staticmethod
    def forward(ctx, t):
        return t.data

    @staticmethod
    def backward(ctx, g):
        return g


def unversioned_local(t):
    """A local tensor ``t`` (requiring grad) under a version counter of its own: its
    values (the same memory) and its gradient path; a tensor not requiring grad as it is."""
    return _Unversioned.apply(t) if t.requires_grad else t


def unversioned(x):
    """``x`` (a DistTensor) whose local tensors, read by the out-of-place op that computes
    an in-place write, are not bumped by that write (torch saves the original ``self`` of
    ``x.mul_(w)`` apart from ``x``)."""
    from .dist_tensor import DistTensor

    def one(t):
        return _Unversioned.apply(t) if t.requires_grad else t.data
    out = DistTensor(storage.map_tensors(x._local, one), x.mesh, x.placements, x.shape,
                     x.dtype, x.names)
    for a in ("_gstride", "_ring_order", "_ring_also"):
        if hasattr(x, a):
            setattr(out, a, getattr(x, a))
    return out


def saved_check(ts):
    """A check of ``ts`` (an op's local operands) for the op's backward, for an op whose
    local kernel saved copies of them where torch on one device saves the operands
    themselves (torch.matmul broadcasting stacked operands: expand, then a reshape that
    cannot be a view, ``ops_table/matmul.py``).  A later write into an operand bumps its
    version counter, not the copy's: before, backward gave the old values' gradient,
    silently.  The check reads the operands' counters (handles share them) when the
    gradient reaches the op, as torch's SavedVariable::unpack does, and raises torch's
    RuntimeError in torch's words where one moved.  (Run by the hook the product already
    has, ``matmul._dense_grad``: a custom Function saving the operands cost ~12 us a
    product, 1% of a gpt-tiny step; a hook of its own about half that.  Measured with
    derive's handles, ``valgrind --tool=callgrind benchmarks/sim_instr.py gpt 3``: 73.62M
    instructions a step before inplace15, 75.50M with the custom Function, 74.42M with a
    pre-hook, 74.15M now (+0.7%: 12 of gpt-tiny Hybrid(dp2, tp2)'s 13 products a step
    read an operand through matmul's copy); the toy TP step calls neither.)"""
    kept = []
    for t in ts:
        tok = _stale_token(t if t._base is None else t._base)   # (a .data write: _stale)
        kept.append((_handle(t), t._version, t.shape, tok, tok[0]))

    def check():
        for h, v, shape, tok, n in kept:
            if h._version != v or tok[0] != n:
                why = "" if h._version != v else (
                    " (written through .data, which torch's saved tensor would read; the "
                    "simulator's copy of it holds the old values)")
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified "
                    f"by an inplace operation: [{h.type()} {list(shape)}] is at version "
                    f"{h._version}; expected version {v} instead{why}. Hint: enable anomaly "
                    "detection to find the operation that failed to compute its gradient, "
                    "with torch.autograd.set_detect_anomaly(True).")
    return check


_PAT = re.compile(r"\[torch\.\w+ \[([\d, ]*)\]\](?:, which is output (\d+) of (\w+))?")


class explained:
    """Runs a backward (``with explained():``); torch's "modified by an inplace operation"
    error gets the DistTensor write it was (where remembered) and the fix appended (same
    type, RuntimeError).  Where torch met the write at a view made in a custom Function
    ("Output 0 of Expand is a view and its base ... has been modified inplace"), one
    device's sentence comes first.  A class, not a generator context manager: entered on
    every ``backward()`` (toy TP step, benchmarks/sim_instr.py)."""
    __slots__ = ()

    def __enter__(self):
        return None

    def __exit__(self, typ, e, tb):
        if typ is None or not issubclass(typ, RuntimeError):
            return False
        msg = str(e)
        if not ("modified by an inplace operation" in msg or "been modified inplace" in msg) \
                or "On DistTensors" in msg or OWN_FIX in msg or "On a wrapper's parameter" in msg \
                or "On simulated ranks: the wrapped module" in msg:
            return False        # not a version error, or its hint names the fix already
        if "modified by an inplace operation" not in msg and "custom Function" in msg:
            # the saved value is a view that one of the simulator's identity Functions
            # (grad_record, reshard_backward: ``x.view_as(x)``) made of a local tensor the
            # write bumped; torch's error there names that view, where one device's names
            # the saved variable: one device's words first, torch's own kept after
            msg = ("one of the variables needed for gradient computation has been modified "
                   f"by an inplace operation (as one device's torch says; autograd met it at "
                   f"a view the simulator made: {msg})")
        m = _PAT.search(msg)
        what = None
        if m:
            shape = tuple(int(s) for s in m.group(1).split(",") if s.strip())
            nr = int(m.group(2)) if m.group(2) is not None else None
            what = _WRITES.get((m.group(3) or "", nr, shape))
        if what is None:
            hint = _param_hint(msg)     # a wrapper's parameter written: its own fix
            if hint is not None:
                raise RuntimeError(hint) from None
            if _SEQ[2] > _SEQ[1]:       # no DistTensor written since a plain module ran
                raise RuntimeError(
                    f"{msg}\nOn simulated ranks: the wrapped module ran on each rank's plain "
                    "tensors, and one an op had saved for backward was written in place "
                    "(torch raises the same on one device). Fix: clone() before writing "
                    "(y = y.clone(); then write y), or use the out-of-place op (y = y + 1 for "
                    "y.add_(1))") from None
        which = f"the DistTensor write {what}" if what else "an in-place write into a DistTensor"
        raise RuntimeError(
            f"{msg}\nOn DistTensors: {which} changed a value that an op had saved for "
            "backward (torch raises the same on one device). Fix: clone() before writing "
            "(y = y.clone(); then write y), or use the out-of-place op (y = y + 1 for "
            "y.add_(1))") from None
