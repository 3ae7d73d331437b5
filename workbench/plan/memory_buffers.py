"""The working buffers ZeRO-3 and FSDP2 hold beyond the model states: the gathered
parameters at their peak (:func:`zero3_gathered_numel`) of each module
(:func:`zero3_modules`) or unit (:func:`_fsdp_units`), and the gradients not yet
reduce-scattered (:func:`_zero3_unreduced_grad_numel`, :func:`_fsdp_buffers`)."""
from __future__ import annotations

from functools import lru_cache

from .memory_states import layer_params


def zero3_gathered_numel(numels, prefetch: int) -> int:
    """Peak elements of gathered parameters ZeRO-3 holds over one forward and backward
    of modules of ``numels`` elements (forward order): the module computing and the ones
    after it (before it, in backward) whose gathers were issued while fewer than
    ``prefetch`` elements were ahead: DeepSpeed's ``PartitionedParameterCoordinator.
    fetch_sub_module`` (deepspeed/runtime/zero/partitioned_param_coordinator.py) pops
    its trace's parameter queue while ``numel_prefetching`` < min(stage3_max_live_
    parameters - available, ``stage3_prefetch_bucket_size``), the latter 5e7 elements by
    default (deepspeed/runtime/zero/config.py); as ``strategies.zero3``'s ledger counts.
    The tied embedding counts wherever it is gathered."""
    return _gathered_numel(tuple(numels), prefetch)


@lru_cache(maxsize=256)
def _gathered_numel(numels: tuple, prefetch) -> int:
    """:func:`zero3_gathered_numel` (cached: a search asks it for every ZeRO-3 candidate,
    whose modules differ only in tp, dp and the stage)."""
    best = 0
    for seq in (list(numels), list(numels)[::-1]):
        k = len(seq)
        for i, n in enumerate(seq):
            tot, ahead = n, 0
            for j in range(i + 1, k):       # by index: a slice would copy the rest each time
                if ahead >= prefetch:
                    break
                m = seq[j]
                tot += m
                ahead += m
            best = max(best, tot)
    return best


def zero3_modules(cfg, tp: int, pp: int, stage: int, dp: int,
                  layers: "int | None" = None) -> list[int]:
    """Elements of each module ZeRO-3 gathers on a rank of ``stage``, forward order (GPT:
    word and position embeddings (and their LayerNorm, ``embed_norm``); per layer LN, q,
    k, v, o, LN, fc1, fc2; final LN; the head's tied copy when pp > 1 or an untied head),
    each padded to a multiple of dp."""
    h, f, V, s = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.seq_len
    llama = cfg.arch == "llama"
    qkv = h * h // tp + h // tp
    if llama:          # Llama: no position table, no biases, RMSNorm weights only
        from .llama_layer import zero3_layer
        layer = zero3_layer(cfg, tp)
    else:
        layer = [2 * h, qkv, qkv, qkv, h * h // tp + h, 2 * h, h * f // tp + f // tp,
                 f * h // tp + h]
    mods = []
    if stage == 0:
        mods += [V * h // tp] + ([] if llama else [s * h])
        mods += [2 * h] if getattr(cfg, "embed_norm", False) else []   # BLOOM's LN
    mods += layer * (cfg.n_layer // pp if layers is None else layers)
    if stage == pp - 1:
        mods.append(h if llama else 2 * h)
        if pp > 1 or not cfg.tie_embeddings:
            mods.append(V * h // tp)
    return [-(-n // dp) * dp for n in mods]


def _zero3_unreduced_grad_numel(cfg, lay, mods) -> tuple[float, float]:
    """(bucket, gradients): 16-bit elements a ZeRO-3 rank holds before their
    reduce-scatter.  DeepSpeed (``stage3.py``, ``contiguous_gradients``): the reduce
    bucket, a buffer of ``reduce_bucket_size`` elements allocated once (v0.3.13's 6.7e7 of
    DeepSpeedExamples' config, ``zero3_2021``; today's default 5e8, ``zero_cost``), into
    which each parameter's gradient is copied and then freed; a parameter above the
    bucket's size is reduced as its own bucket: the largest parameter's gradient whole.
    This library's recipe: no bucket, one layer's whole gradient (an assumption, the dry
    run's)."""
    if lay.engine in ("deepspeed", "deepspeed-0.3"):
        from .zero_cost import REDUCE_BUCKET_NUMEL
        from .zero3_2021 import REDUCE_BUCKET_NUMEL as BUCKET_2021
        bucket = BUCKET_2021 if lay.engine == "deepspeed-0.3" else REDUCE_BUCKET_NUMEL
        return float(bucket), float(max(mods))
    return 0.0, float(layer_params(cfg, lay.tp))


def _fsdp_units(cfg, lay, stage: int, nl: int) -> list:
    """Parameters of FSDP2's units on a rank of ``stage``, forward order (``frameworks``:
    one unit per block, the embedding and the final norm with the head their own)."""
    h, V, s, tp = cfg.d_model, cfg.vocab_size, cfg.seq_len, lay.tp
    llama = cfg.arch == "llama"
    units = [V * h / tp + (0 if llama else s * h)
             + (2 * h if getattr(cfg, "embed_norm", False) else 0)] if stage == 0 else []
    units += [layer_params(cfg, tp)] * nl
    if stage == lay.pp - 1:
        units.append((h if llama else 2 * h)
                     + (V * h / tp if lay.pp > 1 or not cfg.tie_embeddings else 0.0))
    return units


def _fsdp_buffers(cfg, lay, stage: int, nl: int) -> tuple[float, float]:
    """(buffers, of which gradients): FSDP2's working buffers on a rank: the gathered
    16-bit parameters of the unit computing and of the one prefetched (the peak over the
    forward and backward orders, ``zero3_gathered_numel`` with one unit ahead), and the
    unit's unsharded 16-bit gradient with its fp32 copy that the reduce-scatter reads
    (``foreach_reduce`` casts to ``reduce_dtype`` into one flat input buffer), the
    second figure (what :func:`workspace_bytes` takes as ``unreduced``)."""
    from .frameworks import FSDP_PREFETCH_UNITS, FSDP_REDUCE_BYTES
    units = _fsdp_units(cfg, lay, stage, nl)
    gathered = zero3_gathered_numel(units, FSDP_PREFETCH_UNITS)
    grads = (2 + FSDP_REDUCE_BYTES) * max(units)
    return 2 * gathered + grads, grads
