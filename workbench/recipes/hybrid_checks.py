"""The checks of a :class:`~.hybrid.Hybrid`: its arguments, before any mesh is built, and
a model and batch against its layout, before anything runs (a clear error naming the
argument and the fix)."""
from __future__ import annotations

from ..train_checks import check_sizes, check_world
from . import dualpipe as _dualpipe
from .hybrid_layout import SCHEDULES
from .moe import check_ep_batch, check_moe_layout


def _arg(name: str, value=None) -> str:
    """An argument as the messages write it: ``dp`` or ``dp=4``."""
    return name if value is None else f"{name}={value!r}"


def _microbatch_hint(batch_size, dp, m, pp, schedule) -> str:
    """``", or Hybrid(microbatches=k)"`` for the k nearest ``m`` that fits the batch."""
    if batch_size % dp:
        return ""
    per = batch_size // dp
    ks = [k for k in range(1, per + 1) if per % k == 0
          and (schedule != "interleaved" or k % pp == 0)
          and (schedule != "zb-v" or k >= pp)              # zb_v: m >= p
          and (schedule != "dualpipe" or (k % 2 == 0 and k >= 2 * pp))]
    if not ks:
        return ""
    k = min(ks, key=lambda k: (abs(k - m), -k))
    return f", or Hybrid(microbatches={k})"


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_args(*, dp, tp, pp, sp, zero, schedule, microbatches, virtual, distributed,
                regather=True):
    """Hybrid's arguments, before any mesh is built (microseconds whatever the values)."""
    for n, v in (("dp", dp), ("tp", tp), ("pp", pp)):
        if not _int(v) or v < 1:
            raise ValueError(f"Hybrid({n}={v!r}): give an int >= 1, the number of ranks "
                             f"along {n} (1: no {n})")
    check_world(dp, tp, pp, f"Hybrid(dp={dp}, tp={tp}, pp={pp})")
    for n, v in (("sp", sp), ("distributed", distributed), ("regather", regather)):
        if not isinstance(v, bool):
            raise TypeError(f"Hybrid({n}={v!r}): give True or False")
    if sp and tp == 1:
        raise ValueError("Hybrid: sp=True needs tp > 1: sequence parallelism shards the "
                         "tensor-parallel region's norms and dropouts over tp; add tp=2 or "
                         "leave sp False")
    if not regather and not sp:
        raise ValueError("Hybrid(regather=False) with sp=False: regather says what sequence "
                         "parallelism's linears keep for backward (the sequence shard, "
                         "gathered again, or the gathered input); add sp=True (and tp > 1) "
                         "or leave regather True")
    if not _int(zero) or zero not in (0, 1, 2, 3):
        raise ValueError(f"Hybrid(zero={zero!r}): give the ZeRO stage, 0 (plain data "
                         "parallel), 1, 2 or 3")
    if not isinstance(schedule, str) or schedule not in SCHEDULES:
        raise ValueError(f"Hybrid(schedule={schedule!r}): use one of {list(SCHEDULES)}")
    for n, v in (("microbatches", microbatches), ("virtual", virtual)):
        if v is not None and (not _int(v) or v < 1):
            raise ValueError(f"Hybrid({n}={v!r}): give an int >= 1, or None for the default")
    if schedule == "dualpipe":
        _dualpipe.check_args(pp=pp, zero=zero, distributed=distributed)
    if schedule == "zb-v" and distributed:      # before a step, not in its first pipeline
        raise NotImplementedError("Hybrid(schedule='zb-v', distributed=True): the 'v' layout "
                                  "runs on the simulator only; use schedule='1f1b', "
                                  "'interleaved' or 'zb-h1' on torch.distributed")
    if schedule == "zb-v" and virtual not in (None, 2):
        raise ValueError(f"Hybrid(virtual={virtual}) with schedule='zb-v': ZB-V places "
                         "exactly two chunks per rank; leave virtual None")
    if virtual is not None and virtual > 1 and schedule not in ("interleaved", "zb-v"):
        raise ValueError(f"Hybrid(virtual={virtual}) with schedule={schedule!r}: model chunks "
                         "per rank need the interleaved schedule; add schedule='interleaved' "
                         "or leave virtual None")


