"""Defects found this session (fixlist5), each held to a reference that does not use the
code under test: plain PyTorch on one device (what one rank keeps), torch's own saved
tensors, the collectives a traced run records."""
import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from workbench.parallel.strategies.memory import saved_activation_bytes


# ---- 1. saved_activation_bytes: a saved view without the lead axes --------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_column_parallel_shared_input_counted_whole_per_rank(dtype):
    """A column-parallel linear on 2 simulated ranks saves one shared (S*B, H) copy of its
    replicated input (a view without the lead axis); every rank holds it whole, as one
    rank running plain F.linear on its weight slice keeps its whole input.  It was divided
    by its first dimension (S*B): 2048 -> 128 bytes in fp32 (4096 -> 256 in bf16)."""
    mesh = wb.Mesh.grid(2, ["tp"])
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(16, 32, generator=g, dtype=dtype), torch.randn(64, 32, generator=g, dtype=dtype)
    dx = wb.shard_tensor(x, mesh, ["R"]).requires_grad_()
    dw = wb.shard_tensor(w, mesh, ["S(0)"]).requires_grad_()
    _, rep = saved_activation_bytes(F.linear, dx, dw, params=(dw,), lead_dims=1)
    # one rank, plain torch: its weight slice is a parameter, its input is kept whole
    xr, wr = x.clone().requires_grad_(), w[:32].clone().requires_grad_()
    _, want = saved_activation_bytes(F.linear, xr, wr, params=(wr,))
    assert want.bytes == 16 * 32 * x.element_size()
    assert rep.bytes == want.bytes, rep.items


def test_sharded_input_still_split_and_bad_lead_dims_raise():
    """A row-sharded stacked input is still counted as one rank's shard; lead_dims that do
    not match the mesh, or no mesh at all, raise naming the argument."""
    mesh = wb.Mesh.grid(2, ["tp"])
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    dx = wb.shard_tensor(x, mesh, ["S(0)"]).requires_grad_()
    _, rep = saved_activation_bytes(lambda t: t * t, dx, lead_dims=1)
    assert rep.bytes == 8 * 32 * 4, rep.items
    with pytest.raises(ValueError, match="lead_dims=2"):
        saved_activation_bytes(lambda t: t * t, dx, lead_dims=2)
    with pytest.raises(ValueError, match="mesh="):
        saved_activation_bytes(lambda t: t * t, x.clone().requires_grad_(), lead_dims=1)


# ---- 2. the re-gathering linear keeps what torch's linear keeps -----------------------

from workbench.models.gpt import GPTLayer, TP_PLAN                       # noqa: E402
from workbench.parallel.strategies.tensor_parallel import tensor_parallel_region  # noqa: E402

S, B, H, A = 16, 2, 32, 4
_BF16 = dict(device_type="cpu", dtype=torch.bfloat16)


def _sp_layer(regather=True, mesh=None):
    mesh = mesh or wb.Mesh.grid(2, ["tp"])
    torch.manual_seed(0)
    layer = GPTLayer(H, A, dropout=0.0, dtype=torch.float32)
    wb.parallelize(layer, mesh, TP_PLAN, mesh_dim="tp")
    for m in (layer.attn, layer.mlp):
        tensor_parallel_region(m, mesh, "tp", sp=True, seq_dim=0, regather=regather)
    X = torch.randn(S, B, H, generator=torch.Generator().manual_seed(0))
    x = wb.shard_tensor(X, mesh, [wb.Shard(0)]).requires_grad_()
    return layer, x


def _saved_in(layer, x, names, autocast):
    """(shape, dtype) of what autograd saves while the named linears run."""
    on, kept = [False], []
    hooks = []
    for n in names:
        m = layer.get_submodule(n)
        hooks += [m.register_forward_pre_hook(lambda *a: on.__setitem__(0, True)),
                  m.register_forward_hook(lambda *a: on.__setitem__(0, False))]
    with torch.autograd.graph.saved_tensors_hooks(
            lambda t: (kept.append(t) if on[0] else None) or t, lambda t: t), \
            torch.autocast(**_BF16, enabled=autocast):
        layer(x)
    for h in hooks:
        h.remove()
    return [(tuple(t.shape), t.dtype) for t in kept]


