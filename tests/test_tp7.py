"""Adversarial checks of the PyTorch-named tensor / sequence parallel API (tp7): each
held to one device (same seed: outputs, input and every parameter gradient), to
Megatron-LM's communication (one all-reduce forward and one backward for the f/g pair of
a Colwise + Rowwise MLP, Shoeybi et al. 2019 sec. 3), and, where it runs, to PyTorch's own
``parallelize_module`` under ``LocalTensorMode`` (``tests/dtensor_support.py``).

What the existing tests (test_tp_styles, test_dtensor_oracle, ...) already hold is not
repeated: this file adds uneven shapes (hidden, vocabulary and batch not divisible by the
tp size), layout chains between styles (Partial, Shard(1), Replicate hand-offs), an
attention block in three plans, a module with a buffer, a dp x tp mesh, the embedding's
padding_idx under a vocabulary split, loss_parallel's remaining keyword mixes, and
DTensor's from_local / redistribute / full_tensor gradients.
"""
from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import workbench as wb
from tests.dtensor_support import CommDebugMode, LocalTensorMode, oracle  # noqa: F401

R, S, P = wb.Replicate, wb.Shard, wb.Partial
DT = torch.float64


def _full(t):
    return t.full() if isinstance(t, wb.DistTensor) else t


def _check_against_one_device(ref, model, x, *, w=None, atol=1e-12):
    """Run both on ``x`` (a plain global tensor), weight the output by ``w``, backward;
    assert output, input gradient and every parameter gradient equal.  Returns the
    output and the traced collective counts (forward, backward)."""
    xr, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
    with wb.trace("a100") as tr:
        y = model(xm)
        fwd = Counter(tr.counts())
        yf = _full(y)
        w = torch.randn_like(yf) if w is None else w
        (yf * w).sum().backward()
    bwd = Counter(tr.counts()) - fwd
    yr = ref(xr)
    (yr * w).sum().backward()
    torch.testing.assert_close(yf, yr, atol=atol, rtol=0)
    torch.testing.assert_close(xm.grad, xr.grad, atol=atol, rtol=0)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(_full(p.grad), q.grad, atol=atol, rtol=0, msg=n)
    return y, fwd, bwd


class MLP(nn.Module):
    def __init__(self, d, h, bias=True):
        super().__init__()
        self.w1, self.w2 = nn.Linear(d, h, bias=bias), nn.Linear(h, d, bias=bias)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)))


# ---- Megatron MLP: uneven hidden / model dims, one all-reduce each way --------------------

@pytest.mark.parametrize("d, h, tp, bias", [(8, 16, 2, True), (8, 16, 4, False),
                                            (6, 10, 4, True), (5, 7, 2, True),
                                            (8, 6, 4, True)])
