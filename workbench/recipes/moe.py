"""Mixture-of-experts wiring for the hybrid recipe: the MoE layers of a course model
(``workbench/models/moe.py``) and expert parallelism
(``workbench/parallel/strategies/expert_parallel.py``, which knows no model).

How EP maps onto the mesh (Megatron-LM's convention, ``--expert-model-parallel-size``;
DeepSpeed-MoE's ``ep_size`` likewise): the EP group is carved out of the data-parallel
ranks.  ``Hybrid(dp=d, ep=e)`` runs the dense layers data parallel over d x e ranks
(each its own slice of the batch: Megatron's data-parallel size), and the experts over
the same ranks seen as an (edp=d, ep=e, tp) mesh: each ep rank owns E / e experts, the
d ranks of an "expert data parallel" group hold the same experts and reduce their
gradients among themselves.  So ``--ep 2 --dp 2`` is 4 ranks and ``--ep 2 --tp 2`` is
4 ranks (dense layers: dp 2 x tp 2; experts: ep 2, whole and replicated over tp, every
tp rank routing the same tokens; not Megatron-Core's default, which splits each expert
over tp with sequence parallelism: the planner prices both, ``plan.moe_cost``
``mlp_tp``): ``--dp`` counts the expert-data-parallel replicas, as
Megatron's derived ``expert_data_parallel_size = dp_total / ep``.

* :func:`scale_aux_losses`: a pipeline averages m micro-batch losses, so each layer's
  load-balancing gradient is scaled by 1/m (Megatron-LM's
  ``MoEAuxLossAutoScaler.set_loss_scale``);
* :func:`check_ep` / :func:`check_moe_layout`: what EP needs, refused with the fix;
* :func:`wire_expert_parallel`: each stage's MoE layers get their experts sharded over ep
  and an :class:`~workbench.parallel.strategies.expert_parallel.ExpertParallel`
  dispatcher; :func:`split_params`: dense parameters (the stage mesh) apart from expert
  ones (the expert mesh), each reduced over its own data-parallel group.
"""
from __future__ import annotations

import contextlib

import torch

from ..models.moe import moe_layers
from ..ops.moe import one_batch
from ..parallel.placement import Replicate
from ..parallel.seq_order import reordering
from ..parallel.strategies.expert_parallel import (check_expert_parallel, expert_mesh,
                                                   expert_parallel)

__all__ = ["scale_aux_losses", "whole_batch_stats", "check_ep", "check_ep_batch", "check_moe_layout", "wire_expert_parallel",
           "split_params", "expert_meshes", "keep_residual_layout", "keep_sequence_order",
           "add_moe_arguments",
           "moe_overrides", "moe_record"]


def scale_aux_losses(model, microbatches: int) -> None:
    """Every MoE layer's aux-loss gradient scaled by 1/``microbatches``."""
    for layer in moe_layers(model):
        layer.aux_loss_scale = 1.0 / microbatches


@contextlib.contextmanager
def whole_batch_stats(model, *copies):
    """While a pipeline runs one batch as micro-batches: each MoE layer's ``last_stats``
    (and ``models.moe.aux_loss``, ``train``'s ``moe_aux_loss`` / ``moe_dropped``) counts
    every micro-batch's routing, as one device's forward of the whole batch counts it
    (``ops.moe.one_batch``, as the simulated data-parallel wrappers keep every rank's
    rows); ``copies``: other copies of the model that ran some of the micro-batches
    (DualPipe's second copy), whose routing is added to ``model``'s layers.  Was: the
    last micro-batch's alone (Hybrid(pp=2): 64 of a batch's 256 routed assignments; a
    ``train`` record of Hybrid(schedule="interleaved", microbatches=2) on one rank gave
    half the drops of one device, silently)."""
    with one_batch():
        yield
        for twin in copies:
            for mine, theirs in zip(moe_layers(model), moe_layers(twin)):
                mine.add_stats_of(theirs)


def check_ep(ep, ep_chunks, zero, sp) -> None:
    """Hybrid's ``ep`` and ``ep_chunks`` arguments, before any mesh is built."""
    for n, v in (("ep", ep), ("ep_chunks", ep_chunks)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"Hybrid({n}={v!r}): give an int >= 1 (ep: the ranks the experts "
                             "are split over, 1: none; ep_chunks: pieces of the all-to-all "
                             "overlapped with the experts' compute, 1: none)")
    if ep > 1 and zero == 3:
        raise NotImplementedError("Hybrid(ep > 1, zero=3): ZeRO-3 over expert-parallel "
                                  "experts is not built; use zero=1 or 2 (the optimizer "
                                  "states are sharded over each data-parallel group)")
    if ep > 1 and sp:
        raise NotImplementedError("Hybrid(ep > 1, sp=True): expert parallelism takes the "
                                  "whole sequence on every tp rank; leave sp False")


