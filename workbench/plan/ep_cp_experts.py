"""The routed experts' model states and gradient sync: their states on a rank
(:func:`expert_states`), the parameters this library's recipe reduces with the dense
ones (:func:`merged_expert_params`) and the expert-data-parallel reduction
(:func:`expert_sync`)."""
from __future__ import annotations

from ..sim_mesh.cost import wire_bytes
from . import costs as C
from . import moe_cost as M


def expert_states(model, lay, layers: int, grad_extra: int = 0) -> dict:
    """{"params", "grads", "optimizer", "buffers"} bytes of the routed experts of
    ``layers`` layers on one rank: E / ep experts per layer, split by ``moe_cost.mlp_tp``
    (t; whole on the runtime's layout, framework "workbench" with sp=False), their ZeRO-1
    optimizer states over the expert-data-parallel group of dp x cp / ep ranks;
    ``grad_extra`` bytes per parameter of the framework's gradient buffer."""
    if not getattr(model, "moe_experts", 0):
        return {}
    from .memory import model_state_bytes
    psi = layers * M.rank_expert_params(model, lay.tp, lay.ep, lay.sp)
    out = model_state_bytes(psi, lay.dp * lay.cp // lay.ep, lay.zero)
    out["buffers"] = grad_extra * psi
    return out


def merged_expert_params(model, lay, layers: int) -> float:
    """Routed-expert parameters a rank reduces together with its dense ones, in one
    collective: this library's recipe at ep = 1, whose one optimizer (``DataParallel`` /
    ZeRO over dp, or dp x cp) holds every parameter, the experts' gradients in the same
    buckets (the dry run's trace: one "dp bucket" all-reduce of 22.5 MB for a 2-layer
    Llama with 8 experts at dp 2, 110.8 us, where an all-reduce of the dense 5.2 MB and
    one of the experts' 17.3 MB price 126.0 us; tests/test_plan12.py); 0 elsewhere (ep >
    1: the experts' own optimizer over their expert-data-parallel group, Megatron-LM's
    expert buffers of their own: :func:`expert_sync`)."""
    if M.moe_of(model) is None or lay.engine != "workbench" or lay.ep != 1:
        return 0.0
    return layers * M.rank_expert_params(model, lay.tp, lay.ep, lay.sp)


def expert_sync(model, lay, prof, stage: int, layers: int, grad_bytes: int):
    """(seconds, bytes sent, parameters the rank updates) of the routed experts' gradient
    reduction over their expert-data-parallel group, after the dense one (ZeRO-0: an
    all-reduce; ZeRO-1: a reduce-scatter and the updated weights' all-gather)."""
    if M.moe_of(model) is None:
        return 0.0, 0.0, 0.0
    psi = layers * M.rank_expert_params(model, lay.tp, lay.ep, lay.sp)
    ranks = tuple(lay.rank(0, d, stage, c) for d in range(0, lay.dp, lay.ep)
                  for c in range(lay.cp))
    n = len(ranks)
    if n == 1:
        return 0.0, 0.0, psi
    g = grad_bytes * psi
    if lay.zero == 0:
        return (C.group_price("all_reduce", g, ranks, prof),
                wire_bytes("all_reduce", int(g), n), psi)
    t = C.group_price("reduce_scatter", g, ranks, prof) + \
        C.group_price("all_gather", 2 * psi, ranks, prof)
    return t, wire_bytes("reduce_scatter", int(g), n) + wire_bytes("all_gather",
                                                                   int(2 * psi), n), psi / n
