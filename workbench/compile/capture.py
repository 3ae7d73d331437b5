"""Capture a program into a :class:`~.graph.Graph` of op-table calls, on meta tensors.

Two ways in, tried in this order (``method="auto"``):

* ``"export"``: ``torch.export.export`` (non-strict) of the function or module on meta
  inputs and meta parameters; its ATen graph is mapped onto the op table
  (:mod:`.export`; our fused ``wb.ops`` calls stay whole as custom operators,
  :mod:`.export_ops`).  Where an ATen op has no entry, capture goes on by tracing and
  says why in ``graph.notes``.
* ``"trace"``: run the program once on meta tensors under a ``TorchFunctionMode`` that
  records every call the op table answers to, at the level the table speaks (``F.linear``,
  ``wb.ops.rms_norm``), as ``torch.fx.symbolic_trace`` records torch calls, but with
  concrete shapes, so Python control flow on shapes works.

An in-place write into a value the program made (``v = x.clone(); v.mul_(2)``,
``v[0] = 1.5``) is recorded as the new value it gives (:mod:`.writes`, as torch's
functionalization does); a write a graph of values cannot hold (into an input, through a
view) is a break that says why.

No data moves: inputs and parameters are meta tensors of their global shapes.  Control
flow on tensor *values* (``if x.sum() > 0``) cannot be captured: it is a
:class:`~.graph.GraphBreak`, reported with its source line (export's own message, or the
frame that asked for the value); the caller then runs that program eagerly.
"""
from __future__ import annotations

import contextlib
import os
import re
import traceback

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..parallel.dist_tensor import DistTensor
from ..parallel.ops_table import load as _load_ops
from ..parallel.ops_table.composites import COMPOSITES
from ..parallel.ops_table.table import BY_FUNC
from ..parallel.habits import COMPOSED
from .graph import Graph, GraphBreak, Node, Ref, same_tuple
from .guards import state_writes
from .writes import NOT_A_WRITE, Refused, write
from .reads import (TENSOR_READS, amp_state, autograd_reads, from_library, python_writes,
                    rng_reseeds_refused)

__all__ = ["capture", "CaptureError", "Broken", "break_from_export_error"]


class CaptureError(RuntimeError):
    """The program calls something capture cannot map onto the op table; ``where``: the
    user's (file, line, code) that did it, where known."""

    def __init__(self, msg: str, where: tuple | None = None):
        super().__init__(msg)
        self.where = where


class Broken(Exception):
    """Capture stopped at a graph break (``.brk``)."""

    def __init__(self, brk: GraphBreak):
        super().__init__(str(brk))
        self.brk = brk


_HERE = os.path.dirname(__file__)
_TORCH = os.path.dirname(torch.__file__)
T = torch.Tensor
# asking a traced tensor for its value: data-dependent control flow
# random draws made inside the program (capture would freeze one draw into a constant)
_RANDOM = {torch.rand, torch.randn, torch.randint, torch.randperm, torch.rand_like,
           torch.randn_like, torch.randint_like, torch.normal, torch.bernoulli,
           torch.multinomial, T.normal_, T.uniform_, T.bernoulli_, T.random_}
# attributes that are ops: ``x.T`` reverses the dims (as DistTensor.T does: a permute),
# ``x.mT`` swaps the last two (the property's getter is what the mode sees)
_ALIASES = {T.T.__get__: lambda t: (T.permute, (t, tuple(reversed(range(t.ndim)))), {}),
            T.mT.__get__: lambda t: (T.transpose, (t, -2, -1), {})}
_VALUE_FUNCS = {T.__bool__, T.item, T.tolist, T.__int__, T.__float__, T.__index__,
                T.nonzero, T.numpy}


def _data_dependent(func, e):
    """Raise a CaptureError that says so where ``func`` raised ``e`` on the meta stand-ins
    because its output's shape or value is the data's (``nonzero``, ``masked_select``,
    ``unique``, ``torch.equal``: torch has no meta kernel for them, as none can know it)."""
    msg = str(e)
    if not isinstance(e, NotImplementedError) or not (
            "Meta tensors" in msg or "register_meta" in msg or "data-dependent" in msg):
        return
    f, line, code = _user_frame()
    raise CaptureError(
        f"{getattr(func, '__name__', func)} at {f}:{line} ({code}): its output's shape or "
        "value depends on the tensor's data (data-dependent), which capture, running the "
        "program on meta tensors of the global shapes, cannot know: a graph break, the "
        "program runs eagerly (compute it outside the compiled function, or give a fixed "
        "size: torch.where for a mask, topk for a count)", where=(f, line, code))