class _Checks:
    """Checks of a model and batch against the layout (a base of :class:`~.hybrid.Hybrid`)."""

    # ---- checks ---------------------------------------------------------------------------
    def check(self, cfg, batch_size: int) -> None:
        """A clear error before anything runs when the layout does not fit the model."""
        tp, pp, v = self.tp, self.pp, self.v
        check_ep_batch(self.edp, self.ep, batch_size)           # recipes/moe.py
        check_sizes(self.dp, tp, pp, batch_size, cfg, "the model", _arg, self.stage_sizes)
        check_moe_layout(cfg, self.ep)
        if self._m is not None and self.dp * self._m > batch_size:
            raise ValueError(f"microbatches={self._m}: at most batch_size // dp = "
                             f"{batch_size // self.dp} (batch_size={batch_size}, "
                             f"{self._dp_words()}): every micro-batch holds at least one "
                             "sequence per dp rank; lower microbatches")
        if self._m is None and pp > 1:      # 2p micro-batches if the batch allows, else p
            self.m = 2 * pp if batch_size % (self.dp * 2 * pp) == 0 else pp
        for name, val in (("n_head", cfg.n_head), ("n_kv_head", cfg.n_kv_head),
                          ("d_ff", cfg.d_ff)):
            if val % tp:
                raise ValueError(f"tp={tp} does not divide {name}={val}: tensor parallelism "
                                 "splits heads and hidden features evenly")
        self._check_layers(cfg)
        if batch_size % (self.dp * self.m):
            n = self.dp * self.m
            raise ValueError(f"batch_size={batch_size} does not divide into {self._dp_words()} x "
                             f"{self.m} micro-batches: the micro-batches must be equal, each "
                             f"split evenly over the dp ranks; give a batch_size that divides by "
                             f"{n} (e.g. {n * max(1, round(batch_size / n))})"
                             + _microbatch_hint(batch_size, self.dp, self.m, pp,
                                                self.schedule_name))
        if getattr(cfg, "tie_embeddings", False) and pp * v > 1 and self.device.type != "meta":
            # Megatron keeps a copy of the word embedding on the last stage and all-reduces
            # the two copies' gradients every step; without that the copies drift apart
            if pp == 1:                 # virtual stages on one rank (was: "with pp > 1
                raise NotImplementedError(  # ... use pp=1" when pp was 1)
                    f"tie_embeddings=True with schedule={self.schedule_name!r} and {v} "
                    "model chunks on one rank (pp=1): the head's stage needs its copy of "
                    "the embedding's gradient summed with the first stage's, not built yet; "
                    "use schedule='1f1b' (one stage), or cfg.replace(tie_embeddings=False)")
            raise NotImplementedError(
                "tie_embeddings=True with pp > 1: the last stage's copy of the embedding "
                "needs Megatron's embedding-gradient all-reduce, not built yet; use pp=1, or "
                "cfg.replace(tie_embeddings=False), or --dry-run (which prices it)")
        if getattr(cfg, "recompute", "none") == "op" and pp > 1 and \
                self.schedule_name in ("zb-h1", "zb-v", "dualpipe"):
            # PyTorch's selective activation checkpoint allows one backward per region
            raise NotImplementedError(
                f"recompute='op' with schedule={self.schedule_name!r}: the schedule splits "
                "each backward in two (B: input gradients, W: weight gradients), and "
                "PyTorch's selective activation checkpoint allows one backward through its "
                "region; use recompute 'full' or 'selective', or schedule '1f1b'")
        if self.sp and cfg.seq_len % tp:
            raise ValueError(f"sp: seq_len={cfg.seq_len} does not divide by tp={tp}")
        if self.schedule_name == "interleaved" and self.m % pp:
            raise ValueError(f"interleaved schedule: {self.m} micro-batches must be a multiple "
                             f"of pp={pp}")
        if self.schedule_name == "zb-v" and self.m < pp and pp > 1:
            # before the step (was: zb_v's "zb_v(p=2, m=1)" from inside forward_backward,
            # naming the schedule function's arguments, not Hybrid's)
            raise ValueError(f"Hybrid(microbatches={self.m}) with schedule='zb-v' and "
                             f"pp={pp}: the V schedule fills its warm-up with the first pp "
                             f"micro-batches; give Hybrid(microbatches={pp}) or more (a "
                             f"batch_size that divides by dp x it), or schedule='1f1b'")
        if self.schedule_name == "dualpipe":
            _dualpipe.check(self, batch_size)

    def _dp_words(self) -> str:
        """The data-parallel ranks as the user gave them: "dp=2", or with expert parallelism
        "dp=1 x ep=4 = 4" (the dense layers' dp is edp x ep, a number nobody typed: was
        "microbatches=4: at most batch_size // dp = 2 (batch_size=8, dp=4)" for
        Hybrid(ep=4))."""
        if self.ep > 1:
            return f"dp={self.edp} x ep={self.ep} = {self.dp} data-parallel ranks"
        return f"dp={self.dp}"

    def _check_layers(self, cfg) -> None:
        """The model's layers cut into pp x virtual stages (or ``stage_sizes``), said in
        Hybrid's words; :meth:`build_model` checks it too, as it cuts the model before any
        step's :meth:`check` (was: ``model.pipeline_stages``' "n_stages=4 does not divide
        n_layer=2 ... give sizes=", arguments a Hybrid user never wrote)."""
        pp, v = self.pp, self.v
        if self.stage_sizes is not None:
            if sum(self.stage_sizes) != cfg.n_layer:
                raise ValueError(f"stage_sizes={self.stage_sizes} hold {sum(self.stage_sizes)} "
                                 f"layers, not n_layer={cfg.n_layer}")
        elif cfg.n_layer % (pp * v):
            raise ValueError(f"pp={pp} x {v} chunks = {pp * v} stages do not divide "
                             f"n_layer={cfg.n_layer}; pick pp x virtual dividing n_layer"
                             + (" or give stage_sizes (one layer count per stage)"
                                if v == 1 else ""))
