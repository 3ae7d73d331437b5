"""Activation checkpointing around a wrapper (ckpt11): ``torch.utils.checkpoint.checkpoint(
wrapper, x, use_reentrant=...)``, as a user checkpoints a module, on habits15's sweep (DDP,
FSDP, fully_shard, DDP + ZeroRedundancyOptimizer on 4 simulated dp ranks; the same,
ZeRO-1/2 and Zero3 over tensor parallelism on 2 x 2), held to one device's plain PyTorch
(the loss, every gradient, the weights after an SGD step), or a raise naming the fix.

Found and fixed (each test failed before):

1. ``use_reentrant=False`` with a plain tensor input on DDP and DDP + ZeRO raised
   "parameter '0.weight' was assigned after wrapping" in backward: the per-rank recompute
   hooks (rank_recompute.py) took the outer region's nodes for a checkpoint inside the
   module and put rank 0's parameter rows into the module before the outer recompute,
   which reruns the whole wrapper.  Now a region open around the wrapper's forward (its
   saved tensors' unpack hook is the top of the saved-tensor hooks stack at entry) gets no
   rank hooks: the wrapper's rerun puts each rank's parameters in place itself.
2. ``use_reentrant=True`` with a plain tensor input requiring grad on DDP, FSDP,
   fully_shard and DDP + ZeRO: backward raised "element 0 of tensors does not require
   grad" (the wrapper returns a DistTensor, which the reentrant checkpoint's
   autograd.Function cannot track).  Now the forward refuses it naming the fixes
   (``use_reentrant=False``, or a DistTensor input, which parallel/custom_function.py runs
   as ``use_reentrant=False``: it met fix 1's bug on DDP and DDP + ZeRO before, and now
   trains as one device).
"""
import pytest
import torch
from torch.utils.checkpoint import checkpoint

import workbench as wb

from .test_habits11 import close
from .test_habits15 import KINDS, OVER_TP, PLAIN, Wrapped, assert_same_model, batches, mk
from .test_habits18 import full_weights, sgd_pair


def _loss(out, y):
    out = out.full() if isinstance(out, wb.DistTensor) else out
    return ((out - y) ** 2).mean()


def _step_both(opt, ro, loss, want):
    """Backward and one optimizer step of the wrapper's ``loss`` and one device's ``want``,
    the two losses held equal."""
    opt.zero_grad()
    ro.zero_grad()
    loss.backward()
    want.backward()
    close(loss.detach(), want.detach())
    opt.step()
    ro.step()


def _step_as_one_device(kind, call):
    """Two SGD steps (lr 1: each step moves the weights by the gradient itself) with
    ``call(wrapped, x)`` as the forward; the loss, the gradient (before - after) and the
    weights held to one device's."""
    ref, wr, ro, opt = sgd_pair(kind)
    for x, y in batches(2):
        before, ref_before = full_weights(wr), {k: v.clone() for k, v in
                                                ref.state_dict().items()}
        _step_both(opt, ro, _loss(call(wr, x), y), _loss(ref(x), y))
        after, ref_after = full_weights(wr), ref.state_dict()
        for k in ref_after:
            close(before[k] - after[k], ref_before[k] - ref_after[k])   # the gradient
    assert_same_model(wr, ref)


@pytest.mark.parametrize("kind", KINDS)
def test_non_reentrant_checkpoint_around_the_wrapper_trains_as_one_device(kind):
    _step_as_one_device(kind, lambda wr, x: checkpoint(wr.w, wr.inp(x), use_reentrant=False))


@pytest.mark.parametrize("kind", KINDS)
def test_reentrant_checkpoint_around_the_wrapper_with_a_dist_tensor_input_as_one_device(kind):
    def call(wr, x):
        xi = wr.inp(x) if kind in OVER_TP else wb.shard_tensor(x, wr.mesh, [wb.Shard(0)])
        return checkpoint(wr.w, xi.requires_grad_(), use_reentrant=True)
    _step_as_one_device(kind, call)


@pytest.mark.parametrize("kind", PLAIN)
def test_reentrant_checkpoint_with_a_plain_input_raises_naming_the_fix(kind):
    """The wrapper's DistTensor output cannot leave a reentrant checkpoint tracked: before,
    backward raised "element 0 of tensors does not require grad"."""
    ref, wr, ro, opt = sgd_pair(kind)
    x, _ = batches(1)[0]
    before = full_weights(wr)
    with pytest.raises(NotImplementedError, match=r"use_reentrant=False.*shard_tensor"):
        checkpoint(wr.w, x.clone().requires_grad_(), use_reentrant=True)
    after = full_weights(wr)
    assert list(after) == list(before)
    for k in before:
        assert torch.equal(after[k], before[k])
    # the same wrapper trains on afterwards, as one device
    x, y = batches(1)[0]
    opt.zero_grad()
    ro.zero_grad()
    _loss(checkpoint(wr.w, x, use_reentrant=False), y).backward()
    _loss(ref(x), y).backward()
    opt.step()
    ro.step()
    assert_same_model(wr, ref)


class _Inner(torch.nn.Module):
    """A module that checkpoints its own first layer (non-reentrant)."""

    def __init__(self):
        super().__init__()
        self.net = mk()

    def forward(self, x):
        h = checkpoint(lambda t: self.net[1](self.net[0](t)), x, use_reentrant=False)
        return self.net[2](h)


def test_an_outer_checkpoint_around_ddp_of_a_module_that_checkpoints_inside():
    """Both regions: the module's own recompute still runs with each rank's parameters
    (its hooks), the outer one reruns the wrapper."""
    ref, m = _Inner(), _Inner()
    ref.eval()
    m.eval()
    ddp = wb.DistributedDataParallel(m, wb.Mesh.grid(4, ["dp"]))
    opt, ro = torch.optim.SGD(ddp.parameters(), lr=1.0), torch.optim.SGD(ref.parameters(),
                                                                        lr=1.0)
    for x, y in batches(2):
        _step_both(opt, ro, _loss(checkpoint(ddp, x, use_reentrant=False), y), _loss(ref(x), y))
    got = {k: (v.full() if isinstance(v, wb.DistTensor) else v) for k, v in
           m.state_dict().items()}
    for k, v in ref.state_dict().items():
        close(got[k], v)
