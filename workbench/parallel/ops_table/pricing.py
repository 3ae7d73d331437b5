"""Compute events on the trace: every op the dispatcher runs is priced from its entry's
cost on the local (per-rank) shapes of the busiest rank, forward when it runs and
backward when its gradient passes (an identity autograd node on its outputs, as the
backward collectives are recorded in ``sim_mesh/collectives.py``).

The roofline time is ``workbench.sim_mesh.cost.compute_time(flops, bytes, profile,
dtype, op_class=...)``. The dtype priced is the op's floating-point dtype (its first
floating input, else output). An op with no floating tensor at all (integer compares,
index arithmetic) has no peak of its own in the profiles: it is priced at the float32
peak, with its bytes at their real element size. A matmul's GEMMs carry their output
shapes, so that the clock prices their tile and wave quantization as ``plan.layer_cost``
does (``cost.gemm_efficiency``).

A matmul's backward is two GEMMs, as in PyTorch's and Megatron-LM's autograd: first the
input gradient ("dgrad", dA = dC B^T: the forward's multiply-adds again; it reads dC and
B and writes dA), then the weight gradient ("wgrad", dB = A^T dC: the rest of the op's
backward FLOPs and bytes, reading A and writing dB), then, with a bias, its gradient,
the sum of dC over its rows ("bias": a reduction kernel of its own that reads dC and
writes dbias, one FLOP an element of C).  The GEMMs partition the op's backward
FLOPs and bytes less the bias's sum exactly, the bias's sum adds its second read of dC
(:class:`SplitCost`); each is a kernel priced on its own roofline with its launch (as
``plan.layer_cost`` prices them), recorded one after the other, so that a collective on
the input gradient can run beside the wgrad and the bias's sum (:func:`wgrad_overlap`;
Megatron-LM's ``LinearWithGradAccumulationAndAsyncCommunication``:
``strategies.tensor_parallel``).

Autograd computes only the gradients that are needed (``ctx.needs_input_grad``; aten's
``linear``/``addmm``/``mm`` backward formulas are each guarded by their input's mask,
``convolution_backward`` takes an ``output_mask``): the input gradient of data that does
not require grad (the first layer's input) and the weight gradient of a frozen weight
(``requires_grad=False``, ``detach()``) are never run. :func:`backward_parts` is the one
place that says which of an op's backward kernels run for which inputs needing grad; the
dispatcher records those (:func:`on_backward` with ``needs``) and ``compile.kernels``
counts the same. The GEMMs read the gradient of the output once, by the first that runs.
A split backward (zero-bubble ``B`` and ``W``) prices in each pass only the GEMMs it runs
(:mod:`.backward_split`), and nothing twice (``sim_mesh.backward_pass``).

A cost that knows its kernel's measured time on a profile (``cost.measured(profile)``:
the loss, ``loss_pricing.LossCost``) is priced so where the profile measured it.
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch

from ...sim_mesh import cost as _cost
from ...sim_mesh.backward_pass import in_weight_pass
from ...sim_mesh.profiles import get_profile
from ...sim_mesh.trace import current_trace
from .. import layout, storage
from . import backward_split, linear_regather
from .costs import Cost

__all__ = ["local_cost", "record_forward", "on_backward", "pricing_dtype", "SplitCost",
           "record_backward_now", "wgrad_overlap", "graph_sink", "backward_parts", "needs_grad",
           "part_class"]


@dataclass(frozen=True)
class SplitCost(Cost):
    """A matmul's :class:`Cost` with the share of its backward that is the input
    gradient (module docstring); the weight gradient is the rest."""
    dgrad_flops: int = 0
    dgrad_bytes: int = 0
    # the GEMMs' outputs as (batch, rows, columns), for tile and wave quantization
    # (``cost.gemm_efficiency``): forward C, dgrad dA, wgrad dB; None: not a plain GEMM
    gemm: "tuple | None" = None
    dgrad_gemm: "tuple | None" = None
    wgrad_gemm: "tuple | None" = None
    # the output gradient's bytes (read by the dgrad, or by the first GEMM that runs),
    # and a bias's gradient (third input: the sum of dC over its rows, one FLOP
    # per element of C; its bytes written): a kernel of its own (``backward_parts``)
    dy_bytes: int = 0
    bias_flops: int = 0
    bias_bytes: int = 0

    @property
    def wgrad_flops(self) -> int:
        return self.backward_flops - self.dgrad_flops

    @property
    def wgrad_bytes(self) -> int:
        return self.backward_bytes - self.dgrad_bytes


def _split(entry, cost: Cost, ins, outs) -> Cost:
    """``cost`` as a :class:`SplitCost` for a two-operand matmul (``entry.op_class``
    "matmul"): dgrad = the forward's FLOPs without a bias's (backward - forward FLOPs:
    the contractions count 2 x forward backward, ``linear`` 4 M N K + the bias's M N),
    bytes read dC and B, written dA."""
    from .costs import nbytes
    if entry.op_class != "matmul" or len(ins) < 2 or not all(
            isinstance(t, torch.Tensor) for t in ins[:2]) or not outs:
        return cost
    a, b = ins[0], ins[1]
    d_flops = cost.backward_flops - cost.flops
    d_bytes = nbytes(outs[0]) + nbytes(b) + (nbytes(a) if a.dtype.is_floating_point else 0)
    if not (0 <= d_flops <= cost.backward_flops and 0 <= d_bytes <= cost.backward_bytes):
        return cost                  # not the shape of a GEMM's backward: one event
    bias = ins[2] if len(ins) > 2 and isinstance(ins[2], torch.Tensor) else None
    extra = dict(dy_bytes=nbytes(outs[0]),
                 bias_flops=outs[0].numel() if bias is not None else 0,
                 bias_bytes=nbytes(bias) if bias is not None and bias.dtype.is_floating_point
                 else 0)
    if entry.name not in _GEMMS:     # an einsum need not be a GEMM: no shapes
        return SplitCost(cost.flops, cost.bytes, cost.backward_flops, cost.backward_bytes,
                         d_flops, d_bytes, **extra)
    fold = b.dim() == 2              # a 2-d right operand (a weight): cuBLAS runs one GEMM
    return SplitCost(cost.flops, cost.bytes, cost.backward_flops, cost.backward_bytes,
                     d_flops, d_bytes, _gemm(outs[0], fold), _gemm(a, fold), _gemm(b, fold),
                     **extra)


# the table's ops that run as cuBLAS GEMMs on (batched) matrices, A @ B or x @ W^T
_GEMMS = ("matmul", "mm", "bmm", "linear")


def _gemm(t, fold: bool) -> "tuple | None":
    """(batch, rows, columns) of a GEMM writing ``t``: leading dims are a batch of GEMMs,
    or folded into the rows when the other operand is one matrix (torch.matmul and
    F.linear run one GEMM over the flattened rows then). None for a 0-d or 1-d ``t``."""
    if t.dim() < 2:
        return None
    lead = 1
    for n in t.shape[:-2]:
        lead *= n
    rows, cols = t.shape[-2], t.shape[-1]
    return (1, lead * rows, cols) if fold else (lead, rows, cols)


def _meta(shape, dtype):
    return torch.empty(tuple(shape), dtype=dtype, device="meta")


def local_cost(entry, mesh, specs, inputs, cand, out_shapes, out_dtypes, attrs) -> Cost:
    """``entry.cost`` on the busiest rank's local meta tensors (inputs as the strategy
    requires them, outputs as announced)."""
    ins = []
    for x, spec, req in zip(inputs, specs, cand.strategy.inputs):
        if spec is None:
            ins.append(x if not isinstance(x, torch.Tensor) else _meta(x.shape, x.dtype))
        else:
            ins.append(_meta(layout.max_local_shape(spec.shape, mesh, req), spec.dtype))
    outs = [_meta(layout.max_local_shape(s, mesh, ps), dt)
            for s, ps, dt in zip(out_shapes, cand.strategy.outputs, out_dtypes)]
    if getattr(entry.cost, "wants_layout", False):      # e.g. attention's busiest rank
        return entry.cost(ins, outs, layout=(mesh, specs, cand.strategy), **attrs)
    return _split(entry, entry.cost(ins, outs, **attrs), ins, outs)


def pricing_dtype(specs, out_dtypes):
    for dt in [s.dtype for s in specs if s is not None] + list(out_dtypes):
        if dt.is_floating_point:
            return dt
    return torch.float32


# The table's classes that the clock prices as one of its own kernel classes
# (``profiles.OP_CLASSES``): a cross-entropy is a softmax-like reduction over the vocabulary,
# an embedding lookup is a gather (bandwidth bound), a view runs no kernel (never priced).
_CLOCK_CLASS = {"loss": "reduction", "embedding": "data_movement", "view": "data_movement"}


# graph sink (``wb.compile`` at O2 runs the whole graph as one launch): kernels recorded
# meanwhile, and their backward, are priced without a host launch each
_SINK: list = [False]


@contextlib.contextmanager
def graph_sink():
    """Kernels recorded inside (forward now, backward when its gradient passes) are
    priced without their own launch: the caller records the graph's one launch."""
    _SINK.append(True)
    try:
        yield
    finally:
        _SINK.pop()


