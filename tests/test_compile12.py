"""``wb.compile`` on the random programs' wide space and on user modules (helper compile12):
each held to the same program run eagerly on the same DistTensors and to one device.
The probes themselves: tests/compile_probe.py, tests/compile_probe_modules.py."""
from __future__ import annotations

import pytest
import torch

import workbench as wb
from workbench.parallel import Partial, Replicate, Shard


@pytest.mark.parametrize("level", ["O0", "O1", "O2"])
def test_a_complex_program_compiles_and_equals_eager(level):
    """Before: every level priced a complex128 value's bytes with torch.iinfo (TypeError: a raw
    error from the search, wide probe seed 9); now dtype.itemsize, 16 bytes."""
    mesh = wb.Mesh.grid((2, 2))
    g = torch.Generator().manual_seed(0)
    x = torch.complex(torch.randn(4, 6, generator=g, dtype=torch.float64),
                      torch.randn(4, 6, generator=g, dtype=torch.float64))
    w = torch.randn(6, 3, generator=g, dtype=torch.float64).to(torch.complex128)
    f = lambda a, b: (a @ b).exp().sum(0)            # noqa: E731
    args = [wb.distribute_tensor(x, mesh, [Shard(0), Replicate()]),
            wb.distribute_tensor(w, mesh, [Replicate(), Shard(1)])]
    prog = wb.compile(f, *args, level=level)
    assert prog.breaks == []
    got, eager = prog(*args), f(*args)
    assert got.dtype == eager.dtype == torch.complex128
    torch.testing.assert_close(got.full_tensor(), eager.full_tensor(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got.full_tensor(), f(x, w), rtol=1e-12, atol=1e-12)
