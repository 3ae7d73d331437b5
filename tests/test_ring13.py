"""A sequence in load-balanced ring order (to_ring_layout) meets what test_cp12 left open.

Was (``python -m benchmarks.ring_order_probe``, the 69 "+" cases at cp 2 and 4): 32
differed from one device and 8 more lost the record with the values in ring order, no
error: a DistTensor sharded by hand with no record taken as being in the ring's order
beside a recorded one, ``from_ring_layout`` of a tensor with no record "undoing" an order
it was not in, nonzero / masked_select / unique_consecutive listing elements in the ring's
order, repeat / tile end to end, reshape / view / flatten / unflatten merging or splitting
the ring dim, ``x[:, i] = v`` and index_put at natural positions, a batched matmul over
the sequence with a plain weight per position, an einsum whose output columns lost their
order. Now each is refused naming the op, the dim and the fix, or
(order-preserving along the dim) keeps the record and equals one device.
"""
import pytest
import torch

import workbench as wb
from workbench.parallel.seq_order import (RingOrder, RingOrderError, orders_of,
                                          ring_order_of, set_ring_order)
from workbench.parallel.strategies import context_parallel as cp

B, H = 2, 3


def _mesh(p):
    return wb.Mesh(list(range(p)), dim_names=["cp"])


def _ring(t, mesh, dim=1, balanced=True):
    return cp.to_ring_layout(wb.distribute_tensor(t, mesh, [wb.Replicate()]), "cp", dim,
                             balanced)


