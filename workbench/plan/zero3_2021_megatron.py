"""Megatron-LM-v1.1.5-ZeRO3's layer as DeepSpeed's example runs it: its checkpointed
chunks (:func:`chunk_layers`, :func:`check_chunks`), DeepSpeed's partitioned activation
checkpoints (:func:`partition_activation_seconds`) and the unfused kernels
(:func:`unfused_bytes`, :func:`unfused_seconds`)."""
from __future__ import annotations

from .zero3_2021_release import FRAMEWORK


# DeepSpeed v0.3.13 activation_checkpointing/checkpointing.py with partition_activations
# and one model-parallel rank (Megatron-LM-v1.1.5-ZeRO3 passes its mpu, so mp_group is a
# one-rank group, not None): bytes per 16-bit element of a checkpointed layer's input.
# Forward, CheckpointFunction.forward (:446-455): ``item.detach().contiguous().view(-1)
# .narrow(0, start, size).clone()``, the whole input at mp 1 (read + write).  Backward,
# get_full_inputs (:284-309): ``torch.zeros`` of the input (write), ``part_i.copy_(item)``
# (read + write), ``dist.all_gather(partitions, ...)`` on the one-rank group: NCCL copies
# the input into c10d's flat output buffer (a one-rank all-gather out of place is a
# device copy: read + write) and c10d copies the buffer back out to the list's view
# (read + write).  The attention mask, the last argument, is not partitioned
# (``args[:-1]``).
CKPT_FORWARD_BYTES = 2 + 2
CKPT_BACKWARD_BYTES = 2 + (2 + 2) + (2 + 2) + (2 + 2)
CKPT_FORWARD_KERNELS, CKPT_BACKWARD_KERNELS = 1, 4


# Megatron-LM-v1.1.5-ZeRO3 (DeepSpeedExamples 44be774aad) as the example script runs it
# (examples/ds_pretrain_gpt2-zero3.sh: its gpt_options pass none of the fusion flags):
# ``--scaled-upper-triang-masked-softmax-fusion``, ``--scaled-masked-softmax-fusion``,
# ``--bias-gelu-fusion`` and ``--bias-dropout-fusion`` are ``store_true`` (default off,
# megatron/arguments.py:249-260), so the layer runs PyTorch's eager kernels where the
# planner's layer (``layer_cost``: Korthikanti et al.'s Megatron-LM) prices the fused ones:
# - FusedScaleMaskSoftmax without fusion and without ``--apply-query-key-layer-scaling``
#   (scale None, fp16 in: megatron/model/fused_softmax.py:118-128) runs
#   ``gpt2_attention_mask_func``, an in-place ``masked_fill_`` of the b a s s scores
#   (gpt2_model.py:31-33: read + write, and the [1, 1, s, s] bool mask once), then
#   ``torch.nn.Softmax`` (the fused kernel's 2 bytes an element): + 2 e S + s^2 bytes, one
#   kernel; its backward adds ``masked_fill``'s gradient (``grad.masked_fill(mask, 0)``,
#   read + write) beside the softmax's (the fused kernel's 3 e S): + 2 e S + s^2, one
#   kernel;
# - ParallelMLP without ``--bias-gelu-fusion`` (transformer.py:127-132):
#   ``F.gelu(intermediate + bias)``: the add writes T f elements that GeLU reads back,
#   + 2 e T f bytes, one kernel, forward only (GeLU's backward reads its input as the
#   fused backward does; the bias gradient is the same sum);
# - ``bias_dropout_add`` unscripted (transformer.py:422-426, 519-528): ``x + bias``,
#   ``F.dropout``, ``residual + out``, three kernels where the scripted one is one: the
#   two intermediates of T h elements each written and read again, + 4 e T h bytes and
#   two kernels per call (at p = 0 ATen's dropout returns its input: + 2 e T h, one
#   kernel), two calls a layer, forward only (the gradient passes through the adds).
# Recomputed with the forward under full recompute.  Priced at the profile's elementwise
# rate with their launches (``unfused_seconds``).
UNFUSED_SOURCE = ("Megatron-LM-v1.1.5-ZeRO3 (DeepSpeedExamples 44be774aad) without its "
                  "fusion flags, as examples/ds_pretrain_gpt2-zero3.sh runs it "
                  "(arguments.py:249-260 store_true; fused_softmax.py:118-128, "
                  "transformer.py:127-132, :422-426): eager masked_fill_ + softmax, "
                  "add + gelu, add + dropout + add (zero3_2021.unfused_seconds)")


