"""perf18: versions.guard_kernel keeps one answer per call shape (its key: each operand's
global shape, dtype, requires_grad and whether it has history), and the row-parallel
linear (_RankLinear) checks the detach_() tokens in its own backward instead of a
registered prehook.  Held to torch: a 2-d input (one device's F.linear saves it: raises
after ``a.detach_()``) and a 3-d one (a view of it: passes) in either order in one
process, over test_inplace15's layouts, so that no cached answer of one call shape
answers the other."""
import pytest
import torch.nn.functional as F

from tests.test_inplace15 import IDS, LAYOUTS, _same_as_torch, _then

SAVED_IN = "Trying to use a saved tensor that has been detached in-place"


def _lin2(x):
    a = x * 1.5
    return _then(F.linear(a, x), lambda _: a.detach_())


def _lin3(x):
    a = x.unsqueeze(0) * 1.5        # 3-d, not a view (a view cannot be detached in place)
    return _then(F.linear(a, x), lambda _: a.detach_())


def _lin2_kept(x):
    a = x * 1.5
    return F.linear(a, x)


@pytest.mark.parametrize("layout", range(len(LAYOUTS)), ids=IDS)
@pytest.mark.parametrize("order", ["2d_then_3d", "3d_then_2d"])
def test_linear_detach_per_call_shape_is_torchs(order, layout):
    progs = [(_lin2, True), (_lin3, False)]
    for prog, raises in progs if order == "2d_then_3d" else progs[::-1]:
        err = _same_as_torch(prog, layout)
        if raises:
            assert err is not None and SAVED_IN in str(err)
        else:
            assert err is None


@pytest.mark.parametrize("layout", range(len(LAYOUTS)), ids=IDS)
def test_linear_without_detach_after_a_detached_one_is_torchs(layout):
    """a guarded call that raised leaves the next one (same call shape, no detach_)
    answering one device's values and gradients"""
    err = _same_as_torch(_lin2, layout)
    assert err is not None and SAVED_IN in str(err)
    assert _same_as_torch(_lin2_kept, layout) is None
