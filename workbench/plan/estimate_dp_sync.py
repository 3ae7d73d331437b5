"""An estimate's data-parallel synchronisation: a stage's exposed seconds and bytes
(:func:`_dp_sync`), the later stages' sync less the pipeline's slack
(:func:`_hide_in_pipeline`) and the nodes the data-parallel group spans (:func:`_dp_nodes`).
"Module docstring" below: :mod:`.estimate`'s."""
from __future__ import annotations

import dataclasses

from ..sim_mesh.cost import overlap_rate, wire_bytes
from . import costs as C
from . import frameworks as F
from . import stage_sync as S
from . import zero_cost as Z
from . import ep_cp as EC
from .layout import Layout
from .estimate_loss import _loss_queues
from .estimate_ranks import _rows


def _dp_nodes(lay: Layout, prof) -> int:
    """Nodes the first stage's data-parallel group spans (``Layout.grad_ranks``): the
    widest collective group of a layout (tensor parallelism stays inside a node)."""
    return len({r // prof.devices_per_node for r in lay.grad_ranks(0, 0)})


def _dp_sync(psi, lay: Layout, prof, stage: int, blocks, overlap: bool = True,
             overlap_grad_reduce: bool = False, grad_bytes: int = 2,
             head_live: bool = True, side=None, lead=((0.0, 0.0), None)):
    """(exposed seconds, bytes sent) of the data-parallel synchronisation of a stage
    (module docstring); ZeRO-2/3: per micro-batch on one comm stream against the
    ``blocks`` of the stage (``zero_cost``); ``overlap=False`` exposes them whole.
    ``overlap_grad_reduce`` (ZeRO-0/1, Megatron-LM's --overlap-grad-reduce and
    --overlap-param-gather): the gradients reduced module by module during the last
    micro-batch's backward, ZeRO-1's updated weights gathered beside the next step's
    first forward (all gathers issued at once), on the same stream model.
    ``grad_bytes``: bytes per gradient element reduced (``frameworks.grad_reduce_bytes``:
    Megatron-LM reduces bf16 models' gradients in fp32); gathered weights are 16-bit.
    ``head_live``: the head's weight is still gathered when the loss is computed (tied
    to the embedding); if not, this library's recipe re-gathers it before the loss and
    the loss waits behind the backward's prefetch (``zero_cost``'s ``loss_waits``).
    ``side``: (seconds added to a gather of n elements, to a reduce-scatter of n: the
    copies FSDP2 runs in series with them; the indices of the blocks kept gathered from
    forward to backward), ``fsdp2_cost.stage_copies``.  ``lead``: ((the loss's forward,
    backward) seconds, run beside ZeRO-3's backward prefetch where it does not wait for it
    (this library's recipe: ``zero_cost.zero_exposed``'s ``lead``; ``ep_cp.loss_waits``
    says when the loss waits), the seconds of it before the loss's collective where that
    waits and ZeRO's group is the cp group, else None) (``_loss_lead``)."""
    if lay.dp * lay.cp == 1:
        return 0.0, 0.0
    ranks = tuple(lay.grad_ranks(0, stage))      # dp x cp ranks (``plan.ep_cp``)
    g, dp, m = grad_bytes * psi, len(ranks), lay.m
    priced = {}     # group_price's cache key hashes all the ranks: ask it once per size

    def p(kind, nbytes=g):
        t = priced.get((kind, nbytes))
        if t is None:
            t = priced[kind, nbytes] = C.group_price(kind, nbytes, ranks, prof)
        return t

    ag_x, rs_x, stay = side if side else (lambda n: 0.0, lambda n: 0.0, ())

    def gather(n):
        return p("all_gather", 2 * n) + ag_x(n)

    w = 2 * psi                                   # the 16-bit weights
    rs, ag = wire_bytes("reduce_scatter", g, dp), wire_bytes("all_gather", w, dp)
    if lay.zero <= 1 and overlap_grad_reduce:
        kind = "all_reduce" if lay.zero == 0 else "reduce_scatter"
        r = overlap_rate(prof, ranks)    # the SMs NCCL holds for this group
        _, bwd = Z.zero_exposed(blocks, 2, gather, lambda n: p(kind, grad_bytes * n), rate=r)
        if lay.zero == 0:
            return bwd, wire_bytes("all_reduce", g, dp)
        # Megatron-core gathers one bucket ahead (``_finish_param_sync_helper``: "We
        # can't pre-launch all-gathers for all buckets at once", f2e5db402c), the first
        # from zero_grad, just before the forward; a block is one of its buckets on the
        # first stage with ZeRO-1 (plan.megatron_buckets), else a layer
        ahead = 1 if lay.engine == "megatron" else float("inf")
        fwd, _ = Z.zero_exposed(blocks, 3, gather, lambda n: 0.0,
                                prefetch_numel=ahead, rate=r)
        return bwd + fwd, rs + ag
    if lay.zero == 0:
        return p("all_reduce"), wire_bytes("all_reduce", g, dp)
    if lay.zero == 1:
        return p("reduce_scatter") + p("all_gather", w), rs + ag
    if not overlap:
        blocks = [dataclasses.replace(b, fwd=0.0, bwd=0.0, remat=0.0, wait_fwd=0.0,
                                      wait_bwd=0.0, after_fwd=(), after_bwd=(),
                                      after_remat=(), shared=(0.0, 0.0)) for b in blocks]
    bucket = Z.REDUCE_BUCKET_NUMEL if lay.engine == "deepspeed" else None
    # FSDP2: one block ahead (a budget of one element: ``_prefetch`` issues one block)
    ahead = F.FSDP_PREFETCH_UNITS if lay.engine == "fsdp" else Z.PREFETCH_NUMEL
    # the recipe's loss waits for the backward's prefetch where its count's all-reduce is
    # on ZeRO's group (ep_cp.loss_waits), else runs beside it (lead)
    # (with a tied head too where ZeRO's group is the cp group: the backward's prefetch is
    # issued as the head's forward ends, before the loss's count all-reduce on that group,
    # ep_cp.shares_zero_stream; measured on the dry run's trace, tests/test_zerocp3.py;
    # and at ZeRO-3 with dp alone, the prefetch issued as the final norm ends:
    # _loss_queues, tests/test_zerocp4.py)
    shared = _loss_queues(lay, head_live)
    waits = lay.engine == "workbench" and (not head_live or shared) and EC.loss_waits(lay)
    recipe3 = lay.engine == "workbench" and lay.zero == 3 and (not waits or shared) \
        and overlap
    fwd, bwd = Z.zero_exposed(blocks, lay.zero, gather,
                              lambda n: p("reduce_scatter", grad_bytes * n) + rs_x(n),
                              rate=overlap_rate(prof, ranks) if overlap else 1.0, bucket=bucket,
                              prefetch_numel=ahead, loss_waits=waits,
                              stay=stay, regather=lay.engine == "workbench"
                              and lay.recompute in ("full", "op"),
                              lead=lead[0] if recipe3 else (0.0, 0.0),
                              beside=lead[1] if recipe3 and waits else None)
    if lay.zero == 2:       # then the updated 16-bit weights, gathered once per step
        # (fwd: the cp exchange's waits where it shares ZeRO's stream, else 0)
        return m * (fwd + bwd) + p("all_gather", w), m * rs + ag
    again = wire_bytes("all_gather", w - 2 * sum(blocks[i].numel for i in stay), dp)
    return m * (fwd + bwd), m * (ag + again + rs)


def _hide_in_pipeline(stages, lay: Layout, prof, grad_bytes: int,
                      overlap_grad_reduce: bool, links) -> None:
    """Megatron-LM's (and DeepSpeed's pipeline engine's) sync on stages after the first,
    less the pipeline's slack (``stage_sync``), the stages before it each with its own
    crossings on ``links`` (``_rows``): each such stage's ``dp`` replaced."""
    rows = _rows(lay, stages, links)   # each stage's own crossings (was: every middle
    fwd = [d["forward"] for d in rows]     # stage's slack summed with the slowest middle
    bwd = [d["time"] - d["forward"] for d in rows]      # stage's)
    for d in stages.values():
        if d["stage"] > 0:
            sf, sb = S.slacks(d["stage"], fwd, bwd)
            d["dp"] = S.after_flush(d["psi"], lay, prof, d["stage"], grad_bytes, sf, sb,
                                    overlap_grad_reduce) + d["expert_dp"]   # MoE: whole