def check_moe_layout(cfg, ep: int) -> None:
    """EP needs a MoE model whose experts it divides."""
    E = getattr(cfg, "moe_experts", 0)
    if ep > 1 and not E:
        raise ValueError(f"ep={ep} needs a mixture-of-experts model: add --moe-experts E "
                         f"(ModelConfig(moe_experts=E)) with E a multiple of {ep}, or leave "
                         "ep at 1")
    if E:
        check_expert_parallel(E, ep)


def check_ep_batch(edp: int, ep: int, batch_size: int) -> None:
    """Each of the edp x ep data-parallel ranks takes whole sequences: said in EP's terms
    (the recipe's own check would name dp = edp x ep, a number nobody typed)."""
    if ep > 1 and (batch_size < edp * ep or batch_size % (edp * ep)):
        raise ValueError(f"batch_size={batch_size} over dp={edp} x ep={ep} = {edp * ep} "
                         "data-parallel ranks (expert parallelism is carved out of them, "
                         "each takes its own whole sequences): give a batch size that is a "
                         f"multiple of {edp * ep}, or lower dp or ep")


def expert_meshes(meshes, ep: int) -> list:
    """Each stage mesh's (edp, ep, tp) view (its "dp" dim holds edp x ep ranks)."""
    return [expert_mesh(m, ep) for m in meshes]


def wire_expert_parallel(model, stages, meshes, emeshes, pp: int, chunks: int, own) -> None:
    """Shard each MoE layer's experts over its stage's expert mesh and give the layer an
    expert-parallel token dispatcher (stages this process does not run are left alone)."""
    for s, stage in enumerate(stages):
        if not own(meshes[s % pp]):
            continue
        for i in stage["layers"]:
            for layer in moe_layers(model.layers[i]):
                layer.token_dispatcher = expert_parallel(layer.experts, emeshes[s % pp],
                                                         chunks)


def split_params(params, mesh) -> tuple[list, list]:
    """(parameters on ``mesh``, parameters elsewhere: the experts on the expert mesh)."""
    dense = [p for p in params if p.mesh == mesh]
    return dense, [p for p in params if p.mesh != mesh]


# ---- the train command's flags (``python -m workbench train``) -----------------------------

def add_moe_arguments(parser) -> None:
    """The mixture-of-experts and expert-parallel flags of ``train``."""
    g = parser.add_argument_group("mixture of experts (models/moe.py) and expert parallelism")
    g.add_argument("--moe-experts", type=int, default=0,
                   help="routed experts per block (0: dense MLP)")
    g.add_argument("--moe-topk", type=int, default=2, help="experts per token")
    g.add_argument("--moe-capacity-factor", type=float, default=None,
                   help="slots per expert = ceil(cf S k / E) per sequence; default: no drops")
    g.add_argument("--moe-shared-experts", type=int, default=0, help="always-on experts")
    g.add_argument("--moe-gating", default="softmax", choices=["softmax", "sigmoid"],
                   help="router gating: softmax (Mixtral) or sigmoid (DeepSeek-V3)")
    g.add_argument("--moe-aux-loss-coef", type=float, default=0.01,
                   help="load-balancing loss coefficient (Switch: 0.01)")
    g.add_argument("--moe-no-norm-topk", dest="moe_norm_topk", action="store_false",
                   help="gate each token's k experts by the router's own probabilities "
                        "(Switch's top-1 gate) instead of renormalising them to sum 1")
    g.add_argument("--ep", type=int, default=1,
                   help="expert-parallel size, carved out of the data-parallel ranks: "
                        "--ep 2 --dp 2 is 4 ranks (Megatron-LM's convention)")
    g.add_argument("--ep-chunks", type=int, default=1,
                   help="pieces of the all-to-all overlapped with the experts' compute "
                        "(pays off when the exchange is bandwidth-bound: each piece pays the "
                        "link latency and re-reads the expert weights)")


MOE_FLAGS = (("moe_experts", 0), ("moe_topk", 2), ("moe_capacity_factor", None),
             ("moe_shared_experts", 0), ("moe_gating", "softmax"), ("moe_aux_loss_coef", 0.01),
             ("moe_norm_topk", True))


def moe_overrides(args) -> dict:
    """The ModelConfig fields the MoE flags set (none when --moe-experts is 0; a MoE flag
    without it is refused rather than ignored)."""
    given = {n: getattr(args, n, d) for n, d in MOE_FLAGS}
    if not given["moe_experts"]:
        stray = [n for n, d in MOE_FLAGS[1:] if given[n] != d]
        if stray:
            flag = ("moe-no-norm-topk" if stray[0] == "moe_norm_topk"
                    else stray[0].replace("_", "-"))
            raise ValueError(f"--{flag} applies to a mixture-of-experts "
                             "model; add --moe-experts E (e.g. 4) or leave it out")
        return {}
    return given


