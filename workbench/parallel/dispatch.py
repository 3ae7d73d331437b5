"""Running ordinary PyTorch code on DistTensors: rule, reshard, local op, wrap.

``DistTensor.__torch_function__`` sends every torch function, tensor method and
operator here.  For one call, reading the op's entry in the op table
(``ops_table/``: one registration per op):

1. the entry's parser splits the arguments into tensor inputs and attributes;
2. on the first call for an input layout, the real torch callable runs on meta
   tensors of the global shapes (PyTorch's own errors; output shapes and dtypes
   checked against the local implementation's), then the op's SPMD rule returns
   its decision, choosing the cheapest valid strategy on the current profile (where
   a strategy moves nothing, ``ops_table/free_choice.py`` takes the first such one
   without pricing the others: a new shape's first call made cheap, exactly);
3. each input is resharded to what the strategy requires (the inserted
   collectives are recorded in the trace);
4. replicated inputs that meet per-rank computation are given per-rank views
   (:func:`collectives.expand_replicas`; their backward is the gradient
   all-reduce, traced once per input however many ops read it, and a shard the
   op gathered itself gets DTensor's one reduce-scatter back instead:
   ``reshard_backward.gather``; on torch.distributed ``gather_backward_dist.gather``
   for the gathered shard, the replicated input still one all-reduce per op);
5. the local op runs once on the stacked local tensors of all ranks (or per
   rank when shards are uneven; on torch.distributed, on this process's shard,
   uneven or not: the collectives pad, ``sim_mesh/padded.py``) and the result is
   wrapped with the announced
   output placements; under a trace, the entry's cost on the busiest rank is
   recorded as a forward compute event, and as a backward one when the
   gradient passes (``ops_table/pricing.py``).

Autograd records on the local tensors, so ``loss.backward()`` gives every shard
its gradient and the backward communication is each collective's backward.

Where a prepared op's layout leaves steps 3-5 nothing to do but run the local op and
wrap its one output (even shards on simulated ranks, no reshard, no stride tracking;
untraced and unhooked), dispatch runs it without :func:`run_prepared`
(``_fast_facts``, decided once per prepared op; per call it checks only what the cache
key does not hold): the same tensors, bit for bit (tests/test_perf12.py); a view op's
output told to :func:`views.note_views` as run_prepared tells it (tests/test_perf14.py).
"""
from __future__ import annotations

import contextlib
import math
import types
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint
from torch.utils._python_dispatch import _disable_current_modes

from ..sim_mesh import backends as _B
from ..sim_mesh.trace import current_trace
from . import layout, storage
from .dist_tensor import DistTensor, TensorSpec
from .habits import COMPOSED, FACTORIES
from . import strides
from .strides import lost_layout, track as track_strides, view_needs_track
from .views import note_views
from . import autocast as _autocast
from .autocast import POLICY as _AUTOCAST
from .ops_table import checks, free_choice, pricing
from .ops_table.table import BY_FUNC, TABLE, on_change
from .dispatch_local import (VALIDATE, Ctx, as_dist, fallback as _fallback,  # noqa: F401
                             run_cells as _run_cells, wrap as _wrap)
from .placement import Replicate
from . import reshard_backward as _rb
from . import versions as _versions
from . import seq_order as _seq_order
from . import gather_backward_dist as _gbd
from .ops_table.strategy import NoRuleError, infer

__all__ = ["dispatch", "allow_replicate_fallback", "explain_hooks", "force_candidate"]


_FALLBACK = [False]
_HOOKS: list = []          # explain() listens here


@contextlib.contextmanager
def allow_replicate_fallback():
    """Ops with no rule run on gathered (replicated) inputs, recorded in the trace."""
    _FALLBACK.append(True)
    try:
        yield
    finally:
        _FALLBACK.pop()


_FORCE: list = []           # the validator: which candidate to run (see force_candidate)


@contextlib.contextmanager
def force_candidate(pick):
    """Run the candidate ``pick(decision)`` returns instead of the cheapest (a per-candidate
    validator forces each in turn); nothing is cached meanwhile."""
    _FORCE.append(pick)
    try:
        yield
    finally:
        _FORCE.remove(pick)


def _forced(entry, prep, inputs, specs, attrs, mesh):
    cand = _FORCE[-1](prep.dec)
    if cand is None or cand is prep.cand:
        return prep
    return _prepare(entry, prep.dec, inputs, specs, attrs, mesh, cand=cand)


@contextlib.contextmanager
def explain_hooks(fn):
    _HOOKS.append(fn)
    try:
        yield
    finally:
        _HOOKS.remove(fn)


def _spec_of(x, mesh):
    if isinstance(x, DistTensor):
        return x.spec
    if isinstance(x, torch.Tensor):
        return TensorSpec(x.shape, mesh, [Replicate()] * mesh.ndim, x.dtype)
    return None


_as_dist = as_dist


def _no_rule(func, args, kwargs, name):
    if _FALLBACK[-1]:
        return _fallback(func, args, kwargs)
    e = TABLE.get(name)
    if e is not None and e.rule is None and e.runs:
        raise NoRuleError(
            f"{name}() is in the op table but its SPMD rule was removed: register one with "
            f"@workbench.register_rule({name!r}) (see notebook 04)")
    fallback = ("run it inside `with workbench.allow_replicate_fallback():` to gather its "
                "inputs and run it replicated (recorded in the trace), or call it on the "
                "global tensors (`d.full_tensor()`)")
    table = ("add it to the op table with its callables, parse, rule, local implementation "
             "and cost (workbench.parallel.ops_table.table.register; tests/test_op_toy.py "
             "shows one)")
    if (name.endswith("_") and not name.startswith("__") or name == "__setitem__") and args \
            and isinstance(args[0], torch.Tensor) and not isinstance(args[0], DistTensor):
        # plain.copy_(dist): e.g. a plain module's load_state_dict of FSDP's state dict
        raise NoRuleError(
            f"{name}() writes into a plain torch.Tensor from a DistTensor: a plain tensor "
            "cannot take a DistTensor's layout (DTensor refuses mixed torch.Tensor and DTensor "
            "too); write its full value, t.copy_(d.full()) (DTensor's full_tensor()), or load "
            "a state dict of DistTensors into a plain module with "
            "wb.checkpoint.set_model_state_dict(module, sd), which gathers them")
    if e is not None and e.rule is not None:
        # register_rule alone makes a rule to study with wb.spmd.infer, not an op that runs
        raise NoRuleError(
            f"{name}() has a rule (from register_rule), but no op-table entry to run it: "
            f"wb.spmd.infer({name!r}, ...) can use the rule; to run the op on DistTensors, "
            f"{table}, write it from ops that have rules, or {fallback}")
    raise NoRuleError(
        f"{name}() has no SPMD rule for DistTensors: it is not in the op table. Write it "
        f"from ops that have rules (see notebook 04), {fallback}, or {table}")


