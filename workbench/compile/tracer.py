"""The tracer of ``capture(method="trace")``: a ``TorchFunctionMode`` that runs the program
on meta tensors and records every call the op table answers to as a node of the graph
(:mod:`.capture`'s docstring)."""
from __future__ import annotations

import os

import torch
from torch.overrides import TorchFunctionMode

from ..parallel.dist_tensor import DistTensor
from ..parallel.habits import COMPOSED
from ..parallel.ops_table.composites import COMPOSITES
from ..parallel.ops_table.table import BY_FUNC
from ..parallel.reshard import reshard as _reshard
from .capture_errors import Broken, CaptureError, _data_dependent, _user_frame
from .capture_meta import _meta_like
from .capture_trees import _leaves, _swap
from .graph import Graph, GraphBreak, Node, Ref
from .reads import TENSOR_READS, amp_state, from_library
from .trace_calls import (T, _ALIASES, _EXTREMA, _FILL, _NO_VALUES, _RANDOM, _VALUE_FUNCS,
                          _advanced, _like, _meta_device, _whole)
from .writes import NOT_A_WRITE, Refused, write

_RESHARD_FILE = os.path.abspath(_reshard.__code__.co_filename)


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
        if isinstance(t, torch.Tensor) and not isinstance(t, DistTensor) and t.is_meta:
            # DistTensor.redistribute on the stand-in (a plain tensor has none): recorded
            # (on capture's own meta tensors only: a constant the program reads is the
            # user's object, left as it is)
            t.redistribute = lambda *a, **k: self._redistribute(t, *a, **k)

    def _reshard(self, t, mesh=None, placements=None, *, profile=None, expanded=()):
        """``wb.reshard(t, mesh, placements)`` (``parallel/reshard.py`` hands it to this
        mode: its stand-in is no DistTensor): what ``t.redistribute`` is eagerly
        (``habits._redistribute`` calls it), recorded alike.  A profile of its own (the
        trace would price that one call on it) or the dispatcher's ``expanded`` break."""
        where = _user_frame(skip=(_RESHARD_FILE,))
        if profile is not None or expanded:
            f, line, code = where
            raise CaptureError(f"wb.reshard at {f}:{line} ({code}) with profile= or "
                               "expanded=: the program runs eagerly", where=where)
        with self:                          # (inside this mode's call: on again)
            return self._redistribute(t, mesh, placements, _where=where)

    def _redistribute(self, t, device_mesh=None, placements=None, *, async_op=False,
                      forward_dtype=None, backward_dtype=None, _where=None):
        """``t.redistribute(mesh, placements)`` in the program: kept in the graph as a
        ``kept_copy`` of ``t`` (its own layout) whose output is pinned to ``placements``:
        lowering reshards it there at every level, as eager's call does (the mesh is
        held to the program's after the run: a round trip to another mesh and straight
        back is kept, anything else there breaks, ``mesh_trips.py``; None: t's own).
        The forms eager refuses break the graph (eager says why)."""
        f, line, code = _where or _user_frame()
        if forward_dtype is not None or backward_dtype is not None or placements is None:
            raise CaptureError(f"redistribute at {f}:{line} ({code}) without placements, "
                               "or with a dtype: the program runs eagerly",
                               where=(f, line, code))
        if device_mesh is not None:
            # what eager's plan_reshard refuses (another type of mesh, placements that do
            # not fit it or the dtype) it refuses at the call: the program runs eagerly
            from ..parallel.placement import check_partial_dtype, normalize_placements
            from ..sim_mesh.mesh import Mesh
            try:
                if not isinstance(device_mesh, Mesh):
                    raise TypeError(f"mesh={device_mesh!r:.60} is no workbench Mesh")
                check_partial_dtype(normalize_placements(placements, device_mesh, t.ndim),
                                    t.dtype)
            except (TypeError, ValueError) as e:
                raise CaptureError(f"redistribute at {f}:{line} ({code}): eager refuses it "
                                   f"({e}); the program runs eagerly",
                                   where=(f, line, code)) from None
        from ..parallel.ops_table.pointwise import kept_copy
        from torch.overrides import handle_torch_function
        out = handle_torch_function(kept_copy, (t,), t)      # recorded by this mode
        self.g.pins[self.ids[id(out)]] = (device_mesh, tuple(placements), (f, line, code))
        return out

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
        if func is _reshard:                # wb.reshard(t, mesh, placements): as t.redistribute
            return self._reshard(*args, **kwargs)
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
        # (``out=`` breaks for an op of the table too: its parse takes no ``out``, and
        # the captured node would not rebind the tensor written; narrow probe seed 227,
        # ``torch.sum(x, -1, out=z)``, raised a TypeError in the parse)
        if kwargs.get("out") is not None or hit is None and (
                name == "__setitem__" or (name.endswith("_") and not name.startswith("_"))):
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
        whole = _whole(func, args, kwargs)
        if whole is not None:              # x.nanmedian(): nanmedian_all (trace_calls)
            func, args, kwargs = whole[0], whole[1], {}
            hit = BY_FUNC[func]
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