def _time(flops, nbytes, profile, dtype, op_class, gemm=None, launches=None):
    if launches is None:
        launches = 0 if _SINK[-1] else 1
    return _cost.compute_time(flops, nbytes, profile, dtype, launches=launches,
                              op_class=_CLOCK_CLASS.get(op_class, op_class), gemm=gemm)


def _measured(cost, profile):
    """(forward, backward) seconds the profile measured for this kernel, or None."""
    m = getattr(cost, "measured", None)
    return m(profile) if m is not None else None


def _unlaunched(seconds, profile, dtype, sunk=None):
    """A measured kernel's seconds inside a graph sink (``sunk``; default: recorded now):
    less its host launch, which a kernel timed back to back paid (and the roofline floor
    of the measured price holds: ``loss_pricing``), as the roofline path drops it there
    (``_time``)."""
    if not (_SINK[-1] if sunk is None else sunk):
        return seconds
    return max(seconds - get_profile(profile).compute_path(dtype)[3], 0.0)


# predicates (entry -> bool) that may drop a forward event: an op whose kernel did not run
# (a selective checkpoint's recompute served it from its cache: models.op_sac)
SKIP_FORWARD: list = []


def record_forward(tr, entry, mesh, cost: Cost, dtype) -> None:
    if cost.flops == 0 and cost.bytes == 0:          # a view: no kernel runs
        return
    if SKIP_FORWARD and SKIP_FORWARD[-1](entry):
        return
    measured = _measured(cost, tr.profile)
    dur = _unlaunched(measured[0], tr.profile, dtype) if measured else _time(
        cost.flops, cost.bytes, tr.profile, dtype, entry.op_class, getattr(cost, "gemm", None))
    tr.record_compute(mesh.ranks, entry.name, dur, flops=cost.flops, bytes=cost.bytes,
                      label="forward", args={"op_class": entry.op_class, "phase": "forward",
                                             **({"sunk": True} if _SINK[-1] else {})})


