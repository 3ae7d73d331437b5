"""Defects found by the third random sweep (benchmarks/random_sweep.py on the extended
generator, tests/random_programs_more.py), each in its smallest form."""
from __future__ import annotations

import torch

import workbench as wb
from workbench.parallel.placement import Replicate, Shard

MESH = wb.Mesh.grid(2)


def test_repeat_of_a_0d_tensor_with_no_repeats_is_torchs():
    # seed 910110: x.repeat([]) on a 0-d tensor is x in torch; the rule's torch check
    # called repeat(*()) and raised a raw TypeError
    x = torch.tensor(1.5)
    d = wb.shard_tensor(x, MESH, [Replicate()])
    torch.testing.assert_close(d.repeat([]).full(), x.repeat([]))
    torch.testing.assert_close(d.repeat(()).full(), x.repeat(()))


def test_repeat_keeps_torchs_checks():
    d = wb.shard_tensor(torch.randn(4, 3), MESH, [Shard(0)])
    torch.testing.assert_close(d.repeat(2, 1).full(), d.full().repeat(2, 1))
    try:
        torch.randn(4, 3).repeat(2)
    except RuntimeError:
        pass
    else:
        raise AssertionError("torch accepted fewer repeats than dims")
    try:
        d.repeat(2)
    except RuntimeError:
        return
    raise AssertionError("repeat with fewer repeats than dims returned a result")


def test_searchsorted_of_a_python_float_in_an_int_sequence_promotes_as_torch():
    # silent before: the scalar was cast to the sequence's dtype (2.5 -> 2), position 1
    # where torch (the scalar wrapped as a number, compared promoted) gives 2
    seq = torch.tensor([1, 2, 3, 4])
    f32 = torch.tensor([0.0, 0.1, 0.2], dtype=torch.float32)
    for s, v in ((seq, 2.5), (seq, 2), (f32, 0.1), (f32.double(), 0.1)):
        for ps in ([Replicate()], [Shard(0)]):
            d = wb.shard_tensor(s, MESH, ps)
            for right in (False, True):
                got = torch.searchsorted(d, v, right=right)
                want = torch.searchsorted(s, v, right=right)
                assert got.full().dtype == want.dtype
                assert torch.equal(got.full(), want), (s, v, ps, right)
