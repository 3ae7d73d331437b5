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


@pytest.mark.parametrize("level", ["O0", "O1", "O2"])
def test_amin_with_a_gradient_across_ranks_feeds_its_consumers_as_run(level):
    """Before: amin over a sharded dim of a tensor that needs grad runs eagerly as torch's
    even gradient (ops_table/extreme_grad.py), reducing its P(min) inside the op; the
    compiled plan forced ``squeeze`` on the P(min) that never existed: a raw RuntimeError
    ('not among the rule's candidates at run time') at O0, the dispatcher's choice (wide
    probe seed 47; O1 / O2 where their search kept it).
    Now the plan takes the op's Replicated result, its all-reduce priced (O0: eager's
    collectives and bytes), values and torch's even gradient among ties as eager's."""
    mesh = wb.Mesh([[0, 1, 2, 3]])
    f = lambda x: x.amin(1, keepdim=True).squeeze(1) * 2     # noqa: E731
    v = torch.tensor([[1., 0, 3, 0, 5, 6]])          # a tie across ranks 0 and 1
    x = wb.distribute_tensor(v, mesh, [Replicate(), Shard(1)]).requires_grad_()
    with wb.trace() as te:
        e = f(x)
    e.sum().backward()
    ge, x.grad = x.grad.full_tensor(), None
    prog = wb.compile(f, x, level=level)
    assert prog.breaks == []
    with wb.trace() as tr:
        got = prog(x)
    got.sum().backward()
    assert torch.equal(got.full_tensor(), e.full_tensor())
    assert torch.equal(x.grad.full_tensor(), ge)
    r = v.clone().requires_grad_()
    f(r).sum().backward()
    assert torch.equal(ge, r.grad)                    # [0, .5, 0, .5, 0, 0]: torch's
    assert max(tr.bytes_per_rank().values()) == prog.bytes
    if level == "O0":
        assert [e.name for e in tr.events if e.stream == "comm"] == \
            [e.name for e in te.events if e.stream == "comm"]
    # called with an input that needs no grad: the plain amin's P(min), reduced as planned
    x2 = wb.distribute_tensor(v, mesh, [Replicate(), Shard(1)])
    assert torch.equal(prog(x2).full_tensor(), f(x2).full_tensor())


@pytest.mark.parametrize("seed, wide", [(9, True), (47, True), (25, False)])
def test_probe_programs_that_raised_or_differed_compile_as_eager(seed, wide):
    """The probe's programs (tests/compile_probe.py) that raised (wide 9: complex128 priced
    by iinfo; wide 47: amin's P(min) planned past the op) or counted other collectives at
    O0 (narrow 25: the backward's reduce-scatter where eager all-reduces, equal values):
    at every level compiled (or eager after a break), equal to eager."""
    from tests.compile_probe import probe
    p, out = probe(seed, wide)
    assert set(out) == {"O0", "O1", "O2"}
    bad = {lv: r for lv, r in out.items() if r[0] not in ("compiled", "eager")}
    assert not bad, "\n".join(p.lines) + f"\n{bad}"