class _BackwardCompute(torch.autograd.Function):
    """Identity on its tensors; ``when_backward()`` runs when their gradient passes."""

    @staticmethod
    def forward(ctx, when_backward, *xs):
        ctx.when_backward = when_backward
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.when_backward()
        return (None,) + grads


# per trace, per rank: (end of the dgrad, the index of the last event: the wgrad or the
# bias's sum after it) of the last split backward
_SPLITS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def wgrad_overlap(tr, ranks) -> "float | None":
    """When the last compute on every rank of ``ranks`` is a matmul's wgrad, or its bias's
    sum after it (nothing recorded on their compute streams since, no wait), the time its
    dgrad ended: the input gradient is ready then, and a collective on it can run beside
    them (the trace times them again for it). Else None."""
    seen = _SPLITS.get(tr, {})
    for r in ranks:
        e, last = seen.get(r), tr.last_compute(r)
        if e is None or last is None or last[0] != e[1] or tr.now(r) != last[1].end:
            return None
    return max(seen[r][0] for r in ranks)


def needs_grad(inputs) -> tuple:
    """Per input of an op (local data in any form :mod:`..storage` holds, or a non-tensor):
    whether autograd will compute its gradient (it requires grad when the op runs)."""
    return tuple(isinstance(x, (torch.Tensor, storage.Cells)) and storage.requires_grad(x)
                 for x in inputs)