def test_mlp_uneven_equals_one_device_with_one_all_reduce_each_way(d, h, tp, bias):
    torch.manual_seed(0)
    ref = MLP(d, h, bias).to(DT)
    m = wb.parallelize_module(copy.deepcopy(ref), wb.Mesh.grid(tp, ["tp"]),
                              {"w1": wb.ColwiseParallel(), "w2": wb.RowwiseParallel()})
    assert [tuple(t.shape) for t in m.w1.weight.locals()] == \
        [tuple(c.shape) for c in torch.chunk(ref.w1.weight, tp, 0)] + \
        [(0, d)] * (tp - len(torch.chunk(ref.w1.weight, tp, 0)))       # torch.chunk shards
    y, fwd, bwd = _check_against_one_device(ref, m, torch.randn(3, 4, d, dtype=DT))
    assert y.placements == (R(),)
    assert fwd == Counter(all_reduce=1) and bwd == Counter(all_reduce=1)


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")   # CommDebugMode's
def test_mlp_as_pytorch_dtensor(oracle):  # noqa: F811
    """torch's own parallelize_module on the same MLP (bias, tp 2): the same parameter
    layouts, the same output, one all-reduce forward and one backward on both sides."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from workbench.parallel.interop import to_dtensor_placements
    torch.manual_seed(1)
    ref, x = MLP(8, 16).to(DT), torch.randn(3, 8, dtype=DT)
    theirs, xt = copy.deepcopy(ref), x.clone().requires_grad_()     # f's backward: dx
    with LocalTensorMode(2):
        from torch.distributed.tensor.parallel import parallelize_module
        parallelize_module(theirs, oracle.mesh((2,)), {"w1": ColwiseParallel(),
                                                       "w2": RowwiseParallel()})
        with CommDebugMode() as cm:
            y_t = theirs(xt)
            fwd_t = sum(cm.get_comm_counts().values())
            y_t.sum().backward()
            bwd_t = sum(cm.get_comm_counts().values()) - fwd_t
        t_places = {n: tuple(p.placements) for n, p in theirs.named_parameters()}
        y_t0, xt_grad0 = [t._local_tensors[0] if hasattr(t, "_local_tensors") else t
                          for t in (y_t, xt.grad)]
    ours = wb.parallelize_module(copy.deepcopy(ref), wb.Mesh.grid(2, ["tp"]),
                                 {"w1": wb.ColwiseParallel(), "w2": wb.RowwiseParallel()})
    xo = x.clone().requires_grad_()
    with wb.trace("a100") as tr:
        y = ours(xo)
        fwd = sum(tr.counts().values())
        y.sum().backward()
        bwd = sum(tr.counts().values()) - fwd
    assert {n: to_dtensor_placements(p.placements) for n, p in ours.named_parameters()} \
        == t_places
    torch.testing.assert_close(y.full(), torch.as_tensor(y_t0))
    torch.testing.assert_close(xo.grad, torch.as_tensor(xt_grad0))
    assert (fwd, bwd) == (fwd_t, bwd_t) == (1, 1)


class _Attn(nn.Module):
    """torchtitan's attention without its norm: the input prepared once for wq/wk/wv."""

    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = [nn.Linear(8, 8) for _ in range(4)]

    def forward(self, h):
        B, T, _ = h.shape
        q, k, v = [w(h).view(B, T, -1, 2).transpose(1, 2) for w in (self.wq, self.wk, self.wv)]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(B, T, -1))


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")   # CommDebugMode's
def test_prepared_attention_as_pytorch_dtensor(oracle):  # noqa: F811
    """PrepareModuleInput(Replicate -> Replicate) then three colwise linears reading one
    DTensor input: torch reduces the input gradient once (the three Partial gradients are
    summed, then one all-reduce); so do we (Megatron's f applied once, not per linear)."""
    import torch.distributed.tensor.parallel as tp
    from torch.distributed.tensor import Replicate as TR

    def plan(ns, rep):
        return {"": ns.PrepareModuleInput(input_layouts=(rep(),), desired_input_layouts=(rep(),)),
                **{k: ns.ColwiseParallel() for k in ("wq", "wk", "wv")},
                "wo": ns.RowwiseParallel()}

    torch.manual_seed(14)
    ref, x0 = _Attn().to(DT), torch.randn(2, 4, 8, dtype=DT)
    theirs, xt = copy.deepcopy(ref), x0.clone().requires_grad_()
    with LocalTensorMode(4):
        tp.parallelize_module(theirs, oracle.mesh((4,)), plan(tp, TR))
        with CommDebugMode() as cm:
            y_t = theirs(xt)
            fwd_t = sum(cm.get_comm_counts().values())
            y_t.sum().backward()
            bwd_t = sum(cm.get_comm_counts().values()) - fwd_t
        xt_grad0 = xt.grad._local_tensors[0] if hasattr(xt.grad, "_local_tensors") else xt.grad
    ours, xo = copy.deepcopy(ref), x0.clone().requires_grad_()
    wb.parallelize_module(ours, wb.Mesh.grid(4, ["tp"]), plan(wb, R))
    with wb.trace("a100") as tr:
        y = ours(xo)
        fwd = sum(tr.counts().values())
        y.sum().backward()
        bwd = sum(tr.counts().values()) - fwd
    torch.testing.assert_close(y.full(), ref(x0))
    torch.testing.assert_close(xo.grad, torch.as_tensor(xt_grad0))
    assert (fwd, bwd) == (fwd_t, bwd_t) == (1, 1)


