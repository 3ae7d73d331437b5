"""fixemb12: a bfloat16 / float16 partial sum that a rounding op (add, mul...) cannot keep
partial (habits12) is reduced once, into the layout the op needs: Replicate by one
all-reduce when no other input is sharded on that mesh dim (Megatron's
``VocabParallelEmbedding`` all-reduces its output before the position add; torch's
``RowwiseParallel`` gives Replicate), the Shard another input holds by one reduce-scatter.
Before, the add took the op-local cheapest, a reduce-scatter into a Shard(1) nobody needed,
and the next op paid an all-gather: the GPT dry run at tp 2 pp 2 moved 159,383,552 comm
bytes where the estimate says 151,044,096 (tests/test_audit_plan.py)."""
import pytest
import torch
from torch import nn

import workbench as wb
from workbench.parallel.placement import Partial, Replicate, Shard


def _mesh():
    return wb.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))


def _partial(dtype, shape=(1, 16, 8)):
    """A P(sum) from a vocabulary-parallel embedding lookup (each rank its rows' part)."""
    g = torch.Generator().manual_seed(0)
    table = torch.randn(32, shape[-1], generator=g).to(dtype)
    idx = torch.randint(0, 32, shape[:-1], generator=g)
    w = wb.distribute_tensor(table, _mesh(), [Shard(0)])
    return nn.functional.embedding(idx, table), nn.functional.embedding(
        wb.distribute_tensor(idx, w.mesh, [Replicate()]), w)


def _labels(tr):
    return [e.label for e in tr.collectives()]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_embedding_partial_plus_replicated_positions_is_one_all_reduce(dtype):
    one, p = _partial(dtype)
    assert p.placements == (Partial("sum"),)
    pos = torch.randn(16, 8, generator=torch.Generator().manual_seed(1)).to(dtype)
    with wb.trace("a100") as tr:
        y = p + wb.distribute_tensor(pos, p.mesh, [Replicate()])
    assert y.placements == (Replicate(),)
    assert _labels(tr) == ["P(sum)->R on tp"]
    assert torch.equal(y.full_tensor(), one + pos)          # one rounding: as one device


def test_partial_plus_a_sharded_input_is_one_reduce_scatter():
    one, p = _partial(torch.bfloat16)
    other = torch.randn(1, 16, 8, generator=torch.Generator().manual_seed(2)).bfloat16()
    with wb.trace("a100") as tr:
        y = p + wb.distribute_tensor(other, p.mesh, [Shard(1)])
    assert y.placements == (Shard(1),)
    assert _labels(tr) == ["P(sum)->S(1) on tp"]
    assert torch.equal(y.full_tensor(), one + other)


def test_partial_times_a_scalar_is_reduced_to_replicate():
    one, p = _partial(torch.bfloat16)
    with wb.trace("a100") as tr:
        y = p * 0.3
    assert y.placements == (Replicate(),)
    assert _labels(tr) == ["P(sum)->R on tp"]
    assert torch.equal(y.full_tensor(), one * 0.3)


def test_float32_and_nonlinear_choices_are_unchanged():
    """Guards: in float32 the partial passes the add (no collective); ``P + 1`` (not linear
    in any dtype) keeps its op-local cheapest reduce-scatter, as before habits12."""
    _, p = _partial(torch.float32)
    pos = wb.distribute_tensor(torch.randn(16, 8), p.mesh, [Replicate()])
    assert (p + pos).placements == (Partial("sum"),)
    _, p = _partial(torch.bfloat16)
    assert (p + 1).placements == (Shard(1),)
