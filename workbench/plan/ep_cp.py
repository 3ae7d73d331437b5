"""Expert (``Layout(ep=)``) and context (``Layout(cp=)``) parallelism in the planner.

The hooks ``layout``, ``estimate``, ``memory`` and ``search`` call; the costs are
``moe_cost`` (a MoE block over ep ranks) and ``context_cost`` (ring attention over cp).

Rank order (Megatron-Core, ``parallel_state.py``'s default "tp-cp-ep-dp-pp"): tensor
parallel innermost, then context parallel, then data parallel, pipeline outermost,

    rank = t + tp (c + cp (d + dp s)),

and the expert-parallel group is ep consecutive data-parallel ranks (stride tp cp), so
an ep group stays in a node while tp cp ep <= the node's devices; its experts' gradients
are reduced over the other dp / ep (x cp) ranks, the expert-data-parallel group
(Megatron-Core's ``expert_data_parallel``), and their optimizer states shard over it.

A layer with EP or CP is priced op by op: the dense block's kernels (``layer_cost.
layer_ops``) at s / cp tokens, its MLP replaced by the MoE's (``moe_cost``, collectives
on the TP group and the EP group's ranks, ``cost.price`` on the topology: inside a node
or across nodes as the ranks fall), plus ring attention beyond the causal block
(``context_cost``).  ZeRO-1 shards the optimizer states over dp x cp (Megatron-Core's
distributed optimizer on its data-parallel group with context parallel), and so does this
library's runtime (``recipes/context_parallel.py``), which also runs ZeRO-2 over dp x cp:
``framework="workbench"`` prices it; and ZeRO-3 over dp x cp (FSDP over the flattened
group, as torchtitan), any dp and recompute (``check_zero_cp``).  Not modeled,
refused with the fix: ZeRO-2/3 with EP, ZeRO-2/3 with CP on another framework
(Megatron-LM's distributed optimizer is ZeRO-1), FP8 or ``overlap_grad_reduce`` with a
MoE, EP over the context-parallel ranks (Megatron-Core's "MoE parallel folding").
A MoE with tp > 1 takes sp (Megatron-Core: experts split over tp), or
``framework="workbench"`` with sp=False (this library's runtime: the MoE MLP whole on
every tp rank; ``moe_cost.mlp_tp``).

The parts live beside this module, which keeps the checks (``check_fields``,
``check_zero_cp``, ``check_layout``, ``check_estimate``: tests patch the first two here)
and ``applies``, and their import path: one layer's price (:mod:`.ep_cp_layer`), the cp
attention's rows (:mod:`.ep_cp_attention`), the exchange and the loss against ZeRO's
stream (:mod:`.ep_cp_zero_stream`) and the experts' states and sync (:mod:`.ep_cp_experts`).
"""
from __future__ import annotations

from . import context_cost as X
from . import moe_cost as M
from .ep_cp_search import CP_MIN_TOKENS, assumptions, candidates, explain_lines, table_notes
from .ep_cp_layer import (_groups, _layer, layer_cost, layer_detail, _mini,  # noqa: F401
                          _price_moe, _regathers, token_cfg, _whole_sequences)
from .ep_cp_attention import (_ATTN, _a2a_reorder, _a2a_rows, _cost_itemsize,  # noqa: F401
                              _op_sac_ring)
from .ep_cp_zero_stream import (loss_waits, _recomputed, ring_program,  # noqa: F401
                                shares_zero_stream)
from .ep_cp_experts import expert_states, expert_sync, merged_expert_params  # noqa: F401


__all__ = ["check_fields", "check_zero_cp", "check_layout", "check_estimate", "applies",
           "loss_waits", "shares_zero_stream", "ring_program",
           "token_cfg", "layer_cost", "layer_detail", "expert_states", "expert_sync", "candidates",
           "assumptions", "explain_lines", "table_notes", "CP_MIN_TOKENS"]
# candidates, assumptions, explain_lines, table_notes: plan/ep_cp_search.py


def _int(name, v):
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"Layout: {name}={v!r} must be an int >= 1")