def common_mesh(name: str, inputs):
    """The mesh the DistTensors among ``inputs`` live on (None if there are none); inputs
    on different meshes are refused, naming the fix."""
    mesh = None
    for x in inputs:
        if isinstance(x, DistTensor):
            if mesh is None:
                mesh = x.mesh
            elif x.mesh is not mesh and x.mesh != mesh:
                raise ValueError(f"{name}: inputs live on different meshes "
                                 f"({list(mesh.ranks)} and {list(x.mesh.ranks)}); reshard one "
                                 "onto the other's mesh first")
    return mesh


def _writes(func, args, kwargs):
    """Torch functions that write into a DistTensor (:mod:`.inplace`)."""
    from . import inplace
    if torch.is_autocast_enabled("cpu"):
        # torch.autocast casts out-of-place ops only: "In-place variants and calls that
        # explicitly supply an out=... Tensor ... won't go through autocasting" (torch.amp
        # docs); the out-of-place op computing the write must not be cast either
        with torch.autocast("cpu", enabled=False):
            return _writes(func, args, kwargs)
    if isinstance(kwargs.get("out"), DistTensor):
        return inplace.out_call(func, args, kwargs)
    if isinstance(kwargs.get("out"), torch.Tensor):
        return _plain_out(func, args, kwargs)
    if kwargs.get("out") is not None:
        raise TypeError(f"{getattr(func, '__name__', func)}(out={type(kwargs['out']).__name__})"
                        " with DistTensor inputs: give a DistTensor out, or assign the result")
    if getattr(func, "__module__", None) == "torch.nn.init":
        return inplace.init(func, args, kwargs)
    if args and isinstance(args[0], DistTensor):
        if kwargs.get("inplace") is True:
            return inplace.inplace_kwarg(func, args, kwargs)
        return inplace.method(args[0], func.__name__, args[1:], kwargs)
    return _no_rule(func, args, kwargs, getattr(func, "__name__", str(func)))


def _plain_out(func, args, kwargs):
    """``func(..., out=t)`` with DistTensor inputs and a plain tensor ``t`` (torch's
    ``parametrizations.spectral_norm`` power iteration: ``F.normalize(torch.mv(W, v),
    out=self._u)``, its buffer plain, W tensor-parallel: habits12, was a TypeError): each
    DistTensor input gathered whole (``full_tensor()``: an all-gather every rank joins) and
    torch's own ``func`` run into ``t``, as on one device (its resize, dtype and autograd
    rules: torch raises where an input requires grad)."""
    def whole(a):
        if isinstance(a, DistTensor):
            return a.full_tensor()
        if isinstance(a, (list, tuple)) and any(isinstance(b, DistTensor) for b in a):
            return type(a)(whole(b) for b in a)
        return a
    return func(*[whole(a) for a in args], **{k: whole(v) for k, v in kwargs.items()})


_NUMPY_NAMES = (("axis", "dim"), ("keepdims", "keepdim"))
_BUILTIN = (types.BuiltinFunctionType, types.MethodDescriptorType, types.WrapperDescriptorType)


def _numpy_names(func, kwargs):
    """torch.sum(x, axis=-1, keepdims=True): torch's argument parser takes NumPy's names
    for dim and keepdim on its C-bound functions and Tensor methods (torch/csrc/utils/
    python_arg_parser.cpp, numpy_compatibility_arg_names), not on Python ones (F.softmax);
    the parses name only torch's own. Both names given: left for the parse to refuse."""
    if not isinstance(func, _BUILTIN):
        return kwargs
    out = dict(kwargs)
    for np_name, name in _NUMPY_NAMES:
        if np_name in out and name not in out:
            out[name] = out.pop(np_name)
    return out


_AS = (torch.Tensor.view_as, torch.Tensor.reshape_as, torch.Tensor.expand_as,
       torch.Tensor.type_as)


def _plain_as(func, args, kwargs):
    """``t.view_as(d)`` (``reshape_as`` / ``expand_as`` / ``type_as``) of a plain ``t`` and
    a DistTensor ``d``: torch's op on ``t`` with ``d``'s global shape and dtype, a plain
    tensor, as torch's ``view_as`` of a DTensor (``self.view(other.size())``).  It raised
    AttributeError: no DistTensor among the op's inputs, so no mesh (habits7b: torch's
    ``vector_to_parameters`` over DistTensors, which then raises naming
    ``d.copy_(t)``)."""
    def like(d):
        if not isinstance(d, DistTensor):
            return d
        return torch.empty((), dtype=d.dtype).expand(tuple(d.shape))  # its shape, no bytes
    with torch._C.DisableTorchFunctionSubclass():
        return func(*[like(a) for a in args], **{k: like(v) for k, v in kwargs.items()})


