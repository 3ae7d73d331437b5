"""Load-balanced context parallelism knows the order of the sequence (seq_order.py).

Was: inside ``context_parallel(mesh, "cp")`` (balanced=True), causal attention on q, k, v
sharded Shard(2) over cp in the sequence's own order (``distribute_tensor``, ``reshard``)
ran as the ring that assumes rank i holds chunks i and 2p-1-i: 0.94 (cp 2) and 1.93
(cp 4) off one device's ``F.scaled_dot_product_attention(is_causal=True)``, no error.
Now ``to_ring_layout`` records the order, the ops between it and attention keep it, and
causal attention without it is refused, naming to_ring_layout (or exact: contiguous slots,
balanced=False, are the sequence's own order). Every result is held to one device's."""
import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from workbench.parallel.seq_order import RingOrder, ring_order_of
from workbench.parallel.strategies import context_parallel as cp
from workbench.parallel.strategies.context_parallel_a2a import ulysses_attention

B, H, S, D = 1, 4, 16, 8


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, go = (torch.randn(B, H, S, D, generator=g) for _ in range(4))
    return q, k, v, go


def _reference(q, k, v, go):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=True)
    return out.detach(), torch.autograd.grad(out, leaves, go)


def _mesh(p):
    return wb.Mesh(list(range(p)), dim_names=["cp"])


def _attend(op, qkv):
    if op == "sdpa":
        return F.scaled_dot_product_attention(*qkv, is_causal=True)
    return wb.ops.flash_attention(*qkv, causal=True)


CASES = [(op, comm, p) for op in ("sdpa", "flash") for comm in ("p2p", "a2a") for p in (2, 4)]


@pytest.mark.parametrize("op,comm,p", CASES)
def test_natural_order_under_load_balancing_is_refused_naming_to_ring_layout(op, comm, p):
    q, k, v, _ = _data()
    mesh = _mesh(p)
    qkv = [wb.distribute_tensor(t, mesh, [wb.Shard(2)]).requires_grad_() for t in (q, k, v)]
    with cp.context_parallel(mesh, "cp", cp_comm=comm):
        with pytest.raises(ValueError, match=r"no record of its sequence's order.*"
                                             r"to_ring_layout.*balanced=False"):
            _attend(op, qkv)
    assert all(t.grad is None and ring_order_of(t) is None for t in qkv)


@pytest.mark.parametrize("op,comm,p", CASES)
def test_natural_order_with_contiguous_slots_is_exact_forward_and_backward(op, comm, p):
    """balanced=False: the ring's slots are the sequence's own order, so a user's
    ``distribute_tensor(q, mesh, [Shard(2)])`` is what it takes."""
    q, k, v, go = _data(1)
    ref, ref_grads = _reference(q, k, v, go)
    mesh = _mesh(p)
    qkv = [wb.distribute_tensor(t, mesh, [wb.Shard(2)]).requires_grad_() for t in (q, k, v)]
    with cp.context_parallel(mesh, "cp", balanced=False, cp_comm=comm), wb.trace() as tr:
        out = _attend(op, qkv)
    assert out.placements == (wb.Shard(2),)
    (out * wb.distribute_tensor(go, mesh, [wb.Shard(2)])).sum().backward()
    torch.testing.assert_close(out.full(), ref, rtol=1e-5, atol=1e-5)
    for t, g in zip(qkv, ref_grads):
        torch.testing.assert_close(t.grad.full(), g, rtol=1e-5, atol=1e-5)
    kind = "send_recv" if comm == "p2p" else "all_to_all"
    assert tr.counts().get(kind, 0) > 0            # it ran context-parallel


