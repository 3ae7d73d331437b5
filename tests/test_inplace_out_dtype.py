"""``torch.sum(x, dim, out=z)`` and the other reductions that take ``dtype=``: torch computes
them in ``z``'s dtype (aten infers the dtype from the result: the input cast first), so an
int64 ``z`` of a float input holds the sum of the truncated values, not the truncated sum,
and raises nothing.  DistTensors follow (random sweep seeds 1008276 and 1009112: our
``out=`` computed in the input's dtype and refused the cast)."""
import random
import warnings

import pytest
import torch

import workbench as wb
from tests.random_programs import run_program

FUNCS = (torch.sum, torch.prod, torch.nansum, torch.mean, torch.nanmean, torch.cumsum,
         torch.cumprod)
DTYPES = (torch.int64, torch.bool, torch.float64, torch.float16, torch.int32, torch.float32)
MESH = wb.Mesh([0, 1])


@pytest.mark.parametrize("func", FUNCS, ids=lambda f: f.__name__)
def test_out_sets_the_dtype_a_reduction_computes_in(func):
    x = torch.tensor([[0.6, 0.6, 0.6, -0.7], [1.5, -0.7, 2.9, 0.4], [2.5, 1.2, -3.1, 0.9],
                      [0.3, 0.2, 0.1, 0.7]])
    shape = (4, 4) if func in (torch.cumsum, torch.cumprod) else (4,)
    for dt in DTYPES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                want, err = func(x, 1, out=torch.zeros(shape, dtype=dt)), None
            except (RuntimeError, NotImplementedError) as e:
                want, err = None, type(e)
        for ps in ([wb.Shard(0)], [wb.Shard(1)], [wb.Replicate()]):
            z = wb.shard_tensor(torch.zeros(shape, dtype=dt), MESH, [wb.Replicate()])
            if err is not None:
                with pytest.raises(err):
                    func(wb.shard_tensor(x, MESH, ps), 1, out=z)
                continue
            got = func(wb.shard_tensor(x, MESH, ps), 1, out=z)
            assert got is z and got.dtype == want.dtype, (dt, got.dtype)
            tol = dict(rtol=1e-3, atol=1e-2) if dt == torch.float16 else {}
            torch.testing.assert_close(got.full(), want, **tol)


def test_integer_out_of_a_float_sum_sums_the_truncated_values():
    # torch: 0.6 + 0.6 + 0.6 + (-0.7) -> 0 + 0 + 0 + 0 = 0, not int(1.1) = 1
    x = torch.tensor([[0.6, 0.6, 0.6, -0.7]])
    z = wb.shard_tensor(torch.zeros(1, dtype=torch.int64), MESH, [wb.Replicate()])
    assert torch.sum(wb.shard_tensor(x, MESH, [wb.Shard(1)]), 1, out=z).full().tolist() == [0]
    assert torch.sum(x, 1, out=torch.zeros(1, dtype=torch.int64)).tolist() == [0]


@pytest.mark.parametrize("seed", [1008276, 1009112])
def test_the_sweeps_programs_run(seed):
    out = run_program(random.Random(seed))
    assert out.status == "ok", (out.status, out.detail)