def dispatch(func, args, kwargs):
    if func in _AS and args and not isinstance(args[0], DistTensor):
        return _plain_as(func, args, kwargs or {})
    if kwargs and ("axis" in kwargs or "keepdims" in kwargs):
        kwargs = _numpy_names(func, kwargs)
    if kwargs and (kwargs.get("out") is not None or kwargs.get("inplace") is True):
        return _writes(func, args, kwargs)
    hit = BY_FUNC.get(func)
    if (hit[0].name if hit is not None else getattr(func, "__name__", "")) in _AUTOCAST \
            and _autocast._any_enabled():           # (policy_for's None where none is on)
        kind = _autocast.policy_for(hit[0].name if hit is not None else func.__name__,
                                    args, kwargs or {})
        if kind == "off":                         # torch.autocast's policy (autocast.py)
            with torch.autocast("cpu", enabled=False):
                return dispatch(func, args, kwargs)
        if kind is not None:
            args, kwargs = _autocast.cast_args(kind, args, kwargs or {})
    if hit is None:
        name = getattr(func, "__name__", str(func))
        if name.endswith("_") and not name.startswith("_"):     # nn.init.*, torch.relu_
            return _writes(func, args, kwargs or {})
        if func in FACTORIES:                                   # zeros_like, new_zeros...
            out = FACTORIES[func](*args, **(kwargs or {}))
            if isinstance(out, DistTensor) and (out._gstride is not None or
                                                strides.lost_dims(out)):
                track_strides(func, args, kwargs, out)      # torch's: zeros_like keeps x's
            return out
        if func in COMPOSED:                           # allclose, equal, max, min
            return COMPOSED[func](*args, **(kwargs or {}))
        return _no_rule(func, args, kwargs or {}, name)
    entry, parse = hit
    form = entry.extra.get("other_form")          # torch.where(cond): nonzero's (datadep.py)
    if form is not None and (res := form(args, kwargs or {})) is not NotImplemented:
        return res
    if kwargs:
        inputs, attrs = parse(*args, **kwargs)
    else:
        kwargs = {}
        inputs, attrs = parse(*args)
    if entry.extra.get("data_dependent"):        # output size from the values
        from .dispatch_datadep import run_data_dependent
        return run_data_dependent(entry, inputs, attrs, _HOOKS,
                                  _FORCE[-1] if _FORCE else None)
    same = entry.extra.get("returns_self")        # x.to(x.dtype) is x (casts.py)
    if same is not None and isinstance(inputs[0], DistTensor) and same(inputs, attrs, kwargs):
        return inputs[0]
    mesh = None
    plain = False                  # a plain tensor or constant among the inputs
    nones = 0                      # None inputs (an absent bias): no spec, a None const
    for x in inputs:
        if type(x) is DistTensor:
            m = x.mesh
            if mesh is None:
                mesh = m
            elif m is not mesh and m != mesh:
                common_mesh(entry.name, inputs)         # raises, naming the fix
        elif x is None:
            nones += 1
        else:
            plain = True
    consts = ()                    # the types of constant inputs (type promotion differs)
    eager = False                  # reduced first from the values: eager's choice, forced or not
    if entry.name in ("mul", "div") and (plain and _unsafe_scale(entry.name, inputs)
                                         or _unsafe_factor(entry.name, inputs)) or \
            entry.op_class == "matmul" and _unsafe_factor(entry.name, inputs):
        inputs = _partials_reduced(inputs)
        # decided from the values at run time: no plan knew it, so a compiled program's
        # forced strategy (chosen for the Partial input) is not run on the reduced one (it
        # made the reduced value Partial again: O0 ``R * P(sum)`` gave P where eager gives
        # R, compile17b); the op runs as eager's, and the program goes on from that layout
        # (compile/lower.execute_program; the step says so: program_report.data_dependent).
        # Only for a pick that asks it (a compiled program's): a validator forcing each
        # candidate in turn still runs its own
        eager = bool(_FORCE) and getattr(_FORCE[-1], "eager_when_reduced", False)
    if plain:
        specs = []
        for x in inputs:
            s = x.spec if isinstance(x, DistTensor) else _spec_of(x, mesh)
            if s is None:
                consts += (type(x),)
            specs.append(s)
        specs = tuple(specs)
    elif nones:
        # what the plain path gives a None: spec None, its type among the constants
        specs = tuple([None if x is None else x._spec or x.spec for x in inputs])
        consts = (type(None),) * nones
    else:
        specs = tuple([x._spec or x.spec for x in inputs])
    tr = current_trace()
    key = (entry.name, specs, tuple(sorted(attrs.items())) if attrs else (),
           tr.profile.name if tr is not None else _DEFAULT_PROFILE, consts,
           _grads(inputs) if torch.is_grad_enabled() else ())
    prep = _PREPARED.get(key) if not _FORCE or eager else None
    if prep is None:
        if entry.rule is None:
            return _no_rule(func, args, kwargs, entry.name)
        # the checks run on meta tensors, not the program: hidden from dispatch modes (a
        # selective checkpoint must see the same ops in the forward and its recompute)
        with _disable_current_modes():
            prep = _first_call(func, args, kwargs, entry, inputs, specs, attrs, mesh, key,
                               eager)
        if prep is None:
            return _fallback(func, args, kwargs)
    if prep.int_summed:            # (rare) an integer partial sum meets another dtype
        inputs = _partials_reduced(inputs)
        specs = tuple(x.spec if isinstance(x, DistTensor) else _spec_of(x, mesh)
                      for x in inputs)
        key = key[:1] + (specs,) + key[2:]
        prep = _PREPARED.get(key) if not _FORCE or eager else None
        if prep is None:
            with _disable_current_modes():
                prep = _first_call(func, args, kwargs, entry, inputs, specs, attrs, mesh, key,
                                   eager)
            if prep is None:
                return _fallback(func, args, kwargs)
    fast = prep.fast
    if fast and tr is None and not _HOOKS:
        # run_prepared's path where it has nothing to do but run the local op and wrap its
        # output (facts of the layout, checked once: _fast_facts; per call, only what the
        # key does not hold: each input a DistTensor held as one tensor, with no global
        # strides kept and no ring order)
        locs = []
        grads = moved = None
        for x, d in zip(inputs, fast):
            if d is False:
                locs.append(x)                       # a constant (spec None)
            elif type(x) is DistTensor and type(x._local) is torch.Tensor and \
                    getattr(x, "_gstride", None) is None and \
                    getattr(x, "_ring_order", None) is None and \
                    not getattr(x, "_ring_also", ()):          # (slots unset: unpickled)
                loc = x._local
                if d is not True:
                    if type(d) is _Moved:
                        # its plan moves it (the row-parallel linear's bias, R -> P):
                        # run_prepared's own call for it (_moved_input), made below once
                        # every input has passed these checks
                        if moved is None:
                            moved = []
                        moved.append(len(locs))
                        locs.append(x)
                        continue
                    # replicated along mesh dims ``d`` (dim, ranks), every rank given a
                    # view (collectives.expand_replicas)
                    if _rb.KEY in loc.__dict__:
                        break
                    if loc.requires_grad and torch.is_grad_enabled():
                        # the gradient flows back through it: run_prepared's own call
                        # (reshard_backward.gather, else local_for_op's expand), made
                        # below once every input has passed these checks
                        if grads is None:
                            grads = []
                        grads.append(len(locs))
                        locs.append(x)
                        continue
                    shape = None
                    for i, n in d:
                        if loc.shape[i] == 1:
                            if shape is None:
                                shape = list(loc.shape)
                            shape[i] = n
                    if shape is not None:
                        loc = loc.expand(*shape)    # (ints: torch parses a list slower)
                locs.append(loc)
            else:
                break
        else:
            guard = None
            kernel_guard = entry.extra.get("detach_guard")
            if grads is not None:
                plans, expand = prep.cand.plans, prep.expand
                memos = prep.memos or (None,) * len(expand)
                label = prep.label or f"{entry.name} input"
                for k in grads:
                    x = locs[k]
                    loc = _rb.gather(x, plans[k], expand[k], mesh, True, label, memos[k])
                    if loc is None:
                        loc = _rb.local_for_op(x, plans[k], mesh, True, expand[k], label)
                    locs[k] = loc
                    if kernel_guard:                   # (its kernel asks: inplace18)
                        _versions.moved(x._local, loc)
                    else:
                        if guard is None:
                            guard = []
                        guard.append(x)
            if moved is not None:
                plans, expand = prep.cand.plans, prep.expand
                memos = prep.memos or (None,) * len(expand)
                label = prep.label or f"{entry.name} input"
                derived = [] if torch.is_grad_enabled() else None
                for k in moved:
                    x = locs[k]
                    locs[k] = loc = _moved_input(x, plans[k], expand[k], mesh, True, label,
                                                 memos[k])
                    if derived is not None and loc is not x._local:
                        derived.append((x._local, loc, _redo(x, plans[k], expand[k], mesh,
                                                             True, label, memos[k])))
                        if kernel_guard:
                            _versions.moved(x._local, loc)
                        else:
                            if guard is None:
                                guard = []
                            guard.append(x)
            else:
                derived = None
            o = entry.local(prep.nd, prep.ctx, *locs, **attrs)
            if derived:
                for src, loc, redo in derived:         # as run_prepared: after the op,
                    _versions.derive(src, loc, o, redo)    # whose node holds the handles
            if guard:
                for x in guard:                        # (x.detach_() later: inplace18)
                    _versions.guard_detach(o, (func, args, kwargs), x, x._local)
            if prep.keep:
                # run_prepared's keep: even shards, stacked, on simulated ranks
                if type(o) is torch.Tensor and not VALIDATE[-1]:
                    shape = o.shape
                    for i in prep.rep_axes[0]:
                        if shape[i] != 1:
                            o = o.narrow(i, 0, 1)
                else:
                    o = storage.keep_first_replica(
                        (o,), prep.cand.strategy.outputs, prep.out_shapes, locs, mesh,
                        check=VALIDATE[-1])[0]
            ps, shape, sp = prep.fast_out
            w = DistTensor(o, mesh, ps, shape, o.dtype)
            if w.dtype == sp.dtype:
                w._spec = sp
            if entry.op_class == "view" and isinstance(inputs[0], DistTensor):
                note_views(entry.name, inputs[0], (w,), attrs)   # as run_prepared
                if view_needs_track(func) or getattr(inputs[0], "_gstride", None) is not None:
                    track_strides(func, args, kwargs, w)      # torch's view strides (below)
            return w
    out = run_prepared(entry, prep, inputs, specs, attrs, mesh, tr, (func, args, kwargs))
    # the global strides, where the outputs' shards cannot tell them (or an input's were
    # kept: its shards may tell others): torch's, from meta tensors (strides.track)
    # a view's too: torch's strides of ``expand`` (0), a slice's step, ``diagonal``, which
    # dense strides in the shards' order misstated ((16, 4, 1) for (0, 4, 1): fsdpw17)
    track = prep.lost or (entry.op_class == "view" and view_needs_track(func))
    if not track:
        for x in inputs:
            if type(x) is DistTensor and getattr(x, "_gstride", None) is not None:
                track = True
                break
    if track:
        track_strides(func, args, kwargs, out)
    return out