@pytest.mark.parametrize("balanced", [True, False])
@pytest.mark.parametrize("op,comm,p", CASES)
def test_to_ring_layout_programs_keep_their_exact_results(op, comm, p, balanced):
    """to_ring_layout -> attention in the context -> from_ring_layout: one device's
    output and gradients, and bit for bit the direct call on hand-laid inputs (the
    program before the order was recorded)."""
    q, k, v, go = _data(2)
    ref, ref_grads = _reference(q, k, v, go)
    mesh = _mesh(p)
    leaves = [wb.distribute_tensor(t, mesh, [wb.Replicate()]).requires_grad_()
              for t in (q, k, v)]
    qkv = [cp.to_ring_layout(t, "cp", 2, balanced) for t in leaves]
    assert all(ring_order_of(t) == RingOrder(0, p, 2, balanced) for t in qkv)
    with cp.context_parallel(mesh, "cp", balanced=balanced, cp_comm=comm):
        out = _attend(op, qkv)
    assert ring_order_of(out) == RingOrder(0, p, 2, balanced)
    back = cp.from_ring_layout(out, "cp", 2, balanced)
    assert ring_order_of(back) is None
    (back * wb.distribute_tensor(go, mesh, [wb.Replicate()])).sum().backward()
    torch.testing.assert_close(back.full(), ref, rtol=1e-5, atol=1e-5)
    for t, g in zip(leaves, ref_grads):
        torch.testing.assert_close(t.grad.full(), g, rtol=1e-5, atol=1e-5)
    hand = [wb.shard_tensor(cp.ring_order(t, p, 2, balanced), mesh, [wb.Shard(2)])
            for t in (q, k, v)]
    direct = (cp.ring_attention if comm == "p2p" else ulysses_attention)(
        *hand, "cp", causal=True, balanced=balanced)
    assert torch.equal(out.full(), direct.full())