def _extremum(kind):
    """``torch.max`` / ``torch.min`` captured as eager DistTensors compose them
    (``parallel.habits._extremum``): with a dim, ``(values, indices)`` from ``argmax`` /
    ``argmin`` (the first extreme, as torch's) and ``gather`` at it, so the gradient goes to
    that one element; with a tensor, ``maximum`` / ``minimum``.  ``max(x)`` over every dim
    is recorded by the tracer as the eager call itself (``_Tracer``: an ``amax`` node whose
    call is ``max``, so the run takes eager's even gradient among ties and NaNs)."""
    arg, pair = (torch.argmax, torch.maximum) if kind == "max" else (torch.argmin, torch.minimum)
    result = getattr(torch.return_types, kind)

    def extremum(input, dim=None, keepdim=False, *, other=None, out=None):
        if out is not None or (dim is None and other is None):
            return NotImplemented
        if isinstance(dim, torch.Tensor) or other is not None:
            return pair(input, dim if other is None else other)
        if type(dim) is not int or type(keepdim) is not bool:
            return NotImplemented                       # torch's own error, from eager
        n = max(input.ndim, 1)
        if not -n <= dim < n:
            raise IndexError(f"Dimension out of range (expected to be in range of [{-n}, "
                             f"{n - 1}], but got {dim})")
        key = input.to(torch.uint8) if input.dtype == torch.bool else input
        if input.ndim == 0:
            return result((input.clone(), arg(key)))
        idx = arg(key, dim, True)
        values = torch.gather(input, dim, idx)
        if not keepdim:
            values, idx = values.squeeze(dim), idx.squeeze(dim)
        return result((values, idx))
    return extremum


_EXTREMA = {f: _extremum(k) for k in ("max", "min") for f in (getattr(torch, k), getattr(T, k))}

# a new tensor shaped like a traced one (its shape and dtype are static): a constant of the
# program, as ``torch.zeros((8, 6))`` written out is (plain tensors are replicated);
# ``empty_like`` / ``new_empty`` as zeros (one of the values torch may leave there)
_FILL = {torch.zeros_like: 0, torch.ones_like: 1, torch.empty_like: 0,
         T.new_zeros: 0, T.new_ones: 1, T.new_empty: 0}


def _like(func, args, kwargs):
    """``torch.zeros_like(x)``, ``torch.full_like(x, v)``, ``x.new_zeros(size)``... as the
    constant they are: (the constant, or None for a form left to torch)."""
    kw = dict(kwargs)
    x, rest = args[0], list(args[1:])
    if "input" in kw:
        x = kw.pop("input")
    if kw.pop("memory_format", None) not in (None, torch.preserve_format,
                                             torch.contiguous_format):
        return None
    dtype = kw.pop("dtype", None) or x.dtype
    rg = bool(kw.pop("requires_grad", False))
    kw.pop("device", None), kw.pop("layout", None), kw.pop("pin_memory", None)
    if func in (torch.full_like, T.new_full):
        if func is T.new_full:
            if not rest and "size" not in kw:
                return None
            size = rest.pop(0) if rest else kw.pop("size")
        else:
            size = tuple(x.shape)
        if not rest and "fill_value" not in kw:
            return None
        value = rest.pop(0) if rest else kw.pop("fill_value")
    elif func in _FILL:
        value = _FILL[func]
        if func in (torch.zeros_like, torch.ones_like, torch.empty_like):
            size = tuple(x.shape)
        else:
            size = rest[0] if len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)) \
                else tuple(rest) if rest else kw.pop("size", None)
            rest = []
            if size is None:
                return None
    else:
        return None
    if rest or kw:
        return None
    return torch.full(tuple(size), value, dtype=dtype).requires_grad_(rg)


# factories whose values torch leaves unset: made again on the CPU they would hold garbage
_NO_VALUES = {torch.empty, torch.empty_like, torch.empty_strided, T.new_empty}


def _meta_device(device) -> bool:
    """``device`` (a factory's keyword) names the meta device (a stand-in's ``x.device``)."""
    return device is not None and not isinstance(device, int) and \
        torch.device(device).type == "meta"


def _advanced(index) -> bool:
    """An index holding an index tensor or a list: advanced indexing (a constant index or
    one the program computes; a computed bool mask breaks the graph at its ``nonzero``)."""
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, (torch.Tensor, list)) for i in items)


