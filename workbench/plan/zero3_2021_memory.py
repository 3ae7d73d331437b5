"""What a rank of DeepSpeed v0.3.13's ZeRO-3 holds beyond its partitioned model states in
the backward (:func:`backward_peak_bytes`)."""
from __future__ import annotations

from .zero3_2021_release import (MAX_LIVE_NUMEL, PERSISTENCE_NUMEL, PREFETCH_NUMEL,
                                 REDUCE_BUCKET_NUMEL)
from .zero3_2021_trace import _layer_modules


def backward_peak_bytes(cfg, lay, remat: float, head: float, loss: float) -> dict:
    """Bytes a rank of DeepSpeed v0.3.13's ZeRO-3 (tp = pp = 1) holds beyond its
    partitioned model states, the checkpointed inputs and NCCL's buffers, read from the
    source (``benchmarks/zero3_audit.py``'s memory section; s3 = deepspeed/runtime/zero/
    stage3.py, pp = partition_parameters.py, v0.3.13): ``buffers`` (held all backward)
    and ``workspace`` (the transient peak), given ``remat``: the recomputed chunk's
    activations less its kept input, ``head``: the head's saved tensors (final-LN and
    head inputs, fp32 logits) and ``loss``: the loss's working copies.
    - two reduce buckets: ``ipg_buffer`` is two buffers of ``reduce_bucket_size`` when
      ``overlap_comm`` (s3:2535-2546), True by default at stage 3 (zero/config.py:89-94,
      constants.py:55);
    - gathered parameters: the tied word embedding, the root's external parameter, held
      the whole micro-batch (Megatron-LM-v1.1.5-ZeRO3 gpt2_model.py), and the module
      running, the largest (fc2, kept from its recompute for its backward); nothing
      prefetched when the held embedding alone reaches ``stage3_max_live_parameters``
      (the check, s3:293-297, :312-334); below it, ASSUMPTION: the module after it too
      (an upper bound: ``memory.zero3_gathered_numel`` with the 2021 prefetch bucket);
    - the largest parameter's gradient, whole: above the bucket, reduced as its own
      (s3:1452-1453);
    - at that gradient's allocation (fc2's weight gradient, a chunk's first backward op,
      the whole chunk's recomputed activations live: ``remat`` in full, no unreduced
      gradient subtracted) also the previous extra-large gradient (the layer above's
      qkv, reduced at the next hook and freed at the one after: s3:1433-1436, :1693-1694,
      pp:848) and, tied, the head's gradient of the embedding that autograd holds in the
      leaf's input buffer until the embedding's backward adds its own (one leaf, two
      uses; measured, tests/test_i21mem.py); at fc2's bias hook instead the previous
      gradient is freed, c10d flattens fc2's gradient (a whole copy, ProcessGroupNCCL's
      list reduce-scatter) and fc2's saved input (2 s b f) is released: the larger of
      the two;
    - the head's saved tensors are freed by the head's backward, before the layers':
      they and the loss's copies are the other peak, not added to the layers'."""
    h, V, s, b, f = cfg.d_model, cfg.vocab_size, cfg.seq_len, lay.micro_batch, cfg.d_ff
    big = [n for _, ps in _layer_modules(cfg) for _, n in ps if n >= PERSISTENCE_NUMEL]
    largest = max(big)
    extra_large = [n for n in big if n > REDUCE_BUCKET_NUMEL]
    previous = extra_large[0] if len(extra_large) > 1 and cfg.n_layer > 1 else 0.0
    held = V * h if cfg.tie_embeddings else 0.0
    if held >= MAX_LIVE_NUMEL:
        gathered = held + largest
    else:
        from .memory import zero3_gathered_numel
        gathered = held + zero3_gathered_numel(big * cfg.n_layer, PREFETCH_NUMEL)
    tied_grad = 2 * V * h if cfg.tie_embeddings else 0.0
    wgrad = remat + 2 * previous + tied_grad
    bias_hook = remat + 2 * largest - 2 * s * b * f + tied_grad if cfg.arch != "llama" \
        else wgrad
    buffers = 2 * 2 * REDUCE_BUCKET_NUMEL + 2 * gathered + 2 * largest
    return {"buffers": float(buffers),
            "workspace": float(max(wgrad, bias_hook, head + loss)),
            "terms": {"reduce buckets": 2 * 2 * REDUCE_BUCKET_NUMEL,
                      "gathered": 2 * gathered, "largest gradient": 2 * largest,
                      "previous gradient": 2 * previous, "tied head gradient": tied_grad,
                      "at fc2's weight gradient": wgrad, "at fc2's bias hook": bias_hook,
                      "head + loss": head + loss}}
