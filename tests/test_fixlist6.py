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


# ---- 6. the exercise checks' messages: a plural name takes "are" ------------------------

def test_plural_quantities_read_are_in_the_check_messages():
    """'your ZeRO-2 model states is 50 GB' read wrong (before the fix, for every stage),
    as did the compile exercise's 'op-by-op bytes is' / 'compiled bytes is'; the rest of
    the message is unchanged (the hint, then the try count)."""
    from .exercise_helpers import fails
    from workbench.exercises import checks_compile as K
    from workbench.exercises import checks_plan as P
    for stage in range(4):
        fails(rf"^your ZeRO-{stage} model states are 50 GB: .+"
              r"\(try 1;", P.check_zero_states_gb, 50.0, stage=stage)
    fails(r"^your op-by-op bytes are 1536 B: that is the compiled program's count",
          K.check_greedy_vs_whole_bytes, 1536, 1536)
    fails(r"^your compiled bytes are 1920 B: that is the op-by-op count",
          K.check_greedy_vs_whole_bytes, 384 + 1536, 1920)
    fails(r"^your MFU is 200: ", P.check_mfu, 200.0, 1.0)       # a singular name keeps "is"
