"""Defects left by earlier sessions (fixlist6), each held to plain PyTorch or to a rule
counted independently of the code under test."""
import pytest
import torch
import torch.nn.functional as F

import workbench as wb


def _torch_outcome(fn):
    try:
        r = fn()
    except Exception as e:                      # the reference's error: type and message
        return type(e), str(e)
    return tuple(r.shape), r.dtype, r


# ---- 2. softmax / log_softmax of bool (and integer) tensors: torch's answer -------------

@pytest.mark.parametrize("fn", [torch.log_softmax, torch.softmax, F.log_softmax, F.softmax])
@pytest.mark.parametrize("shape,dtype", [((0, 3), torch.bool), ((4, 3), torch.bool),
                                         ((4, 0), torch.bool), ((0, 3), torch.int64),
                                         ((4, 3), torch.int32)])
def test_softmax_of_bool_and_integer_tensors_as_torch(fn, shape, dtype):
    """torch returns an empty tensor of the input's dtype for an empty bool (or integer)
    input and raises NotImplementedError ('"log_softmax_lastdim_kernel_impl" not
    implemented for 'Bool'') for a non-empty one.  Before the fix log_softmax of a bool
    DistTensor raised the meta decomposition's RuntimeError ('Subtraction, the `-`
    operator, with two bool tensors...'), empty or not."""
    mesh = wb.Mesh.grid(2, ["x"])
    x = torch.zeros(shape, dtype=dtype)
    for pl in (wb.Replicate(), wb.Shard(0), wb.Shard(1)):
        for dim in (0, -1):
            want = _torch_outcome(lambda: fn(x, dim))
            d = wb.shard_tensor(x, mesh, [pl])
            got = _torch_outcome(lambda: fn(d, dim))
            assert got[:2] == want[:2], (pl, dim)
            if len(want) == 3:
                assert got[2].placements is not None and got[2].full().shape == want[0]
