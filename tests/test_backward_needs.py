"""The modeled clock prices only the backward kernels autograd runs: a matmul's input
gradient (dgrad) when its first operand requires grad, its weight gradient (wgrad) when
its second does, a bias's sum when the bias does. Held to torch's own backward (the GEMMs
``torch.profiler`` sees it run on CPU), in eager dispatch and in a compiled step."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

import workbench as wb
from workbench.parallel.ops_table import pricing
from workbench.sim_mesh import cost as sim_cost

M2 = wb.Mesh.grid(2, ["tp"])
R, S = wb.Replicate(), wb.Shard
_GEMM_KERNELS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm")


def _torch_gemms(fn, *ts) -> int:
    """How many GEMMs torch's own backward runs for ``fn(*ts)`` (CPU profiler)."""
    return _torch_kernels(fn, *ts)[0]


def _torch_kernels(fn, *ts) -> tuple:
    """(GEMMs, sums) torch's own backward runs for ``fn(*ts)`` (CPU profiler): a
    broadcast bias's gradient is summed by an ``aten::sum`` after the node's GEMMs
    (autograd's ``validate_outputs``)."""
    y = fn(*ts).sum()
    with profile(activities=[ProfilerActivity.CPU]) as p:
        y.backward()
    names = [e.name for e in p.events() if e.name in _GEMM_KERNELS + ("aten::sum",)]
    if "aten::sum" in names:           # after the last GEMM
        assert names.index("aten::sum") > max(
            (i for i, n in enumerate(names) if n != "aten::sum"), default=-1)
    return sum(n in _GEMM_KERNELS for n in names), names.count("aten::sum")


def _backward(tr, name):
    return [e for e in tr.events if e.stream == "compute" and e.name == name
            and e.args.get("phase") == "backward"]


def _ours(fn, name, *ts):
    """The backward events the trace records for ``fn`` on replicated DistTensors, each
    input requiring grad as its torch tensor does."""
    dts = [wb.shard_tensor(t.detach(), M2, [R]).requires_grad_(t.requires_grad) for t in ts]
    with wb.trace() as tr:
        fn(*dts).sum().backward()
    return _backward(tr, name), dts


def _mk(shape, rg, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).requires_grad_(rg)


LINEAR_NEEDS = [(True, True, True), (False, True, True), (True, False, False),
                (True, False, True), (False, True, False), (False, False, True)]


@pytest.mark.parametrize("rx,rw,rb", LINEAR_NEEDS,
                         ids=["all", "data-x", "frozen-w-b", "frozen-w", "data-x-no-b",
                              "bias-only"])
def test_linear_prices_the_gemms_torch_runs(rx, rw, rb):
    X, W, B = _mk((6, 8), rx, 0), _mk((4, 8), rw, 1), _mk((4,), rb, 2)
    evs, _ = _ours(F.linear, "linear", X, W, B)
    parts = [e.args["part"] for e in evs]
    want = [p for p, need in (("dgrad", rx), ("wgrad", rw), ("bias", rb)) if need]
    assert parts == want
    # torch's backward runs one GEMM per dgrad / wgrad we price, then a sum for the bias
    gemms, sums = _torch_kernels(F.linear, X, W, B)
    assert gemms == sum(p in ("dgrad", "wgrad") for p in parts)
    assert sums == parts.count("bias")
    M, K, N = 6, 8, 4
    e = 4
    by = {ev.args["part"]: ev for ev in evs}
    if rx:                                # dX = dY W: read dY, W; write dX
        assert by["dgrad"].flops == 2 * M * N * K
        assert by["dgrad"].bytes == e * (M * N + N * K + M * K)
    if rw:                                # dW = dY^T X: read X, write dW
        assert by["wgrad"].flops == 2 * M * N * K
        assert by["wgrad"].bytes == e * (M * K + N * K +
                                         (0 if rx else M * N))     # dY read here if alone
    if rb:                                # dB = sum of dY over rows: a reduction of its own
        assert by["bias"].flops == M * N
        assert by["bias"].bytes == e * (N + M * N)                  # dY read again
        assert by["bias"].args["op_class"] == "reduction"
    for ev in evs:
        assert ev.duration == sim_cost.compute_time(
            ev.flops, ev.bytes, wb.get_profile(None), torch.float32,
            op_class=ev.args["op_class"], gemm={"dgrad": (1, M, K), "wgrad": (1, N, K)}.get(
                ev.args["part"]))


