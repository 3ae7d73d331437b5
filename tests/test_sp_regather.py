"""Sequence parallelism's column-parallel linears keep the SHARD of their all-gathered input
and gather it again in backward, as Megatron-LM's
``LinearWithGradAccumulationAndAsyncCommunication`` does (Korthikanti et al. 2022, sec.
4.2.2, whose Table 2 counts those inputs at 2 sbh / t): what autograd keeps, the gradients
against one device, and the re-gather on the clock (``ops_table/linear_regather.py``).
The exact bytes per process on torch.distributed: ``test_distributed_engine``."""
import pytest
import torch

import workbench as wb
from workbench.models.config import get_config
from workbench.models.data import get_batch
from workbench.models.gpt import GPTLayer, TP_PLAN
from workbench.parallel.strategies.tensor_parallel import tensor_parallel_region
from workbench.recipes.hybrid import Hybrid
from workbench.train import SingleDevice

S, B, H, A = 16, 2, 32, 4


def _layer(mesh, regather, dtype=torch.float32):
    layer = GPTLayer(H, A, dropout=0.0, dtype=dtype)
    wb.parallelize(layer, mesh, TP_PLAN, mesh_dim="tp")
    for m in (layer.attn, layer.mlp):          # sequence-first: the sequence is dim 0
        tensor_parallel_region(m, mesh, "tp", sp=True, seq_dim=0, regather=regather)
    return layer


def _input(mesh, dtype=torch.float32):
    x = torch.randn(S, B, H, dtype=dtype, generator=torch.Generator().manual_seed(0))
    return x, [wb.Replicate()] * (mesh.ndim - 1) + [wb.Shard(0)]


def _kept_by(layer, names, x):
    """What autograd saves while the modules ``names`` run (their linears), parameters
    left out; and each module's input, the norm's output."""
    params = {p._local.untyped_storage().data_ptr() for _, p in wb.dist_parameters(layer)}
    on, kept, inputs = [False], [], {}

    def pack(t):
        if on[0] and t.untyped_storage().data_ptr() not in params:
            kept.append(t)
        return t
    hooks = []
    for n in names:
        m = layer.get_submodule(n)
        hooks.append(m.register_forward_pre_hook(
            lambda mod, args, n=n: (on.__setitem__(0, True), inputs.__setitem__(n, args[0]))
            and None))
        hooks.append(m.register_forward_hook(lambda *a: on.__setitem__(0, False)))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    for h in hooks:
        h.remove()
    return kept, inputs