def _meta_like(x, requires_grad=None):
    rg = x.requires_grad if requires_grad is None else requires_grad
    t = torch.empty(tuple(x.shape), dtype=x.dtype, device="meta")
    return t.requires_grad_(bool(rg) and x.dtype.is_floating_point)


def _user_frame(tb=None):
    """(file, line, code) of the innermost frame outside torch and this package (of the
    stack now, or of the traceback ``tb`` of an exception)."""
    frames = traceback.extract_stack() if tb is None else traceback.extract_tb(tb)
    # (an exception raised inside workbench, wb.reshard on a meta tensor, is the user's
    # call of it that raised)
    ours = _HERE if tb is None else os.path.dirname(_HERE)
    for fr in reversed(frames):
        f = os.path.abspath(fr.filename)
        if f.startswith(_TORCH) or f.startswith(ours) or "/contextlib.py" in f:
            continue
        return f, fr.lineno or 0, (fr.line or "").strip()
    return "?", 0, ""


def _leaves(tree, out):
    if isinstance(tree, (torch.Tensor, DistTensor)):
        out.append(tree)
    elif isinstance(tree, (tuple, list)):
        for x in tree:
            _leaves(x, out)
    elif isinstance(tree, dict):
        for x in tree.values():
            _leaves(x, out)
    elif isinstance(tree, slice):
        _leaves([tree.start, tree.stop, tree.step], out)
    return out


def nested_tensors(tree) -> list:
    """The tensors and DistTensors in a (nested) list, tuple or dict."""
    if isinstance(tree, (torch.Tensor, DistTensor)):
        return [tree]
    items = tree.values() if isinstance(tree, dict) else \
        tree if isinstance(tree, (list, tuple)) else ()
    return [t for x in items for t in nested_tensors(x)]


def _swap(tree, fn):
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, tuple):
        return same_tuple(tree, [_swap(x, fn) for x in tree])
    if isinstance(tree, list):
        return [_swap(x, fn) for x in tree]
    if isinstance(tree, dict):
        return {k: _swap(x, fn) for k, x in tree.items()}
    if isinstance(tree, slice):
        return slice(_swap(tree.start, fn), _swap(tree.stop, fn), _swap(tree.step, fn))
    return tree