def test_all_needed_is_the_split_it_always_was():
    """Every input needing its gradient: dgrad + wgrad + the bias's sum partition the
    op's FLOPs; its bytes but the sum's second read of dY."""
    X, W, B = _mk((6, 8), True, 0), _mk((4, 8), True, 1), _mk((4,), True, 2)
    evs, _ = _ours(F.linear, "linear", X, W, B)
    want = wb.ops.cost("linear", X, W, B)
    assert sum(e.flops for e in evs) == want.backward_flops
    assert sum(e.bytes for e in evs) == 4 * (6 * 4 + 2 * (6 * 8 + 4 * 8) + 4) + 4 * 6 * 4


def test_one_row_bias_is_summed_too():
    """A 1-d input: torch runs linear as addmm on one row and still sums the bias's
    gradient to its shape (a kernel); the clock prices it."""
    X, W, B = _mk((8,), True, 0), _mk((4, 8), True, 1), _mk((4,), True, 2)
    evs, _ = _ours(F.linear, "linear", X, W, B)
    assert [e.args["part"] for e in evs] == ["dgrad", "wgrad", "bias"]
    assert _torch_kernels(F.linear, X, W, B) == (2, 1)


@pytest.mark.parametrize("fn,name", [(torch.bmm, "bmm"), (torch.matmul, "matmul"),
                                     (lambda a, b: torch.einsum("bij,bjk->bik", a, b),
                                      "einsum")], ids=["bmm", "matmul", "einsum"])
@pytest.mark.parametrize("ra,rb", [(True, True), (False, True), (True, False)])
def test_batched_matmuls_price_the_gemms_torch_runs(fn, name, ra, rb):
    A, Bm = _mk((2, 3, 5), ra, 3), _mk((2, 5, 4), rb, 4)
    evs, _ = _ours(fn, name, A, Bm)
    assert [e.args["part"] for e in evs] == [p for p, n in (("dgrad", ra), ("wgrad", rb)) if n]
    assert len(evs) == _torch_gemms(fn, A, Bm)
    f = 2 * 2 * 3 * 5 * 4
    assert all(e.flops == f for e in evs)              # each GEMM is the forward's size
    alone = [e for e in evs if e.args["part"] == "wgrad" and not ra]
    for ev in alone:                                   # dB = A^T dC: read dC, A; write dB
        assert ev.bytes == 4 * (2 * 3 * 4 + 2 * 3 * 5 + 2 * 5 * 4)


@pytest.mark.parametrize("rx,rw", [(True, True), (False, True), (True, False)])
def test_conv_prices_only_the_gradients_convolution_backward_computes(rx, rw):
    """aten's convolution_backward takes an output_mask: grad_input only when the input
    requires grad, grad_weight only when the weight does (torch's grads say the same)."""
    X, W, B = _mk((2, 3, 6, 6), rx, 5), _mk((4, 3, 3, 3), rw, 6), _mk((4,), rw, 7)
    y = F.conv2d(X, W, B, padding=1)
    y.sum().backward()
    evs, _ = _ours(lambda x, w, b: F.conv2d(x, w, b, padding=1), "conv2d", X, W, B)
    # (the bias's sum after both: cuDNN computes no bias gradient, convolution_backward
    # sums grad_output itself, "Calculate bias gradients outside of the backend")
    assert [e.args["part"] for e in evs] == \
        [p for p, n in (("dgrad", X.grad is not None), ("wgrad", W.grad is not None),
                        ("bias", B.grad is not None)) if n]
    macs = y.numel() * 3 * 9
    for ev in evs:
        assert ev.flops == (y.numel() if ev.args["part"] == "bias" else 2 * macs)


def test_detach_and_frozen_parameters_price_no_weight_gradient():
    X, W = _mk((6, 8), True, 0), _mk((4, 8), True, 1)
    x = wb.shard_tensor(X.detach(), M2, [R]).requires_grad_()
    w = wb.shard_tensor(W.detach(), M2, [S(0)]).requires_grad_()
    with wb.trace() as tr:
        F.linear(x, w.detach()).sum().backward()
    assert [e.args["part"] for e in _backward(tr, "linear")] == ["dgrad"]
    assert w.grad is None and x.grad is not None


def test_no_grad_records_no_backward():
    X, W = _mk((6, 8), True, 0), _mk((4, 8), True, 1)
    x, w = (wb.shard_tensor(t.detach(), M2, [R]).requires_grad_() for t in (X, W))
    with wb.trace() as tr, torch.no_grad():
        y = F.linear(x, w)
    assert not y.requires_grad and not _backward(tr, "linear")