def _unsafe_scale(name, inputs) -> bool:
    """A number by which a partial sum cannot be scaled part by part: inf or nan (each
    part becomes +-inf, their sum nan, where the sum times inf is +-inf), a divisor 0, or
    a floating partial sum times 0 (each part becomes a zero of its own sign, and +0 + -0
    is +0 where one device's v * 0 is -0 for v < 0: digamma / reciprocal / atan2 of it
    then differ, sweep wide seed 2005232)."""
    floating = []
    for k, x in enumerate(inputs):
        if type(x) is torch.Tensor and x.dim() == 0 and x.device.type == "cpu" and \
                x.dtype.is_floating_point:
            x = float(x)                # a 0-d tensor on the CPU is read (no device sync)
        if unsafe_number(name, k, x, floating, inputs):
            return True
    return False


def unsafe_number(name, k, x, floating, inputs=None) -> bool:
    """Whether number ``x``, input ``k`` of mul / div, makes :func:`_unsafe_scale` reduce
    the partial sum first.  ``floating``: [] (asked of ``inputs`` when needed, then kept)
    or [bool]: a floating partial sum among the inputs (a compiled program's plan asks it
    of the placements it chose: ``compile/int_partials.reduced_first``)."""
    if isinstance(x, float) and not math.isfinite(x):
        return True
    if isinstance(x, (int, float)) and x == 0:
        if name == "div" and k == 1:
            return True
        if name == "mul":
            if not floating:
                floating.append(any(_summed(y) and (y.dtype.is_floating_point or
                                                    y.dtype.is_complex) for y in inputs))
            return floating[0]
    return False


def _summed(x) -> bool:
    """A DistTensor partial on some mesh dim by sum or average (remembered per placements
    tuple: every matmul-class call asks it of each input, toy TP step)."""
    if not isinstance(x, DistTensor):
        return False
    ps = x.placements
    hit = _SUMMED.get(id(ps))
    if hit is not None and hit[0] is ps:
        return hit[1]
    got = any(p.is_partial() and p.reduce_op in ("sum", "avg") for p in ps)
    if type(ps) is tuple:               # (immutable: its answer stays its own)
        if len(_SUMMED) > 4096:
            _SUMMED.clear()
        _SUMMED[id(ps)] = (ps, got)     # holds ps: its id stays its own
    return got


_SUMMED: dict = {}     # id(placements) -> (placements, _summed's answer)


# the matmul-class ops (op_class "matmul") whose third input is a bias, not a factor
_BIASED = frozenset(("linear", "conv1d", "conv2d", "conv3d", "convolution"))


