"""SPMD propagation: the matmul-relu example, autograd through a TP MLP, errors."""
import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from workbench.parallel import infer


def test_matmul_relu_example_end_to_end():
    """PaddlePaddle's example: A replicated, B sharded on its contraction dim."""
    mesh = wb.Mesh.grid(4, ["x"])
    A, B = torch.randn(8, 12), torch.randn(12, 6)
    a = wb.shard_tensor(A, mesh, [wb.Replicate()])
    b = wb.shard_tensor(B, mesh, [wb.Shard(0)])
    dec = infer("matmul", a.spec, b.spec)
    assert dec.inputs == ((wb.Shard(1),), (wb.Shard(0),))      # A is sliced to match, locally
    assert dec.outputs == ((wb.Partial("sum"),),)
    assert dec.chosen.bytes == 0 and "partial sums" in dec.reason
    with wb.trace() as tr:
        c = torch.matmul(a, b)
        assert c.placements == (wb.Partial("sum"),)
        d = torch.relu(c)                                        # relu(P) is not linear
    assert len(tr.collectives()) == 1
    kind = tr.collectives()[0].name
    # reduce-scatter is the cheapest way out of Partial for relu; all-reduce if R is required
    assert kind == "reduce_scatter" and d.placements == (wb.Shard(0),)
    torch.testing.assert_close(d.full(), torch.relu(A @ B))
    with wb.trace() as tr:
        e = wb.reshard(c, mesh, [wb.Replicate()])
    assert tr.counts() == {"all_reduce": 1}
    torch.testing.assert_close(torch.relu(e).full(), torch.relu(A @ B))


def test_tensor_parallel_mlp_gradients_equal_single_device():
    torch.manual_seed(0)
    mesh = wb.Mesh.grid(8, ["tp"])
    X, W1, W2 = torch.randn(32, 64), torch.randn(256, 64) / 8, torch.randn(64, 256) / 8
    w1r, w2r = W1.clone().requires_grad_(), W2.clone().requires_grad_()
    ref = F.linear(torch.relu(F.linear(X, w1r)), w2r)
    (ref ** 2).mean().backward()

    x = wb.shard_tensor(X, mesh, [wb.Replicate()])
    w1 = wb.shard_tensor(W1, mesh, [wb.Shard(0)]).requires_grad_()   # column parallel
    w2 = wb.shard_tensor(W2, mesh, [wb.Shard(1)]).requires_grad_()   # row parallel
    with wb.trace() as tr:
        h = torch.relu(F.linear(x, w1))
        assert h.placements == (wb.Shard(1),)                        # no communication yet
        y = F.linear(h, w2)
        assert y.placements == (wb.Partial("sum"),)
        loss = (y ** 2).mean()                                       # square needs R or S
        loss.backward()
    torch.testing.assert_close(y.full(), ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w1.grad.full(), w1r.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w2.grad.full(), w2r.grad, rtol=1e-5, atol=1e-6)
    assert w1.grad.placements == (wb.Shard(0),) and w2.grad.placements == (wb.Shard(1),)
    kinds = [e.name for e in tr.collectives()]
    assert kinds.count("all_gather") + kinds.count("all_reduce") + \
        kinds.count("reduce_scatter") >= 1


def test_data_parallel_gradient_all_reduce_is_traced():
    mesh = wb.Mesh.grid(4, ["dp"])
    X, W = torch.randn(16, 8), torch.randn(8, 3)
    x = wb.shard_tensor(X, mesh, [wb.Shard(0)])
    w = wb.shard_tensor(W, mesh, [wb.Replicate()]).requires_grad_()
    with wb.trace() as tr:
        n_fwd = None
        loss = (x @ w).sum()
        n_fwd = len(tr.collectives())
        loss.backward()
    bwd = [e for e in tr.collectives()[n_fwd:] if e.bytes >= W.numel() * 4 // 2]
    assert [e.name for e in bwd] == ["all_reduce"]                   # the DP gradient all-reduce
    wr = W.clone().requires_grad_()
    (X @ wr).sum().backward()
    torch.testing.assert_close(w.grad.full(), wr.grad)
    assert w.grad.placements == (wb.Replicate(),)


def test_op_without_rule_is_a_clear_error_and_fallback_is_opt_in():
    mesh = wb.Mesh.grid(2)
    x = wb.shard_tensor(torch.randn(4, 4), mesh, [wb.Shard(0)])
    with pytest.raises(NotImplementedError, match="no SPMD rule.*allow_replicate_fallback"):
        torch.linalg.qr(x)
    with wb.trace() as tr:
        with wb.allow_replicate_fallback():
            q, r = torch.linalg.qr(x)
    assert q.placements == (wb.Replicate(),)
    assert any(e.name.startswith("fallback") for e in tr.events)
    torch.testing.assert_close(q.full() @ r.full(), x.full())


def test_op_without_entry_says_what_a_rule_alone_does_not_do():
    """An op outside the op table: the error lists what works; after register_rule alone
    it says that the rule is for wb.spmd.infer and the op still lacks an entry (it said
    "has no SPMD rule" and "Register one" again), and the input is untouched."""
    from workbench.parallel import NoRuleError
    from workbench.parallel.ops_table import RULES
    from workbench.parallel.rules import combine
    R, S = wb.Replicate(), wb.Shard
    mesh = wb.Mesh.grid(2)
    X = torch.arange(8.0).reshape(2, 4)
    x = wb.shard_tensor(X, mesh, [S(0)])
    assert "trapezoid" not in RULES
    with pytest.raises(NoRuleError, match=r"trapezoid\(\) has no SPMD rule.*not in the op table"
                       r".*ops that have rules.*allow_replicate_fallback.*register"):
        torch.trapezoid(x, dim=1)

    @wb.register_rule("trapezoid")
    def trapezoid_rule(x, dim):
        return combine(x.mesh.ndim, [[((R,), (R,), "replicated")]] * x.mesh.ndim, 1)
    try:
        assert infer("trapezoid", x.spec, dim=1).outputs == ((R,),)
        with pytest.raises(NoRuleError, match=r"trapezoid\(\) has a rule.*no op-table entry"
                           r".*spmd\.infer.*allow_replicate_fallback"):
            torch.trapezoid(x, dim=1)
    finally:
        del RULES["trapezoid"]
    assert "trapezoid" not in RULES and torch.equal(x.full(), X) and x.placements == (S(0),)


def test_user_rule_with_one_decorator():
    from workbench.parallel.rules import combine
    R, S = wb.Replicate(), wb.Shard

    @wb.register_rule("my_double", override=True)
    def my_double(x):
        return combine(x.mesh.ndim, [[((R,), (R,), "replicated"),
                                      ((S(0),), (S(0),), "rows independent")]] * x.mesh.ndim, 1)
    mesh = wb.Mesh.grid(2)
    spec = wb.TensorSpec((4, 2), mesh, [S(0)])
    d = infer("my_double", spec)
    assert d.outputs == ((S(0),),) and d.chosen.bytes == 0