# ---- layout hand-offs between styles ------------------------------------------------------

SEQ = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 6), nn.Linear(6, 8), nn.Linear(8, 6))
CHAINS = {
    "rowwise Partial -> colwise Partial": {
        "0": wb.ColwiseParallel(), "1": wb.RowwiseParallel(output_layouts=P()),
        "2": wb.ColwiseParallel(input_layouts=P()), "3": wb.RowwiseParallel()},
    "Shard(1) hand-offs": {
        "0": wb.ColwiseParallel(), "1": wb.RowwiseParallel(output_layouts=S(1)),
        "2": wb.ColwiseParallel(input_layouts=S(1)), "3": wb.RowwiseParallel(output_layouts=S(1))},
    "colwise -> colwise (input left Shard(-1))": {
        "0": wb.ColwiseParallel(), "1": wb.ColwiseParallel(), "2": wb.ColwiseParallel(),
        "3": wb.RowwiseParallel()},
    "Replicate hand-off, then a Shard(0) output": {
        "0": wb.ColwiseParallel(output_layouts=R()), "1": wb.RowwiseParallel(),
        "2": wb.ColwiseParallel(use_local_output=False), "3": wb.RowwiseParallel(output_layouts=S(0))},
    "wildcards": {"[02]": wb.ColwiseParallel(), "[13]": wb.RowwiseParallel()},
}


@pytest.mark.parametrize("name", list(CHAINS))
@pytest.mark.parametrize("seq_len", [4, 5])                     # 5: uneven Shard(1)
def test_style_chains_equal_one_device(name, seq_len):
    torch.manual_seed(2)
    ref = copy.deepcopy(SEQ).to(DT)
    m = wb.parallelize_module(copy.deepcopy(ref), wb.Mesh.grid(2, ["tp"]),
                              copy.deepcopy(CHAINS[name]))
    _check_against_one_device(ref, m, torch.randn(2, seq_len, 6, dtype=DT))


@pytest.mark.parametrize("style, out", [
    (wb.ColwiseParallel(), S(0)),                                   # 1-d input: features
    (wb.RowwiseParallel(), R()),
    (wb.RowwiseParallel(output_layouts=P()), P()),
    (wb.RowwiseParallel(output_layouts=S(-1)), S(0)),
    (wb.ColwiseParallel(input_layouts=S(0), output_layouts=S(0)), S(0)),
])
def test_linear_layouts_and_1d_inputs(style, out):
    torch.manual_seed(3)
    ref = nn.Linear(6, 4).to(DT)
    m = wb.parallelize_module(copy.deepcopy(ref), wb.Mesh.grid(2, ["tp"]), style)
    x = torch.randn(6, dtype=DT) if style.input_layouts[0] != S(0) else torch.randn(5, 6, dtype=DT)
    y, _, _ = _check_against_one_device(ref, m, x)
    assert y.placements == (out,)


# ---- an attention block in three plans ----------------------------------------------------

D, NH = 8, 4


