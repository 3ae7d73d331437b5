"""Checker slips found in the browser review of notebooks 00, 12, 13 and 14 (nbv1214): an
unordered answer that passed an "in mesh order" check, and mistakes named wrongly or as a
raw error.  Each test failed before its fix."""
import pytest
import torch
from torch import nn

import workbench as wb
from workbench.exercises import checks_experts as E
from workbench.exercises.feedback import reset_tries

from .exercise_helpers import fails, message


@pytest.fixture(autouse=True)
def _fresh():
    reset_tries()
    yield
    reset_tries()


def test_tp_group_refuses_a_set():
    """00, exercise 2 asks for the group "in mesh order" and names a reordered tuple as
    wrong, yet ``{4, 5, 6, 7}`` passed: a set has no order, it iterated 4, 5, 6, 7 by the
    accident of small ints hashing to themselves (``{7, 6, 5, 4}`` passed too)."""
    fails("a set has no order", wb.exercises.check_tp_group, {7, 6, 5, 4})
    fails("a set has no order", wb.exercises.check_tp_group, frozenset({4, 5, 6, 7}))


def test_ring_kv_mb_twice_names_fp32_too():
    """14, exercise 3: K and V counted at 4 bytes a value (fp32) give 1,007 MB, which the
    check named only "that counts a backward too"; the student who slipped on the dtype
    was sent looking for a backward they never counted."""
    fp32 = 15 * 2 * 8192 * 8 * 128 * 4 / 1e6
    text = message(E.check_ring_kv_mb, fp32)
    assert "backward" in text and "4 bytes" in text and "bf16" in text, text


def test_ep_tp_mb_twice_names_fp32_too():
    """14, exercise 2: EP's and TP's bytes at 4 bytes a value (fp32) were named "that counts
    the backward's two all-to-alls too" (EP) and "did you count four collectives" (TP)."""
    tokens, h, k, p = 4096, 4096, 2, 8
    ep = 2 * tokens * k * h * 2 * (p - 1) / p / 1e6            # bf16: 2 bytes a value
    tp = 2 * p * tokens * h * 2 * (p - 1) / p / 1e6
    text = message(E.check_ep_tp_mb, 2 * ep, tp)
    assert "backward" in text and "4 bytes" in text and "bf16" in text, text
    text = message(E.check_ep_tp_mb, ep, 2 * tp)
    assert "four collectives" in text and "4 bytes" in text and "bf16" in text, text


def test_dropped_slots_says_a_count_is_whole():
    """14, exercise 1: 35.4 token-slots read "too high: capacity = ..." (the formula again);
    a count of slots is a whole number, and the message now says so first."""
    loads = [70, 56, 45, 108, 44, 87, 43, 59]
    fails("whole number", E.check_dropped_slots, 35.4, loads, capacity_factor=1.25)


class _AllFrozen(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.table = nn.Parameter(torch.randn(32, 16) * 0.1, requires_grad=False)

    def forward(self, ids):                                   # (B, T) int64
        return self.table[ids]                                # (B, T, 16)


class _ReturnsAFloat(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.table = nn.Parameter(torch.randn(32, 16) * 0.1)
        self.scale = nn.Parameter(torch.ones(16), requires_grad=False)

    def forward(self, ids):
        return (self.table[ids] * self.scale).sum().item()    # a Python float, no graph


class _ReturnsATuple(_ReturnsAFloat):
    def forward(self, ids):
        return (self.table[ids] * self.scale) @ self.table.T, None   # (logits, extra)


def test_like_one_device_names_a_model_with_nothing_to_train():
    """13, exercise 2: a model whose every parameter is frozen got torch's own "element 0
    of tensors does not require grad and does not have a grad_fn" through the check."""
    text = message(wb.exercises.check_like_one_device, _AllFrozen)
    assert "trains" in text and "element 0" not in text, text


@pytest.mark.parametrize("model, kind", [(_ReturnsAFloat, "float"), (_ReturnsATuple, "tuple")])
def test_like_one_device_names_a_forward_that_returns_no_tensor(model, kind):
    """13, exercise 2: a forward returning a float or a (logits, extra) tuple got
    "'float' object has no attribute 'float'" (the check's own .float() call)."""
    text = message(wb.exercises.check_like_one_device, model)
    assert f"returned a {kind}, not a tensor" in text and "attribute" not in text, text


@pytest.mark.parametrize("other", ["h100", "a100"])
def test_fusion_us_names_another_profiles_figures(other):
    """12, exercise 1 asks for the Ascend 910B; the cell just above it loops over
    ascend-910b, a100 and h100 and leaves ``p`` at h100's profile.  A student who reuses
    that ``p`` (or reads the A100's) got "too low: compare each factor with the formula"
    for 1,001-1,002 us: every factor of their formula was right, the profile was not."""
    p = wb.get_profile(other)
    bw = p.memory_bandwidth * p.memory_efficiency
    unfused = 1000 * (4096 / bw + p.launch_overhead) * 1e6
    fused = (1000 * 4096 / bw + p.launch_overhead) * 1e6
    fails("another profile.*ascend-910b", wb.exercises.check_fusion_us, unfused, fused)
    fails("another profile.*ascend-910b", wb.exercises.check_fusion_us, 5003.0, fused)


LOADS = [70, 56, 45, 108, 44, 87, 43, 59]          # 14's router: 256 tokens, k = 2


@pytest.mark.parametrize("answer, match", [
    (0, "no expert over its capacity.*512 token-slots as tokens"),   # C = ceil(1.25 x 512 x 2 / 8)
    (512 - 35, "kept"),                                              # routed - dropped
    (100 * 35 / 512, "percent"),                                     # the dropped share, in %
])
def test_dropped_slots_names_more_slips(answer, match):
    """14, exercise 1: three slips read only "too high / too low: capacity = ...": 0 (a
    capacity of 160 from the 512 token-slots taken as tokens: no expert over it), 477 (the
    slots kept, not dropped) and 6.84 (the dropped share in percent)."""
    fails(match, E.check_dropped_slots, answer, LOADS, capacity_factor=1.25)


def _tiny_step_trace():
    """12's simulated step, on a smaller scale: the tiny Llama on dp 2 x tp 2, traced."""
    from workbench.models import get_batch, get_config
    from workbench.recipes.hybrid import Hybrid
    torch.manual_seed(0)
    cfg = get_config("tiny")
    tokens, targets = get_batch(cfg, 4, seed=0, step=0)
    strategy = Hybrid(dp=2, tp=2, pp=1)
    model = strategy.build_model(cfg, seed=0)
    with wb.trace("ascend-910b") as tr:
        strategy.forward_backward(model, tokens, targets)
    return tr


def test_top_op_names_max_over_the_keys_and_the_least():
    """12, exercise 2: ``max(per_name)`` (the alphabetically last key, 'silu') and
    ``min(per_name, key=per_name.get)`` read "'silu' has 20.7 us of compute: sum each
    name's durations", which the student had done: the slip was the max itself."""
    tr = _tiny_step_trace()
    per = {}
    for e in tr.events:
        if e.stream == "compute":
            per[e.name] = per.get(e.name, 0.0) + e.duration
    assert max(per) != max(per, key=per.get)
    fails(r"alphabetically last.*key=", wb.exercises.check_top_op, max(per), tr)
    least = min(per, key=per.get)
    assert least != max(per)
    fails(r"LEAST", wb.exercises.check_top_op, least, tr)