@pytest.mark.parametrize("regather", [True, False])
def test_column_parallel_linears_keep_the_sequence_shard(regather):
    """tp = 2: the QKV and fc1 linears each keep the (t, s/t, b, h) stack of their input's
    sequence shards, 2 sbh / t bytes a rank (Table 2's count); ``regather=False`` keeps
    the whole gathered sequence, 2 sbh, which every rank multiplies."""
    mesh = wb.Mesh.grid(2, ["tp"])
    layer = _layer(mesh, regather, torch.bfloat16)
    X, pl = _input(mesh, torch.bfloat16)
    x = wb.shard_tensor(X, mesh, pl).requires_grad_()
    kept, _ = _kept_by(layer, ["attn.qkv", "mlp.fc1"], x)
    assert len(kept) == 2                                  # one input per linear
    if regather:
        assert all(tuple(t.shape) == (2, S // 2, B, H) and t.stride(0) for t in kept)
        per_rank = [t.numel() // 2 * t.element_size() for t in kept]
        assert per_rank == [2 * S * B * H // 2] * 2        # 2 sbh / t each
    else:
        # the one copy every rank multiplies (F.linear keeps it as (s b, h) rows)
        assert all(tuple(t.shape) == (S * B, H) for t in kept)
        assert [t.numel() * t.element_size() for t in kept] == [2 * S * B * H] * 2


def test_the_kept_shard_is_the_norms_output():
    """The shard kept is the norm's sequence-sharded output itself (no copy), so the
    linear needs nothing a device would not already hold."""
    mesh = wb.Mesh.grid(2, ["tp"])
    layer = _layer(mesh, True)
    X, pl = _input(mesh)
    x = wb.shard_tensor(X, mesh, pl).requires_grad_()
    kept, inputs = _kept_by(layer, ["attn.qkv"], x)
    # the qkv module's input is f's gathered copy; what it keeps is the norm's output
    ln = layer.ln1(x)
    assert torch.equal(kept[0], ln._local)
    assert inputs["attn.qkv"].shape == (S, B, H)


@pytest.mark.parametrize("grid", [(2,), (2, 2)], ids=["tp2", "dp2xtp2"])
def test_gradients_equal_one_device(grid):
    """The input's and every parameter's gradient equal one device's (fp32), and equal the
    keep-the-gathered-input path's bit for bit (the same local backward runs)."""
    ref = GPTLayer(H, A, dropout=0.0, dtype=torch.float32)
    X, _ = _input(wb.Mesh.grid(grid, ["dp", "tp"][-len(grid):]))
    xr = X.clone().requires_grad_()
    (ref(xr) ** 2).sum().backward()
    want = dict(ref.named_parameters())
    got = {}
    for regather in (True, False):
        mesh = wb.Mesh.grid(grid, ["dp", "tp"][-len(grid):])
        layer = _layer(mesh, regather)
        _, pl = _input(mesh)
        x = wb.shard_tensor(X, mesh, pl).requires_grad_()
        (layer(x) ** 2).sum().backward()
        grads = {n: p.grad.full() for n, p in wb.dist_parameters(layer)}
        grads["x"] = x.grad.full()
        got[regather] = grads
        torch.testing.assert_close(grads["x"], xr.grad, rtol=1e-5, atol=1e-6)
        for n, p in want.items():
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-6, msg=n)
    assert all(torch.equal(got[True][n], got[False][n]) for n in got[True])


def test_one_regather_per_region_beside_its_first_dgrad():
    """The Llama's q, k and v read one gathered input (Megatron-LM fuses them into one
    QKV GEMM): ONE all-gather in backward for the three, issued with the dgrad of the
    first of them autograd runs (v), every wgrad after it; none with ``regather=False``."""
    cfg = get_config("tiny", dropout=0.0, n_layer=1)
    x, y = get_batch(cfg, 4, 0, 0)
    counts = {}
    for regather in (True, False):
        h = Hybrid(tp=2, sp=True)
        h.check(cfg, 4)
        model = h.build_model(cfg, 0)
        if not regather:         # the recipe's regions, f rebuilt to keep the gathered copy
            for name in model.tp_regions([0]):
                mod = model.get_submodule(name)
                mod._forward_pre_hooks.clear()
                mod._forward_hooks.clear()
                tensor_parallel_region(mod, h.meshes[0], "tp", True, seq_dim=1,
                                       regather=False)
        with wb.trace("a100") as tr:
            h.forward_backward(model, x, y)
        again = [e for e in tr.events if e.label == "f: re-gather"]
        counts[regather] = len(again)
        if regather:
            bwd = [e for e in tr.events if e.name == "linear" and 0 in e.ranks
                   and e.args.get("phase") == "backward"]
            for ag in again:
                first = next(e for e in bwd if e.start >= ag.start)
                assert first.args["part"] == "dgrad" and first.start == ag.start
                later = [e for e in bwd if e.start > ag.start and e.args["part"] == "wgrad"]
                assert all(e.start >= ag.end for e in later)
    assert counts == {True: 2, False: 0}           # attention and MLP of the one layer


@pytest.mark.parametrize("kw", [dict(tp=2, sp=True, recompute="full"),
                                dict(tp=2, sp=True, recompute="selective"),
                                dict(tp=2, pp=2, sp=True, schedule="zb-h1")],
                         ids=["full", "selective", "zb-h1"])
def test_recompute_and_split_backward_train_like_one_device(kw):
    """Recompute (the kept shard is dropped and recomputed by ``torch.utils.checkpoint``)
    and a split backward (zero-bubble: the weight gradients, and so the re-gather, in
    ``W``) give one device's losses."""
    kw = dict(kw)
    cfg = get_config("tiny", dropout=0.0, recompute=kw.pop("recompute", "none"))

    def losses(strategy):
        torch.manual_seed(0)
        model = strategy.build_model(cfg, 0)
        opt = strategy.build_optimizer(model, 1e-3, 0.0)
        out = []
        for step in range(2):
            x, y = get_batch(cfg, 4, 0, step)
            out.append(float(strategy.forward_backward(model, x, y)))
            strategy.optimizer_step(opt)
        return out
    strategy = Hybrid(**kw, microbatches=2) if "schedule" in kw else Hybrid(**kw)
    assert losses(strategy) == pytest.approx(losses(SingleDevice()), rel=1e-5)


def test_double_backward_raises_not_a_wrong_number():
    """The re-gathering linear's backward is differentiable once: a gradient of a gradient
    through it raises (torch's once_differentiable) instead of silently dropping terms."""
    mesh = wb.Mesh.grid(2, ["tp"])
    layer = _layer(mesh, True)
    X, pl = _input(mesh)
    x = wb.shard_tensor(X, mesh, pl).requires_grad_()
    (gx,) = torch.autograd.grad((layer(x) ** 2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        (gx ** 2).sum().backward()