def _unsafe_factor(name, inputs) -> bool:
    """A tensor factor holding inf (a divisor holding 0) beside a partial sum: as for
    numbers (:func:`_unsafe_scale`), the partial sum is reduced first, which is exact (the
    local product refused it: ops_table/pointwise._scaled_local; seeds 1043842, 1044382,
    1044502).  The partial inputs are read too (``d * d`` reduces one of them: its value
    is the factor).  Values are read only where a partial sum or average is met.  The
    matmul-class ops (matmul, mm, bmm, linear, einsum, convolutions) are products too:
    ``x @ w`` with x P(sum) of parts a + b and w holding inf at (k, j) is a_ik inf + b_ik
    inf summed over the ranks, nan where a_ik and b_ik differ in sign, where one device
    gives x_ik inf = +-inf (sweep14; was nan for every matmul-class op and addmm / mv).

    Under torch.distributed each process reads its own shards: where a factor read is
    not replicated on every mesh dim (x [Partial, Replicate] times a [Replicate, Shard(0)]
    factor holding inf in one column), the processes decide together through the job's
    store (``agreed_reads.agree_any``), so all hold one placement, the simulator's (before,
    the processes holding the inf held a Replicate product, the others a Partial one).  Not
    by a collective: ``d * d`` runs inside reads one process may make alone (``if rank ==
    0: print(p.grad.norm())``), where an all-reduce paired with the peers' next collective
    (2e408050, reverted); through the store that read ends in agree's error naming the
    fix."""
    for x in inputs:
        if _summed(x):
            break
    else:
        return False
    # mul / div of a floating partial sum: a factor holding 0 (mul) or a divisor holding
    # inf gives zeros whose sign is the sum's, lost part by part (+0 + -0 = +0; seed 2005232
    # wide): reduced first too.  Not for matmul-class ops (their zeros are sums themselves)
    signed = name in ("mul", "div") and any(
        _summed(x) and (x.dtype.is_floating_point or x.dtype.is_complex) for x in inputs)
    found, local = False, False          # local: a value read differs between processes
    for k, x in enumerate(inputs):
        if name == "div" and k == 0 or k == 2 and name in _BIASED:
            continue                     # a dividend; a bias (added, not a factor)
        if isinstance(x, DistTensor) and not all(p.is_replicate() for p in x.placements):
            local = True
        if found:
            continue
        ts = storage.tensors(x._local) if isinstance(x, DistTensor) else \
            [x] if isinstance(x, torch.Tensor) else []
        # read for zeros: a divisor; a factor beside a floating partial sum (not the
        # partial sum's own parts: those of R -> P hold zeros on every rank but one)
        zeros = name == "div" or signed and not _summed(x)
        infs = name != "div" or signed            # read for +-inf: a factor, a divisor
        for t in ts:
            fl = t.is_floating_point() or t.is_complex()
            if not t.numel() or not (fl or zeros):
                continue
            hit = t == 0 if zeros else None
            if infs and fl:
                hit = torch.isinf(t) if hit is None else hit | torch.isinf(t)
            if hit is not None and bool(hit.any()):
                found = True
                break
    mesh = next(x.mesh for x in inputs if isinstance(x, DistTensor))
    if local and _B.is_distributed(mesh) and _B.rank() in mesh.ranks:
        found = _agreed_factor(name, inputs, mesh, found)
    return found


def _agreed_factor(name, inputs, mesh, found: bool) -> bool:
    """_unsafe_factor's answer agreed by every process of ``mesh`` (through the store)."""
    from ..sim_mesh.agreed_reads import agree_any
    from .reshard import unsummed_read
    what = how = None
    for x in inputs:                       # p.grad before opt.step(): readsync's words
        if isinstance(x, DistTensor) and (read := unsummed_read(x)) is not None:
            what, how = read[1], "summed over"
            break
    if what is None:
        what = (f"{name} of " + " and ".join(
            f"{tuple(x.shape)} {list(x.placements)}" if isinstance(x, DistTensor)
            else type(x).__name__ for x in inputs)
            + (" (whether a divisor holds 0" if name == "div" else " (whether a factor holds inf")
            + ": a partial sum is reduced first)")
        how = "decided together by"
    return agree_any(mesh.ranks, what, found, how)


def _partials_reduced(inputs):
    """The inputs with Partial sum / avg DistTensors reduced (a traced all-reduce)."""
    from .reshard import reshard
    out = []
    for x in inputs:
        if isinstance(x, DistTensor) and any(p.is_partial() and p.reduce_op in ("sum", "avg")
                                             for p in x.placements):
            x = reshard(x, x.mesh, [Replicate() if p.is_partial() else p for p in x.placements])
        out.append(x)
    return tuple(out)


def _int_summed(specs, out_dtypes) -> bool:
    """An integer Partial sum / avg input and an output of another dtype: the parts are
    sums modulo 2**bits (uint8 parts 255 + 2 hold 1), so each part promoted or widened
    (to float32 by ``* 1.5``, to int64 by ``sum()`` or ``+ int64``) and then summed is
    not the value's (uint8 P(sum) * 1.5: 769.5 for 1.5, sweep11): reduced first, as
    :func:`_unsafe_scale`'s numbers. Same-dtype ops (+, *, neg, matmul) stay modular:
    exact part by part."""
    for s in specs:
        if s is None or s.dtype.is_floating_point or s.dtype.is_complex or \
                s.dtype == torch.bool:
            continue
        if any(p.is_partial() and p.reduce_op in ("sum", "avg") for p in s.placements) and \
                any(d != s.dtype for d in out_dtypes):
            return True
    return False


def _grads(inputs) -> tuple:
    """Per input, whether it requires grad (grad mode on): the decision prices those
    inputs' reshards in backward too (``ops_table/strategy.backward_price``); () where
    none does.  A ``wb.reshard`` result with its way back (``reshard_backward.mark``,
    simulated or on torch.distributed: ``reshard_backward.way_of``, one rule for both, so
    both executors choose alike, tdway17) gives that way's key instead of True: its gradient goes back to the
    reshard's source once, whatever slice the op takes of it, and is priced so (a slice
    priced as an all-gather in backward made the chooser gather the other operand where
    DTensor slices it: tests/test_reshardbwd.py); with the gradient layouts its earlier
    readers noted (``_Way.key_with_uses``): a further slice is priced as what it adds to
    the one redistribution back, nothing where it slices as they did (chooser17)."""
    out = None
    for k, x in enumerate(inputs):
        if type(x) is DistTensor:
            loc = x._local
            plain = type(loc) is torch.Tensor
            rg = loc.requires_grad if plain and \
                "_wb_requires_grad_of" not in loc.__dict__ else x.requires_grad
            if rg:
                if out is None:
                    out = [False] * len(inputs)
                way = _rb.way_of(x) if plain and loc.__dict__ else None
                out[k] = way.key_with_uses if way is not None else True
    return () if out is None else tuple(out)