class Attn(nn.Module):
    def __init__(self, bias):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.wq, self.wk, self.wv, self.wo = [nn.Linear(D, D, bias=bias) for _ in range(4)]

    def forward(self, x):
        h = self.norm(x)
        B, T, _ = h.shape
        q, k, v = [w(h).view(B, T, -1, D // NH).transpose(1, 2) for w in (self.wq, self.wk, self.wv)]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.wo(o.transpose(1, 2).reshape(B, T, -1))


def _attn_plan(kind):
    if kind == "sp":
        return {"norm": wb.SequenceParallel(),
                "": wb.PrepareModuleInput(input_layouts=(S(1),), desired_input_layouts=(S(1),)),
                **{k: wb.ColwiseParallel(input_layouts=S(1)) for k in ("wq", "wk", "wv")},
                "wo": wb.RowwiseParallel(output_layouts=S(1))}
    local = kind != "dtensor outputs"
    return {**{k: wb.ColwiseParallel(use_local_output=local) for k in ("wq", "wk", "wv")},
            "wo": wb.RowwiseParallel(use_local_output=local)}


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("kind, out, fwd_want", [
    ("tp", R(), Counter(all_reduce=1)),
    ("dtensor outputs", R(), Counter(all_reduce=1)),
    ("sp", S(1), Counter(all_gather=3, reduce_scatter=1)),
])
def test_attention_block_equals_one_device(bias, kind, out, fwd_want):
    torch.manual_seed(4)
    ref = Attn(bias).to(DT)
    m = wb.parallelize_module(copy.deepcopy(ref), wb.Mesh.grid(4, ["tp"]), _attn_plan(kind))
    y, fwd, _ = _check_against_one_device(ref, m, torch.randn(2, 4, D, dtype=DT))
    assert y.placements == (out,) and fwd == fwd_want


# ---- a buffer, a dp x tp mesh, a module called twice, checkpointing -----------------------

class WithBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 8)
        self.register_buffer("scale", torch.linspace(0.5, 2, 8))

    def forward(self, x):
        return self.lin(x) * self.scale


@pytest.mark.parametrize("out", [R(), S(-1)])
def test_module_with_a_buffer(out):
    torch.manual_seed(5)
    ref = WithBuffer().to(DT)
    m = wb.parallelize_module(copy.deepcopy(ref), wb.Mesh.grid(2, ["tp"]),
                              {"lin": wb.ColwiseParallel(output_layouts=out)})
    assert type(m.scale) is torch.Tensor                        # the buffer is left alone
    _check_against_one_device(ref, m, torch.randn(3, 6, dtype=DT))


class Twice(nn.Module):
    def __init__(self, ckpt=False):
        super().__init__()
        self.mlp, self.ckpt = MLP(6, 10), ckpt

    def forward(self, x):
        if self.ckpt:
            return torch.utils.checkpoint.checkpoint(self.mlp, x, use_reentrant=False)
        return self.mlp(self.mlp(x))


@pytest.mark.parametrize("ckpt", [False, True])
def test_module_called_twice_and_checkpointed(ckpt):
    torch.manual_seed(6)
    ref = Twice(ckpt).to(DT)
    m = wb.parallelize_module(copy.deepcopy(ref), wb.Mesh.grid(4, ["tp"]),
                              {"mlp.w1": wb.ColwiseParallel(), "mlp.w2": wb.RowwiseParallel()})
    _check_against_one_device(ref, m, torch.randn(3, 6, dtype=DT))


@pytest.mark.parametrize("sp", [False, True])
def test_dp_by_tp_mesh(sp):
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.w1, self.w2 = nn.LayerNorm(6), nn.Linear(6, 8), nn.Linear(8, 6)

        def forward(self, x):
            return self.w2(F.relu(self.w1(self.norm(x))))

    torch.manual_seed(7)
    ref, mesh = Block().to(DT), wb.Mesh.grid((2, 2), ["dp", "tp"])
    plan = {"w1": wb.ColwiseParallel(), "w2": wb.RowwiseParallel()}
    if sp:
        plan = {"norm": wb.SequenceParallel(), "w1": wb.ColwiseParallel(input_layouts=S(1)),
                "w2": wb.RowwiseParallel(output_layouts=S(1))}
    m = wb.parallelize_module(copy.deepcopy(ref), mesh, plan)
    x, w = torch.randn(4, 6, 6, dtype=DT), torch.randn(4, 6, 6, dtype=DT)
    y = m(wb.shard_tensor(x, mesh, [S(0), R()]))
    assert y.placements == (S(0), S(1) if sp else R())
    (y * wb.shard_tensor(w, mesh, [S(0), R()])).sum().backward()
    (ref(x) * w).sum().backward()
    torch.testing.assert_close(y.full(), ref(x))
    for (n, p), q in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(_full(p.grad), q.grad, msg=n)


def test_distribute_module_partition_and_hooks():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 4)
            self.register_buffer("c", torch.linspace(1, 2, 4))

        def forward(self, x):
            return self.b(torch.tanh(self.a(x))) * self.c

    def part(name, mod, mesh):
        if name == "a":
            for pn, p in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(pn, nn.Parameter(wb.distribute_tensor(p, mesh, [S(0)])))

    torch.manual_seed(8)
    ref, mesh = M().to(DT), wb.Mesh.grid(4, ["tp"])
    m = wb.parallel.distribute_module(
        copy.deepcopy(ref), mesh, part,
        input_fn=lambda mod, inp, mesh: wb.distribute_tensor(inp[0], mesh, [S(0)]),
        output_fn=lambda mod, out, mesh: out.redistribute(mesh, [R()]).to_local())
    assert [p.placements for p in m.parameters()] == [(S(0),), (S(0),), (R(),), (R(),)]
    x, w = torch.randn(5, 6, dtype=DT), torch.randn(5, 4, dtype=DT)
    y = m(x)
    assert type(y) is torch.Tensor
    (y * w).sum().backward()
    (ref(x) * w).sum().backward()
    torch.testing.assert_close(y, ref(x))
    for p, q in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full(), q.grad)