class _Tracer(TorchFunctionMode):
    """Records the op-table calls made on traced meta tensors (module docstring)."""

    def __init__(self, graph: Graph):
        super().__init__()
        self.g = graph
        self.ids: dict[int, int] = {}     # id(meta tensor) -> vid
        self.keep: list = []              # traced tensors stay alive (ids stay unique)
        self.const_ids: dict[int, int] = {}
        self._twins: dict[int, torch.Tensor] = {}   # const vid -> its meta twin
        self.made: set = set()            # storages of tensors the program made itself
        self.keep_made: list = []         # (kept alive: their addresses stay theirs)

    def _write_outside(self, func, name, args, kwargs, leaves):
        """Refuse, before it runs, a write into a tensor that was there before the
        program: a module's buffer, a global (the graph would not repeat it)."""
        if name in ("requires_grad_", "share_memory_") or not (
                name == "__setitem__" or kwargs.get("out") is not None or
                (name.endswith("_") and not name.startswith("_"))):
            return
        dst = kwargs.get("out") if kwargs.get("out") is not None else \
            (args[0] if args else None)
        dsts = _leaves(dst, [])
        if not any(isinstance(t, torch.Tensor) and not t.is_meta and
                   t.untyped_storage().data_ptr() not in self.made for t in dsts):
            return
        f, line, code = _user_frame()
        raise CaptureError(f"{name} at {f}:{line} ({code}) writes into a tensor the program "
                           "did not make (a module's buffer, a global): the captured graph "
                           "would not repeat the write on each call; the program runs "
                           "eagerly (return the new value, or keep such state outside)",
                           where=(f, line, code))

    def _made(self, out, leaves):
        """Note the storages ``out`` holds that no input of the call held."""
        had = {t.untyped_storage().data_ptr() for t in leaves
               if isinstance(t, torch.Tensor) and not t.is_meta}
        for t in _leaves(out, []):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                ptr = t.untyped_storage().data_ptr()
                if ptr not in had:
                    self.made.add(ptr)
                    self.keep_made.append(t)

    def track(self, t, vid):
        self.ids[id(t)] = vid
        self.keep.append(t)

    def _const(self, t):
        vid = self.const_ids.get(id(t))
        if vid is None:
            if t.requires_grad:
                f, line, code = _user_frame()
                what = "a DistTensor that requires grad" if isinstance(t, DistTensor) else \
                    "a tensor that requires grad"
                raise CaptureError(
                    f"{what} {tuple(t.shape)} at {f}:{line} ({code}) is not an input of the "
                    "program (a parameter of a module the function reads from outside?): "
                    "the graph would hold it as a constant, and no gradient would reach it; "
                    "compile the module itself, or pass the tensor as an argument",
                    where=(f, line, code))
            if t.is_meta:
                f, line, code = _user_frame()
                raise CaptureError(
                    f"a tensor {tuple(t.shape)} made on the meta device at {f}:{line} "
                    f"({code}) is read by the program: capture's stand-ins are meta tensors, "
                    "and a constant made from them holds no values; make it on the CPU "
                    "(or from an input), or compute it outside the compiled function",
                    where=(f, line, code))
            vid = self.g.value(t.shape, t.dtype, "const", f"const{len(self.g.consts)}")
            self.g.consts[vid] = t.detach()
            self.const_ids[id(t)] = vid
            twin = _meta_like(t, False)
            self.track(t, vid)
            self.track(twin, vid)
            self._twins[vid] = twin
        return vid

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = _leaves((args, kwargs), [])
        traced = any(id(t) in self.ids for t in leaves)
        if traced and func in TENSOR_READS and not from_library(1):   # a branch may
            # follow it (reads.py)
            self.g.autograd_reads.add(TENSOR_READS[func])
        if func in _RANDOM:
            f, line, code = _user_frame()
            raise CaptureError(f"{func.__name__} at {f}:{line} ({code}) draws random numbers "
                               "inside the program; a captured graph would keep one draw for "
                               "every call: pass the random tensor in as an input",
                               where=(f, line, code))
        name = getattr(func, "__name__", "")
        if not traced:
            self._write_outside(func, name, args, kwargs, leaves)
            out = func(*args, **kwargs)
            if _meta_device(kwargs.get("device")) and func not in _NO_VALUES and \
                    any(t.is_meta for t in _leaves(out, []) if isinstance(t, torch.Tensor)) \
                    and not from_library(1):
                # ``torch.arange(S, device=idx.device)``: a constant made on a stand-in's
                # device has no values (the run read garbage: NaN logits of a compiled
                # gpt-tiny, whose positions are made so); made on the CPU, as eager's
                out = func(*args, **dict(kwargs, device=torch.device("cpu")))
            self._made(out, leaves)
            return out
        alias = _ALIASES.get(func)
        if alias is not None:               # x.T, x.mT: the op they are
            func, args, kwargs = alias(*args)
            name = func.__name__
        if func in _VALUE_FUNCS:
            f, line, code = _user_frame()
            raise Broken(GraphBreak(f"{getattr(func, '__name__', func)}() reads a traced "
                                    "tensor's value: data-dependent control flow", f, line, code))
        # an in-place write into a value the program made: captured as the new value it
        # gives (writes.py, torch's functionalization); others stay breaks, saying why
        try:
            wrote = write(self, func, name, args, kwargs)
        except Refused as e:
            f, line, code = _user_frame()
            raise CaptureError(f"{name} at {f}:{line} ({code}): {e}",
                               where=(f, line, code)) from None
        if wrote is not NOT_A_WRITE:
            return wrote
        hit = BY_FUNC.get(func)
        if hit is None and (func in _FILL or func in (torch.full_like, T.new_full)):
            with self:
                out = _like(func, args, kwargs)
            if out is not None:
                return out
        if func is T.__getitem__ and len(args) == 2 and _advanced(args[1]):
            # x[idx], x[i, :, j] with index tensors: as eager composes them
            # (tensor_methods' __getitem__: index_select of the index, table ops)
            from ..parallel.ops_table.indexing import advanced_index, index_with, mixed_index
            with self:
                out = mixed_index(args[0], args[1])
                if out is None:
                    adv = advanced_index(args[0], args[1])
                    out = None if adv is None else index_with(args[0], *adv)
            if out is not None:
                return out
        if hit is None and func in _EXTREMA and len(args) == 1 and not kwargs and \
                isinstance(args[0], torch.Tensor) and args[0].numel():
            # ``x.max()``: over every dim, the eager call itself (habits._extremum: amax
            # over every dim, with torch's even gradient among ties and NaNs where it is
            # needed, extreme_grad.py), recorded as the ``amax`` / ``amin`` it places
            red = torch.amax if func in (torch.max, T.max) else torch.amin
            entry, parse = BY_FUNC[red]
            x = args[0]
            return self._record(func, entry, parse, args, kwargs, leaves,
                                parse_as=((x, tuple(range(x.ndim))), {}))
        if hit is None and func in _EXTREMA:
            with self:
                out = _EXTREMA[func](*args, **kwargs)
            if out is not NotImplemented:
                return out
        if hit is None and func in COMPOSITES:
            # a torch function the dispatcher runs as a composition of table ops (var,
            # std, logsumexp, F.normalize, addmm, mse_loss...: ops_table/composites.py):
            # captured as those ops, each with its rule and cost, as eager runs them
            with self:
                return COMPOSITES[func](*args, **kwargs)
        if hit is None and (name == "__setitem__" or kwargs.get("out") is not None or
                            (name.endswith("_") and not name.startswith("_"))):
            f, line, code = _user_frame()
            raise CaptureError(f"{name} at {f}:{line} ({code}) writes into a traced tensor; "
                               "capture follows values, not writes: compute a new tensor "
                               "(torch.where, torch.cat) instead", where=(f, line, code))
        if hit is None and func in COMPOSED and name.startswith("_foreach_"):
            # torch._foreach_<op>: the per-tensor ops eager runs (parallel/foreach_ops.py),
            # each an op of the table (an in-place one a write: writes.py)
            with self:
                return COMPOSED[func](*args, **kwargs)
        if hit is None:
            try:
                out = func(*args, **kwargs)
            except (Broken, CaptureError):
                raise
            except Exception as e:    # noqa: BLE001 (e.g. a meta tensor beside a CPU one)
                _data_dependent(func, e)
                f, line, code = _user_frame()
                raise CaptureError(
                    f"{getattr(func, '__qualname__', func)} at {f}:{line} ({code}) has no "
                    "entry in the op table and does not run on the traced meta tensors "
                    f"({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}); "
                    "register the op (workbench.parallel.ops_table) or compute it outside "
                    "the compiled function", where=(f, line, code)) from None
            if _leaves(out, []):
                f, line, code = _user_frame()
                raise CaptureError(
                    f"{getattr(func, '__qualname__', func)} at {f}:{line} ({code}) has no "
                    "entry in the op table, so it cannot be placed; register the op "
                    "(workbench.parallel.ops_table) or compute it outside the compiled "
                    "function", where=(f, line, code))
            return out                     # metadata: sizes, dims, dtypes
        entry, parse = hit
        return self._record(func, entry, parse, args, kwargs, leaves)

    def _record(self, func, entry, parse, args, kwargs, leaves, parse_as=None):
        """Run ``func`` on the meta tensors and record it as a node of ``entry``;
        ``parse_as``: (args, kwargs) the entry's parse reads instead of the call's (a
        ``max()`` recorded as ``amax`` over every dim)."""
        # constants (buffers, tensors made inside) become replicated values
        for t in leaves:
            if id(t) not in self.ids:
                self._const(t)

        def to_ref(t):
            vid = self.ids[id(t)]
            return Ref(vid)

        def to_meta(t):
            vid = self.ids[id(t)]
            tw = self._twins.get(vid)
            return tw if tw is not None else t
        margs, mkw = _swap(args, to_meta), _swap(kwargs, to_meta)
        rargs, rkw = _swap(args, to_ref), _swap(kwargs, to_ref)     # before outputs register
        try:
            out = func(*margs, **mkw)
        except NotImplementedError as e:
            _data_dependent(func, e)
            raise
        if parse_as is not None:
            margs, mkw = _swap(parse_as[0], to_meta), _swap(parse_as[1], to_meta)
        ins, attrs = parse(*margs, **mkw)
        g = self.g
        inputs = []
        for x in ins:
            if not isinstance(x, torch.Tensor):
                inputs.append(None)
            elif id(x) in self.ids:
                inputs.append(self.ids[id(x)])
            else:        # made by the parse itself, afresh on each call (a dropout mask)
                inputs.append(g.value(x.shape, x.dtype, "fresh", f"{entry.name} {len(g.nodes)}"))
        inputs = tuple(inputs)
        nid = len(g.nodes)
        outs = []

        def new_value(t):
            vid = g.value(t.shape, t.dtype, "op", f"{entry.name}_{nid}", nid, t.requires_grad)
            self.track(t, vid)
            outs.append(vid)
            return Ref(vid)
        tree = _swap(out, new_value)
        f, line, code = _user_frame()
        g.nodes.append(Node(nid, entry.name, func, rargs, rkw,
                            inputs, dict(attrs), tuple(outs), tree,
                            f"{os.path.basename(f)}:{line}  {code}",
                            in_consts=tuple(None if isinstance(x, torch.Tensor) else x
                                            for x in ins),
                            grad=torch.is_grad_enabled(), amp=amp_state()))
        return out