def chunk_layers(n_layer: int, k: int) -> list[list[int]]:
    """The layers each checkpointed chunk of Megatron-LM-v1.1.5-ZeRO3 runs with
    ``--checkpoint-num-layers k`` (DeepSpeedExamples 44be774aad ``megatron/model/
    transformer.py``:949-969): ``custom(l, l + k)`` for l = 0, k, 2k, ... < n_layer, each
    running ``self._get_layer(index)`` for index in range(l, l + k), whose index
    ``_get_layer_index`` takes modulo the unique layers (:938-947; ``--param-sharing-style``
    'grouped' and ``--num-unique-layers`` = the layers by default, arguments.py:160-166):
    where k does not divide the layers the last chunk runs layer 0, 1, ... again."""
    for name, v in (("n_layer", n_layer), ("k", k)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be an int >= 1")
    return [[i % n_layer for i in range(l, l + k)] for l in range(0, n_layer, k)]


def check_chunks(cfg, lay) -> None:
    """Raise ValueError where DeepSpeed v0.3.13-0.3.16's ZeRO-3 stops the run at its first
    backward: with full recompute in chunks of k layers that do not divide the model's
    layers, Megatron-LM-v1.1.5 runs layer 0 again in the last chunk (:func:`chunk_layers`),
    whose backward is its own ``torch.autograd.backward`` call (DeepSpeed
    ``activation_checkpointing/checkpointing.py``:686), so layer 0's parameters reach
    their gradient hook twice in one backward, and ``reduce_independent_p_g_buckets_and_
    remove_grads`` asserts "Multiple gradient reduction is currently not supported"
    (v0.3.13 ``stage3.py``:1446-1449, the flag set at :1713 and cleared only in the
    epilogue, :1293-1294; v0.3.16 :1898-1901)."""
    k = getattr(lay, "recompute_num_layers", 1)
    if lay.recompute != "full" or k == 1:
        return
    runs = [i for c in chunk_layers(cfg.n_layer, k) for i in c]
    twice = sorted({i for i in runs if runs.count(i) > 1})
    if twice:
        raise ValueError(f"framework={FRAMEWORK!r}: recompute_num_layers={k} does not "
                         f"divide the {cfg.n_layer} layers, so Megatron-LM-v1.1.5 runs "
                         f"layer(s) {twice} again in the last chunk and DeepSpeed "
                         f"v0.3.13-0.3.16's ZeRO-3 asserts on their second gradient "
                         f"('Multiple gradient reduction is currently not supported', "
                         f"stage3.py:1446-1449): use a recompute_num_layers that divides "
                         f"{cfg.n_layer} (1: Megatron's default)")


def unfused_bytes(cfg, micro_batch: int) -> dict:
    """Bytes and kernel launches per layer and micro-batch that Megatron-LM-v1.1.5-ZeRO3's
    eager (unfused) softmax, bias-GeLU and bias-dropout-add move beyond the fused kernels
    the planner's layer prices (``UNFUSED_SOURCE``'s comment): ``forward`` and
    ``backward`` (the backward pass alone, without its recompute), each (bytes,
    launches), and ``core``: the attention core's part of ``forward`` (what selective
    recompute re-runs).  A GPT layer (``cfg.arch == "gpt"``) only: Megatron-LM-v1.1.5 has no
    other."""
    if isinstance(micro_batch, bool) or not isinstance(micro_batch, int) or micro_batch < 1:
        raise ValueError(f"micro_batch={micro_batch!r}: sequences per micro-batch, an "
                         f"int >= 1")
    if cfg.arch != "gpt":
        raise ValueError(f"arch={cfg.arch!r}: the unfused kernels priced are "
                         f"Megatron-LM-v1.1.5's GPT layer; framework={FRAMEWORK!r} runs no "
                         f"other (give arch='gpt')")
    from .layer_cost import _ITEMSIZE
    e = _ITEMSIZE[cfg.dtype]
    s, b, h, a, f = cfg.seq_len, micro_batch, cfg.d_model, cfg.n_head, cfg.d_ff
    S, T = b * a * s * s, s * b
    mask = s * s                                  # the broadcast [1, 1, s, s] bool mask
    drop = cfg.dropout > 0
    bda = (4 if drop else 2) * e * T * h, (2 if drop else 1)
    fwd = (2 * e * S + mask + 2 * e * T * f + 2 * bda[0], 1 + 1 + 2 * bda[1])
    bwd = (2 * e * S + mask, 1)
    # ``core``: what selective recompute re-runs of it (the attention core's masked_fill_)
    return {"forward": fwd, "backward": bwd, "core": (2 * e * S + mask, 1)}


def unfused_seconds(cfg, micro_batch: int, prof, recompute: str) -> dict:
    """Seconds per layer and micro-batch :func:`unfused_bytes` adds on ``prof`` at its
    elementwise rate (``sim_mesh.kernel_cost.compute_time``): ``forward``, and
    ``backward`` with what the recompute re-runs (``"full"``: the forward's, ``"selective"``:
    the attention core's masked_fill_; the layer's backward seconds include its
    recompute, ``costs.LayerCost``); 0 for a model that is not a GPT (Megatron-LM-v1.1.5's
    layer only)."""
    from ..sim_mesh.kernel_cost import compute_time
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute={recompute!r}: 'none', 'selective' or 'full' (what "
                         f"Megatron-LM-v1.1.5 runs)")
    if cfg.arch != "gpt":
        return {"forward": 0.0, "backward": 0.0}
    x = unfused_bytes(cfg, micro_batch)
    fwd, bwd = (compute_time(0.0, float(nb), prof, cfg.dtype, "elementwise", launches=n)
                for nb, n in (x["forward"], x["backward"]))
    again = {"full": fwd, "selective": x["core"], "none": 0.0}[recompute]
    if recompute == "selective":    # the attention core re-run: its masked_fill_ again
        again = compute_time(0.0, float(again[0]), prof, cfg.dtype, "elementwise",
                             launches=again[1])
    return {"forward": fwd, "backward": bwd + again}


def partition_activation_seconds(cfg, micro_batch: int, prof) -> tuple[float, float]:
    """(forward, backward) seconds per layer and micro-batch of DeepSpeed's activation
    checkpointing with ``partition_activations`` at one model-parallel rank
    (``CKPT_FORWARD_BYTES`` / ``CKPT_BACKWARD_BYTES`` per element of the layer's input,
    b x s x h in 16 bits, at the profile's copy rate with their launches)."""
    from ..sim_mesh.kernel_cost import compute_time
    if isinstance(micro_batch, bool) or not isinstance(micro_batch, int) or micro_batch < 1:
        raise ValueError(f"micro_batch={micro_batch!r}: sequences per micro-batch, an "
                         f"int >= 1")
    n = micro_batch * cfg.seq_len * cfg.d_model
    return (compute_time(0.0, CKPT_FORWARD_BYTES * n, prof, "float16",
                         launches=CKPT_FORWARD_KERNELS),
            compute_time(0.0, CKPT_BACKWARD_BYTES * n, prof, "float16",
                         launches=CKPT_BACKWARD_KERNELS))
