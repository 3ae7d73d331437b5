"""The dry run's recipe for expert and context parallelism (``plan.dryrun``).

- ``Layout(ep=e)`` on a MoE model: ``Hybrid(dp=dp / e, ep=e, ...)`` (the recipe carves
  the expert-parallel group out of the data-parallel ranks, as the planner's layout:
  ``recipes.moe``), its MoE layers routed on meta tensors by :mod:`.meta_moe` (balanced
  by default, what the planner assumes; or given counts);
- ``Layout(cp=c)``: ``ContextParallel(cp=c, dp=, tp=, sp=, cp_comm=)``
  (``recipes.context_parallel``: ring attention, or DeepSpeed-Ulysses' all-to-all with
  ``cp_comm="a2a"``, with tp too; causal load balancing), the rank order tp, cp, dp of
  ``plan.ep_cp``.

- a MoE model with tp > 1 (sp=False): the runtime keeps the MoE MLP whole on every tp
  rank (router, experts, shared experts: ``models.split.tp_plan``), the experts split
  over ep only; the planner prices that layout as ``Layout(framework="workbench",
  sp=False)`` (``plan.moe_cost``: ``mlp_tp``), and the dry run compares with it.

Refused with the fix (the runtime does not run them, or not as the planner prices them):
a MoE model with tp > 1 and sp (the planner prices Megatron-Core's experts split over
tp with sequence parallelism; the runtime refuses ep with sp and keeps the MLP whole on
every tp rank: no like-for-like comparison), cp with pp > 1 or ep > 1
(``ContextParallel`` does not build them; a MoE model under cp runs
its experts with ep = 1 on whole sequences: ``recipes.moe.keep_sequence_order``, priced
by the estimate of framework "workbench" (``plan.ep_cp._whole_sequences``: was 1.51x the
step on tests/test_dryrun_ep_cp.py's model at cp 2, now within 0.1%; where cp does not
divide the micro-batch the layer runs replicated over cp, each rank its own copy of the
whole sequences' tensors, as the planner counts them (``moe_cost.dense_groups``); the
dry run counted the simulator's stacked copies of the experts' GEMM outputs cp times,
1.36x the activations, until ``meta_run.SavedCounter._slots``: now 1.005x). cp with tp > 1 runs, with or without
sp (measured on tests/test_dryrun_ep_cp.py's model, cp 2 tp 2: step 1.08x the estimate,
memory total 1.005x; with sp: step 1.053x, activations 1.003x; sp was once dropped here,
the recipe built without it: activations 1.103x).  cp with ZeRO-3 runs
(``ContextParallel(zero=3)``: FSDP over dp x cp), with recompute too (was refused: the
recomputed attention ran off the ring, raising on meta tensors, until
``context_parallel_autograd`` ran a backward started from ZeRO-3's laid-out loss with the
ring active; tests/test_cprecomp.py).

A MoE model with ep = 1 runs the model's own dispatch: every expert on its (B, E, C, h)
buffer, C = S when dropless (GShard's einsum), E / k times the routed rows; the estimate
of framework "workbench" prices it so (``plan.moe_cost.dense_dispatch``; was priced as
the routed rows: the dry run 1.35x its step and 2.35x its activations on
tests/test_dryrun_ep_cp.py's model, now within 0.1%).

The EP un-permute saves what the planner counts (was one R x h buffer more per MoE
block, its scatter's source, until ``ExpertParallel._unpermute`` used ``index_put``:
activations 1.03-1.06x the estimate's, now 1.000-1.002x; tests/test_moeclk8.py).  (With dp > 1 and ZeRO the cp recipe shards the optimizer states over dp x cp,
as the planner prices it: tests/test_zerocp.py; was over dp alone, 2.0x the optimizer
states and 1.34x the step at dp 2, cp 2, zero 1.)
"""
from __future__ import annotations

__all__ = ["check", "recipe", "stage_optimizers"]

_SCHEDULE = {"1f1b": "1f1b", "gpipe": "gpipe", "interleaved_1f1b": "interleaved"}


def check(model, lay) -> None:
    moe = bool(getattr(model, "moe_experts", 0))
    if moe and lay.tp > 1 and lay.sp:
        raise ValueError(f"dry_run: a MoE model with tp={lay.tp} and sp=True: the planner "
                         f"prices experts split over tp with sequence parallelism "
                         f"(Megatron-Core), the runtime keeps the MoE MLP whole on each tp "
                         f"rank and refuses ep with sp; dry-run it with sp=False (estimate: "
                         f"framework='workbench', sp=False), or use wb.plan.estimate")
    if lay.cp > 1:
        bad = [("pp", lay.pp)] if lay.pp != 1 else []
        if lay.ep > 1:
            bad.append(("ep", lay.ep))
        if bad:
            n, v = bad[0]
            raise ValueError(f"dry_run: cp={lay.cp} with {n}={v} is not run by the context-"
                             f"parallel recipe (recipes.context_parallel: dp x cp x tp with or "
                             f"without sp, ZeRO 0-3, no pp or ep); change {n}, or use "
                             f"wb.plan.estimate")


def recipe(lay):
    """The recipe the layout describes (module docstring)."""
    if lay.cp > 1:
        from ..recipes.context_parallel import ContextParallel
        return ContextParallel(cp=lay.cp, dp=lay.dp, tp=lay.tp, sp=lay.sp, zero=lay.zero,
                               cp_comm=lay.cp_comm)
    from ..recipes.hybrid import Hybrid
    return Hybrid(dp=lay.dp // lay.ep, ep=lay.ep, tp=lay.tp, pp=lay.pp, sp=lay.sp,
                  zero=lay.zero, schedule=_SCHEDULE[lay.schedule], microbatches=lay.m,
                  virtual=lay.v if lay.schedule == "interleaved_1f1b" else None,
                  stage_sizes=lay.stages)


def stage_optimizers(h, opts, model=None) -> list[list]:
    """The recipe's optimizers per layer-stage: one each, or with expert parallelism the
    dense one and, after it, the experts' (``Hybrid.build_optimizer``); none (``[]``) for
    a middle stage of 0 layers, which holds no parameter and gets no optimizer
    (``Hybrid._stage_holds_params``: ``Layout(stages=(2, 0, 2))``)."""
    emeshes = getattr(h, "expert_meshes", [])
    holds = getattr(h, "_stage_holds_params", None)
    empty = ({s for s in range(len(h.stage_layers)) if not holds(model, s)}
             if model is not None and holds is not None else set())
    out = []
    for o in opts:
        if out and emeshes and getattr(o, "mesh", None) in emeshes:
            out[-1].append(o)
        else:
            while len(out) in empty:
                out.append([])
            out.append([o])
    while len(out) in empty:
        out.append([])
    if len(out) != len(h.stage_layers):
        raise RuntimeError(f"dry_run: {len(out)} optimizer groups for {len(h.stage_layers)} "
                           f"stages (a bug in grouping the recipe's optimizers)")
    return out