@contextlib.contextmanager
def meta_twins(module):
    """Swap every parameter of ``module`` for a meta twin (tied ones share one twin);
    yields [(full name, original, twin, first name of this twin?)]; puts the originals
    back after, whatever happens inside."""
    saved, twins, rows, back = [], {}, [], {}
    try:
        for mname, mod in module.named_modules(remove_duplicate=False):
            for pname, p in list(mod._parameters.items()):
                if p is None:
                    continue
                # (a module met twice, registered under two names: its slot already
                # holds the twin; it is recorded and put back once, with the original)
                p = back.get(id(p), p)
                if mod._parameters[pname] is p:
                    saved.append((mod, pname, p))
                tw = twins.get(id(p))
                first = tw is None
                if first:
                    tw = twins[id(p)] = nn.Parameter(
                        _meta_like(p, p.requires_grad),
                        requires_grad=bool(p.requires_grad) and p.dtype.is_floating_point)
                    back[id(tw)] = p
                rows.append((f"{mname}.{pname}" if mname else pname, p, tw, first))
                mod._parameters[pname] = tw
        yield rows
    finally:
        for mod, pname, p in saved:
            mod._parameters[pname] = p


@contextlib.contextmanager
def meta_buffers(module):
    """Swap every buffer of ``module`` for a meta twin (a buffer registered twice shares
    one twin), as :func:`meta_twins` does the parameters: ``torch.export`` runs the program
    on fake tensors of the twins' device, and a CPU buffer beside meta parameters fails it
    (FakeTensorDeviceMismatchError).  A plain tensor attribute (``self.scale = t``, not
    registered) is swapped too: export lifts it as a constant of the graph, as it does a
    buffer (torch.export's ``InputKind.CONSTANT_TENSOR``).  Yields {full name: original}
    (every name); puts the originals back after, whatever happens inside."""
    saved, twins, back, originals = [], {}, {}, {}

    def swap(where, name, full):
        t = back.get(id(where[name]), where[name])   # (a module met twice: twinned once)
        tw = twins.get(id(t))
        if tw is None:
            tw = twins[id(t)] = _meta_like(t, False)
            back[id(tw)] = t
        if where[name] is t:
            saved.append((where, name, t))
            where[name] = tw
        originals[full] = t
    try:
        for mname, mod in module.named_modules(remove_duplicate=False):
            for bname, b in list(mod._buffers.items()):
                if b is not None:
                    swap(mod._buffers, bname, f"{mname}.{bname}" if mname else bname)
            for aname, t in list(vars(mod).items()):
                if type(t) is torch.Tensor and (not t.is_meta or id(t) in back):
                    swap(mod.__dict__, aname, f"{mname}.{aname}" if mname else aname)
        yield originals
    finally:
        for where, name, t in saved:
            where[name] = t


