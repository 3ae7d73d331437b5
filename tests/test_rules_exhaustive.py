"""Every rule, every input placement combination, on meshes of 2, 4 and 2x2 ranks,
uneven shapes included, Partial inputs from unequal parts: the result gathered from
the shards equals one device's (see tests/spmd_harness.py).

One case is thinned where two placements take one path: linear's x of shape (3, 5, 6) has
two batch dims, which its rule treats alike (one einsum letter each). On the 2 x 2 mesh,
placements that shard the second batch dim (dim 1) meet every weight placement but a
replicated bias only; every bias placement meets every other placement of x (2,448 of
the 3,600 combinations there)."""
import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from tests.spmd_harness import check_op

torch.manual_seed(0)
X = torch.randn(5, 6)          # 5 rows: uneven on 2 and 4 ranks
Y = torch.randn(5, 6)

CASES = {
    "relu": (torch.relu, [X]),
    "neg": (torch.neg, [X]),
    "exp": (torch.exp, [X]),
    "gelu": (F.gelu, [X]),
    "scale": (lambda x: x * 3.0, [X]),
    "add": (torch.add, [X, Y]),
    "add_broadcast": (torch.add, [X, torch.randn(6)]),
    "sub": (lambda a, b: a - b, [X, Y]),
    "mul": (torch.mul, [X, Y]),
    "div": (lambda a, b: a / b, [X, Y.abs() + 1]),
    "maximum": (torch.maximum, [X, Y]),
    "where": (lambda a, b: torch.where(a > 0, a, b), [X, Y]),
    "matmul": (torch.matmul, [X, torch.randn(6, 3)]),
    "matmul_batched": (torch.matmul, [torch.randn(2, 5, 3), torch.randn(2, 3, 4)]),
    "matmul_broadcast": (torch.matmul, [torch.randn(2, 5, 3), torch.randn(3, 4)]),
    "matvec": (torch.matmul, [X, torch.randn(6)]),
    "linear": (F.linear, [torch.randn(3, 5, 6), torch.randn(4, 6), torch.randn(4)]),
    "einsum": (lambda a, b: torch.einsum("bij,bjk->bik", a, b),
               [torch.randn(2, 3, 5), torch.randn(2, 5, 3)]),
    "sum_dim": (lambda x: x.sum(1), [X]),
    "sum_keepdim": (lambda x: x.sum(0, keepdim=True), [X]),
    "sum_all": (lambda x: x.sum(), [X]),
    "mean_dim": (lambda x: x.mean(0), [X]),
    "mean_all": (lambda x: x.mean(), [X]),
    "amax": (lambda x: x.amax(1), [X]),
    "softmax": (lambda x: torch.softmax(x, -1), [X]),
    "log_softmax": (lambda x: F.log_softmax(x, 0), [X]),
}


def _linear_skip(mesh, combo):
    """On the 2 x 2 mesh, x sharded on its second batch dim: a replicated bias only."""
    xps, _, bps = combo
    return mesh.ndim == 2 and wb.Shard(1) in xps and bps != (wb.Replicate(), wb.Replicate())


# name: (skip, the number of combinations checked: meshes 2 and 4, then 2 x 2)
SKIP = {"linear": (_linear_skip, 2 * 5 * 4 * 3 + 16 * 16 * 9 + 9 * 16 * 1)}


@pytest.mark.parametrize("name", sorted(CASES))
def test_rule_exhaustive(name):
    fn, inputs = CASES[name]
    skip, want = SKIP.get(name, (lambda mesh, combo: False, None))
    checked = check_op(fn, inputs, skip=skip)
    assert checked > 0 and checked == (want or checked)
