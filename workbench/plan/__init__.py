"""Plan a cluster: will a layout fit, how fast is it, and which layout is best.

    import workbench as wb
    cfg = wb.models.get_config("gpt3-175b")                # Megatron's GPT, GPT-3's shape
    cl  = wb.plan.Cluster(profile="a100", devices=1024)
    lay = wb.plan.Layout(dp=16, tp=8, pp=8, recompute="full", micro_batch=1,
                         global_batch=1536)
    est = wb.plan.estimate(cfg, lay, cl)                   # analytic, about a millisecond
    print(est, est.memory, est.breakdown)
    best = wb.plan.search(cfg, cl, global_batch=1536, top=5)
    print(best)                                            # a table, and why #1 beats #2
    dr  = wb.plan.dry_run(cfg, lay, cl)    # the real model on meta tensors (``dryrun``)

Formulas and their sources: ``memory`` (ZeRO; Korthikanti et al. 2022 Table 2),
``costs`` (per-layer FLOPs and TP communication), ``layer_cost`` (one GPT layer op by op, Table 4), ``estimate`` (pipeline, DP sync, MFU), ``ep_cp`` (expert and context parallelism:
``moe_cost``, ``context_cost``; ``presets``: Mixtral-8x7B, 128K-context Llama 3), ``frameworks`` (what
Megatron-LM, DeepSpeed and this library's recipe do differently: gradient dtype,
ZeRO granularity; ``Layout(framework=...)``; ``megatron_2021``: Megatron-LM's layer before
its async TP all-reduce and fused gradient accumulation, as Megatron-DeepSpeed still ran
it), ``zero_cost`` (ZeRO's collectives against
compute), ``zero3_count`` (DeepSpeed ZeRO-3's collectives per step, counted as its
coordinator runs them and priced, latency apart).  ``Estimate.assumptions()`` lists
what an estimate rests on beyond cited measurements; ``estimate_range`` (``ranges``) re-prices it with the profile's uncertain
figures at their stated bounds.
"""
from .layout import Cluster, Layout, SCHEDULES, check_layout
from .estimate import Estimate, estimate
from .search import Ranking, search
from .dryrun import DryRun, dry_run
from .ranges import EstimateRange, estimate_range
from . import memory, costs, frameworks, zero3_count, presets

__all__ = ["Cluster", "Layout", "SCHEDULES", "check_layout", "Estimate", "estimate", "search",
           "Ranking", "memory", "costs", "frameworks", "zero3_count", "DryRun", "dry_run",
           "EstimateRange", "estimate_range", "presets"]