@contextlib.contextmanager
def _meta_parameters(module, graph, tracer, placements):
    """:func:`meta_twins`, each twin registered as a parameter value of ``graph`` and
    tracked by ``tracer``."""
    with meta_twins(module) as rows:
        for full, p, tw, first in rows:
            if not first:
                continue
            vid = graph.value(p.shape, p.dtype, "param", full, requires_grad=tw.requires_grad)
            graph.params[full] = vid
            tracer.track(tw, vid)
            if isinstance(p, DistTensor):
                placements[vid] = (p.mesh, tuple(p.placements))
            else:
                placements[vid] = p      # a plain parameter: replicated
        yield



def _registered(module):
    """``module`` and the modules registered under it (``_modules``), depth first."""
    yield module
    for child in module._modules.values():
        if child is not None:
            yield from _registered(child)

def capture(fn, args, method: str = "auto"):
    """(graph, placements of the inputs and parameters) of ``fn(*args)``.

    ``placements``: vid -> (mesh, placements) for DistTensor inputs and parameters, or
    the plain tensor for plain ones (replicated on the program's mesh).  Raises
    :class:`Broken` at a graph break, :class:`CaptureError` for an op without entry."""
    if method not in ("auto", "export", "trace"):
        raise ValueError(f"capture(method={method!r}): use 'auto', 'export' or 'trace'")
    _load_ops()
    if any(isinstance(a, (list, tuple, dict)) and nested_tensors(a) for a in args):
        raise CaptureError("a tensor inside a list, tuple or dict argument would be frozen "
                           "into the graph as a constant; pass each tensor as an argument of "
                           "its own (the program runs eagerly)")
    if isinstance(fn, nn.Module):
        # the registered tree itself (``_modules``), not ``modules()``: the data-parallel
        # wrappers answer ``modules()`` with the module they wrap, kept apart from them
        walked = {id(p) for m in _registered(fn) for p in m._parameters.values()
                  if p is not None}
        if any(id(p) not in walked for p in fn.parameters()):
            raise CaptureError(f"{type(fn).__name__}'s parameters are not registered on its "
                               "submodules (a wrapper such as DistributedDataParallel keeps "
                               "the module apart): capture would freeze them as constants "
                               "and no gradient would reach them; the program runs eagerly")
    # capture runs with gradients on, whatever the caller's mode (compile under no_grad
    # captures the program, not the mode): a no_grad block inside the program is then
    # its nodes' ``grad=False``, and the run calls them so (as eager does)
    from ..ops.moe import stats_sink
    with state_writes(fn) as writes, python_writes(fn) as globals_written, \
            autograd_reads() as (asked, watch), rng_reseeds_refused(_reseed_error), \
            torch.enable_grad(), _custom_functions_refused(), stats_sink() as layers:
        try:
            out = _capture(fn, args, method, watch)
        except Broken:
            if writes:                     # the write came first: name it
                raise _state_error(writes) from None
            raise
    if writes:
        raise _state_error(writes)
    if globals_written:
        raise CaptureError(f"the program writes Python state ({', '.join(globals_written[:3])}"
                           "): a captured graph would not repeat the write on each call; "
                           "it runs eagerly (the values are as they were before the "
                           "capture; return the new value instead, or keep such state "
                           "outside the compiled function)")
    out[0].autograd_reads |= set(asked)
    if layers:
        # a mixture-of-experts layer keeps its last routing (MoE.last_stats): the program
        # hands it its router_topk node's outputs on each call, one node per layer call
        routers = [n for n in out[0].nodes if n.op == "router_topk"]
        if len(routers) != len(layers):
            raise CaptureError(f"the program calls router_topk {len(routers)} times and "
                               f"MoE layers {len(layers)} times: which routing each layer "
                               "reports (last_stats) is not known; the program runs eagerly")
        out[0].stats_layers = list(layers)
    return out