# ---- embeddings: uneven vocabulary, padding_idx, tied to a rowwise head ---------------------

@pytest.mark.parametrize("V, tp, kw", [(10, 4, {}), (10, 4, {"padding_idx": 2}),
                                       (12, 4, {"padding_idx": 0}), (7, 2, {})])
@pytest.mark.parametrize("style", ["rowwise", "rowwise S(1)", "colwise"])
def test_embedding_uneven_vocab_and_padding_idx(V, tp, kw, style):
    torch.manual_seed(9)
    ref = nn.Embedding(V, 6, **kw).to(DT)
    st = {"rowwise": wb.RowwiseParallel(input_layouts=R()),
          "rowwise S(1)": wb.RowwiseParallel(input_layouts=R(), output_layouts=S(1)),
          "colwise": wb.ColwiseParallel()}[style]
    m = wb.parallelize_module(copy.deepcopy(ref), wb.Mesh.grid(tp, ["tp"]), st)
    ids = torch.tensor([[0, 1, 2, V - 1], [2, 2, 3, V - 2]])
    y = m(ids)
    w = torch.randn(2, 4, 6, dtype=DT)
    (y.full() * w).sum().backward()
    (ref(ids) * w).sum().backward()
    torch.testing.assert_close(y.full(), ref(ids), atol=0, rtol=0)
    torch.testing.assert_close(m.weight.grad.full(), ref.weight.grad)
    if "padding_idx" in kw:
        assert not m.weight.grad.full()[kw["padding_idx"]].any()


def test_tied_colwise_embedding_and_rowwise_head():
    """The other tie that lays the (V, D) weight out alike: Shard(1) for a colwise
    embedding and for a rowwise head (input features) -- both uses' gradients summed."""
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(10, 8), nn.Linear(8, 10, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, ids):
            return self.head(self.emb(ids))

    torch.manual_seed(10)
    ref, ids = Tied().to(DT), torch.randint(0, 10, (2, 4))
    m = wb.parallelize_module(copy.deepcopy(ref), wb.Mesh.grid(2, ["tp"]),
                              {"emb": wb.ColwiseParallel(), "head": wb.RowwiseParallel()})
    assert m.head.weight is m.emb.weight and m.emb.weight.placements == (S(1),)
    y = m(ids)
    y.full().pow(2).sum().backward()
    ref(ids).pow(2).sum().backward()
    torch.testing.assert_close(y.full(), ref(ids))
    torch.testing.assert_close(m.emb.weight.grad.full(), ref.emb.weight.grad)


# ---- loss_parallel: the keyword mixes test_tp_styles does not hold ------------------------

@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("kw", [{}, {"label_smoothing": 0.2},
                                {"reduction": "none", "label_smoothing": 0.3},
                                {"reduction": "sum", "label_smoothing": 0.1},
                                {"weight": True}, {"weight": True, "label_smoothing": 0.1}])