def _mlp_step(x_needs_grad):
    torch.manual_seed(0)
    mesh = wb.Mesh.grid(1, ["dp"])
    up, down = nn.Linear(512, 1024), nn.Linear(1024, 512)
    x = wb.shard_tensor(torch.randn(256, 512), mesh, [R]).requires_grad_(x_needs_grad)
    w1, b1, w2, b2 = (wb.shard_tensor(p.detach(), mesh, [R]).requires_grad_()
                      for p in (up.weight, up.bias, down.weight, down.bias))
    with wb.trace(profile="a100") as tr:
        F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2).sum().backward()
    return tr, x


def test_first_layer_of_an_mlp_on_data_has_no_dgrad_on_the_a100():
    """A 256 x 512 -> 1024 -> 512 MLP on data (a100): torch computes no gradient for the
    data (x.grad is None), so the first linear's dgrad is not on the clock, and the step
    is shorter than the same step whose input needs its gradient by that kernel."""
    tr, x = _mlp_step(False)
    lin = _backward(tr, "linear")
    assert [e.args["part"] for e in lin] == ["dgrad", "wgrad", "bias",   # down, then up
                                             "wgrad", "bias"]
    assert lin[3].bytes == 4 * (256 * 512 + 1024 * 512 + 256 * 1024)
    assert lin[4].bytes == 4 * (1024 + 256 * 1024)           # dbias; dY read again
    assert x.grad is None
    tr2, x2 = _mlp_step(True)
    lin2 = _backward(tr2, "linear")
    assert [e.args["part"] for e in lin2] == ["dgrad", "wgrad", "bias"] * 2
    assert x2.grad is not None
    dgrad = lin2[3]
    assert tr2.time() - tr.time() == pytest.approx(
        dgrad.duration - (lin[3].duration - lin2[4].duration), rel=1e-9)


def _compiled_mlp(freeze=None):
    torch.manual_seed(0)

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

        def forward(self, x):
            return self.down(F.gelu(self.up(x)))
    m = MLP()
    if freeze:
        for p in getattr(m, freeze).parameters():
            p.requires_grad_(False)
    mesh = wb.Mesh.grid(2, ["dp"])
    x = wb.shard_tensor(torch.randn(8, 16), mesh, [S(0)])
    return wb.compile(m, x, level="O1", profile="a100")


@pytest.mark.parametrize("freeze", [None, "down"])
def test_compiled_step_counts_the_same_kernels(freeze):
    prog = _compiled_mlp(freeze)
    g = prog.graph
    lin = [n for n in g.nodes if n.op == "linear"]
    assert len(lin) == 2
    from workbench.compile.kernels import op_kernels
    from workbench.compile.propagate import _Pricer
    pr = _Pricer(g, prog.mesh, "a100")
    launches = []
    for n in lin:
        c = prog.assignment.choice[n.nid]
        specs = tuple(None if v is None else pr.spec(v, ps)
                      for v, ps in zip(n.inputs, c.strategy.inputs))
        k = op_kernels(g, prog.mesh, wb.get_profile("a100"), n, specs, c,
                       n.nid in pr.backward)
        launches.append(None if k.backward is None else k.backward[1])
    # up reads the data: wgrad and the bias's sum; down: dgrad and (unless frozen) wgrad
    # and the bias's sum
    assert launches == ([2, 3] if freeze is None else [2, 1])
    assert prog.assignment.time == pytest.approx(prog.step().time, rel=1e-12, abs=0)


@pytest.mark.parametrize("rx,rw", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm", "wb_rms_norm", "batch_norm",
                                  "group_norm"])
def test_norms_price_a_weight_gradient_only_when_it_is_computed(norm, rx, rw):
    """native_layer_norm_backward's output_mask and wb.ops.rms_norm's needs_input_grad:
    a frozen weight's sum(dy * x_hat) (2 FLOPs an element, a bias's sum 1) is not run,
    nor written; data's dx (the rest) neither."""
    X, W, B = _mk((4, 6, 8), rx, 8), _mk((8,), rw, 9), _mk((8,), rw, 10)
    fn, args, name = {
        "layer_norm": (lambda x, w, b: F.layer_norm(x, (8,), w, b), (X, W, B), "layer_norm"),
        "rms_norm": (lambda x, w: F.rms_norm(x, (8,), w, 1e-6), (X, W), "rms_norm"),
        "wb_rms_norm": (lambda x, w: wb.ops.rms_norm(x, w, 1e-6), (X, W), "rms_norm"),
        "batch_norm": (lambda x, w, b: F.batch_norm(x.transpose(1, 2), None, None, w, b,
                                                    training=True), (X, W, B), "batch_norm"),
        "group_norm": (lambda x, w, b: F.group_norm(x.transpose(1, 2), 2, w, b), (X, W, B),
                       "group_norm")}[norm]
    fn(*args).sum().backward()                      # torch's own: which grads exist
    assert (X.grad is not None, W.grad is not None) == (rx, rw)
    (ev,), _ = _ours(fn, name, *args)
    n, e = X.numel(), 4
    total = {"layer_norm": 14 * n, "rms_norm": 8 * n, "batch_norm": 14 * n,
             "group_norm": 14 * n}[name]
    params = [(W, 2 * n)] + ([(B, n)] if name != "rms_norm" else [])
    w_share = sum(f for _, f in params)
    want_flops = (total - w_share if rx else 0) + (w_share if rw else 0)
    assert ev.flops == want_flops
    grads = (n * e if rx else 0) + (sum(p.numel() * e for p, _ in params) if rw else 0)
    all_grads = n * e + sum(p.numel() * e for p, _ in params)
    full, _ = _ours(fn, name, *(t.detach().requires_grad_() for t in args))
    assert ev.bytes == full[0].bytes - all_grads + grads


