"""Model states and the parameters they count: ZeRO's partitioned weights, gradients and
optimizer state per rank (:func:`model_state_bytes`), a layer's and a pipeline stage's
parameters on a rank (:func:`layer_params`, :func:`stage_params`), and the argument
checks the memory functions share (:func:`_check`)."""
from __future__ import annotations


K_ADAM = 12          # bytes of optimizer state per parameter (ZeRO sec. 3.1)


def _check(fn, name, v, ok, fix):
    """A clear error for an argument these public functions were given (a typo here
    read as another case: recompute="Full" as "none", zero=4 as 3, stage=-1 as a
    stage)."""
    if not ok:
        raise ValueError(f"{fn}: {name}={v!r}; {fix}")


def _is_int(v, lo):
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


def _is_number(v):
    """A real number that is not a bool (nan fails every comparison, so ``>= 0`` too)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def model_state_bytes(psi: float, dp: int, zero: int, k: int = K_ADAM) -> dict:
    """{"params", "grads", "optimizer"} bytes per rank for ``psi`` parameters under ZeRO
    ``zero`` over ``dp`` ranks (ZeRO Figure 1: psi=7.5e9, N_d=64 -> 120, 31.4, 16.6,
    1.875 GB for stages 0-3)."""
    _check("model_state_bytes", "zero", zero, zero in (0, 1, 2, 3) and _is_int(zero, 0),
           "ZeRO stages are 0, 1, 2 or 3")
    _check("model_state_bytes", "dp", dp, _is_int(dp, 1), "give the data-parallel ranks, "
           "an int >= 1")
    _check("model_state_bytes", "psi", psi, _is_number(psi) and psi >= 0,
           "give the parameters, a number >= 0")
    _check("model_state_bytes", "k", k, _is_number(k) and k >= 0,
           f"give the optimizer's bytes per parameter, a number >= 0 (Adam: {K_ADAM})")
    return {"params": 2 * psi / (dp if zero >= 3 else 1),
            "grads": 2 * psi / (dp if zero >= 2 else 1),
            "optimizer": k * psi / (dp if zero >= 1 else 1)}


def layer_params(cfg, tp: int) -> float:
    """Parameters of one layer on one tensor-parallel rank (Llama: ``llama_layer``; a MoE:
    all but its routed experts, which ``ep_cp.expert_states`` counts over ep)."""
    _check("layer_params", "tp", tp, _is_int(tp, 1), "give the tensor-parallel ranks, an "
           "int >= 1")
    if getattr(cfg, "moe_experts", 0):
        from .moe_cost import dense_layer_params
        return dense_layer_params(cfg, tp)
    if cfg.arch == "llama":
        from .llama_layer import layer_params as llama_params
        return llama_params(cfg, tp)
    h, f = cfg.d_model, cfg.d_ff
    sharded = 4 * h * h + 2 * h * f + 3 * h + f      # q,k,v,o; fc1, fc2; q,k,v and fc1 bias
    return sharded / tp + 6 * h                       # o and fc2 bias, 2 LayerNorms (w, b)


def stage_params(cfg, tp: int, pp: int, stage: int, layers: "int | None" = None) -> float:
    """Parameters on a rank of pipeline ``stage`` (0 .. pp-1): its n_layer / pp layers
    (``layers``: that many), plus the embeddings on the first stage and the final
    LayerNorm and head on the last (Llama: no position table, an RMSNorm of h)."""
    _check("stage_params", "tp", tp, _is_int(tp, 1), "give the tensor-parallel ranks, an "
           "int >= 1")
    _check("stage_params", "pp", pp, _is_int(pp, 1), "give the pipeline stages, an int >= 1")
    _check("stage_params", "stage", stage, _is_int(stage, 0) and stage < pp,
           f"give a pipeline stage in 0 .. pp - 1 = {pp - 1}")
    _check("stage_params", "layers", layers, layers is None or _is_int(layers, 0),
           "give the stage's layers, an int >= 0, or None (n_layer / pp)")
    h, V, s = cfg.d_model, cfg.vocab_size, cfg.seq_len
    llama = cfg.arch == "llama"
    n = (cfg.n_layer // pp if layers is None else layers) * layer_params(cfg, tp)
    if stage == 0:
        n += V * h / tp + (0 if llama else s * h)
        n += 2 * h if getattr(cfg, "embed_norm", False) else 0    # BLOOM's embedding LN
    if stage == pp - 1:
        n += h if llama else 2 * h
        if pp > 1 or not cfg.tie_embeddings:
            n += V * h / tp                            # tied copy (pp > 1) or untied head
    return n
