"""Capture by ``torch.export``: the ATen graph of a program, mapped onto the op table.

``torch.export.export(module, args, strict=False)`` runs the program on fake tensors
(here made from meta inputs, parameters and buffers: no data moves) and returns an
``ExportedProgram`` whose graph calls ATen overloads (``aten.linear.default``,
``aten.softmax.int``; a buffer is a constant of the graph, the module's own tensor).
Each is mapped to the torch callable of an op-table entry with the arguments that
callable takes (:data:`ADAPT`; most ATen signatures are the torch
function's, a few differ: ``aten.embedding(weight, ids)`` is ``F.embedding(ids,
weight)``), and the mapping is checked on meta tensors against the shape export
recorded.  An op with no mapping raises :class:`Unmapped` (capture then traces instead).
A data-dependent guard is a graph break, with the source line export reports.
"""
from __future__ import annotations

import contextlib
import io
import logging
import operator
import warnings

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn

from ..parallel.dist_tensor import DistTensor
from ..parallel.ops_table.table import BY_FUNC
from .graph import Graph, Node, Ref
from .capture import Broken, _meta_like, break_from_export_error, _swap, meta_twins, \
    meta_buffers
from .export_consts import Const, Env, node_args, view_of_const
from .export_ops import ADAPT as _KEPT_WHOLE, Unmapped, kept_whole
from .reads import amp_state

__all__ = ["capture_export", "Unmapped", "ADAPT"]

aten = torch.ops.aten
T = torch.Tensor


def _same(func):
    return lambda args, kwargs: (func, args, kwargs)


def _embedding_kw(a, k):
    """aten.embedding(weight, indices, padding_idx=-1, scale_grad_by_freq, sparse) as
    F.embedding's keywords (the padding row gets no gradient: it must not be dropped)."""
    names = ("padding_idx", "scale_grad_by_freq", "sparse")
    got = dict(zip(names, a[2:]), **{n: k[n] for n in names if n in k})
    if got.get("padding_idx", -1) == -1:
        got.pop("padding_idx", None)
    return {n: v for n, v in got.items() if v or n == "padding_idx"}


def _slice(a, k):
    """aten.slice(x, dim=0, start=None, end=None, step=1) as ``x[..., start:end:step, ...]``
    (a negative dim counted from the end: an Ellipsis before it)."""
    names = ("dim", "start", "end", "step")
    got = dict(zip(names, a[1:]), **{n: k[n] for n in names if n in k})
    dim = got.get("dim", 0)
    sl = slice(got.get("start"), got.get("end"), got.get("step", 1))
    idx = (slice(None),) * dim + (sl,) if dim >= 0 else (Ellipsis, sl) + (slice(None),) * (-dim - 1)
    return T.__getitem__, (a[0], idx), {}


_REDUCTION = {0: "none", 1: "mean", 2: "sum"}    # at::Reduction (aten/src/ATen/core/Reduction.h)


def _cross_entropy(a, k):
    """aten.cross_entropy_loss(x, target, weight=None, reduction=1, ignore_index=-100,
    label_smoothing=0.0) as F.cross_entropy's keywords."""
    names = ("weight", "reduction", "ignore_index", "label_smoothing")
    got = dict(zip(names, a[2:]), **{n: k[n] for n in names if n in k})
    if got.pop("weight", None) is not None:
        raise Unmapped("aten.cross_entropy_loss with class weights (tracing composes it)")
    if "reduction" in got:
        got["reduction"] = _REDUCTION[got["reduction"]]
    return F.cross_entropy, a[:2], got


