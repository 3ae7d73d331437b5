"""Checker slips found in the browser review of notebooks 13, 14 and 15 (nbr1315): a wrong
answer that passed, and mistakes named wrongly or not at all.  Each test failed before its
fix."""
import pytest
import torch
from torch import nn

import workbench as wb
from workbench.exercises import checks_experts as E
from workbench.exercises import checks_serve as S
from workbench.exercises.feedback import CheckError, reset_tries

from .exercise_helpers import fails, passes


@pytest.fixture(autouse=True)
def _fresh():
    reset_tries()
    yield
    reset_tries()


class _SumsTheBatch(nn.Module):
    """A forward that sums over the batch's rows: on 2 ranks each rank sums only its own."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 8)
        self.scale = nn.Parameter(torch.ones(8), requires_grad=False)   # frozen

    def forward(self, ids):                                  # (B, T) int64
        return (self.emb(ids) * self.scale).sum()            # a scalar over all rows


def _sums_the_batch():
    torch.manual_seed(0)
    return _SumsTheBatch()


def test_like_one_device_catches_a_forward_that_sums_the_batch():
    """13, exercise 2: a forward returning the sum over the whole batch passed ("one device's
    parameters"): its loss under DDP is the mean of the ranks' local squares (3.47 against
    one device's 13.9), but AdamW's first steps move each value by about lr times the sign
    of its gradient, and the signs agreed.  The per-step losses are now compared too."""
    fails("loss of step 1 differs from one device's.*mix rows",
          wb.exercises.check_like_one_device, _sums_the_batch)


def test_like_one_device_still_passes_a_per_row_pooling(capsys):
    """A mean over the sequence (dim 1) keeps each row to itself: still right."""
    class Pooled(_SumsTheBatch):
        def forward(self, ids):
            return (self.emb(ids) * self.scale).mean(1)      # (B, 8)

    def make():
        torch.manual_seed(0)
        return Pooled()
    assert "Correct: Pooled" in passes(capsys, wb.exercises.check_like_one_device, make)


@pytest.mark.parametrize("ep_mb, tp_mb, which", [(8 * 117.44, 469.76, "EP"),
                                                 (117.44, 8 * 469.76, "TP")])
def test_ep_tp_summed_over_the_ranks_is_named(ep_mb, tp_mb, which):
    """14, exercise 2: the bytes of all 8 ranks (939.5 MB for EP, 3,758 MB for TP) read only
    "too high: compare each factor with the formula"."""
    fails(f"your {which} volume.*summed over the 8 ranks", E.check_ep_tp_mb, ep_mb, tp_mb)


def test_decode_floor_with_the_two_answers_swapped_is_named():
    """15, exercise 1: bf16 4.13 ms and int8 8.26 ms (swapped) read "that counts 1 byte per
    bf16 weight"."""
    w, bw = 6_607_077_376, 1.6e12
    bf16 = w * 2 / bw * 1e3
    fails("swap", S.check_decode_floor_ms, bf16 / 2, bf16, w, bw)
    fails("1 byte per bf16 weight", S.check_decode_floor_ms, bf16 / 2, bf16 / 4, w, bw)


def test_ring_kv_with_128k_as_128000_tokens_is_named():
    """14, exercise 3: 128K read as 128,000 tokens gives 491.5 MB, 2.3% low, which read
    "close, but more than 0.5% off: rounded too far?"."""
    fails("128K tokens as 128,000", E.check_ring_kv_mb, 15 * 2 * 8000 * 8 * 128 * 2 / 1e6)
    fails("rounded too far", E.check_ring_kv_mb, 0.985 * 503.3)     # a rounding still is