def test_loss_parallel_default_ignore_index_mixes(tp, kw):
    """Targets holding torch's default ignore_index (-100) with label smoothing, class
    weights and every reduction."""
    torch.manual_seed(11)
    kw = dict(kw)
    if kw.pop("weight", False):
        kw["weight"] = torch.rand(12, dtype=DT)
    x, t = torch.randn(8, 12, dtype=DT), torch.randint(0, 12, (8,))
    t[1] = t[6] = -100
    xr = x.clone().requires_grad_()
    want = F.cross_entropy(xr, t, **kw)
    want.sum().backward()
    xd = wb.shard_tensor(x, wb.Mesh.grid(tp, ["tp"]), [S(1)]).requires_grad_()
    with wb.loss_parallel():
        got = F.cross_entropy(xd, t, **kw)
    got.sum().backward()
    torch.testing.assert_close(got.full(), want)
    torch.testing.assert_close(xd.grad.full(), xr.grad)


def test_loss_parallel_every_target_ignored_is_nan_as_torch():
    x, t = torch.randn(4, 8, dtype=DT), torch.full((4,), -100)
    xd = wb.shard_tensor(x, wb.Mesh.grid(2, ["tp"]), [S(1)]).requires_grad_()
    with wb.loss_parallel():
        got = F.cross_entropy(xd, t)
    assert torch.isnan(got.full()) and torch.isnan(F.cross_entropy(x, t))


def test_log_softmax_then_nll_loss_inside_loss_parallel():
    """torch's loss_parallel also runs log_softmax + nll_loss vocabulary-parallel; so
    does ours (Shard(1) kept: test_loss8.py holds the layout and the counts)."""
    torch.manual_seed(12)
    x, t = torch.randn(6, 12, dtype=DT), torch.randint(0, 12, (6,))
    t[0] = -100
    xr = x.clone().requires_grad_()
    want = F.nll_loss(F.log_softmax(xr, -1), t)
    want.backward()
    xd = wb.shard_tensor(x, wb.Mesh.grid(4, ["tp"]), [S(1)]).requires_grad_()
    with wb.loss_parallel():
        got = F.nll_loss(F.log_softmax(xd, -1), t)
    got.backward()
    torch.testing.assert_close(got.full(), want)
    torch.testing.assert_close(xd.grad.full(), xr.grad)


# ---- DTensor's methods: from_local, redistribute, full_tensor, to_local --------------------

@pytest.mark.parametrize("p, shape, scale", [(S(0), (12, 2), None), (R(), (3, 2), 1),
                                             (P(), (3, 2), 4)])
def test_from_local_one_tensor_for_every_rank(p, shape, scale):
    """One tensor passed by every rank (DTensor's SPMD reading): Shard(0) stacks four
    copies, Replicate is the tensor, Partial sums four; its gradient is the derivative
    of the global value (the sum over the chunks / once / four times)."""
    mesh = wb.Mesh.grid(4, ["tp"])
    t = torch.arange(6, dtype=DT).view(3, 2).requires_grad_()
    d = wb.DistTensor.from_local(t, mesh, [p])
    assert tuple(d.shape) == shape and d.placements == (p,)
    w = torch.arange(d.numel(), dtype=DT).view(shape)
    (d.full_tensor() * w).sum().backward()
    want = w.view(4, 3, 2).sum(0) if scale is None else scale * w
    torch.testing.assert_close(t.grad, want)


def test_from_local_uneven_list_shape_and_stride():
    mesh = wb.Mesh.grid(4, ["tp"])
    ts = [torch.full((3 if i < 3 else 1, 2), float(i), dtype=DT, requires_grad=True)
          for i in range(4)]
    d = wb.DistTensor.from_local(ts, mesh, [S(0)])
    assert tuple(d.shape) == (10, 2)
    assert tuple(wb.DistTensor.from_local(ts, mesh, [S(0)], shape=(10, 2), stride=(2, 1)).shape) \
        == (10, 2)
    w = torch.randn(10, 2, dtype=DT)
    (d.redistribute(mesh, [R()]).to_local() * w).sum().backward()
    for t, wi in zip(ts, torch.split(w, [3, 3, 3, 1])):
        torch.testing.assert_close(t.grad, wi)
    with pytest.raises(NotImplementedError, match=r"stride=\(1, 10\).*contiguous"):
        wb.DistTensor.from_local(ts, mesh, [S(0)], shape=(10, 2), stride=(1, 10))
    with pytest.raises(RuntimeError, match="without shape"):
        wb.DistTensor.from_local(ts, mesh, [S(0)], stride=(2, 1))