def _first_call(func, args, kwargs, entry, inputs, specs, attrs, mesh, key, eager=False):
    """The first call for an input layout: torch's own checks on meta tensors of the
    global shapes, the rule, the strategy (module docstring, 2.); None: the rule found no
    strategy and the replicate fallback is on.  ``eager``: the chooser's own strategy
    even where a candidate is forced (inputs reduced first from their values)."""
    theirs = checks.torch_meta_outputs(func, args, kwargs) if entry.meta_check else None
    forced = bool(_FORCE) and not eager
    try:
        # a new shape: free_choice's shortcut where a candidate moves nothing
        dec = infer(entry.name, *specs, _grads=key[-1], **attrs) if forced else \
            free_choice.choose(entry.name, specs, attrs, check=VALIDATE[-1], grads=key[-1])
    except NoRuleError:
        if _FALLBACK[-1]:
            return None
        raise
    prep = _prepare(entry, dec, inputs, specs, attrs, mesh)
    if theirs is not None:
        checks.check_outputs(entry.name, list(zip(prep.out_shapes, prep.out_dtypes)), theirs)
    prep.int_summed = _int_summed(specs, prep.out_dtypes)
    if forced:
        prep = _forced(entry, prep, inputs, specs, attrs, mesh)
    else:
        if len(_PREPARED) > 20000:
            _PREPARED.clear()
        _PREPARED[key] = prep
    return prep


_PREPARED: dict = {}
on_change(_PREPARED.clear)
# keyed by specs, whose meshes compare by value: a simulated mesh's prepared ops (its
# stacked layout, e.g. sequence parallelism's per-rank norm copies) are not the real one's
_B.on_register(_PREPARED.clear)


@dataclass
class _Prepared:
    dec: Any
    out_shapes: tuple
    even: bool
    expand: tuple          # per input: mesh axes to expand (replicated meeting per-rank work)
    cand: Any = None       # the candidate that runs (the decision's, or a forced one)
    out_dtypes: tuple = ()
    cost: Any = None       # the op's cost on the busiest rank (computed when first traced)
    ctx: Any = None        # the local implementation's Ctx (made on the first run)
    out_specs: Any = None  # the outputs' TensorSpecs (made on the first run): every call's
                           # outputs share them, so the next op's cache key hashes and
                           # compares them by identity, and no spec is built per call
    keep: bool = True      # keep_first_replica has work: an output replicated on some
                           # mesh dim, or uneven shards (cells to settle)
    lost: bool = False     # an output's shards cannot tell its strides (strides.lost_dims)
    int_summed: bool = False   # an integer P(sum) input meets another output dtype: reduce
    #                            it first (_int_summed)
    # per-call facts of the layout, computed once here (run_prepared's hot path):
    moves: tuple = ()      # per input: its plan moves data or it is expanded per rank
    rep_axes: Any = None   # per output: the mesh dims it is Replicate on (even shards only;
                           # None: storage.keep_first_replica's general path)
    label: str = ""        # "<op> input", the label of the inputs' collectives
    memos: tuple = ()      # per input: reshard_backward.gather's facts, by local lead shape
    fast: Any = None       # per input: True for a DistTensor, False for a constant, where
    #                        dispatch may run the op without run_prepared (_fast_facts)
    nd: int = 0            # the mesh's ndim (set with fast)
    fast_out: Any = None   # (placements, shape, spec) of the one output (set with fast)


def _is_even(cand, specs, out_shapes, mesh) -> bool:
    st = cand.strategy
    return all(layout.is_even(s.shape, mesh, req) for s, req in zip(specs, st.inputs)
               if s is not None and req is not None) and \
        all(layout.is_even(s, mesh, ps) for s, ps in zip(out_shapes, st.outputs))


def _prepare(opdef, dec, inputs, specs, attrs, mesh, cand=None) -> _Prepared:
    out_shapes, out_dtypes = _out_shapes(opdef, dec, inputs, attrs)
    cand = cand or dec.chosen
    # uneven shards run on both executors (torch.distributed pads its collectives,
    # sim_mesh/padded.py): the same candidate everywhere
    even = _is_even(cand, specs, out_shapes, mesh)
    st = cand.strategy
    expand = _rb.per_rank_dims(st, mesh.ndim)
    keep = not even or any(p.is_replicate() for ps in st.outputs for p in ps)
    lost = any(lost_layout(tuple(s), mesh.shape, tuple(ps)) for s, ps in zip(out_shapes, st.outputs))
    moves = tuple(bool(ax) or (plan is not None and bool(plan.steps))
                  for ax, plan in zip(expand, cand.plans))
    rep_axes = tuple(tuple(i for i, p in enumerate(ps) if isinstance(p, Replicate))
                     for ps in st.outputs) if even else None
    return _Prepared(dec, out_shapes, even, expand, cand, out_dtypes, keep=keep, lost=lost,
                     moves=moves, rep_axes=rep_axes, label=f"{opdef.name} input",
                     memos=tuple({} for _ in expand))


def _cost_of(opdef, prep, inputs, specs, attrs, mesh):
    if prep.cost is None:
        with _disable_current_modes():       # pricing on meta tensors, not the program
            prep.cost = pricing.local_cost(opdef, mesh, specs, inputs,
                                           prep.cand or prep.dec.chosen, prep.out_shapes,
                                           prep.out_dtypes, attrs)
    return prep.cost


# ops whose kernel saves its outputs for backward (a fused attention keeps O and the
# log-sum-exp: Dao 2023, Algorithm 1), so PyTorch's non-reentrant checkpoint, which stops
# its recompute once the last saved tensor is saved again (early stop, torch's default),
# stops AFTER their kernel ran: a selective recompute (checkpoint(attention_core)) re-runs
# the attention kernel, whose forward event the stop skipped (recorded below the local
# call).  An op saving its inputs only (a GEMM) stops before its kernel: nothing ran.
_SAVES_OUTPUTS = frozenset({"flash_attention", "scaled_dot_product_attention"})
_StopRecomputation = getattr(torch.utils.checkpoint, "_StopRecomputationError", ())


def _stopped_after_kernel(opdef, prep, inputs, specs, attrs, mesh, tr) -> None:
    """A checkpoint's recompute stopped inside ``opdef``'s local call: record its
    forward where its kernel ran (``_SAVES_OUTPUTS``)."""
    if opdef.name not in _SAVES_OUTPUTS:
        return
    if tr is False:
        tr = current_trace()
    if tr is not None:
        pricing.record_forward(tr, opdef, mesh, _cost_of(opdef, prep, inputs, specs, attrs,
                                                          mesh),
                               pricing.pricing_dtype(specs, prep.out_dtypes))