def test_running_statistics_have_no_gradient_to_write():
    """batch_norm's running mean and variance are buffers it updates, never
    differentiated: their bytes are not a gradient written."""
    from workbench.parallel.ops_table.table import TABLE
    x = torch.empty(6, 4, 5, device="meta")
    rm, rv, w, b = (torch.empty(4, device="meta") for _ in range(4))
    c = TABLE["batch_norm"].cost([x, rm, rv, w, b], [torch.empty_like(x)], training=True,
                                 momentum=0.1, eps=1e-5)
    ((_, f_all, b_all, _),) = pricing.backward_parts(c)
    ((_, f, nb, _),) = pricing.backward_parts(c, (True, False, False, True, True))
    assert (f, nb) == (f_all, b_all - 2 * 4 * 4)


def test_attention_backward_is_one_fused_kernel_whatever_needs_grad():
    """torch runs scaled_dot_product_attention's backward as one fused kernel that
    computes dq, dk and dv together (CPU: _scaled_dot_product_flash_attention_for_cpu_
    backward, FlashAttention-2's backward on GPU): with only q needing its gradient the
    whole kernel runs, and is priced whole."""
    Q, K, V = _mk((2, 4, 16, 8), True, 11), _mk((2, 4, 16, 8), False, 12), \
        _mk((2, 4, 16, 8), False, 13)
    fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    y = fn(Q, K, V)
    with profile(activities=[ProfilerActivity.CPU]) as p:
        y.sum().backward()
    assert sum("flash_attention_for_cpu_backward" in e.name for e in p.events()) == 1
    (part,), _ = _ours(fn, "scaled_dot_product_attention", Q, K, V)
    (full,), _ = _ours(fn, "scaled_dot_product_attention",
                       *(t.detach().requires_grad_() for t in (Q, K, V)))
    assert (part.flops, part.bytes) == (full.flops, full.bytes)


def test_a_frozen_embedding_has_no_backward():
    idx = torch.tensor([[1, 2, 3], [4, 5, 6]])
    table = wb.shard_tensor(torch.randn(10, 4), M2, [R])           # requires_grad False
    with wb.trace() as tr:
        y = F.embedding(wb.shard_tensor(idx, M2, [R]), table)
    assert not y.requires_grad and not _backward(tr, "embedding")


@pytest.mark.parametrize("rx,rw,rb", LINEAR_NEEDS[:5])
def test_wb_ops_linear_reference_computes_only_the_gradients_asked_for(rx, rw, rb):
    """wb.ops.linear's hand-written backward runs the GEMMs torch's F.linear runs."""
    X, W, B = _mk((6, 8), rx, 0), _mk((4, 8), rw, 1), _mk((4,), rb, 2)
    with wb.ops.use("reference"):
        y = wb.ops.linear(X, W, B)
    with profile(activities=[ProfilerActivity.CPU]) as p:
        y.sum().backward()
    ours = sum(e.name == "aten::mm" for e in p.events())
    assert ours == rx + rw == _torch_gemms(F.linear, *(t.detach().requires_grad_(r) for t, r
                                                       in ((X, rx), (W, rw), (B, rb))))
    ref = [t.detach().requires_grad_(r) for t, r in ((X, rx), (W, rw), (B, rb))]
    F.linear(*ref).sum().backward()
    for t, r in zip((X, W, B), ref):
        assert (t.grad is None) == (r.grad is None)
        if t.grad is not None:
            torch.testing.assert_close(t.grad, r.grad)