@contextlib.contextmanager
def _custom_functions_refused():
    """While capture runs: a custom ``torch.autograd.Function`` applied to a traced tensor
    is refused (its ``backward`` is code capture cannot see: export inlines its forward and
    the graph's gradient is the forward's, 8 where the Function says 40; tracing records its
    forward under no_grad, so no gradient at all).  ``torch.utils.checkpoint``'s reentrant
    Function is one.  workbench's own Functions (``wb.ops``: the exact gradient, held to a
    reference by their tests) are the op table's business and pass, as does the autograd
    Function PyTorch generates for their custom operators under export (export_ops.py)."""
    base = torch.autograd.Function
    orig = base.__dict__["apply"]

    def apply(cls, *args, **kwargs):
        ours = cls.__module__.startswith("workbench.") or \
            cls.__name__.startswith("GeneratedBackwardFor_workbench_")
        if not ours and any(
                isinstance(t, torch.Tensor) and t.device.type == "meta"
                for t in _leaves((args, kwargs), [])):
            f, line, code = _user_frame()
            raise CaptureError(f"the autograd.Function {cls.__qualname__} at {f}:{line} "
                               f"({code}) has its own backward, which a captured graph "
                               "cannot hold; the program runs eagerly (compile the code "
                               "around it, or register it in the op table)",
                               where=(f, line, code))
        if ours and torch.is_grad_enabled() and torch.overrides._is_torch_function_mode_enabled() \
                and any(isinstance(m, _Tracer)
                        for m in torch.overrides._get_current_function_mode_stack()) \
                and any(isinstance(t, torch.Tensor) and t.requires_grad
                        for t in _leaves((args, kwargs), [])):
            # workbench's own Function applied inside a composition the tracer follows
            # (var's _NoDof: no degrees of freedom): its forward would be recorded as
            # untracked ops and its backward lost (the output did not require grad where
            # eager's does: narrow probe seed 78); a table op records it whole instead
            f, line, code = _user_frame()
            raise CaptureError(f"the autograd.Function {cls.__qualname__} (workbench's own) at "
                               f"{f}:{line} ({code}) runs on the traced tensors outside an op "
                               "of the table: its backward would not be captured; the "
                               "program runs eagerly", where=(f, line, code))
        return orig.__func__(cls, *args, **kwargs)
    base.apply = classmethod(apply)
    try:
        yield
    finally:
        base.apply = orig


