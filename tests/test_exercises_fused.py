"""Notebook 09's checks: the online-softmax update and the sliding-window tile count."""
import math

import torch

import workbench as wb
from workbench.exercises import checks_fused as ex
from tests.exercise_helpers import fails, passes


def right(m, l, acc, s, v):
    m_new = torch.maximum(m, s.max(dim=-1, keepdim=True).values)
    safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
    r = torch.exp(m - safe)
    p = torch.exp(s - safe)
    return m_new, l * r + p.sum(-1, keepdim=True), acc * r + p @ v


def no_rescale(m, l, acc, s, v):
    m_new = torch.maximum(m, s.max(dim=-1, keepdim=True).values)
    p = torch.exp(s - m_new)
    return m_new, l + p.sum(-1, keepdim=True), acc + p @ v


def nan_on_empty(m, l, acc, s, v):
    m_new = torch.maximum(m, s.max(dim=-1, keepdim=True).values)
    r, p = torch.exp(m - m_new), torch.exp(s - m_new)
    return m_new, l * r + p.sum(-1, keepdim=True), acc * r + p @ v


def test_online_softmax(capsys):
    passes(capsys, ex.check_online_softmax, right)
    fails("rescale", ex.check_online_softmax, no_rescale)
    fails("nan or inf", ex.check_online_softmax, nan_on_empty)
    fails("tuple", ex.check_online_softmax, lambda m, l, acc, s, v: acc)
    fails("raised ZeroDivisionError", ex.check_online_softmax, lambda *a: 1 / 0)
    fails("update", ex.check_online_softmax, 3)


def test_window_tiles(capsys):
    assert ex._window_tiles_by_hand(1024, 256, 128) == 21
    plan = wb.ops.attention_tiles(1024, mask=wb.ops.SlidingWindow(256), tile_q=128, tile_k=128)
    assert plan.computed == 21                       # the library agrees with the hand count
    passes(capsys, ex.check_window_tiles, 21)
    fails("causal mask alone", ex.check_window_tiles, 36)
    fails("every tile", ex.check_window_tiles, 64)
    fails("not aligned", ex.check_window_tiles, 16)
    fails("an int", ex.check_window_tiles, 21.0)


def test_cases_reach_the_edge_cases():
    cases = list(ex._cases())
    assert any(math.isinf(s.min().item()) for s, _, _ in cases)
    assert any(bool(torch.isinf(s[:, 8:]).all()) for s, _, _ in cases)
    assert any(bool(torch.isinf(s[:, :4]).all()) for s, _, _ in cases)


def test_online_softmax_noop_is_told_it_changes_nothing():
    """An update that returns its inputs leaves l = 0, so acc / l is nan; the diagnosis is
    the missing update, not a nan from exp(-inf - (-inf))."""
    with_msg = "returns m, l and acc unchanged"
    fails(with_msg, ex.check_online_softmax, lambda m, l, acc, s, v: (m, l, acc))
    fails(with_msg, ex.check_online_softmax, lambda m, l, acc, s, v: (m.clone(), l.clone(),
                                                                      acc.clone()))


def no_max(m, l, acc, s, v):
    """exp(s) without subtracting any max: right for small scores, overflows for large."""
    p = torch.exp(s)
    return torch.maximum(m, s.max(dim=-1, keepdim=True).values), \
        l + p.sum(-1, keepdim=True), acc + p @ v


def test_online_softmax_without_the_max_is_told_exp_overflows():
    fails("exp\\(1000\\) overflows", ex.check_online_softmax, no_max)


def test_window_tiles_counted_from_the_last_query_is_told_the_first_reaches_further():
    fails("first query reaches one key tile further left", ex.check_window_tiles, 8 + 7)


def flipped_rescale(m, l, acc, s, v):
    """The rescale factor's sign flipped: exp(m_new - m_old)."""
    m_new = torch.maximum(m, s.max(dim=-1, keepdim=True).values)
    safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
    old = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    r, p = torch.exp(safe - old), torch.exp(s - safe)
    return m_new, l * r + p.sum(-1, keepdim=True), acc * r + p @ v


def flipped_rescale_nan(m, l, acc, s, v):
    """The same, without a guard for m = -inf: exp(x + inf) * 0 is nan on the first tile."""
    m_new = torch.maximum(m, s.max(dim=-1, keepdim=True).values)
    safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
    r, p = torch.exp(safe - m), torch.exp(s - safe)
    return m_new, l * r + p.sum(-1, keepdim=True), acc * r + p @ v


def test_online_softmax_with_the_rescale_flipped_is_told_the_sign():
    fails("not exp\\(m_new - m_old\\)", ex.check_online_softmax, flipped_rescale)
    fails("not exp\\(m_new - m_old\\)", ex.check_online_softmax, flipped_rescale_nan)
    assert not ex._rescale_grows(right) and not ex._rescale_grows(no_rescale)


def test_online_softmax_arguments_in_another_order_are_told_the_signature():
    fails("calls update\\(m, l, acc, s, v\\)", ex.check_online_softmax,
          lambda s, v, m, l, acc: right(m, l, acc, s, v))


def test_window_tiles_common_miscounts_are_named():
    fails("first query tiles have fewer key tiles", ex.check_window_tiles, 8 * 3)
    fails("a window of 384 keys", ex.check_window_tiles, 26)
    fails("draw the 8 x 8 grid", ex.check_window_tiles, 22)


def rescale_only(which):
    """The earlier sums rescaled when the max rises, but only ``which`` of l and acc."""
    def update(m, l, acc, s, v):
        m_new = torch.maximum(m, s.max(dim=-1, keepdim=True).values)
        safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        r, p = torch.exp(m - safe), torch.exp(s - safe)
        l_old = l * r if which == "l" else l
        acc_old = acc * r if which == "acc" else acc
        return m_new, l_old + p.sum(-1, keepdim=True), acc_old + p @ v
    return update


def test_online_softmax_rescaling_only_one_of_l_and_acc_is_told_which():
    fails("you rescale l but not acc", ex.check_online_softmax, rescale_only("l"))
    fails("you rescale acc but not l", ex.check_online_softmax, rescale_only("acc"))


def test_online_softmax_nan_on_a_masked_first_tile_is_told_the_fix():
    fails("Where m_new is -inf, subtract 0 instead", ex.check_online_softmax, nan_on_empty)


def old_max(m, l, acc, s, v):
    """exp(s - m_old): m_old is -inf on the first tile, so every term is inf."""
    m_new = torch.maximum(m, s.max(dim=-1, keepdim=True).values)
    p = torch.exp(s - m)
    return m_new, l + p.sum(-1, keepdim=True), acc + p @ v


def test_online_softmax_nan_on_finite_scores_is_not_blamed_on_masking():
    fails("where the scores are finite", ex.check_online_softmax, old_max)
