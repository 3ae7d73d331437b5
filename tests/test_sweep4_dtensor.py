"""PyTorch DTensor as the oracle for a sample of the ops and habits the fourth sweep added
to the random programs (tests/random_programs_habits.py): every rank's local shard of our
result is held to DTensor's redistributed to our output placements (tests/
test_sweep3_dtensor.py's ``hold_to_dtensor``; cases DTensor cannot run are skipped)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from tests.dtensor_support import oracle  # noqa: F401
from tests.test_sweep3_dtensor import dtensor_cases, hold_case

R, S, P = wb.Replicate, wb.Shard, wb.Partial


def _fmod(a, b):
    return torch.fmod(a, b.abs() + 1)


OPS = {  # name -> (fn, input shapes)
    "fmod": (_fmod, [(5, 3), (3,)]), "le": (torch.le, [(5, 3), (5, 1)]),
    "logical_or": (lambda a, b: torch.logical_or(a > 0, b > 0), [(4, 3), (4, 3)]),
    "bitwise_and": (lambda a, b: torch.bitwise_and(a.long(), b.long()), [(5, 3), (3,)]),
    "int_plus_float": (lambda a, b: a.long() + b, [(5, 3), (5, 3)]),
    "bf16_plus_f32": (lambda a, b: a.bfloat16() + b.float(), [(4, 3), (3,)]),
    "expand_as": (lambda a, b: a.expand_as(b) * b, [(5, 1), (5, 3)]),
    "sum_tuple_neg": (lambda x: x.sum((-1, 0), keepdim=True), [(4, 3, 2)]),
    "amax_tuple": (lambda x: x.amax((0, 2)), [(4, 3, 2)]),
    "var_mean": (lambda x: torch.var_mean(x, 0, correction=0)[0], [(5, 3)]),
    "aminmax": (lambda x: torch.aminmax(x, dim=1)[1], [(5, 3)]),
    "where_bc": (lambda c, x, y: torch.where(c > 0, x, y), [(3,), (5, 3), (5, 1)]),
    "masked_fill_bc": (lambda x, m: x.masked_fill(m > 0, -2.0), [(5, 3), (3,)]),
    "adv_neg": (lambda x: x[:, torch.tensor([-1, 0, -2])], [(5, 3)]),
    "index_put": (lambda x, v: x.index_put((torch.tensor([2, 0]),), v), [(5, 3), (2, 3)]),
    "conv1d": (lambda x, w: F.conv1d(x, w, padding=1), [(2, 3, 6), (4, 3, 3)]),
    "avg_pool1d": (lambda x: F.avg_pool1d(x, 2), [(2, 3, 6)]),
    "group_norm": (lambda x: F.group_norm(x, 1), [(2, 4, 3)]),
}
# not held to DTensor: x[idx1, :, idx2] (refused here: one index tensor per call), and
# v = x.clone(); v[1:].add_(y) with y Partial on a 2x2 mesh, where DTensor's locals under
# LocalTensorMode are not the one-device value's chunks (ours are: tests/test_sweep4.py)
@pytest.mark.parametrize("name,mesh_shape,ins,seed", dtensor_cases(OPS, 40, 4))
def test_locals_equal_dtensors(oracle, name, mesh_shape, ins, seed):  # noqa: F811
    hold_case(oracle, OPS[name][0], mesh_shape, ins, seed)