def check_fields(lay) -> None:
    """What ``Layout`` checks of ep and cp without the model."""
    _int("ep", lay.ep)
    _int("cp", lay.cp)
    if lay.cp_comm not in ("p2p", "a2a"):
        raise ValueError(f"Layout: cp_comm={lay.cp_comm!r}; give 'p2p' (ring attention) or "
                         f"'a2a' (DeepSpeed-Ulysses), Megatron-LM's --cp-comm-type names "
                         f"('a2a+p2p' and 'all_gather' are not modeled)")
    if lay.dp % lay.ep:
        raise ValueError(f"Layout: ep={lay.ep} must divide dp={lay.dp}: the expert-parallel "
                         f"group is carved out of the data-parallel ranks; use an ep dividing "
                         f"{lay.dp} or a dp that is a multiple of {lay.ep}")
    own = lay.zero in (2, 3) and lay.ep == 1 and lay.framework == "workbench"
    if (lay.ep > 1 or lay.cp > 1) and lay.zero >= 2 and not own:
        raise ValueError(f"Layout: zero={lay.zero} with ep={lay.ep}, cp={lay.cp} is not "
                         f"modeled (Megatron-LM's distributed optimizer, ZeRO-1, is what runs "
                         f"expert and context parallelism; this library's runtime runs ZeRO-2 "
                         f"and ZeRO-3 over dp x cp: framework='workbench'); use zero<=1"
                         + ("" if lay.ep > 1 else ", or framework='workbench'"))


def check_zero_cp(lay) -> None:
    """What ``estimate`` refuses of ZeRO-2/3 with cp (the layout itself stands: ``dry_run``
    runs it): nothing now; each was refused until the dry run held the estimate to it.
    ZeRO-3 over dp x cp (this library's runtime: ``ContextParallel(zero=3)``, FSDP over
    the flattened dp x cp group as torchtitan's "fsdp" mesh) is priced as the runtime runs
    it (``zero_cost.recipe_blocks`` over the dp x cp ranks; the loss beside the
    backward's prefetch, ``loss_waits``), ZeRO-2 likewise.  At dp >= 2 without
    recompute, "full" or "selective": measured dry run / estimate on
    tests/test_zero3cp.py's blocks, tests/test_cprecomp.py: step 0.946-0.995 (full;
    1.005-1.059 before the runtime's first backward stopped re-gathering w2 / fc2),
    0.961-1.034 (selective), memory total 1.000, activations 1.000-1.017.  At dp = 1
    ZeRO's group is the cp group itself, so the ring's K/V exchange (a collective on the
    cp group, ``parallel/strategies/context_parallel_comm.py`` ``_record``; Ulysses'
    all-to-alls alike) queues behind ZeRO's collectives on that group's one stream:
    priced as the runtime orders them (``ring_program``, ``zero_cost.run_program``;
    0.969-1.025 on tests/test_zerocp3.py's 44 layouts), with recompute its re-run of the
    exchange too (``_recomputed``: ZeRO-2 "full" / "selective", ZeRO-3 "selective"
    0.965-1.017, tests/test_zerocp4.py).

    Lifted last (tests/test_zerocp5.py, a sweep of Llama / GPT x ZeRO 2 / 3 x cp 2 / 4 x
    tp 1 / 2 / 2 + sp x ring / a2a x dp 1 / 2):

    - ZeRO-3 with the Llama's recompute "op" (torchtitan's op-level checkpointing), any
      dp: refused at 1.031-1.069.  What was left was no order of the estimate's but the
      runtime's first backward: a recompute reaching w2 after w2's backward began gathered
      it a second time, queued behind the head's reduce-scatter (~139 us at dp 2 cp 2),
      in the first backward only (``strategies/zero3_clock.py``
      ``_holds_backward_copy``; the dry run runs one micro-batch).  Now 0.984-1.003 at
      dp 2, 0.975-0.992 at dp 1.
    - dp = 1 with "op" (ZeRO-2 and 3; the ring's sends and merges or Ulysses'
      all-to-alls again, the kernels' outputs saved: ``_recomputed``'s ``saved``), and
      ZeRO-3 "full" at dp = 1 (its re-gathered layer runs the recomputed exchange after
      the value projection's re-run: ``zero_cost.recipe_blocks``' ``after_remat``):
      ZeRO-2 op 1.007-1.032, ZeRO-3 op 0.975-0.992, ZeRO-3 full 0.967-0.990 (with full
      recompute's early stop priced with cp, ``_layer``).

    Below 5% still, priced before: GPT dp 2 cp 4 tp 1 ring ZeRO-3 "full" 0.946 (ZeRO-2
    0.954; without recompute 0.982).

    (Full recompute in chunks of k > 1 layers: ``Layout`` refuses it with
    framework='workbench'.)  ``search`` still tries ZeRO-2/3 with cp at dp = 1 without
    recompute only and ZeRO-3 without "op" (``ep_cp_search.candidates``)."""
    return None