def _moves(cand, expand):
    return tuple(bool(ax) or (plan is not None and bool(plan.steps))
                 for ax, plan in zip(expand, cand.plans))


def _fast_facts(opdef, prep, specs, mesh, many):
    """``prep.fast``: per input, True (a DistTensor run as it is), False (a constant, spec
    None), ((mesh dim, ranks), ...) (a DistTensor expanded to one view per rank along
    those dims, no reshard) or a ``_Moved`` (a DistTensor its plan moves: run_prepared's
    own :func:`_moved_input` runs for it), where a call of this prepared op, untraced and
    unhooked, has nothing for run_prepared to do but lay out the inputs, run the local op
    on their local tensors and wrap its one output (dispatch's fast path): even shards on
    simulated ranks, the output's strides told by its shards, no integer partial sum to reduce
    (a view op's one output is noted as run_prepared notes it: views.note_views); else
    False.  Every fact read here is a fact of the layout (the cache
    key's specs and the mesh), the same on every call of ``prep``."""
    if many or not prep.even or prep.lost or prep.int_summed \
            or prep.ctx.coord is not None or _B.is_distributed(mesh) or \
            len(prep.out_specs) != 1 or prep.keep and prep.rep_axes is None or \
            not len(prep.moves) == len(prep.expand) == len(specs) == len(prep.cand.plans):
        return False
    kinds = []
    for s, plan, axes in zip(specs, prep.cand.plans, prep.expand):
        if s is None:
            kinds.append(False)
        elif plan is not None and plan.steps:
            # moved by its plan (the row-parallel linear's bias, R -> P over tp)
            kinds.append(_Moved(axes))
        elif axes:
            if not all(type(a) is int and 0 <= a < mesh.ndim for a in axes):
                return False
            kinds.append(tuple((a, mesh.shape[a]) for a in axes))
        else:
            kinds.append(True)
    return tuple(kinds)


def _moved_input(t, plan, axes, mesh, even, label, memo):
    """The local tensor an op runs on for DistTensor input ``t``, which its ``plan``
    moves or which is expanded per rank along mesh dims ``axes`` (run_prepared's, and
    dispatch's fast path's for an input its plan moves: one code for both)."""
    if _rb.KEY in getattr(t._local, "__dict__", ()):
        # a reshard's gathered result: its gradient's way back recorded as one
        # redistribution (reshard_backward.py)
        loc = _rb.convert(t, plan, axes, mesh, even, label)
        if loc is not None:
            return loc
    elif axes or _gbd.KEY in getattr(t._local, "__dict__", ()):
        # the op gives every rank a view of one copy (gathered by its own reshard, or
        # replicated): the gradient's way back recorded once per input, as DTensor's
        # (reshard_backward.gather; on torch.distributed gather_backward_dist.gather, and
        # .use_marked for a wb.reshard result, per rank or sliced, as _rb.convert above)
        loc = None
        own = storage.holds_own(mesh)
        if own and _gbd.KEY in getattr(t._local, "__dict__", ()):
            loc = _gbd.use_marked(t, plan, axes, mesh, even, label)
        if loc is None and axes:
            loc = _gbd.gather(t, plan, axes, mesh, even, label) if own else \
                _rb.gather(t, plan, axes, mesh, even, label, memo)
        if loc is not None:
            return loc
    return _rb.local_for_op(t, plan, mesh, even, axes, label)


def _redo(x, plan, axes, mesh, even, label, memo):
    """``x``'s move for an op run again on its present values (versions.derive's ``redo``:
    a write through ``x.data`` after the op read the copy), None where ``x`` is gone or
    holds other local tensors since."""
    xr, src = weakref.ref(x), x._local
    sr = weakref.ref(src) if type(src) is torch.Tensor else None

    def redo():
        x = xr()
        if x is None or sr is None or x._local is not sr():
            return None
        return _moved_input(x, plan, axes, mesh, even, label, memo)
    return redo


class _Moved(tuple):
    """``prep.fast``'s kind of an input its plan moves: the mesh dims it is expanded
    along after (dispatch's fast path runs :func:`_moved_input` for it)."""
    __slots__ = ()