def _reseed_error(name):
    f, line, code = _user_frame()
    return CaptureError(f"torch.{name} at {f}:{line} ({code}) reseeds the random generator "
                        "inside the program: each eager call restarts its draws there, a "
                        "captured graph would draw on; the program runs eagerly (seed "
                        "outside the compiled function)", where=(f, line, code))


def _state_error(writes):
    return CaptureError(f"the forward sets module state ({', '.join(writes[:3])}): a "
                        "captured graph would not repeat the write on each call; the module "
                        "runs eagerly (keep such state outside forward, or return it)")


def _capture(fn, args, method, watch):
    notes = []
    if method in ("auto", "export"):
        from .export import capture_export, Unmapped
        try:
            return capture_export(fn, args, watch)
        except Unmapped as e:
            if method == "export":
                raise CaptureError(str(e)) from None
            notes.append(f"export: {e}; captured by tracing torch functions instead")
        from ..ops.moe import stats_layers
        if stats_layers() is not None:
            stats_layers().clear()         # (the export run's layer calls)
    graph, placements = _capture_trace(fn, args)
    graph.notes = notes + graph.notes
    return graph, placements


def _capture_trace(fn, args):
    g = Graph(method="trace")
    tracer = _Tracer(g)
    placements = {}
    margs = []
    for i, a in enumerate(args):
        if isinstance(a, (DistTensor, torch.Tensor)):
            rg = bool(getattr(a, "requires_grad", False))
            m = _meta_like(a, rg)
            vid = g.value(a.shape, a.dtype, "input", f"arg{i}", requires_grad=m.requires_grad)
            g.inputs.append(vid)
            tracer.track(m, vid)
            placements[vid] = (a.mesh, tuple(a.placements)) if isinstance(a, DistTensor) else a
            margs.append(m)
        else:
            margs.append(a)
    module = fn if isinstance(fn, nn.Module) else None
    ctx = _meta_parameters(module, g, tracer, placements) if module is not None \
        else contextlib.nullcontext()
    with ctx, tracer:
        try:
            out = fn(*margs)
        except (Broken, CaptureError):
            raise
        except Exception as e:    # noqa: BLE001 (code that needs real DistTensors or data)
            where = _user_frame(e.__traceback__)     # the user's line that raised
            if where[0] == "?":
                # workbench's own code raised (a model's or a recipe's hook reading a
                # DistTensor's placements): name its line rather than "?:0"
                inner = [fr for fr in traceback.extract_tb(e.__traceback__)
                         if not os.path.abspath(fr.filename).startswith(_TORCH)
                         and not os.path.abspath(fr.filename).startswith(_HERE)]
                if inner:
                    fr = inner[-1]
                    where = (fr.filename, fr.lineno or 0, (fr.line or "").strip())
            raise CaptureError(
                "capture runs the program on meta tensors of the global shapes (plain "
                f"tensors, no data) and it raised {type(e).__name__}: "
                f"{str(e).splitlines()[0][:200] if str(e) else ''}",
                where=where if where[0] != "?" else None) from None
    missing = [t for t in _leaves(out, []) if id(t) not in tracer.ids]
    if missing:
        raise CaptureError("the program returns a tensor it did not compute from its inputs "
                           "(a constant); return it outside the compiled function")
    g.output = _swap(out, lambda t: Ref(tracer.ids[id(t)]))
    if any(n.op == "expert_parallel" for n in g.nodes):
        g.notes.append("expert_parallel: its all-to-alls and expert GEMMs depend on the "
                       "routing, so they are priced on the trace as they run, not in the "
                       "modeled step (ASSUMPTION: the plan's placements ignore them)")
    return g, placements


def break_from_export_error(e: Exception) -> GraphBreak | None:
    """The source line of a data-dependent guard in ``torch.export``'s message."""
    msg = str(e)
    if "data-dependent" not in msg and "GuardOnDataDependent" not in type(e).__name__:
        return None
    m = list(re.finditer(r'File "([^"]+)", line (\d+), in \S+\n\s+(.*)', msg))
    if not m:
        return GraphBreak(msg.splitlines()[0][:200], "?", 0, "")
    f, line, code = m[-1].group(1), int(m[-1].group(2)), m[-1].group(3).strip()
    return GraphBreak("torch.export: " + msg.splitlines()[0][:160], f, line, code)

