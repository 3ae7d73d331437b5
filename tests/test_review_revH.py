"""Review revH: regressions for the defects found in the titanrows merge (7f73ec3..7e657a3:
torchtitan's FSDP rows, profile h100-hbm2e, ``plan.titan_eager``, ``plan.ranges``)."""
import pytest
import torch

from workbench.plan import titan_eager as E


def test_eager_counts_do_not_follow_torchs_default_dtype():
    """torchtitan's freqs_cis is complex64; under ``torch.set_default_dtype(torch.float64)``
    the counting built complex128 frequencies, RoPE's products promoted to them, and the
    counts (cached for the process) read 1.5 .. 1.7x the bytes."""
    E._measure.cache_clear()
    E.kernels.cache_clear()
    want = E.kernels("pre_attention", 64, 256, 4, 2, 64)
    E._measure.cache_clear()
    E.kernels.cache_clear()
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        got = E.kernels("pre_attention", 64, 256, 4, 2, 64)
    finally:
        torch.set_default_dtype(old)
        E._measure.cache_clear()
        E.kernels.cache_clear()
    assert got == want