def run_prepared(opdef, prep, inputs, specs, attrs, mesh, tr=False, call=None):
    dec = prep.dec
    cand = prep.cand or dec.chosen
    for x in inputs:               # positions read in ring order: refused (seq_order.py)
        if type(x) is DistTensor and (getattr(x, "_ring_order", None) is not None
                                      or getattr(x, "_ring_also", ())):
            _seq_order.check_op(opdef, inputs, specs, cand.plans, attrs)
            break
    outs_ps = cand.strategy.outputs
    even = prep.even
    locs = []
    redos = {}
    label = prep.label or f"{opdef.name} input"
    memos = prep.memos or (None,) * len(prep.expand)
    for x, spec, plan, axes, moves, memo in zip(inputs, specs, cand.plans, prep.expand,
                                                prep.moves or _moves(cand, prep.expand),
                                                memos):
        if spec is None:
            locs.append(x)
            continue
        if type(x) is not DistTensor:
            t = _as_dist(x, mesh)
        elif not moves:
            t = x
            loc = t._local
            if even and type(loc) is torch.Tensor:  # as it is: _rb.local_for_op's answer
                locs.append(loc)
                continue
        else:
            locs.append(loc := _moved_input(x, plan, axes, mesh, even, label, memo))
            if torch.is_grad_enabled() and loc is not x._local:
                if opdef.extra.get("detach_guard"):
                    _versions.moved(x._local, loc)     # (read by the kernel: inplace18)
                redos[len(locs) - 1] = _redo(x, plan, axes, mesh, even, label, memo)
            continue
        locs.append(_rb.local_for_op(t, plan, mesh, even, axes, label))
    out_shapes = prep.out_shapes
    ctx = prep.ctx
    if ctx is None:
        # the input layouts after the plans: the same for every call of this prepared op
        in_specs = tuple(None if spec is None else
                         spec if plan is None or not plan.steps else
                         TensorSpec(spec.shape, mesh, plan.dst, spec.dtype, _trusted=True)
                         for spec, plan in zip(specs, cand.plans))
        ctx = Ctx(mesh, in_specs, outs_ps, out_shapes,
                  coord=storage.own_coord(mesh))   # None on simulated ranks
        if not _FORCE:
            prep.ctx = ctx
    try:
        if even or ctx.coord is not None:      # (one process's shard: one cell)
            out = opdef.local(mesh.ndim, ctx, *locs, **attrs)
        else:
            out = _run_cells(opdef, ctx, locs, attrs, outs_ps, mesh)
    except _StopRecomputation:
        _stopped_after_kernel(opdef, prep, inputs, specs, attrs, mesh, tr)
        raise
    if torch.is_grad_enabled():
        # an input read through a copy (moved by its plan): a later write into the input
        # bumps the copy's version too, as torch's saved input would be (versions.py)
        for i, (x, loc) in enumerate(zip(inputs, locs)):
            if type(x) is DistTensor and loc is not x._local:
                _versions.derive(x._local, loc, out, redos.get(i))
                # a later x.detach_(): raised where one device's op saves x (inplace18;
                # ``call``: dispatch's func, args, kwargs), unless the kernel asks itself
                if not opdef.extra.get("detach_guard"):
                    _versions.guard_detach(out, call, x, x._local)
    many = opdef.multi or opdef.n_out > 1
    outs = out if many else (out,)
    if tr is False:                # (dispatch passes the trace it read)
        tr = current_trace()
    cost = None
    if tr is not None or _HOOKS:
        cost = _cost_of(opdef, prep, inputs, specs, attrs, mesh)
    if tr is not None:
        dtype = pricing.pricing_dtype(specs, prep.out_dtypes)
        pricing.record_forward(tr, opdef, mesh, cost, dtype)
        if torch.is_grad_enabled():
            outs = pricing.on_backward(outs, opdef, mesh, cost, dtype,
                                       pricing.needs_grad(locs), inputs=locs)
    # cells of an even layout stacked again; a replicated output computed per rank kept
    # once (under VALIDATE, ranks that computed different copies raise).  Nothing to do
    # where every output is sharded or partial on every mesh dim and the shards are even.
    if prep.keep:
        rep = prep.rep_axes
        kept = None
        if rep is not None and not VALIDATE[-1] and not _B.is_distributed(mesh):
            # even shards, stacked: storage._first_copy of each output, unchecked
            kept = []
            for o, axes in zip(outs, rep):
                if type(o) is not torch.Tensor:
                    kept = None
                    break
                shape = o.shape
                for i in axes:
                    if shape[i] != 1:
                        o = o.narrow(i, 0, 1)
                kept.append(o)
        outs = tuple(kept) if kept is not None else storage.keep_first_replica(
            outs, outs_ps, out_shapes, locs, mesh, check=VALIDATE[-1])
    out_specs = prep.out_specs
    if out_specs is None:
        out_specs = tuple(TensorSpec(s, mesh, ps, dt, _trusted=True)
                          for s, ps, dt in zip(out_shapes, outs_ps, prep.out_dtypes))
        if not _FORCE:
            prep.out_specs = out_specs
    if not many:
        o = outs[0]
        wrapped = (DistTensor(o, mesh, outs_ps[0], out_shapes[0], o.dtype),)
    else:
        wrapped = tuple(_wrap(o, mesh, ps, s) for o, ps, s in zip(outs, outs_ps, out_shapes))
    for w, sp in zip(wrapped, out_specs):
        if w.dtype == sp.dtype:
            w._spec = sp          # the spec DistTensor.spec would build, shared
    if opdef.op_class == "view" and isinstance(inputs[0], DistTensor):
        note_views(opdef.name, inputs[0], wrapped, attrs)    # x[0].zero_() reaches x
    for x in inputs:               # a sequence in ring order stays so (seq_order.py)
        if type(x) is DistTensor and getattr(x, "_ring_order", None) is not None:
            _seq_order.propagate(inputs, specs, cand.plans, outs_ps, out_shapes, wrapped)
            break
    for x in inputs:               # and the other dims in that order (seq_order.py)
        if type(x) is DistTensor and (getattr(x, "_ring_order", None) is not None
                                      or getattr(x, "_ring_also", ())):
            _seq_order.propagate_whole(opdef, inputs, out_shapes, wrapped, attrs)
            break
    for h in _HOOKS:
        h(dec, specs, wrapped, cost)
    if prep.fast is None and not _FORCE and prep.ctx is not None and \
            prep.out_specs is not None:
        prep.fast = _fast_facts(opdef, prep, specs, mesh, many)
        prep.nd = mesh.ndim
        if prep.fast:                # one output (an unbind of a size-0 dim has none)
            prep.fast_out = (outs_ps[0], out_shapes[0], out_specs[0])
    if not many:
        return wrapped[0]
    result_type = opdef.extra.get("result_type") if hasattr(opdef, "extra") else None
    return result_type(wrapped) if result_type is not None else wrapped


from ..sim_mesh.profiles import DEFAULT_PROFILE as _DEFAULT_PROFILE  # noqa: E402


_OUT_SHAPES: dict = {}   # (local, multi, n_out, inputs, attrs, global state) -> result
on_change(_OUT_SHAPES.clear)


def _out_shapes(opdef, dec, inputs, attrs):
    """The outputs' global shapes and dtypes: the local implementation on meta tensors of
    the global shapes (no mesh: ``nd`` 0).  Memoized on what that call reads (the
    inputs' shapes and dtypes, constants by type and value, the attributes, the default
    dtype), not on placements: every layout of the same shapes asks again."""
    # (only top-level tensors and constants are memoized: a tensor elsewhere, in a list or
    # an attribute, is not)
    key = None
    if all(isinstance(x, (DistTensor, torch.Tensor)) or type(x) in checks.ATOMS
           for x in inputs):
        sa = checks.signature(tuple(inputs))
        sk = checks.signature(tuple(sorted(attrs.items())), tensors=False) if attrs else ()
        if sa is not None and sk is not None:
            key = (opdef.local, opdef.multi, opdef.n_out, sa, sk, torch.get_default_dtype(),
                   torch.is_grad_enabled())
    try:
        hit = _OUT_SHAPES.get(key) if key is not None else None
    except TypeError:                    # an unhashable value after all
        key = hit = None
    if hit is not None:
        return hit
    # on meta tensors of the global shapes; a meta error judged again by eager
    out = checks.on_meta(lambda *xs: opdef.local(0, None, *xs, **attrs), inputs)
    outs = out if (opdef.multi or opdef.n_out > 1) else (out,)
    res = tuple(torch.Size(o.shape) for o in outs), tuple(o.dtype for o in outs)
    if key is not None:
        if len(_OUT_SHAPES) > 4096:
            _OUT_SHAPES.clear()
        _OUT_SHAPES[key] = res
    return res