def keep_residual_layout(model, layers) -> None:
    """Each MoE layer's output laid out as its input (a forward hook): under sequence
    parallelism the residual stream stays sharded on the sequence over tp, as the dense
    MLP's g (reduce-scatter) leaves it; the router needs whole sequences, so the layer
    gathers them and its output would otherwise come back replicated."""
    from ..parallel.ops_table.layout_hooks import keep_layout

    def hook(mod, args, out):       # (one op to wb.compile's capture: ops_table/layout_hooks)
        return keep_layout(out, args[0])
    for i in layers:
        for layer in moe_layers(model.layers[i]):
            layer.register_forward_hook(hook)


def keep_sequence_order(model, mesh_dim: str, balanced: bool) -> None:
    """Each MoE layer of a context-parallel model (the residual stream in ring order,
    sharded over ``mesh_dim``; ``recipes/context_parallel.py``) routes as one device does.

    The router takes whole sequences (each one a routing group: ``ops/moe.py``), so the
    layer's input is laid out batch-sharded over cp (an all-to-all: each cp rank whole
    sequences of its own), and with a capacity under load balancing put back in sequence
    order (a local reordering), since tokens claim slots in sequence order.  The output
    goes back to the input's layout (ring order, sequence-sharded), where the next
    attention finds it.  A batch the cp ranks do not divide runs the layer replicated over
    cp on simulated ranks; under torch.distributed each rank would then attach the whole
    load-balancing gradient to its copy, which the data-parallel sum over cp would count
    cp times, so it is refused there."""
    import math

    from ..parallel.reshard import reshard
    from ..parallel.placement import Shard
    from ..parallel.strategies.context_parallel import slot_positions
    from ..sim_mesh import backends as _B
    laid = {}

    def sequences(x):
        """x's placements with whole sequences: the batch over cp where it divides."""
        mesh, cp = x.mesh, x.mesh.dim(mesh_dim)
        ps = [Replicate() if p == Shard(1) else p for p in x.placements]
        over = math.prod(mesh.shape[i] for i, p in enumerate(ps) if p == Shard(0))
        if x.shape[0] % (over * mesh.shape[cp]) == 0:
            ps[cp] = Shard(0)
        elif _B.is_distributed(mesh):
            raise NotImplementedError(
                f"context parallelism with a mixture of experts: a batch of {x.shape[0]} "
                f"sequences over {over} data-parallel x {mesh.shape[cp]} cp ranks; under "
                "torch.distributed each cp rank routes whole sequences of its own, so give "
                f"a batch that is a multiple of {over * mesh.shape[cp]}")
        return ps

    def order(mod, x, inverse):
        if not (balanced and mod.capacity_factor is not None):
            return x                    # routing token by token: the order is no matter
        perm = slot_positions(x.shape[1], x.mesh.shape[x.mesh.dim(mesh_dim)], True)
        perm = torch.argsort(perm) if inverse else perm
        with reordering():              # (ring order <-> sequence order, on purpose)
            return torch.index_select(x, 1, perm.to(x.device))

    def pre(mod, args):
        x = args[0]
        if not hasattr(x, "placements"):
            return None
        laid[id(mod)] = list(x.placements), getattr(x, "_ring_order", None)
        ps = sequences(x)
        x = reshard(x, x.mesh, ps) if ps != list(x.placements) else x
        return (order(mod, x, True),) + tuple(args[1:])

    def post(mod, args, out):
        ps, seq = laid.pop(id(mod), (None, None))
        if ps is None or not hasattr(out, "placements"):
            return out
        whole = sequences(out)
        if list(out.placements) != whole:
            out = reshard(out, out.mesh, whole)
        out = order(mod, out, False)
        if list(out.placements) != ps:
            out = reshard(out, out.mesh, ps)
        # token by token, in the input's order: the input's recorded order (seq_order.py)
        out._ring_order = seq
        return out
    for layer in moe_layers(model):
        layer.register_forward_pre_hook(pre)
        layer.register_forward_hook(post)


def moe_record(model, strategy) -> dict:
    """What a training step's record adds for a MoE model (``train``): ``moe_aux_loss``,
    the load-balancing loss the step trained on (sum over layers of alpha x the batch
    mean), and ``moe_dropped``, the (token, choice) pairs dropped over capacity; read from
    each layer's last forward, which under a pipeline holds every micro-batch of the step
    (:func:`whole_batch_stats`).  Left out on torch.distributed with pp > 1, where a
    process runs only its own stages' layers."""
    layers = moe_layers(model)
    if not layers or (getattr(strategy, "pp", 1) > 1 and getattr(strategy, "distributed",
                                                                  False)):
        return {}
    stats = [layer.last_stats for layer in layers]
    return {"moe_aux_loss": sum(s["aux_loss"] for s in stats),
            "moe_dropped": sum(s["dropped"] for s in stats)}
