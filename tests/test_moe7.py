"""Adversarial audit (task moe7) of mixture of experts, expert parallelism and context
parallelism: each test pins a silent wrong answer found by a probe, held to a one-device
reference in plain torch (``tests/test_auditmoe.py``'s paper reference, in float64) or to
a count made by hand.  Each test failed before its fix (named in its docstring)."""
import pytest
import torch

import workbench as wb
from workbench.ops.moe import router_topk
from workbench.parallel.module import parallelize
from workbench.parallel.strategies.expert_parallel import expert_mesh, expert_parallel
from workbench.sim_mesh.all_to_all_v import record_all_to_all_v
from tests.test_auditmoe import _close, _layer, _reference_grads

R, Sh = wb.Replicate(), wb.Shard
F64 = torch.float64


# ---- ties in the router's scores -------------------------------------------------------------

@pytest.mark.parametrize("gating", ["softmax", "sigmoid"])
@pytest.mark.parametrize("cf", [None, 0.5])
def test_tied_router_scores_go_to_the_lower_expert_as_argmax(gating, cf):
    """Two experts with one router row score alike on every token.  Was: ``torch.topk``
    (torch 2.13, CPU) put the higher index first, so a top-1 layer sent every such token to
    expert 1 where Switch's / GShard's argmax (and ``torch.argmax``) sends it to expert 0,
    and the outcome was the backend kernel's (unspecified order of equal values)."""
    c = dict(arch="llama", E=4, k=1, gating=gating, cf=cf, norm=True, alpha=0.1, shared=0,
             B=2, S=7)
    m, x, gy = _layer(c, 1)
    with torch.no_grad():
        m.router.weight[1] = m.router.weight[0]
        m.router.weight[3] = m.router.weight[2]
    want_y, want_gx, want, _, routes = _reference_grads(m, c, x, gy)
    xa = x.clone().requires_grad_()
    y = m(xa)
    (y * gy).sum().backward()
    _close(y, want_y, "y")
    _close(xa.grad, want_gx, "x.grad")
    for n, p in m.named_parameters():
        _close(p.grad, want[n], n)
    assert m.last_stats["tokens_per_expert"].tolist()[1::2] == [0, 0]   # never the higher
    assert m.last_stats["dropped"] == sum(not r[4] for r in routes)


def test_router_topk_on_equal_scores_takes_the_lowest_indices_in_order():
    """All-equal logits: experts 0 .. k-1 in that order (the first is the first choice,
    which claims its slot first); was [5, 4] of 6 on CPU."""
    w, e, slots, _ = router_topk(torch.zeros(1, 3, 6, dtype=F64), 2, capacity=1)
    assert e.tolist() == [[[0, 1]] * 3]
    assert slots.tolist() == [[[0, 0], [-1, -1], [-1, -1]]]
    _close(w, torch.full((1, 3, 2), 0.5, dtype=F64), "gates")


# ---- the uneven all-to-all's bytes per rank --------------------------------------------------

def test_uneven_all_to_all_counts_each_ranks_own_sends():
    """``Trace.bytes_per_rank`` of an uneven all-to-all: each rank its row of the matrix,
    off the diagonal.  Was: every rank of the group the busiest sender's bytes (30 each)."""
    with wb.trace() as tr:
        record_all_to_all_v([[4, 10, 20], [5, 9, 0], [0, 0, 7]], (0, 1, 2))
    assert tr.bytes_per_rank() == {0: 30, 1: 5, 2: 0}
    assert tr.collectives()[0].bytes == 30          # the event: the busiest rank's


