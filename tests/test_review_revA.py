"""Review findings (revA): each a defect found reading today's change, held to torch."""
import torch

import workbench as wb


def _x():
    m = wb.Mesh([0, 1], ["dp"])
    return wb.shard_tensor(torch.arange(4.0), m, [wb.Shard(0)])


def test_to_copy_true_is_a_copy_as_torch():
    # torch: x.to(x.dtype, copy=True) is a new tensor; writing to it leaves x alone
    ref = torch.arange(4.0)
    ref_y = ref.to(torch.float32, copy=True)
    ref_y.add_(1)
    assert torch.equal(ref, torch.arange(4.0))
    x = _x()
    y = x.to(torch.float32, copy=True)
    assert y is not x
    y.add_(1)
    assert torch.equal(x.full(), torch.arange(4.0))
    assert torch.equal(y.full(), ref_y)
    z = x.to(dtype=torch.float32, copy=True)
    z.mul_(0)
    assert torch.equal(x.full(), torch.arange(4.0))


def test_to_same_dtype_without_copy_is_self_as_torch():
    x = _x()
    assert x.to(torch.float32) is x and x.float() is x