def check_layout(model, lay) -> None:
    """What ``check_layout`` checks of ep and cp against the model."""
    moe = M.moe_of(model)
    if moe is None and lay.ep > 1:
        raise ValueError(f"Layout: ep={lay.ep} splits experts, but the model has none "
                         f"(moe_experts=0); use ep=1 or a MoE model "
                         f"(moe_experts=E, moe_topk=k)")
    if moe is not None:
        if moe.experts % lay.ep:
            raise ValueError(f"Layout: ep={lay.ep} does not divide moe_experts={moe.experts} "
                             f"(each expert-parallel rank holds whole experts); use an ep in "
                             f"{[d for d in range(1, moe.experts + 1) if moe.experts % d == 0]}")
        if lay.zero >= 2:
            raise ValueError(f"Layout: zero={lay.zero} with a MoE model is not modeled; use "
                             f"zero<=1 (Megatron-LM's distributed optimizer)")
        if lay.tp > 1 and not lay.sp and lay.engine != "workbench":
            raise ValueError(f"Layout: a MoE model with tp={lay.tp} needs sp=True (Megatron-LM: "
                             f"'When using MoE and tensor parallelism, sequence parallelism "
                             f"must be used'); set sp=True, or framework='workbench' with "
                             f"sp=False for this library's runtime (the MoE MLP whole on "
                             f"every tp rank: plan/moe_cost.py)")
        if lay.tp > 1 and not lay.sp and moe.shared:
            raise ValueError(f"Layout: framework='workbench', tp={lay.tp}, sp=False with "
                             f"moe_shared_experts={moe.shared} is not priced (the runtime keeps "
                             f"the shared experts whole on every tp rank; the planner's layer "
                             f"parameters split them); use moe_shared_experts=0, tp=1, or "
                             f"framework='megatron' with sp=True")
        mt = M.mlp_tp(lay.tp, lay.sp)
        if moe.d_ff % mt or (moe.shared and (moe.shared * moe.d_ff) % mt):
            raise ValueError(f"Layout: tp={lay.tp} must divide the expert width moe_d_ff="
                             f"{moe.d_ff} (experts are tensor-parallel as the dense MLP); "
                             f"choose another tp")
    X.check_cp(model, lay.cp)
    X.check_cp_comm(model, lay)
    # sp with cp: s / cp must divide by tp (layout.check_layout, after this)


def check_estimate(model, lay, attention, fp8, overlap_grad_reduce) -> None:
    """What ``estimate`` refuses of ep and cp (module docstring)."""
    X.check_cp(model, lay.cp, attention, lay.cp_comm)
    check_zero_cp(lay)
    if M.moe_of(model) is not None:
        if fp8:
            raise ValueError("fp8=True with a MoE model is not modeled; use fp8=False")
        if overlap_grad_reduce:
            raise ValueError("overlap_grad_reduce=True with a MoE model is not modeled (its "
                             "expert gradients reduce over their own group); use False")
        if lay.tp > 1 and lay.sp and lay.engine == "workbench":
            # the runtime's MoE block on tp ranks' sequence shards (Hybrid runs it with ep =
            # 1): neither its dispatch over shards nor its reshards are priced, and the dry
            # run refuses it (dryrun_ep_cp.check); was priced as Megatron-Core's experts
            # split over tp, which this runtime does not run
            raise ValueError(f"estimate: framework='workbench' with a MoE model, tp={lay.tp} "
                             f"and sp=True is not priced (this library's runtime keeps the "
                             f"MoE MLP whole on every tp rank; the dry run refuses it too); "
                             f"use sp=False, or framework='megatron' (Megatron-Core's experts "
                             f"split over tp with sequence parallelism)")


def applies(model, lay) -> bool:
    """Whether a layer of ``model`` on ``lay`` needs this module's pricing."""
    return lay.cp > 1 or M.moe_of(model) is not None
