"""Back-of-the-envelope estimates from the papers: FLOPs, parameters, memory.

Each function is one published formula, with its source. The course shows them
beside what the simulator counts.

- Kaplan et al. 2020, "Scaling Laws for Neural Language Models" (6ND).
- Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM" (SC21), eq. 2 and eq. 3.
- Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
  Transformer Models", Table 2 and eq. 7 (model FLOPs, MFU).
- Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
  Parameter Models", sec. 3.1 and sec. 5 / Figure 1.
"""
from __future__ import annotations

__all__ = ["training_flops", "megatron_params", "megatron_flops", "model_flops", "mfu",
           "training_days", "utilization_for_days", "zero_model_state_bytes",
           "ACTIVATION_CASES", "activation_bytes_per_layer"]

SECONDS_PER_DAY = 86400.0


def _pos(**kw):
    for name, v in kw.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"{name}={v!r} must be a number > 0")


def training_flops(params: float, tokens: float) -> float:
    """Training FLOPs ~ 6 N D: 2 per parameter per token forward, 4 backward
    (Kaplan et al. 2020, sec. 2.1). GPT-3: 6 x 174.6e9 x 300e9 = 3.14e23."""
    _pos(params=params, tokens=tokens)
    return 6.0 * params * tokens


def megatron_params(layers: int, hidden: int, vocab: int, seq: int) -> float:
    """Parameters of a GPT model, Narayanan et al. 2021 eq. 2:
    P = 12 l h^2 (1 + 13/(12 h) + (V + s)/(12 l h))
    (the s term counts learned position embeddings)."""
    _pos(layers=layers, hidden=hidden, vocab=vocab, seq=seq)
    l, h = layers, hidden
    return 12 * l * h**2 * (1 + 13 / (12 * h) + (vocab + seq) / (12 * l * h))


def megatron_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """FLOPs of one iteration (batch B sequences) with full activation recompute,
    Narayanan et al. 2021 eq. 3: F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h))
    (forward counted twice: once forward, once recomputed)."""
    _pos(batch=batch, seq=seq, layers=layers, hidden=hidden, vocab=vocab)
    s, l, h = seq, layers, hidden
    return 96 * batch * s * l * h**2 * (1 + s / (6 * h) + vocab / (16 * l * h))


def model_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """FLOPs of one iteration without recompute, the numerator of MFU,
    Korthikanti et al. 2022 eq. 7: 72 B L s h^2 (1 + s/(6h) + V/(12 h L))."""
    _pos(batch=batch, seq=seq, layers=layers, hidden=hidden, vocab=vocab)
    s, L, h = seq, layers, hidden
    return 72 * batch * L * s * h**2 * (1 + s / (6 * h) + vocab / (12 * h * L))


def mfu(model_flops: float, seconds: float, peak_flops: float, n_devices: int) -> float:
    """Model FLOPs utilisation (Korthikanti et al. 2022, sec. 6; Chowdhery et al.
    2022, PaLM app. B): model FLOPs / (time x peak x devices)."""
    _pos(model_flops=model_flops, seconds=seconds, peak_flops=peak_flops,
         n_devices=n_devices)
    return model_flops / (seconds * peak_flops * n_devices)


def training_days(flops: float, n_devices: int, peak_flops: float,
                  utilization: float) -> float:
    """Days to spend ``flops`` on n devices running at ``utilization`` of peak:
    flops / (n x peak x utilization) / 86400. GPT-3's 3.14e23 on 1000 A100
    (312e12) at 50% is 23.3 days; the often quoted "about 22 days" needs 53%."""
    _pos(flops=flops, n_devices=n_devices, peak_flops=peak_flops, utilization=utilization)
    if utilization > 1:
        # a percentage (40 for 40%) is the likely slip: name its fraction (review nbr17b)
        fix = (f": {utilization:g}% of peak is utilization={utilization / 100:g}"
               if utilization <= 100 else "")
        raise ValueError(f"utilization={utilization!r} is a fraction of peak, in (0, 1]{fix}")
    return flops / (n_devices * peak_flops * utilization) / SECONDS_PER_DAY


def utilization_for_days(flops: float, n_devices: int, peak_flops: float,
                         days: float) -> float:
    """The utilisation at which ``flops`` take ``days`` (inverse of training_days)."""
    _pos(flops=flops, n_devices=n_devices, peak_flops=peak_flops, days=days)
    return flops / (n_devices * peak_flops * days * SECONDS_PER_DAY)


def zero_model_state_bytes(params: float, n_d: int, stage: int, k: int = 12) -> float:
    """Model-state bytes per device for mixed-precision Adam under ZeRO
    (Rajbhandari et al. 2020, sec. 3.1 and Figure 1): 2 psi fp16 weights + 2 psi
    fp16 gradients + K psi optimizer state (fp32 weights, momentum, variance:
    K = 12), the partitioned parts divided over N_d data-parallel ranks:

        stage 0 (baseline) (4 + K) psi        stage 2 (P_os+g)    2 psi + (2 + K) psi / N_d
        stage 1 (P_os)     4 psi + K psi / N_d  stage 3 (P_os+g+p) (4 + K) psi / N_d

    Figure 1, psi = 7.5e9, N_d = 64: 120, 31.4, 16.6 and 1.9 GB (1e9 bytes)."""
    _pos(params=params, k=k)
    if isinstance(n_d, bool) or not isinstance(n_d, int) or n_d < 1:
        raise ValueError(f"n_d={n_d!r} must be the data-parallel size, an int >= 1")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage!r}: ZeRO stages are 0 (none), 1, 2, 3")
    psi = params
    return {0: (4 + k) * psi,
            1: 4 * psi + k * psi / n_d,
            2: 2 * psi + (2 + k) * psi / n_d,
            3: (4 + k) * psi / n_d}[stage]


# Korthikanti et al. 2022, Table 2: activation bytes per transformer layer with
# 16-bit activations; s sequence, b micro-batch, h hidden, a heads, t TP size.
ACTIVATION_CASES = {
    "none": lambda s, b, h, a, t: s * b * h * (34 + 5 * a * s / h),
    "tp": lambda s, b, h, a, t: s * b * h * (10 + 24 / t + 5 * a * s / (h * t)),
    "tp+sp": lambda s, b, h, a, t: s * b * h * (34 / t + 5 * a * s / (h * t)),
    "tp+selective": lambda s, b, h, a, t: s * b * h * (10 + 24 / t),
    "tp+sp+selective": lambda s, b, h, a, t: s * b * h * 34 / t,
    "full": lambda s, b, h, a, t: 2 * s * b * h,
}


def activation_bytes_per_layer(seq: int, batch: int, hidden: int, heads: int,
                               tp: int = 1, case: str = "none") -> float:
    """Activation bytes one transformer layer keeps for backward, Korthikanti et
    al. 2022 Table 2. ``case``: "none" sbh(34 + 5as/h); "tp" sbh(10 + 24/t +
    5as/(ht)); "tp+sp" sbh(34/t + 5as/(ht)); "tp+selective" sbh(10 + 24/t);
    "tp+sp+selective" 34 sbh / t; "full" (full recompute, the layer input only)
    2 sbh. "none" ignores ``tp``."""
    if case not in ACTIVATION_CASES:
        raise ValueError(f"case={case!r}: use one of {list(ACTIVATION_CASES)}")
    _pos(seq=seq, batch=batch, hidden=hidden, heads=heads, tp=tp)
    return float(ACTIVATION_CASES[case](seq, batch, hidden, heads, tp))