def backward_parts(cost: Cost, needs=None) -> list:
    """The backward kernels that run, as ``(part, flops, bytes, gemm)``: ``part`` None for
    an op priced as one backward kernel (less the per-input terms of a
    :class:`~.costs.TermsCost` whose input needs no gradient: a norm's frozen weight),
    else "dgrad" (the first input's gradient), "wgrad" (the second's) and "bias" (a
    bias's sum, a reduction kernel of its own after the two GEMMs: autograd's
    ``validate_outputs`` sums ``AddmmBackward0``'s gradient of the bias to its shape once
    the node has run, as ``torch.profiler`` shows, ``aten::sum`` after the two
    ``aten::mm``; Megatron-LM's ``grad_output.sum(dim=0)`` after the wgrad GEMM
    likewise). ``needs`` (:func:`needs_grad`) says which inputs need their gradient;
    None: all of them. A split matmul's GEMMs partition its backward less the bias's sum
    (:class:`SplitCost`), the GEMMs' output gradient read by the first of them that runs;
    the bias's sum reads it again. A part that does not run is dropped."""
    if not (cost.backward_flops or cost.backward_bytes):
        return []
    def need(i):
        return needs is None or (i < len(needs) and bool(needs[i]))
    if not isinstance(cost, SplitCost):
        skip = [t for t in getattr(cost, "terms", ()) if not need(t[0])]
        return [(None, cost.backward_flops - sum(t[1] for t in skip),
                 cost.backward_bytes - sum(t[2] for t in skip), None)]
    parts, dy = [], cost.dy_bytes
    if need(0):
        parts.append(("dgrad", cost.dgrad_flops, cost.dgrad_bytes, cost.dgrad_gemm))
        dy = 0                                    # counted in the dgrad's bytes
    if need(1):
        parts.append(("wgrad", cost.wgrad_flops - cost.bias_flops,
                      cost.wgrad_bytes - cost.bias_bytes + dy, cost.wgrad_gemm))
    if need(2) and (cost.bias_flops or cost.bias_bytes):
        # a kernel of its own after the GEMMs: it reads the output gradient again
        parts.append(("bias", cost.bias_flops, cost.bias_bytes + cost.dy_bytes, None))
    return parts


def part_class(part, op_class: str) -> str:
    """The op class a backward part (:func:`backward_parts`) is priced as: a bias's sum is
    a reduction, the GEMMs and a whole backward the op's own class."""
    return "reduction" if part == "bias" else op_class