def _x(p, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(B, 4 * p, H, generator=g) + 0.5
    return x, _ring(x, _mesh(p))


def _natural(out):
    """``out`` read back in the sequence's own order along every recorded dim."""
    got = out.full()
    for o in orders_of(out):
        inv = torch.argsort(cp.slot_positions(got.shape[o.dim], o.ring, o.balanced))
        got = got.index_select(o.dim, inv)
    return got


# ---- (1) a DistTensor sharded by hand, no record, beside a recorded one -------------------

@pytest.mark.parametrize("p", [2, 4])
def test_a_hand_sharded_partner_is_refused_and_a_stated_one_is_exact(p):
    x, rx = _x(p)
    y = torch.randn(B, 4 * p, H, generator=torch.Generator().manual_seed(1))
    mesh = _mesh(p)
    before = rx.full().clone()
    for laid in (y, cp.ring_order(y, p, 1)):          # its own order, or ring order by hand
        hand = wb.distribute_tensor(laid, mesh, [wb.Shard(1)])
        with pytest.raises(RingOrderError, match=r"add: input 1, a DistTensor sharded "
                           r"Shard\(1\).*no record.*set_ring_order"):
            rx + hand
        with pytest.raises(RingOrderError, match="where: input 0"):
            torch.where(wb.distribute_tensor(laid > 0, mesh, [wb.Shard(1)]), rx, 0.0)
    assert torch.equal(rx.full(), before)
    stated = set_ring_order(wb.distribute_tensor(cp.ring_order(y, p, 1), mesh, [wb.Shard(1)]),
                            RingOrder(0, p, 1, True))
    out = rx + stated
    assert ring_order_of(out) == RingOrder(0, p, 1, True)
    torch.testing.assert_close(_natural(out), x + y)


def test_contiguous_slots_and_one_rank_take_a_hand_sharded_partner():
    x, y = torch.rand(B, 8, H), torch.rand(B, 8, H)
    m2 = _mesh(2)                                   # contiguous slots: the sequence's order
    out = _ring(x, m2, balanced=False) + wb.distribute_tensor(y, m2, [wb.Shard(1)])
    torch.testing.assert_close(out.full(), x + y)
    m1 = _mesh(1)
    out = _ring(x, m1) + wb.distribute_tensor(y, m1, [wb.Shard(1)])
    torch.testing.assert_close(out.full(), x + y)


# ---- (3) from_ring_layout of a tensor with no record --------------------------------------

@pytest.mark.parametrize("p", [2, 4])
def test_from_ring_layout_of_an_unrecorded_tensor_is_refused_unless_stated(p):
    x, _ = _x(p)
    mesh = _mesh(p)
    hand = wb.distribute_tensor(x, mesh, [wb.Shard(1)])
    with pytest.raises(ValueError, match=r"from_ring_layout: x .*no record of its dim 1.*"
                                         r"set_ring_order\(x, RingOrder\(0, %d, 1, True\)\)" % p):
        cp.from_ring_layout(hand, "cp", 1)
    laid = wb.distribute_tensor(cp.ring_order(x, p, 1), mesh, [wb.Shard(1)])
    set_ring_order(laid, RingOrder(0, p, 1, True))
    back = cp.from_ring_layout(laid, "cp", 1)
    assert torch.equal(back.full(), x) and ring_order_of(back) is None
    # contiguous slots are the sequence's own order: nothing to assume
    assert torch.equal(cp.from_ring_layout(hand, "cp", 1, balanced=False).full(), x)


# ---- (2) data-dependent ops, repeats, merges, writes --------------------------------------

_REFUSED = {
    "nonzero": (lambda x: torch.nonzero(x > 1), "nonzero: .*lists elements"),
    "argwhere": (lambda x: torch.argwhere(x > 1), "argwhere: "),
    "x[x > 1]": (lambda x: x[x > 1], "bool_mask_index: "),
    "masked_select": (lambda x: torch.masked_select(x, x > 1), "masked_select: .*lists"),
    "unique_consecutive": (lambda x: torch.unique_consecutive(x, dim=1), "unique_consecutive"),
    "unique inverse": (lambda x: torch.unique(x, return_inverse=True)[1], "unique: "),
    "repeat along seq": (lambda x: x.repeat(1, 2, 1), r"repeat: .*end to end, reps \(1, 2, 1\)"),
    "tile along seq": (lambda x: torch.tile(x, (1, 2, 1)), "repeat: "),
    "reshape (B*S, H)": (lambda x: x.reshape(-1, H), r"reshape: .*merges the dim"),
    "view (B, S*H)": (lambda x: x.view(B, -1), r"view: .*merges the dim"),
    "flatten(1)": (lambda x: x.flatten(1), "flatten: "),
    "unflatten seq": (lambda x: x.unflatten(1, (2, -1)), "unflatten: "),
    "argmax along seq": (lambda x: torch.argmax(x, 1), "indices would count the ring's order"),
    "matmul batched over seq, plain w": (
        lambda x: x.unsqueeze(2) @ torch.randn(x.shape[1], H, 2), "matmul: input 1"),
    "einsum with a plain weight along seq": (
        lambda x: torch.einsum("bsh,sg->bhg", x, torch.randn(x.shape[1], 2)), "einsum: input 1"),
}


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("name", list(_REFUSED))
def test_ops_that_list_repeat_or_merge_the_ring_dim_are_refused_naming_the_dim_and_fix(name, p):
    x, rx = _x(p)
    fn, msg = _REFUSED[name]
    fn(x)                                          # one device runs it
    before = rx.full().clone()
    with pytest.raises(RingOrderError, match=msg) as e:
        fn(rx)
    assert "along dim 1" in str(e.value) or "its dim 1" in str(e.value)
    assert "from_ring_layout" in str(e.value)
    assert torch.equal(rx.full(), before)


def test_the_fix_from_ring_layout_then_the_op_is_one_device():
    x, rx = _x(2)
    nat = cp.from_ring_layout(rx, "cp", 1)
    torch.testing.assert_close(torch.nonzero(nat > 1).full(), torch.nonzero(x > 1))
    torch.testing.assert_close(nat.reshape(-1, H).full(), x.reshape(-1, H))


_KEPT = {
    "argmax over H": lambda x: torch.argmax(x, 2),
    "max(dim=H) indices": lambda x: torch.max(x, 2).indices,
    "repeat over batch": lambda x: x.repeat(2, 1, 1),
    "unflatten H": lambda x: x.unflatten(2, (H, 1)),
    "reshape adds a dim": lambda x: x.reshape(B, x.shape[1], 1, H),
    "stack dim 0": lambda x: torch.stack([x, x]),
    "bucketize": lambda x: torch.bucketize(x, torch.tensor([0.75, 1.0, 1.25])),
    "einsum bsh,bth->bst": lambda x: torch.einsum("bsh,bth->bst", x, x),
    "unique sorted": lambda x: torch.unique(x),
    "where x > 1": lambda x: torch.where(x > 1, x, 0.0),
    "sort over H indices": lambda x: torch.sort(x, 2).indices,
    "topk over H values": lambda x: torch.topk(x, 2, 2).values,
    "cumsum over H": lambda x: torch.cumsum(x, 2),
    "flip over H": lambda x: torch.flip(x, [2]),
}


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("name", list(_KEPT))
def test_order_preserving_ops_keep_the_record_and_equal_one_device(name, p):
    x, rx = _x(p)
    out = _KEPT[name](rx)
    want = _KEPT[name](x)
    torch.testing.assert_close(_natural(out), want)
    assert out.dtype == want.dtype


def test_a_batched_matmul_over_the_sequence_takes_weights_laid_out_with_it():
    x, rx = _x(2)
    w = torch.randn(x.shape[1], H, 2, generator=torch.Generator().manual_seed(3))
    out = rx.unsqueeze(2) @ _ring(w, _mesh(2), 0)
    assert ring_order_of(out) == RingOrder(0, 2, 1, True)
    torch.testing.assert_close(_natural(out), x.unsqueeze(2) @ w)


def test_einsum_records_both_sequence_dims_of_a_score_matrix():
    _, rx = _x(2)
    s = torch.einsum("bsh,bth->bst", rx, rx)
    assert {o.dim for o in orders_of(s)} == {1, 2}


@pytest.mark.parametrize("p", [2, 4])
def test_writes_at_natural_positions_are_refused_and_leave_x_untouched(p):
    x, rx = _x(p)
    S = x.shape[1]
    before = rx.full().clone()
    y = rx.clone()
    with pytest.raises(RingOrderError, match=r"__setitem__: .*positions written vary along "
                                             r"dim 1"):
        y[:, S - 1] = 0.0
    assert torch.equal(y.full(), before)
    with pytest.raises(RingOrderError, match="values written vary along dim 1"):
        y[:, :, 0] = torch.arange(S, dtype=torch.float32).expand(B, S)
    with pytest.raises(RingOrderError, match="__setitem__"):
        torch.index_put(rx, (torch.tensor([0]), torch.tensor([S - 1])), torch.tensor(9.0))
    assert torch.equal(y.full(), before) and torch.equal(rx.full(), before)
    # a mask computed from x's ring-ordered values is in that order: exact
    y[y > 1] = 0.0
    want = x.clone()
    want[want > 1] = 0.0
    torch.testing.assert_close(_natural(y), want)
    # one value along the sequence is order-free
    y[:, :, 0] = 5.0
    want[:, :, 0] = 5.0
    torch.testing.assert_close(_natural(y), want)