@pytest.mark.parametrize("dst", [S(0), S(1)])
def test_partial_to_uneven_shard(dst):
    torch.manual_seed(13)
    mesh = wb.Mesh.grid(4, ["tp"])
    parts = [torch.randn(10, 3, dtype=DT, requires_grad=True) for _ in range(4)]
    d = wb.DistTensor.from_local(parts, mesh, [P()])
    s = d.redistribute(mesh, [dst])
    total = sum(p.detach() for p in parts)
    assert [tuple(t.shape) for t in s.locals()] == \
        [tuple(c.shape) for c in torch.chunk(total, 4, dst.dim)] + \
        [(10, 0)] * (4 - len(torch.chunk(total, 4, dst.dim)))
    torch.testing.assert_close(s.full(), total)
    w = torch.randn(10, 3, dtype=DT)
    (s.full_tensor() * w).sum().backward()
    for p in parts:                                  # Partial's backward: each part gets it
        torch.testing.assert_close(p.grad, w)


def test_full_tensor_gradient_keeps_the_shard_layout_and_to_local_grad_placements():
    mesh = wb.Mesh.grid(4, ["tp"])
    x = torch.randn(10, 3, dtype=DT, requires_grad=True)
    d = wb.distribute_tensor(x, mesh, [S(0)])
    assert d.is_leaf and d.requires_grad
    y = d.full_tensor()
    (y * y).sum().backward()
    assert d.grad.placements == (S(0),) and x.grad is None       # a new leaf, as DTensor's
    torch.testing.assert_close(d.grad.full(), 2 * x.detach())
    r = wb.distribute_tensor(torch.randn(5, 3, dtype=DT), mesh, [R()]).requires_grad_()
    (r.to_local(grad_placements=[R()]) * 3).sum().backward()
    torch.testing.assert_close(r.grad.full(), torch.full((5, 3), 3.0, dtype=DT))
    with pytest.raises(NotImplementedError, match=r"to_local\(grad_placements=\['P\(sum\)'\]\)"):
        r.to_local(grad_placements=[P()])


# ---- plans that do not resolve ------------------------------------------------------------

def test_plan_keys_that_match_nothing_raise_and_change_nothing():
    """torch warns and skips such a key; here it raises before anything changes,
    naming the token that matched nothing (also under a wildcard that matches some
    children only)."""
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([MLP(4, 8), nn.Sequential(nn.Linear(4, 4))])

    m, mesh = Two(), wb.Mesh.grid(2, ["tp"])
    for key, token in (("layers.*.w1", "w1"), ("layers.0.w1.weight", "weight"),
                       ("nope", "nope")):
        with pytest.raises(ValueError, match=f"parallelize_plan key '{key}'.*matches '{token}'"):
            wb.parallelize_module(m, mesh, {"layers.0.w2": wb.RowwiseParallel(),
                                            key: wb.ColwiseParallel()})
        assert not any(isinstance(p, wb.DistTensor) for p in m.parameters())


@pytest.mark.parametrize("out, fwd_want, bwd_want", [
    (R(), Counter(all_reduce=1), Counter()),
    (S(1), Counter(reduce_scatter=1), Counter(all_gather=1)),
])
def test_vocab_sharded_embedding_communication(out, fwd_want, bwd_want):
    """Megatron's VocabParallelEmbedding: the masked lookups' partial sums leave through
    one all-reduce (or a reduce-scatter onto the sequence); backward needs none (its
    all-gather is the reduce-scatter's own backward)."""
    e = wb.parallelize_module(nn.Embedding(10, 6), wb.Mesh.grid(4, ["tp"]),
                              wb.RowwiseParallel(input_layouts=R(), output_layouts=out))
    ids = torch.randint(0, 10, (2, 8), generator=torch.Generator().manual_seed(15))
    with wb.trace("a100") as tr:
        y = e(ids)
        fwd = Counter(tr.counts())
        (y * y).sum().backward()
    assert fwd == fwd_want and Counter(tr.counts()) - fwd == bwd_want