def test_expert_parallel_bytes_per_rank_are_the_rows_each_rank_sent():
    """Every token of both ep ranks routed to expert 3 (ep rank 1): rank 0 sends its 5 rows
    in the dispatch, rank 1 sends them back in the combine, each once; plus the E int64
    counts ((p-1)/p of 4 x 8 bytes).  Was 656 bytes a rank: dispatch and combine both
    charged to both ranks."""
    c = dict(arch="llama", E=4, k=1, gating="softmax", cf=None, norm=False, alpha=0.0,
             shared=0, B=2, S=5)
    m, x, gy = _layer(c, 3)
    with torch.no_grad():
        m.router.weight.zero_()
        m.router.weight[3, 0] = 50.0
        x[..., 0] = x[..., 0].abs() + 0.1
    want_y = _reference_grads(m, c, x, gy)[0]
    mesh = wb.Mesh.grid((2, 1), ["dp", "tp"])
    m.token_dispatcher = expert_parallel(m.experts, expert_mesh(mesh, 2))
    parallelize(m, mesh, {})
    with wb.trace() as tr:
        y = m(wb.shard_tensor(x, mesh, [Sh(0), R]))
    _close(y, want_y, "y")
    assert m.last_stats["tokens_per_expert"].tolist() == [0, 0, 0, 10]
    row = 5 * 8 * 8                                  # 5 tokens of h = 8 in float64
    assert tr.bytes_per_rank("all_to_all") == {0: row + 16, 1: row + 16}


# ---- context parallelism: the two attentions on one layout ----------------------------------

@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (4, 2)])
def test_ulysses_by_default_reads_the_layout_ring_attention_reads(Hq, Hkv):
    """q, k, v laid out by ``ring_order``'s default (load-balanced, as ``to_ring_layout``
    and ``ring_attention`` take them); both attentions with their defaults (causal) give
    one device's output.  Was: ``ulysses_attention`` defaulted to contiguous slots and put
    the causal mask on the wrong positions (1.2 off; the ring 7e-16)."""
    from workbench.parallel.strategies import context_parallel as cp
    from workbench.parallel.strategies.context_parallel_a2a import ulysses_attention
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 16, 8, generator=g, dtype=F64) for h in (Hq, Hkv, Hkv))
    mesh = wb.Mesh([0, 1], dim_names=["cp"])
    d = [wb.shard_tensor(cp.ring_order(t, 2, 2), mesh, [Sh(2)]) for t in (q, k, v)]
    want = cp.ring_order(wb.ops.flash_attention(q, k, v, causal=True), 2, 2)
    for attend in (cp.ring_attention, ulysses_attention):
        torch.testing.assert_close(attend(*d, "cp").full(), want, rtol=1e-12, atol=1e-12,
                                   msg=attend.__name__)


def test_ulysses_balanced_on_a_sequence_it_cannot_balance_says_balanced_false():
    """With the default now balanced=True, 6 tokens on cp = 2 (3 a rank, contiguous) are
    refused before any all-to-all, naming ``balanced=False``."""
    from workbench.parallel.strategies.context_parallel_a2a import ulysses_attention
    mesh = wb.Mesh([0, 1], dim_names=["cp"])
    d = [wb.shard_tensor(torch.randn(1, 2, 6, 4), mesh, [Sh(2)]) for _ in range(3)]
    with wb.trace() as tr, pytest.raises(ValueError, match=r"sequence of 6 tokens.*pass "
                                                         r"balanced=False"):
        ulysses_attention(*d, "cp")
    assert not tr.events
    assert ulysses_attention(*d, "cp", balanced=False).shape == (1, 2, 6, 4)


@pytest.mark.parametrize("kw,match", [
    (dict(rows=[[0, 2.5], [2, 0]]), r"rows hold 2.5; give whole token counts"),
    (dict(rows=[[0, -3], [2, 0]]), r"rows hold -3"),
    (dict(chunks=0), r"chunks=0; give an int >= 1"),
    (dict(per_expert=0), r"per_expert=0; give an int >= 1"),
    (dict(experts_per_rank=0), r"experts_per_rank=0; give an int >= 1")])
def test_exchange_report_refuses_what_it_would_price_wrong(kw, match):
    """Was: 2.5 tokens priced as 2 (``int()``), chunks=0 an IndexError, no experts or no
    weights priced as the kernels' launches alone."""
    from workbench.parallel.strategies.expert_parallel import exchange_report
    args = dict(rows=[[0, 3], [2, 0]], row_bytes=8192, per_expert=3 * 4096 * 1792,
                experts_per_rank=2, profile="h100")
    with pytest.raises(ValueError, match=match):
        exchange_report(**{**args, **kw})
    assert exchange_report(**args).comm > 0
