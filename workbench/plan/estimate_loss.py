"""This library's loss in an estimate: its cross-entropy's target-count all-reduce
(:func:`_loss_count`) and what of the loss runs beside ZeRO-3's backward prefetch
(:func:`_loss_lead`, :func:`_loss_queues`)."""
from __future__ import annotations

from ..sim_mesh.cost import wire_bytes
from . import costs as C
from . import ep_cp as EC
from .layout import Layout


def _loss_count(lay: Layout, prof) -> tuple[float, float]:
    """(seconds, bytes sent) per micro-batch of this library's cross-entropy's global
    target count on the last stage: an all-reduce of one int64 over each mesh dim the
    targets are sharded on, dp then cp, one after the other (each sums the last's),
    before the loss divides by it (``parallel/ops_table/cross_entropy.py``,
    ``_cross_entropy_local``), so exposed; on the dry run's trace a "small" Llama of one
    layer at dp 16 on two A100 nodes: 27.5 us a micro-batch, the estimate 1.21x below it
    without (``benchmarks/plan_random_layouts.py`` seed 13).  Other frameworks: none here
    (Megatron-LM's loss is local to the rank; its logging average over dp is not priced)."""
    if lay.engine != "workbench":
        return 0.0, 0.0
    last = lay.pp - 1
    t = sent = 0.0
    for n, ranks in ((lay.dp, [lay.rank(0, d, last, 0) for d in range(lay.dp)]),
                     (lay.cp, [lay.rank(0, 0, last, c) for c in range(lay.cp)])):
        if n > 1:
            t += C.group_price("all_reduce", 8, tuple(ranks), prof)
            sent += wire_bytes("all_reduce", 8, n)
    return t, sent


def _loss_lead(cfg, lay: Layout, head, edge) -> tuple:
    """(forward, backward) seconds of the last stage that run beside ZeRO-3's backward
    prefetch, which this library's recipe issues as the forward's last module ends
    (``zero_cost.zero_exposed``'s ``lead``): the loss (the logits' cast and the
    cross-entropy, forward and backward); where ZeRO's group is the cp group
    (``ep_cp.shares_zero_stream``) the cross-entropy's count all-reduce on that group
    (``parallel/ops_table/cross_entropy.py`` ``_cross_entropy_local``) queues behind the
    prefetch, so only what runs before it beside it: the cast, and a tied head's GEMM (its
    weight is the embedding module's: the last module is the final norm, the prefetch
    starts as it ends); the cross-entropy and the cast's backward then run before the
    head's backward (its pre-backward hook prefetches on), measured on the dry run's
    trace (tests/test_zerocp3.py).  Returns (lead, beside) for ``zero_exposed``."""
    # a tied head's GEMM beside the prefetch wherever the loss runs beside it too (dp >= 2
    # with cp >= 2: the count's groups are not ZeRO's dp x cp one); was left before the
    # prefetch, measured on the dry run's trace (GPT dp 2 cp 4 ZeRO-3: the final norm ends
    # and the prefetch starts at 968 us, the head's 133 us GEMM beside it; the estimate
    # started it 146 us later, dry run / estimate 0.948, tests/test_zerocp5.py)
    head_f = head.fwd_compute if cfg.tie_embeddings and lay.pp == 1 else 0.0
    if _loss_queues(lay, cfg.tie_embeddings):
        return (edge["loss"][0] + head_f, edge["loss"][1]), edge["cast"][0] + head_f
    return (edge["loss"][0] + head_f, edge["loss"][1]), None


def _loss_queues(lay: Layout, tied: bool) -> bool:
    """Whether this library's loss splits around ZeRO's backward prefetch (``_loss_lead``'s
    ``beside``): its count all-reduce queues behind the prefetch on ZeRO's stream while
    the ops before it run beside.  Where ZeRO's group is the cp group
    (``ep_cp.shares_zero_stream``); and with a tied head on one stage at ZeRO-3 where the
    count's group is ZeRO's (``ep_cp.loss_waits``: dp alone): the head's GEMM belongs to
    the embedding module, so the last module to end is the final norm and the prefetch is
    issued then (``parallel/strategies/zero3_clock.py``), before the cross-entropy's
    all-reduce (dry run's trace, GPT dp 2 ZeRO-3: the prefetch from 674 us, the
    all-reduce at 1350 us behind it; tests/test_zerocp4.py)."""
    if lay.engine != "workbench":
        return False
    return EC.shares_zero_stream(lay) or (tied and lay.pp == 1 and lay.zero == 3
                                          and EC.loss_waits(lay))
