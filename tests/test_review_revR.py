"""Review of the afternoon's merges (revR): each case held to plain PyTorch on one device."""
import pytest
import torch

import workbench as wb


# ---- quantile: a q that requires grad ------------------------------------------------------

@pytest.mark.parametrize("fn", [torch.quantile, torch.nanquantile], ids=["quantile", "nan"])
def test_quantile_q_requiring_grad_raises_instead_of_a_missing_gradient(fn):
    # torch differentiates through q (the lerp weight between the two order statistics);
    # the op table read q as floats, so q.grad stayed None after backward, silently
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    q = torch.tensor(0.3, requires_grad=True)
    fn(x, q, dim=0).sum().backward()
    assert q.grad is not None and q.grad.abs() > 0          # torch's answer has one
    mesh = wb.Mesh.grid((2,), ["a"])
    q2 = torch.tensor(0.3, requires_grad=True)
    with pytest.raises(NotImplementedError, match=r"q\.detach\(\)"):
        fn(wb.shard_tensor(x, mesh, ["S(1)"]).requires_grad_(), q2, dim=0)
    # a detached q (or one read under no_grad) still gives torch's values
    y = fn(wb.shard_tensor(x, mesh, ["S(1)"]), q2.detach(), dim=0)
    torch.testing.assert_close(y.full(), fn(x, q2.detach(), dim=0))
    with torch.no_grad():
        y = fn(wb.shard_tensor(x, mesh, ["S(1)"]), q2, dim=0)
    torch.testing.assert_close(y.full(), fn(x, q2.detach(), dim=0))


# ---- sequence parallelism's re-gathering linear: checks that held (kept as guards) ---------

def _sp_layer(mesh, regather, dtype):
    from workbench.models.gpt import GPTLayer, TP_PLAN
    from workbench.parallel.strategies.tensor_parallel import tensor_parallel_region
    torch.manual_seed(0)
    layer = GPTLayer(32, 4, dropout=0.0, dtype=dtype)
    wb.parallelize(layer, mesh, TP_PLAN, mesh_dim="tp")
    for m in (layer.attn, layer.mlp):
        tensor_parallel_region(m, mesh, "tp", sp=True, seq_dim=0, regather=regather)
    return layer


def test_sp_regather_bf16_layer_used_twice_and_inference_match_the_gathered_path():
    # bf16 parameters, the same layer applied twice in one forward (its linears each read
    # two marked inputs), dp2 x tp2: gradients equal the keep-the-gathered-input path's
    # bit for bit; an inference_mode forward gives the same output on both paths
    X = torch.randn(16, 2, 32, generator=torch.Generator().manual_seed(0))
    got, outs = {}, {}
    for regather in (True, False):
        mesh = wb.Mesh.grid((2, 2), ["dp", "tp"])
        layer = _sp_layer(mesh, regather, torch.bfloat16)
        pl = [wb.Replicate(), wb.Shard(0)]
        x = wb.shard_tensor(X.bfloat16(), mesh, pl).requires_grad_()
        (layer(layer(x)).float() ** 2).sum().backward()
        got[regather] = {n: p.grad.full() for n, p in wb.dist_parameters(layer)}
        got[regather]["x"] = x.grad.full()
        with torch.inference_mode():
            outs[regather] = layer(wb.shard_tensor(X.bfloat16(), mesh, pl)).full()
    assert all(torch.equal(got[True][n], got[False][n]) for n in got[True])
    assert torch.equal(outs[True], outs[False])


# ---- FSDP over DistTensors: module gradients with tied weights (held; kept as a guard) -----

def test_fsdp_tied_weight_module_grads_and_steps_equal_one_device():
    # a weight shared by two linears: the module's p.grad (GradOf, fixlist3) is the sum of
    # both uses' gradients, over two micro-batches of accumulation, and three AdamW steps
    # over the wrapper's shards train the module as one device does
    from torch import nn

    def make():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(6, 6), nn.GELU(), nn.Linear(6, 6))
        m[2].weight = m[0].weight
        return m
    ref, mesh = make(), wb.Mesh.grid((2, 2), ["dp", "tp"])
    model = wb.parallelize(make(), mesh, {}, mesh_dim="tp")
    w = wb.FullyShardedDataParallel(model, mesh, "dp")
    opt = torch.optim.AdamW(w.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    pl, g = [wb.Shard(0), wb.Replicate()], torch.Generator().manual_seed(1)
    for step in range(3):
        for _ in range(2):                               # two micro-batches accumulated
            x = torch.randn(4, 6, generator=g)
            (w(wb.shard_tensor(x, mesh, pl)) ** 2).mean().backward()
            (ref(x) ** 2).mean().backward()
        want = dict(ref.named_parameters())
        got = dict(model.named_parameters())
        assert list(got) == list(want)                   # the tied weight listed once
        for n, p in got.items():
            torch.testing.assert_close(p.grad.full(), want[n].grad, msg=f"{step} {n}")
        torch.testing.assert_close(model[2].weight.grad.full(), ref[2].weight.grad)
        w.finish_gradient_synchronization()
        opt.step()
        ropt.step()
        opt.zero_grad(set_to_none=True)
        ropt.zero_grad(set_to_none=True)
        assert all(p.grad is None for p in model.parameters())
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.full().detach(), dict(ref.named_parameters())[n].detach(),
                                   msg=n)
