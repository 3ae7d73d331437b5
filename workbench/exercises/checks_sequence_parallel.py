"""Checks for the exercises of notebook 06 (tensor and sequence parallel): the bytes one
layer sends under TP and TP+SP, Megatron-SP's f and g, and the largest micro-batch whose
activations fit.

Expected values are derived here: bytes from ring collectives, activation memory from
Korthikanti et al. 2022 (Table 2); f and g are run and their collectives counted."""
from __future__ import annotations

import math
import numbers

import torch

from ..parallel.dist_tensor import DistTensor, from_local, shard_tensor
from ..parallel.placement import Partial, Replicate, Shard, fmt_placements
from ..sim_mesh.mesh import Mesh
from ..sim_mesh.trace import trace
from .answers import _other_n
from .checks import _hint, _number, _ok, _whole
from .feedback import CheckError, exercise, raised

__all__ = ["check_tp_sp_layer_bytes", "check_sp_f_g", "check_sp_max_microbatch"]


# ---- 06 tensor and sequence parallel: bytes per layer -------------------------------------------

_BITS = ("8 times too large: that is bits, not bytes (each activation is elem bytes of 8 "
         "bits): give the bytes")
# with t = 8 (the exercise's), 8 times is also every rank's bytes summed
_BITS_OR_RANKS = ("8 times too large: that is bits, not bytes, or the sum over all 8 ranks: "
                  "give the bytes one rank sends")

