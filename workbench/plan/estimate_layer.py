"""The layer an estimate prices (:func:`layer_for`) and the checks that its framework
runs the layout with the options given (:func:`check_runs`)."""
from __future__ import annotations

from . import costs as C
from . import deepspeed_step as DS
from . import ep_cp as EC
from . import tp_overlap as TPO
from . import megatron_2021 as M21
from .layout import Layout
from .memory import _regather


def layer_for(cfg, lay: Layout, prof, attention: str, fp8: bool = False,
              tp_comm_overlap: bool = False, async_allreduce: bool = True,
              transformer_engine: bool = False):
    """One layer's ``costs.LayerCost`` for one micro-batch on a rank of ``lay``, as
    :func:`estimate` prices it (``prof``: the profile it prices on), with EP and CP
    (``plan.ep_cp``) or without; ``async_allreduce=False``: ``plan.megatron_2021``;
    ``transformer_engine``: Megatron-LM's TE spec (``layer_cost.TE_SOURCES``)."""
    if EC.applies(cfg, lay):
        if transformer_engine:
            raise ValueError(f"layout {lay.short()}: transformer_engine=True is modeled "
                             f"for Megatron-LM's dense GPT layer (layer_cost.TE_SOURCES), "
                             f"not with expert / context parallelism: give "
                             f"transformer_engine=False")
        _check_ep_cp_async(lay, async_allreduce)
        return EC.layer_cost(cfg, lay, prof, attention, fp8)
    return C.layer_cost(cfg, lay.micro_batch, lay.tp, lay.sp, lay.recompute, prof, attention,
                        fp8, tp_comm_overlap and lay.tp > 1, async_allreduce or lay.tp == 1,
                        lay.engine != "workbench",   # the recipe: 16-bit param.grad,
                        # torch.utils.checkpoint's early stop: the recipe's and torchtitan's
                        # (non-reentrant; torchtitan_breakdown's "relative errors")
                        lay.engine in ("workbench", "fsdp"),
                        split_qkv=lay.engine == "workbench",    # the GPT's wq, wk, wv;
                        # torchtitan's DTensor TP keeps the gathered input: no re-gather
                        regather=_regather(cfg, lay), transformer_engine=transformer_engine)


def check_runs(model, layout, cluster, attention: str, fp8: bool = False,
               overlap_grad_reduce: bool = False, tp_comm_overlap: bool = False) -> None:
    """Raise ValueError naming the fix where the layout's framework does not run it with
    these options (beyond ``check_layout``): expert / context parallelism's
    (``ep_cp.check_estimate``), Megatron-LM's TP overlap's (``tp_overlap``), DeepSpeed's
    pipeline engine's (``deepspeed_step.check``)."""
    EC.check_estimate(model, layout, attention, fp8, overlap_grad_reduce)
    TPO.check_estimate(model, layout, cluster.profile, fp8, tp_comm_overlap,
                       EC.applies(model, layout))
    if layout.engine == "deepspeed" and layout.pp > 1:
        DS.check(model, layout, overlap_grad_reduce)    # its pipeline engine: deepspeed_step
    if EC.applies(model, layout):
        # DeepSpeed's layers run no async TP all-reduce (megatron_2021.resolve)
        _check_ep_cp_async(layout, M21.resolve(layout, None, None)[0])


def _check_ep_cp_async(lay: Layout, async_allreduce: bool) -> None:
    """Expert / context parallelism is priced with the asynchronous TP all-reduce only."""
    if not async_allreduce and lay.tp > 1:
        raise ValueError(f"layout {lay.short()}: expert / context parallelism is priced "
                         f"with Megatron-LM's asynchronous TP all-reduce (2021-09 on); "
                         f"async_tensor_model_parallel_allreduce=False is not modeled there: "
                         f"leave it None, or use tp=1")
