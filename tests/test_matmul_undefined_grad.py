"""A product's gradient hook given no gradient: ``vector_norm(a @ b, 0)`` has no
derivative through its input (torch's gradient is zeros), so autograd hands the
product's hook None, and the hook that makes the simulated ranks' gradient contiguous
(``ops_table/matmul._dense_grad``) raised "descriptor 'contiguous' ... 'NoneType'"
(random sweep seed 1030754)."""
import random

import torch

import workbench as wb
from tests.random_programs import run_program


def test_norm_zero_of_a_product_backward_is_torchs():
    mesh = wb.Mesh([0, 1, 2, 3])
    g = torch.Generator().manual_seed(0)
    a0, b0 = torch.randn(4, 3, 4, generator=g, dtype=torch.float64), \
        torch.randn(4, 5, generator=g, dtype=torch.float64)
    ra, rb = a0.clone().requires_grad_(), b0.clone().requires_grad_()
    a = wb.distribute_tensor(a0.clone(), mesh, [wb.Shard(0)]).requires_grad_()
    b = wb.distribute_tensor(b0.clone(), mesh, [wb.Replicate()]).requires_grad_()
    w = torch.randn(4, generator=g, dtype=torch.float64)
    (torch.linalg.vector_norm(ra @ rb, 0, (1, 2)) * w).sum().backward()
    (torch.linalg.vector_norm(a @ b, 0, (1, 2)) * w).sum().backward()
    for got, want, x in ((a.grad, ra.grad, a0), (b.grad, rb.grad, b0)):
        # torch leaves no gradient (None) or zeros: a zero DistTensor matches either
        want = torch.zeros_like(x) if want is None else want
        torch.testing.assert_close(got.full() if got is not None else torch.zeros_like(x),
                                   want, rtol=0, atol=0)


def test_sweep_seed_runs():
    out = run_program(random.Random(1030754))
    assert out.status == "ok", out