# ATen overload -> (args, kwargs) -> (torch callable, args, kwargs)
ADAPT = {
    aten.linear.default: _same(F.linear),
    aten.matmul.default: _same(torch.matmul),
    aten.mm.default: _same(torch.mm),
    aten.bmm.default: _same(torch.bmm),
    aten.relu.default: _same(torch.relu),
    aten.gelu.default: lambda a, k: (F.gelu, a, k),
    aten.silu.default: _same(F.silu),
    aten.tanh.default: _same(torch.tanh),
    aten.sigmoid.default: _same(torch.sigmoid),
    aten.exp.default: _same(torch.exp),
    aten.neg.default: _same(torch.neg),
    aten.rsqrt.default: _same(torch.rsqrt),
    aten.sqrt.default: _same(torch.sqrt),
    aten.add.Tensor: _same(torch.add),
    aten.sub.Tensor: _same(torch.sub),
    aten.mul.Tensor: _same(torch.mul),
    aten.div.Tensor: _same(torch.div),
    aten.pow.Tensor_Scalar: _same(torch.pow),
    aten.softmax.int: lambda a, k: (torch.softmax, a[:2], {"dtype": a[2]} if len(a) > 2 else {}),
    aten.log_softmax.int: lambda a, k: (torch.log_softmax, a[:2],
                                        {"dtype": a[2]} if len(a) > 2 else dict(k)),
    aten.layer_norm.default: lambda a, k: (F.layer_norm, a[:5], {}),
    aten.rms_norm.default: lambda a, k: (F.rms_norm, a[:4], {}),
    aten.embedding.default: lambda a, k: (F.embedding, (a[1], a[0]), _embedding_kw(a, k)),
    aten.t.default: _same(T.t) if T.t in BY_FUNC else None,
    aten.transpose.int: _same(torch.transpose),
    aten.view.default: _same(T.view),
    aten.reshape.default: _same(torch.reshape),
    aten.sum.dim_IntList: _same(torch.sum),
    aten.sum.default: _same(torch.sum),
    aten.mean.dim: _same(torch.mean),
    aten.mean.default: _same(torch.mean),
    aten.unsqueeze.default: _same(torch.unsqueeze),
    aten.permute.default: _same(torch.permute),
    aten.cat.default: _same(torch.cat),
    aten.split.Tensor: _same(torch.split),
    aten.masked_fill.Scalar: _same(torch.masked_fill),
    aten.chunk.default: _same(torch.chunk),
    aten.clone.default: _same(torch.clone),
    aten.slice.Tensor: _slice,
    aten.cross_entropy_loss.default: _cross_entropy,
    aten.dropout.default: lambda a, k: (F.dropout, (a[0], a[1], a[2]), {}),
    aten.scaled_dot_product_attention.default: _same(F.scaled_dot_product_attention),
}
ADAPT = {k: v for k, v in ADAPT.items() if v is not None}
ADAPT.update(_KEPT_WHOLE)       # wb.ops kept whole: torch.ops.workbench.* (export_ops.py)


@contextlib.contextmanager
def _quiet():
    """torch.export logs its guards and the graph it gave up on (the error carries what
    we report): keep the notebook's output to our own report."""
    old = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    sink = io.StringIO()
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            yield
    finally:
        logging.disable(old)


class _Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


@contextlib.contextmanager
def _inference_mode_seen():
    """Yields a list that holds True once the program entered ``torch.inference_mode()``:
    export keeps no trace of it (its ops come out as if gradients were on: the output
    required grad where eager's does not), so such a program is traced instead, which
    records the region's ops as called without gradients."""
    cls = torch.autograd.grad_mode.inference_mode
    orig, seen = cls.__dict__["__enter__"], []

    def enter(self):
        if self.mode:
            seen.append(True)
        return orig(self)
    cls.__enter__ = enter
    try:
        yield seen
    finally:
        cls.__enter__ = orig