@pytest.mark.parametrize("autocast", [False, True])
def test_regathered_linear_keeps_no_bias(autocast):
    """torch's F.linear (with or without bf16 autocast) keeps its input and weight, not
    its bias (checked here on one device); the SP re-gathering QKV and fc1 linears kept
    the bias too (under autocast its bf16 copy: memory torch frees).  Per linear now:
    the input's sequence shard and the weight, as torch's input and weight."""
    names = ("attn.qkv", "mlp.fc1")
    torch.manual_seed(0)
    ref = GPTLayer(H, A, dropout=0.0, dtype=torch.float32)
    ref_saved = _saved_in(ref, torch.randn(S, B, H), names, autocast)
    bias_shapes = {tuple(ref.get_submodule(n).bias.shape) for n in names}
    assert len(ref_saved) == 4 and not {s for s, _ in ref_saved} & bias_shapes
    layer, x = _sp_layer()
    got = _saved_in(layer, x, names, autocast)
    bias_local = {tuple(layer.get_submodule(n).bias._local.shape) for n in names}
    assert len(got) == len(ref_saved) and not {s for s, _ in got} & bias_local, got
    wd = torch.bfloat16 if autocast else torch.float32
    assert sorted(str(d) for _, d in got) == sorted(map(str, [torch.float32] * 2 + [wd] * 2)), got


def test_regathered_linear_bias_gradient_unchanged():
    """The bias gradient (and every other) of the re-gathering path equals the
    keep-the-gathered-input path's under autocast, bit for bit."""
    got = {}
    for regather in (True, False):
        layer, x = _sp_layer(regather)
        with torch.autocast(**_BF16):
            y = layer(x)
        (y.float() ** 2).sum().backward()
        got[regather] = {n: p.grad.full() for n, p in wb.dist_parameters(layer)}
    assert any("bias" in n for n in got[True])
    assert all(torch.equal(got[True][n], got[False][n]) for n in got[True])


# ---- 3. SP: the LM head runs and is priced as Megatron-LM's ---------------------------

@pytest.mark.parametrize("tied", [False, True])
def test_sp_head_traced_collectives_are_the_priced_ones(tied):
    """tp = 2 with sequence parallelism, one layer, a vocabulary that divides by tp: the
    head is Megatron-LM's ColumnParallelLinear with sequence_parallel, so the traced step
    runs, for the head: the final norm's sequence all-gather (forward), vocab-parallel
    cross-entropy's three fp32 all-reduces, and in backward the re-gather of the kept
    shard and the input gradient's reduce-scatter; ``costs.head_cost`` prices those same
    bytes.  Before, the dispatcher gathered the head's weight instead (logits sharded
    on the batch: no cross-entropy all-reduce) and all-reduced the head input's
    gradient ('linear input'), and the planner priced no re-gather."""
    from workbench.models.config import get_config
    from workbench.models.data import get_batch
    from workbench.plan import Cluster
    from workbench.plan import costs as C
    from workbench.recipes.hybrid import Hybrid

    cfg = get_config("tiny", vocab_size=128, dropout=0.0, n_layer=1, tie_embeddings=tied)
    b = 2
    h = Hybrid(tp=2, sp=True)
    h.check(cfg, b)
    torch.manual_seed(0)
    model = h.build_model(cfg, 0)
    x, y = get_batch(cfg, b, 0, 0)
    with wb.trace("a100") as tr:
        h.forward_backward(model, x, y)
    ev = sorted((e for e in tr.events if 0 in e.ranks and e.stream == "comm"),
                key=lambda e: e.start)
    names = [(e.name, e.label) for e in ev]
    assert ("all_reduce", "linear input") not in names, names
    ce = [e for e in ev if e.label.startswith("cross_entropy")]
    assert [e.name for e in ce] == ["all_reduce"] * 3
    i = ev.index(ce[0])
    fwd_gather = [e for e in ev[:i] if e.label == "f: all-gather"][-1]   # the head's f
    assert fwd_gather.name == "all_gather"
    bwd = ev[i + 3:]
    regather = next(e for e in bwd if e.label == "f: re-gather")
    rs = next(e for e in bwd if e.name == "reduce_scatter" and e.label == "f: all-gather")
    head = [fwd_gather, *ce, regather, rs]
    n = cfg.torch_dtype.itemsize * cfg.seq_len * b * cfg.d_model
    assert fwd_gather.args["buffer_bytes"] == n
    prof = Cluster("a100", 2).profile
    assert C.head_cost(cfg, b, 2, True, prof).comm_bytes == sum(e.bytes for e in head)
