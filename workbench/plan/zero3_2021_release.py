"""The DeepSpeed release whose ZeRO-3 :mod:`.zero3_2021` prices and how it is configured:
the framework's name, the release and what each release's hooks do (:func:`behaviour`),
the example's coordinator settings and the live-parameter counter a step starts from
(:func:`counter_start`).  "Module docstring" below: :mod:`.zero3_2021`'s."""
from __future__ import annotations


FRAMEWORK = "deepspeed-0.3"
# the release whose hooks the estimate prices, ASSUMED from the dates (module docstring)
VERSION = "0.3.13"
# release -> (trace off by one: no prefetch, no reuse keeping; a norm + .item() per
# fetched parameter), read from each tag's stage3.py (module docstring)
VERSIONS = {"0.3.13": (False, False), "0.3.14": (True, False),
            "0.3.15": (True, True), "0.3.16": (True, True)}

# DeepSpeedExamples Megatron-LM-v1.1.5-ZeRO3/examples/ds_zero_stage_3_config.json
# (44be774aad); persistence: deepspeed/runtime/zero/constants.py v0.3.13 (module docstring)
PREFETCH_NUMEL = 60_397_980
MAX_LIVE_NUMEL = 1_000_000_000
MAX_REUSE_NUMEL = 1_000_000_000
PERSISTENCE_NUMEL = 100_000
REDUCE_BUCKET_NUMEL = 67_108_860
# the step whose live-parameter counter the estimate prices (module docstring: it drifts
# down by the persistent parameters' elements each step): 2, the first that prefetches,
# ASSUMED (the published runs' measured step is not stated)
COUNTER_STEP = 2


def behaviour(version: str) -> tuple:
    """(trace off by one, norm per fetched parameter) of DeepSpeed ``version`` (module
    docstring: v0.3.14's root reset hook, v0.3.15's debug-print norm)."""
    if version not in VERSIONS:
        raise ValueError(f"version={version!r}: the DeepSpeed release whose ZeRO-3 hooks "
                         f"are priced; use one of {sorted(VERSIONS)}")
    return VERSIONS[version]


def counter_start(trace, step: int, first: bool) -> float:
    """DeepSpeed v0.3's live-parameter counter when a micro-batch of optimizer step
    ``step`` (>= 2) starts (module docstring): -(step - 2) x the persistent parameters'
    elements for the step's first micro-batch (``_post_step``'s gather of them is not
    counted), one more of those lower for the others."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 2:
        raise ValueError(f"step={step!r}: the optimizer step priced, an int >= 2 (step 1 "
                         f"records the trace and prefetches nothing)")
    size = {pid: n for e in trace for pid, n in e.params}
    persistent = sum(n for n in size.values() if n < PERSISTENCE_NUMEL)
    return -float((step - 2 + (0 if first else 1)) * persistent)