@exercise
def check_tp_sp_layer_bytes(tp_bytes, sp_bytes, seq: int = 2048, batch: int = 1,
                            hidden: int = 12288, tp: int = 8, elem: int = 2,
                            model_layers: int = 96) -> None:
    """Bytes each rank sends per transformer layer per training step, counting Megatron's
    f and g only, as Korthikanti et al. 2022 (sec. 4.2.2) compare them and as notebook
    06's exercise 1 asks: tensor parallel (4 all-reduces of b s h) and tensor + sequence
    parallel (4 all-gathers and 4 reduce-scatters of b s h), ``elem``-byte activations,
    ring algorithms.  Not counted: the 2 backward re-gathers of the column-parallel inputs
    that Megatron-LM and the course's recipe send on top with sequence parallelism
    (``parallel.ops_table.linear_regather``; PyTorch's DTensor styles send none); an
    answer that includes them is refused with a hint.  ``model_layers`` (GPT-3's 96) names
    an answer for the whole model instead of one layer."""
    n = batch * seq * hidden * elem
    whole_model = (f"that is all {model_layers} layers of the model; the question asks for "
                   "one layer")
    want_tp = 4 * (2 * (tp - 1) * n // tp)                      # 4 ring all-reduces
    want_sp = 4 * 2 * ((tp - 1) * n // tp)                      # 4 all-gathers + 4 r-scatters
    regathers = 2 * ((tp - 1) * n // tp)        # backward re-gathers: not asked (docstring)
    a, b = _number("tp_bytes", tp_bytes), _number("sp_bytes", sp_bytes)
    t = tp
    if elem > 1 and all(math.isclose(v, w / elem, rel_tol=1e-4)
                        for v, w in ((a, want_tp), (b, want_sp))):
        # both 1/elem of their bytes: n counted values (each half-answer has hints of its own)
        forward = ("; or only the forward: backward sends as many again (f's all-reduces; "
                   "SP's conjugates)" if elem == 2 else "")
        raise CheckError(f"both are 1/{elem} of the bytes: n counts the activation's values; "
                         f"each is {elem} bytes (bf16)" + forward,
                         expected=f"TP {want_tp:.4g} B, TP+SP {want_sp:.4g} B")
    if not math.isclose(a, want_tp, rel_tol=1e-4):
        raise CheckError(f"your TP bytes are {a:.4g}: " + _hint(
            a, want_tp, [(want_tp / 2, "half of it: either only the forward's 2 all-reduces "
                          "(g after attention and after the MLP; backward has 2 more, f's), or "
                          "(t-1)/t n per all-reduce, an all-gather's share: an all-reduce "
                          "sends 2 (t-1)/t n"),
                         (8 * n, f"did you drop (t-1)/t? Each all-reduce sends 2 (t-1)/t n = "
                          f"{2 * (t - 1) / t:g} n per rank"),
                         (2 * want_tp, f"the activations are {elem} bytes each (bf16)"),
                         (want_tp / 4, "that is one all-reduce; a layer has 4 per step: 2 "
                          "forward (g), 2 backward (f)"),
                         (want_tp / t, "each all-reduce moves the whole b s h activation, "
                          "not a 1/t slice"),
                         (8 * want_tp, _BITS if tp != 8 else _BITS_OR_RANKS), (model_layers * want_tp, whole_model)]
            + _other_n(8 * n, tp, 2, "t", "section 1's t"),
            rel=1e-4), expected=f"TP {want_tp:.4g} B")
    if not math.isclose(b, want_sp, rel_tol=1e-4):
        raise CheckError(f"your TP+SP bytes are {b:.4g}: " + _hint(
            b, want_sp, [(want_sp + regathers, "that includes the 2 backward re-gathers "
                          "of the column-parallel inputs (section 4); the question counts "
                          "f and g only, as Korthikanti et al. compare them: leave the "
                          "re-gathers out"),
                         (want_sp / 2, "half of it: SP's f and g send 4 all-gathers AND 4 "
                          "reduce-scatters per layer per step, each (t-1)/t n"),
                         (want_sp / t, "the all-gathers and reduce-scatters move (t-1)/t of "
                          "the whole b s h, not of a 1/t slice"),
                         (8 * n, f"did you drop (t-1)/t? Each all-gather or reduce-scatter "
                          f"sends (t-1)/t n = {(t - 1) / t:g} n per rank: a rank already "
                          "holds its own 1/t"),
                         (2 * want_sp, "twice too much: each all-gather or reduce-scatter "
                          "sends (t-1)/t n, half an all-reduce"),
                         (8 * want_sp, _BITS if tp != 8 else _BITS_OR_RANKS), (model_layers * want_sp, whole_model)]
            + _other_n(8 * n, tp, 2, "t", "section 1's t"), rel=1e-4),
                         expected=f"TP+SP {want_sp:.4g} B")
    _ok(f"{want_tp / 2**20:.0f} MiB per layer per step both ways, counting f and g: "
        "sequence parallelism replaces each all-reduce by an all-gather + a reduce-scatter "
        f"of the same total (Megatron's 2 backward re-gathers, {regathers / 2**20:.0f} MiB, "
        "come on top)")


# ---- 06 sequence parallel: f and g ----------------------------------------------------------

def _run(fn, x, what):
    with trace() as tr:
        try:
            out = fn(x)
        except Exception as e:          # the student's code: any error is an answer
            raise CheckError(raised(f"your {what}", e)) from None
    return out, [(e.name, e.bytes, e.args.get("buffer_bytes")) for e in tr.collectives()]


def _same_mesh(what, out, mesh) -> None:
    """f and g change a layout on the tensor-parallel group they are given, never the group:
    a result on another mesh (the notebook's 2-rank ``mesh`` instead of ``x.mesh``) is a
    different program, whatever its placements say."""
    if out.mesh != mesh:
        arg = "x" if what == "f" else "y"
        raise CheckError(f"{what} returned a DistTensor on {out.mesh}, but its input lives on "
                         f"{mesh}: {what} changes the layout on the input's own tensor-parallel "
                         f"group, so reshard onto {arg}.mesh, not onto another mesh")


@exercise
def check_sp_f_g(f, g, tp: int = 4, shape=(2, 8, 16)) -> None:
    """Megatron-SP's f (sequence-sharded [Shard(1)] -> whole [Replicate()] before the
    column-parallel linear) and g (partial sums [Partial()] -> [Shard(1)] after the
    row-parallel one), each one collective of (t-1)/t n bytes per rank."""
    if not callable(f) or not callable(g):
        raise CheckError("pass two functions, f(x) and g(y), each taking and returning a "
                         "DistTensor")
    mesh = Mesh.grid(tp, ["tp"])
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(shape, generator=gen)
    parts = [torch.randn(shape, generator=gen) for _ in range(tp)]
    Y = sum(parts)
    n = math.prod(shape) * 4
    share = (tp - 1) * n // tp
    # f
    x = shard_tensor(X, mesh, [Shard(1)])
    out, colls = _run(f, x, "f")
    if not isinstance(out, DistTensor):
        raise CheckError(f"f returned a {type(out).__name__}; return a DistTensor, e.g. "
                         "wb.reshard(x, x.mesh, [...])")
    _same_mesh("f", out, mesh)
    if out.placements != (Replicate(),):
        raise CheckError(f"f returns {fmt_placements(out.placements)}; the column-parallel "
                         "linear multiplies every token by its weight columns, so every rank "
                         "needs the whole sequence: [Replicate()]")
    if not torch.equal(out.full(), X):
        raise CheckError("f's result is not the input gathered: keep the values, change only "
                         "the layout")
    if not colls:
        raise CheckError("f recorded no communication: a device holds only its shard, so "
                         "the other pieces must be sent to it; wb.reshard moves them (and the "
                         "trace counts it)")
    if [c[0] for c in colls] != ["all_gather"]:
        raise CheckError(f"f sends {', '.join(c[0] for c in colls)}; S(1) -> R is one "
                         "all-gather of (t-1)/t n bytes per rank")
    # g
    y = from_local(parts, mesh, [Partial("sum")])
    out, colls_g = _run(g, y, "g")
    if not isinstance(out, DistTensor):
        raise CheckError(f"g returned a {type(out).__name__}; return a DistTensor")
    _same_mesh("g", out, mesh)
    ps = out.placements
    if ps != (Shard(1),):
        hint = {(Replicate(),): "that is tensor parallelism's g, an all-reduce (2 (t-1)/t n "
                                "per rank); with SP the result stays sharded over the sequence: "
                                "a reduce-scatter, half the bytes, and the norm and dropout "
                                "after it work on 1/t of the tokens",
                (Shard(0),): "Shard(0) splits the batch; sequence parallelism splits the "
                             "sequence, dim 1 of (batch, sequence, hidden)",
                (Shard(2),): "Shard(2) splits the hidden dim, but RMSNorm and the residual "
                             "need each token's whole hidden vector: split the sequence "
                             "(dim 1)",
                (Partial("sum"),): "still partial sums: reduce them"}.get(
            tuple(ps), "the residual stream is sequence-sharded: [Shard(1)]")
        raise CheckError(f"g returns {fmt_placements(ps)}: {hint}")
    if not torch.allclose(out.full(), Y, atol=1e-5):
        raise CheckError("g's result is not the sum of the partial results: keep the value, "
                         "change only the layout")
    if [c[0] for c in colls_g] != ["reduce_scatter"]:
        raise CheckError(f"g sends {', '.join(c[0] for c in colls_g) or 'nothing'}; "
                         "P(sum) -> S(1) is one reduce-scatter of (t-1)/t n bytes per rank")
    _ok(f"f all-gathers, g reduce-scatters: {share:,d} + {share:,d} B per rank, what TP's "
        f"one all-reduce sends ({2 * share:,d} B)")


# ---- 06 activation memory: the largest micro-batch -----------------------------------------------

def _activation_bytes(seq, hidden, heads, tp, case) -> float:
    """Korthikanti et al. 2022, Table 2: bytes one layer keeps per sequence (16-bit)."""
    sbh, att = seq * hidden, 5 * heads * seq / hidden
    return sbh * {"none": 34 + att, "tp": 10 + 24 / tp + att / tp, "tp+sp": (34 + att) / tp,
                  "tp+selective": 10 + 24 / tp, "tp+sp+selective": 34 / tp, "full": 2}[case]


@exercise
def check_sp_max_microbatch(b, budget_bytes: float = 20e9, layers: int = 12, seq: int = 2048,
                            hidden: int = 12288, heads: int = 96, tp: int = 8,
                            case: str = "tp+sp+selective", in_flight: int = 8) -> None:
    """The largest micro-batch whose activations (Korthikanti et al. 2022, Table 2,
    ``case``) for ``layers`` layers fit in ``budget_bytes`` on the first pipeline stage,
    which under 1F1B holds ``in_flight`` (= p) micro-batches at once."""
    # a whole float is its int, as in notebook 11's check_biggest_micro_batch: 20e9 // x,
    # the floor division of floats, rounds down right and gives 1.0, the answer 1
    whole = _whole(b)
    if whole is None:
        fraction = isinstance(b, numbers.Real) and not isinstance(b, bool) \
            and math.isfinite(b)             # 20e9 / x: a share of a sequence
        raise CheckError(f"b should be a whole number of sequences, got {b!r}"
                         + (": round down" if fraction else ": give an int"))
    b = whole
    per = lambda c: _activation_bytes(seq, hidden, heads, tp, c)  # noqa: E731
    stage = layers * per(case) * in_flight
    want = int(budget_bytes // stage)
    if b == want:
        _ok(f"b = {want}: {in_flight} micro-batches in flight x {layers} layers x "
            f"{per(case) / 1e6:.1f} MB x b = {want * stage / 1e9:.1f} GB of "
            f"{budget_bytes / 1e9:g} GB; b = {want + 1} would need "
            f"{(want + 1) * stage / 1e9:.1f} GB")
        return
    one = layers * per(case)
    others = {c: int(budget_bytes // (layers * per(c) * in_flight)) for c in
              ("tp+selective", "tp+sp", "tp", "none", "full")}
    if b == int(budget_bytes // one):
        msg = (f"that fits ONE micro-batch's activations; under 1F1B the first stage "
               f"keeps {in_flight} micro-batches in flight (its warm-up of p - 1 forwards "
               "and the steady state's first forward come before its first backward; "
               "notebook 7)")
    elif b == want + 1:
        msg = (f"b = {b} needs {b * stage / 1e9:.2f} GB, more than {budget_bytes / 1e9:g} GB: "
               f"round down")
        if b == int(budget_bytes * 2**30 / 1e9 // stage):   # the unit slip gives it too
            msg += (f"; and 1 GB is 1e9 bytes here, not 2**30 (a GiB): the budget is "
                    f"{budget_bytes:,.0f} bytes")
    elif b == int(budget_bytes // (per(case) * in_flight)):
        msg = f"that fits ONE layer; the stage holds {layers}"
    elif b == int(budget_bytes * 2**30 / 1e9 // stage):
        msg = f"the budget is {budget_bytes / 1e9:g} GB = {budget_bytes:.3g} bytes, not GiB"
    elif sum(b == others[c] for c in ("tp+selective", "tp+sp", "tp", "none")) > 1:
        # several slips give this b (0: nothing fits): name them together, not one guess
        msg = (f"b = {b} is what you get without sequence parallelism or without selective "
               f"recompute (one sequence of either needs over {budget_bytes / 1e9:g} GB); the "
               f"exercise has both: 34 sbh / t per layer, in bytes already (Table 2 counts "
               f"16-bit activations: no factor of 2 or 4 bytes on top)")
    elif b == others["tp+selective"]:
        msg = ("that is tensor parallelism with selective recompute but without SP: 10 sbh "
               "of the 34 (norms, dropouts, residuals) stays whole on every rank; SP splits "
               "it too: 34 sbh / t")
    elif b == others["tp+sp"]:
        msg = ("that keeps the attention scores (5as/(ht) sbh); selective recompute "
               "recomputes them in backward: 34 sbh / t")
    elif b in (others["tp"], others["none"]):
        msg = "use the formula for TP + SP + selective recompute: 34 sbh / t per layer"
    else:
        msg = (f"per layer and sequence: 34 s h / t = {per(case) / 1e6:.1f} MB; times "
               f"{layers} layers and {in_flight} micro-batches in flight, how many sequences "
               f"fit in {budget_bytes / 1e9:g} GB?")
    raise CheckError(f"your b is {b}: {msg}", expected=str(want))