def test_the_order_survives_the_ops_a_layer_runs_and_is_lost_where_it_is_not_known():
    """(B, S, h) ids-like input in ring order -> linear -> view -> transpose -> RoPE's
    products (tables laid out on the ring: a plain ring-ordered table is refused, as
    test_cp12 holds) -> causal attention: one device's. A sequence sharded afresh is
    refused by attention; reordering one by position (index_select), by the op itself."""
    p, h, hd = 2, 16, 8
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(2, S, h, generator=g), torch.randn(3 * h, h, generator=g) / h ** 0.5
    cos, sin = torch.randn(S, hd, generator=g), torch.randn(S, hd, generator=g)

    def layer(x, cos, sin):
        qkv = F.linear(x, w).view(x.shape[0], x.shape[1], 3, h // hd, hd)
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
        q, k = (t * cos + t.flip(-1) * sin for t in (q, k))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref = layer(x, cos, sin)
    mesh = _mesh(p)
    perm = cp.slot_positions(S, p)
    xr = cp.to_ring_layout(wb.distribute_tensor(x, mesh, [wb.Replicate()]), "cp", 1)
    cos_r, sin_r = (cp.to_ring_layout(wb.distribute_tensor(t, mesh, [wb.Replicate()]), "cp", 0)
                    for t in (cos, sin))
    with cp.context_parallel(mesh, "cp"):
        out = layer(xr, cos_r, sin_r)
    torch.testing.assert_close(out.full()[:, :, torch.argsort(perm)], ref,
                               rtol=1e-5, atol=1e-5)
    # reordering it by position (index_select) is refused since test_cp12 (it was: lost)
    with pytest.raises(ValueError, match="index_select reads positions along dim 1"):
        torch.index_select(wb.reshard(xr, mesh, [wb.Replicate()]), 1, torch.arange(S))
    lost = [wb.distribute_tensor(cp.ring_order(x, p), mesh, [wb.Shard(1)])]
    for y in lost:
        assert ring_order_of(y) is None
        with cp.context_parallel(mesh, "cp"), pytest.raises(ValueError, match="to_ring_layout"):
            layer(wb.reshard(y, mesh, [wb.Shard(1)]), cos_r, sin_r)
    # a reshard keeps it (the global tensor is unchanged), and so does detach
    assert ring_order_of(wb.reshard(xr, mesh, [wb.Replicate()])) == RingOrder(0, p, 1, True)
    assert ring_order_of(xr.detach()) == RingOrder(0, p, 1, True)


@pytest.mark.parametrize("comm", ["p2p", "a2a"])
def test_an_order_that_is_not_the_contexts_is_refused(comm):
    """Was silent too: to_ring_layout(balanced=False) in the balanced context (and the
    other way round) ran the mask over the wrong positions."""
    q, k, v, _ = _data(4)
    mesh = _mesh(2)
    for laid, ctx in ((False, True), (True, False)):
        qkv = [cp.to_ring_layout(wb.distribute_tensor(t, mesh, [wb.Replicate()]), "cp", 2,
                                 laid) for t in (q, k, v)]
        with cp.context_parallel(mesh, "cp", balanced=ctx, cp_comm=comm), \
                pytest.raises(ValueError, match=f"set balanced={laid} to match"):
            F.scaled_dot_product_attention(*qkv, is_causal=True)
        direct = cp.ring_attention if comm == "p2p" else ulysses_attention
        with pytest.raises(ValueError, match="recorded as dim 2"):
            direct(*qkv, "cp", balanced=ctx)


def test_attention_without_a_mask_takes_any_order():
    q, k, v, _ = _data(5)
    mesh = _mesh(4)
    qkv = [wb.distribute_tensor(t, mesh, [wb.Shard(2)]) for t in (q, k, v)]
    with cp.context_parallel(mesh, "cp"):
        out = F.scaled_dot_product_attention(*qkv)
    torch.testing.assert_close(out.full(), F.scaled_dot_product_attention(q, k, v),
                               rtol=1e-5, atol=1e-5)


def test_ring_layout_round_trip_and_its_misuse():
    p = 4
    mesh = wb.Mesh.grid((2, p), ["dp", "cp"])
    X = torch.randn(2, S, 3, generator=torch.Generator().manual_seed(6))
    x = wb.shard_tensor(X, mesh, [wb.Shard(0), wb.Replicate()])
    for balanced in (True, False):
        y = cp.to_ring_layout(x, "cp", 1, balanced)
        assert y.placements == (wb.Shard(0), wb.Shard(1))
        assert torch.equal(y.full(), cp.ring_order(X, p, 1, balanced))
        back = cp.from_ring_layout(y, "cp", 1, balanced)
        assert torch.equal(back.full(), X) and ring_order_of(back) is None
        with pytest.raises(ValueError, match="undoing that would scramble it"):
            cp.from_ring_layout(y, "cp", 1, not balanced)
        with pytest.raises(ValueError, match="already.*scramble"):
            cp.to_ring_layout(wb.reshard(y, mesh, [wb.Shard(0), wb.Replicate()]), "cp", 1)


def test_a_capacity_router_takes_tokens_in_the_recorded_ring_order_only():
    """The same hazard in a mixture-of-experts router with a capacity: tokens claim slots
    in sequence order, and the context reordered them "back" from ring order whatever
    order they were in (natural order: other tokens dropped than on one device)."""
    p, n = 2, 8
    mesh = _mesh(p)
    logits = torch.randn(2, n, 4, generator=torch.Generator().manual_seed(7))
    want = wb.ops.router_topk(logits, 2, capacity=3)
    natural = wb.distribute_tensor(logits, mesh, [wb.Shard(1)])
    with cp.context_parallel(mesh, "cp"), pytest.raises(ValueError, match="to_ring_layout"):
        wb.ops.router_topk(natural, 2, capacity=3)
    ring = cp.to_ring_layout(wb.distribute_tensor(logits, mesh, [wb.Replicate()]), "cp", 1)
    with cp.context_parallel(mesh, "cp"):
        got = wb.ops.router_topk(ring, 2, capacity=3)
    inv = torch.argsort(cp.slot_positions(n, p))
    for a, b in zip(got[:3], want[:3]):
        assert torch.equal(a.full()[:, inv], b)


def test_the_recorded_order_is_saved_and_loaded():
    import io
    mesh = _mesh(2)
    x = cp.to_ring_layout(wb.distribute_tensor(torch.randn(2, S, 3), mesh, [wb.Replicate()]),
                          "cp", 1)
    buf = io.BytesIO()
    torch.save({"x": x}, buf)
    buf.seek(0)
    y = torch.load(buf)["x"]                    # weights_only=True: RingOrder allowlisted
    assert ring_order_of(y) == RingOrder(0, 2, 1, True) and torch.equal(y.full(), x.full())