def _record_backward(name, op_class, ranks, cost, dtype, needs=None, edges=None,
                     regather=None):
    launches = 0 if _SINK[-1] else 1          # as when the forward ran
    sunk = {"sunk": True} if not launches else {}
    whole = backward_parts(cost, needs)
    done: set = set()                         # parts recorded (a split backward's B)

    def record():
        tr = current_trace()
        if tr is None or not whole:
            return
        parts = whole
        if in_weight_pass():                  # W walks B's graph again: the rest of it
            parts = [q for q in whole if q[0] not in done]
            if done and parts and parts[0] is whole[0] and isinstance(cost, SplitCost) \
                    and parts[0][0] != "bias":
                n, f, b, gm = parts[0]        # B's part read the output gradient already
                parts[0] = (n, f, b - cost.dy_bytes, gm)
        elif isinstance(cost, SplitCost) and edges is not None:    # B: the GEMMs it runs
            parts = backward_parts(cost, backward_split.running(
                needs if needs is not None else (True,) * len(edges), edges))
        done.update(q[0] for q in parts)
        if not parts:
            return
        # a sequence-parallel input kept as its shard: gathered again beside the dgrad,
        # waited for by the wgrad (linear_regather); only where a wgrad runs
        waits = linear_regather.trace_regather(tr, regather) if regather is not None and \
            any(q[0] in ("wgrad", None) for q in parts) else []
        if not isinstance(cost, SplitCost):
            for h in waits:
                tr.wait(h)
            if waits and isinstance(regather, linear_regather.CastRegather):
                _record_regather_cast(tr, ranks, regather, launches, sunk)
            ((_, flops, nbytes, _),) = parts
            measured = _measured(cost, tr.profile)
            dur = (_unlaunched(measured[1], tr.profile, dtype, not launches) if measured
                   else _time(flops, nbytes, tr.profile, dtype, op_class, launches=launches))
            tr.record_compute(ranks, name, dur, flops=flops, bytes=nbytes,
                              label="backward",
                              args={"op_class": op_class, "phase": "backward", **sunk})
            return
        # the GEMMs that run, each on its own roofline with its launch (as
        # plan.layer_cost); a bias's sum alone is a reduction
        evs = []
        for part, flops, nbytes, gemm in parts:
            if part == "wgrad":
                for h in waits:
                    tr.wait(h)
                if waits and isinstance(regather, linear_regather.CastRegather):
                    _record_regather_cast(tr, ranks, regather, launches, sunk)
            cls = part_class(part, op_class)
            dur = _time(flops, nbytes, tr.profile, dtype, cls, gemm, launches=launches)
            evs.append(tr.record_compute(ranks, name, dur, flops=flops, bytes=nbytes,
                                         label="backward",
                                         args={"op_class": cls, "phase": "backward",
                                               "part": part, **sunk}))
        if [p[0] for p in parts][:2] == ["dgrad", "wgrad"]:     # (then the bias's sum)
            seen = _SPLITS.setdefault(tr, {})
            for r in ranks:
                seen[r] = (evs[0].end, tr.last_compute(r)[0])
    return record


def _record_regather_cast(tr, ranks, rg, launches, sunk) -> None:
    """Autocast's cast of the re-gathered input before the wgrad GEMM
    (``linear_regather.CastRegather``): reads the gathered buffer, writes it in the
    autocast dtype."""
    n = rg.nbytes // rg.src.itemsize
    nbytes = n * (rg.src.itemsize + rg.dtype.itemsize)
    tr.record_compute(ranks, "to", _time(0, nbytes, tr.profile, rg.dtype, "elementwise",
                                         launches=launches),
                      flops=0, bytes=nbytes, label="backward",
                      args={"op_class": "elementwise", "phase": "backward",
                            "part": "regather cast", **sunk})


def record_backward_now(name, op_class, ranks, cost: Cost, dtype) -> None:
    """Record ``cost``'s backward kernel on the current trace now: for a hand-written
    backward that runs an op's backward kernel itself (ring attention's blocks,
    ``strategies/context_parallel_backward.py``)."""
    _record_backward(name, op_class, ranks, cost, dtype)()


def on_backward(outs, entry, mesh, cost: Cost, dtype, needs=None, inputs=None):
    """Attach the backward event to the outputs that take part in autograd (one node for
    all of them, so it is recorded once); ``outs`` is a tuple of local data (any form
    :mod:`..storage` holds); ``needs`` which of the op's inputs need their gradient
    (:func:`needs_grad` of the local inputs; None: all), so that only the backward
    kernels autograd runs are recorded (:func:`backward_parts`); ``inputs`` (the local
    inputs) let a matmul's backward price only the GEMMs a split backward's pass runs
    (:mod:`.backward_split`)."""
    held = [storage.tensors(o) for o in outs]
    slots = [(j, k, t) for j, ts in enumerate(held) for k, t in enumerate(ts)
             if isinstance(t, torch.Tensor) and t.requires_grad]
    if not slots:
        return outs
    edges = backward_split.edges_of(inputs) if (
        inputs is not None and isinstance(cost, SplitCost)) else None
    marked = linear_regather.of(inputs[0]) if inputs and entry.name == "linear" else None
    record = _record_backward(entry.name, entry.op_class, mesh.ranks, cost, dtype, needs,
                              edges, marked[0] if marked is not None else None)
    res = _BackwardCompute.apply(record, *[t for _, _, t in slots])
    for (j, k, _), r in zip(slots, res):
        held[j][k] = r
    return tuple(storage.with_tensors(o, ts) for o, ts in zip(outs, held))
