"""A PyTorch user's habits on the wrappers, habits7's second sweep (habits7b; the file
test_habits7.py holds the first).  Each test holds a habit to plain PyTorch on one device
(or torch's documented semantics) on habits15's sweep (DDP, FSDP, fully_shard, DDP +
ZeroRedundancyOptimizer on 4 simulated dp ranks; the same, ZeRO-1/2 and Zero3 over tensor
parallelism on 2 x 2) and failed before its fix.

1. ``p.data = w`` (a manual weight load, ``w`` of the module parameter's shape) on a
   wrapped parameter swapped the storage for ``w``: DDP's ``state_dict()`` then gave row 0
   of it as the parameter (a ``(3,)`` tensor for the ``(6, 3)`` weight, silently, and
   ``torch.save`` wrote it), FSDP / fully_shard's next forward raised torch's "shape
   '[4, -1]' is invalid", DDP over tensor parallelism's ``state_dict()`` "all_gather: the
   input is the same on every rank".  Now one device's load (written as ``p.copy_(w)``);
   a ``w`` of another shape or dtype raises naming ``p.data.copy_``.
"""
import pytest
import torch

from .test_habits11 import close
from .test_habits15 import KINDS, Wrapped, batches, full_state, mk, ref_backward

# ZeRO-1/2 over DistTensors hand the optimizer the module's DistTensors, whose
# ``.data = tensor`` raises naming shard_tensor (habits.py): not laid-out storages
LAID_OUT = [k for k in KINDS if k not in ("zero_tp", "zero2_tp")]


def assert_same_model(wr, ref):
    got, want = full_state(wr.m.state_dict()), ref.state_dict()
    assert list(got) == list(want)
    for k in want:
        assert got[k].shape == want[k].shape, k
        close(got[k], want[k])


# ---- 1. p.data = w -------------------------------------------------------------------------
@pytest.mark.parametrize("kind", LAID_OUT)
def test_data_assignment_of_the_modules_shape_is_one_devices_load(kind):
    """``p.data = w`` for every parameter the optimizer holds, then a forward and an SGD
    step: one device's.  Before: DDP's state_dict read a (3,) row, FSDP's forward raised."""
    ref, wr = mk(), Wrapped(kind)
    ref.eval()
    wr.w.eval()
    torch.manual_seed(4)
    news = [torch.randn(q.shape) for q in ref.parameters()]
    for p, q, w in zip(wr.params(), ref.parameters(), news):
        p.data = w.clone()
        q.data = w.clone()
    assert_same_model(wr, ref)
    x, y = batches(1)[0]
    with torch.no_grad():
        close(wr.out(x), ref(x))
    opt = wr.optimizer(cls=torch.optim.SGD, lr=0.1)
    ro = torch.optim.SGD(ref.parameters(), lr=0.1)
    wr.backward(x, y)
    ref_backward(ref, x, y)
    opt.step()
    ro.step()
    assert_same_model(wr, ref)


@pytest.mark.parametrize("kind", ["ddp", "fsdp", "ddp_tp", "zero3_tp"])
@pytest.mark.parametrize("bad", ["dtype", "shape"])
def test_data_assignment_of_another_dtype_or_shape_raises_untouched(kind, bad):
    """A ``w`` of the module's shape in float64, or of neither the module's nor the
    storage's shape: raises naming p.data.copy_, the parameter untouched."""
    ref, wr = mk(), Wrapped(kind)
    p = wr.params()[0]
    w = torch.ones(6, 3, dtype=torch.float64) if bad == "dtype" else torch.ones(2, 9)
    with pytest.raises(RuntimeError, match=r"p\.data = t with t of shape .*p\.data\.copy_"):
        p.data = w
    assert_same_model(wr, ref)