def capture_export(fn, args, watch=None):
    if any(isinstance(a, (list, tuple, dict)) for a in args):
        raise Unmapped("an argument is a list, tuple or dict (export flattens it)")
    module = fn if isinstance(fn, nn.Module) else _Fn(fn)
    g = Graph(method="export")
    placements = {}
    margs = [(_meta_like(a, bool(getattr(a, "requires_grad", False)))
              if isinstance(a, (DistTensor, torch.Tensor)) else a) for a in args]
    with meta_twins(module) as rows, meta_buffers(module) as buffers:
        by_name = {full: p for full, p, _, _ in rows}   # every name, tied ones too
        try:
            with _quiet(), warnings.catch_warnings(), kept_whole():
                # export's own advice (e.g. "tensor attributes assigned during export"):
                # capture reports what it does with such code itself (guards.py)
                warnings.simplefilter("ignore", UserWarning)
                with _inference_mode_seen() as inference, \
                        (watch() if watch is not None else contextlib.nullcontext()):
                    ep = torch.export.export(module, tuple(margs), strict=False)
        except Exception as e:               # noqa: BLE001 (what export says is the report)
            brk = break_from_export_error(e)
            if brk is not None:
                raise Broken(brk) from None
            raise Unmapped(f"torch.export failed ({type(e).__name__}: "
                           f"{str(e).splitlines()[0][:120] if str(e) else ''})") from None
    if inference:
        raise Unmapped("torch.inference_mode() inside the program (export drops it)")
    sig = ep.graph_signature
    env = Env()                 # fx node name -> Ref (or tuple of Refs)
    metas = {}                   # vid -> meta tensor
    buffer_vids = {}             # id(buffer) -> its const vid
    user_i = 0
    from torch.export.graph_signature import InputKind
    specs = {s.arg.name: s for s in sig.input_specs}
    # values numbered as tracing numbers them: the inputs, the parameters, then each
    # constant where it is first read (export lists parameters and buffers first)
    first = {InputKind.USER_INPUT: 0, InputKind.PARAMETER: 1}
    holders = sorted((n for n in ep.graph.nodes if n.op == "placeholder"),
                     key=lambda n: first.get(specs[n.name].kind, 2))
    for node in holders:
        s = specs[node.name]
        val = node.meta.get("val")
        if s.kind == InputKind.PARAMETER:
            name = s.target
            p = by_name[name]
            vid = g.value(val.shape, val.dtype, "param", name,
                          requires_grad=bool(p.requires_grad))
            g.params[name] = vid
            placements[vid] = (p.mesh, tuple(p.placements)) if isinstance(p, DistTensor) else p
        elif s.kind == InputKind.USER_INPUT:
            # export's user inputs are the arguments one by one (nested ones refused
            # above); a Python value is a constant of the graph
            a = args[user_i]
            user_i += 1
            if not isinstance(a, (DistTensor, torch.Tensor)):
                env[node.name] = a
                continue
            vid = g.value(val.shape, val.dtype, "input", f"arg{user_i - 1}",
                          requires_grad=bool(getattr(a, "requires_grad", False)))
            g.inputs.append(vid)
            placements[vid] = (a.mesh, tuple(a.placements)) if isinstance(a, DistTensor) else a
        else:                   # buffers and constant tensors
            # (a buffer was exported as its meta twin: the graph holds the module's
            # own; one registered on two modules is one constant, as tracing makes it)
            data = buffers[s.target].detach() if s.target in buffers else \
                ep.state_dict.get(s.target) if s.target in ep.state_dict \
                else ep.constants.get(s.target)
            if not isinstance(data, torch.Tensor) or data.is_meta:
                # (a torch.Generator the program draws from is lifted as a constant
                # too: tracing then names the random draw)
                raise Unmapped(f"constant {s.target!r} has no data" if data is None or
                               isinstance(data, torch.Tensor) else
                               f"constant {s.target!r} is a {type(data).__name__}")
            key = id(buffers[s.target]) if s.target in buffers else None
            env.later[node.name] = Const(g, metas, buffer_vids, data, s.target, key)
            continue
        env[node.name] = Ref(vid)
        metas[vid] = torch.empty(val.shape, dtype=val.dtype, device="meta")
    for node in ep.graph.nodes:
        if node.op == "placeholder":
            continue
        elif node.op == "call_function":
            if node.target is operator.getitem:
                env[node.name] = env[node.args[0].name][node.args[1]]
                continue
            if node.target in _FACTORIES and not node.all_input_nodes:
                env.later[node.name] = _factory_const(g, node, metas)
            elif not view_of_const(g, node, env, metas, ADAPT):
                _map_node(g, node, env, metas)
        elif node.op == "output":
            outs = node.args[0]
            kinds = {str(o.kind).rsplit(".", 1)[-1] for o in sig.output_specs}
            if kinds != {"USER_OUTPUT"} and outs:
                raise Unmapped(f"the exported graph returns {sorted(kinds)} besides the "
                               "program's outputs (a write to a buffer or an input)")
            refs = [env[o.name] if hasattr(o, "name") else o for o in outs]
            # export flattens the result: its out_spec gives back the program's own
            # structure (a dict, a list, a 1-tuple, nested), as eager returns it
            g.output = pytree.tree_unflatten(refs, ep.call_spec.out_spec)
    return g, placements


# A tensor made from Python numbers alone (the GPT's ``torch.arange(S)`` positions): a
# constant of the graph, as tracing holds it (the same values on every call)
_FACTORIES = (aten.arange.default, aten.arange.start, aten.arange.start_step)


def _factory_const(g, node, metas):
    from .export_consts import Const
    kwargs = dict(node.kwargs)
    if kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "meta":
        kwargs["device"] = "cpu"          # (made on the meta twins' device during export)
    with torch.no_grad():
        data = node.target(*node.args, **kwargs)
    return Const(g, metas, {}, data, f"const ({node.name})")


def _map_node(g, node, env, metas):
    ad = ADAPT.get(node.target)
    if ad is None:
        raise Unmapped(f"{node.target} has no op-table entry")
    func, args, kwargs = ad(*node_args(node, env))
    hit = BY_FUNC.get(func)
    if hit is None:
        raise Unmapped(f"{node.target} maps to {func}, which has no op-table entry")
    entry, parse = hit
    from .graph import map_refs
    margs = map_refs(args, lambda r: metas[r.vid])
    mkw = map_refs(kwargs, lambda r: metas[r.vid])
    out = func(*margs, **mkw)
    val = node.meta.get("val")
    outs_t = out if isinstance(out, (tuple, list)) else (out,)
    vals = val if isinstance(val, (tuple, list)) else (val,)
    if len(outs_t) != len(vals) or any(tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype
                                       for a, b in zip(outs_t, vals)):
        raise Unmapped(f"{node.target} mapped to {getattr(func, '__name__', func)} gives "
                       "another shape or dtype than export recorded")
    ins, attrs = parse(*margs, **mkw)
    ids = {id(t): vid for vid, t in metas.items()}
    inputs = tuple(ids.get(id(x)) if isinstance(x, torch.Tensor) else None for x in ins)
    if any(isinstance(x, torch.Tensor) and id(x) not in ids for x in ins):
        raise Unmapped(f"{node.target}: an input is not a traced tensor")
    nid = len(g.nodes)
    outs = []

    def new(t):
        vid = g.value(t.shape, t.dtype, "op", f"{entry.name}_{nid}", nid,
                      bool(t.requires_grad) or any(
                          i is not None and g.values[i].requires_grad for i in inputs))
        metas[vid] = torch.empty(t.shape, dtype=t.dtype, device="meta")
        outs.append(vid)
        return Ref(vid)
    tree = _swap(out, new)
    env[node.name] = tree
    st = node.meta.get("stack_trace") or ""
    src = ""
    lines = [ln.strip() for ln in st.strip().splitlines()]
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("File "):
            import re
            m = re.match(r'File "([^"]+)", line (\d+)', lines[i])
            code = lines[i + 1] if i + 1 < len(lines) else ""
            if m:
                import os
                src = f"{os.path.basename(m.group(1))}:{m.group(2)}  {code}"
            break
    g.nodes.append(Node(nid, entry.name, func, args, kwargs, inputs, dict(attrs), tuple(outs),
                        tree, src, in_consts=tuple(None if isinstance(x, torch.Tensor) else x
                                                   for x in ins),
                        amp=amp_state()))     # the caller's autocast: export keeps no cast
