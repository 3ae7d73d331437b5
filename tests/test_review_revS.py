"""Review of the fixlist4 / habits4 merges (revS): each test holds a result to plain
PyTorch (one device, or torch's own wrapper) and failed before its fix."""
import torch
from torch import nn

import workbench as wb


# ---- 1. DDP over DistTensors: parameters(recurse=False) is torch DDP's (none) ------------

class _Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.fc = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(self.lin(x))


def test_ddp_over_disttensors_parameters_recurse_false_is_empty_as_torch_ddps():
    """torch DDP holds no parameter of its own, so ``ddp.parameters(recurse=False)`` and
    ``named_parameters(recurse=False)`` are both empty (``nn.Module``'s, the module a
    child).  DDP over DistTensors gave every replica for ``parameters(recurse=False)``
    (4 here) while ``named_parameters(recurse=False)`` gave none; recurse=True unchanged."""
    torch.manual_seed(0)
    ref = _Two()
    want = (len(list(ref.parameters(recurse=False))), len(list(ref.parameters())))
    assert want == (0, 4)
    torch.manual_seed(0)
    m = _Two()
    mesh = wb.Mesh.grid((2, 2), ["dp", "tp"])
    wb.parallelize(m, mesh, {"lin": "colwise", "fc": "rowwise"}, mesh_dim="tp")
    ddp = wb.DistributedDataParallel(m, mesh, "dp")
    assert type(ddp).__name__ == "DistTensorDDP"
    assert list(ddp.parameters(recurse=False)) == []                 # was 4 replicas
    assert list(ddp.named_parameters(recurse=False)) == []
    assert len(list(ddp.parameters())) == want[1]
    assert [id(p) for p in ddp.parameters()] == [id(p) for _, p in ddp.named_parameters()]


# ---- 2. sequence parallelism's re-gather under bf16 autocast on a dp x tp mesh ----------

def test_autocast_regather_on_a_dp_x_tp_mesh_equals_keeping_the_input_and_one_device():
    """On a (dp 2, tp 2) mesh, a batch sharded on dp and the sequence on tp, the
    re-gathering QKV / fc1 linears under bf16 autocast raised in backward ('the
    re-gathered input is laid out ((2, 2, 16, 1, 32), (512, 0, 32, 1)); the forward read
    (..., (1024, 0, 32, 1))'): the cast in backward laid the gathered input out afresh.
    Now it is cast into the forward's layout: the gradients are the keep-the-gathered-
    input path's bit for bit, and one device's under the same autocast within bf16's."""
    from workbench.models.gpt import GPTLayer, TP_PLAN
    from workbench.parallel.strategies.tensor_parallel import tensor_parallel_region
    S, B, H, A = 16, 2, 32, 4
    bf16 = dict(device_type="cpu", dtype=torch.bfloat16)
    X = torch.randn(S, B, H, generator=torch.Generator().manual_seed(0))
    got = {}
    for regather in (True, False):
        mesh = wb.Mesh.grid((2, 2), ["dp", "tp"])
        torch.manual_seed(0)
        layer = GPTLayer(H, A, dropout=0.0, dtype=torch.float32)
        wb.parallelize(layer, mesh, TP_PLAN, mesh_dim="tp")
        for m in (layer.attn, layer.mlp):
            tensor_parallel_region(m, mesh, "tp", sp=True, seq_dim=0, regather=regather)
        x = wb.shard_tensor(X, mesh, [wb.Shard(1), wb.Shard(0)]).requires_grad_()
        with torch.autocast(**bf16):
            y = layer(x)
        (y.float() ** 2).sum().backward()                # raised with regather=True
        got[regather] = {n: p.grad.full() for n, p in wb.dist_parameters(layer)}
        got[regather]["x"] = x.grad.full()
    assert all(torch.equal(got[True][n], got[False][n]) for n in got[False])
    torch.manual_seed(0)
    ref = GPTLayer(H, A, dropout=0.0, dtype=torch.float32)
    Xr = X.clone().requires_grad_()
    with torch.autocast(**bf16):
        y = ref(Xr)
    (y.float() ** 2).sum().backward()
    torch.testing.assert_close(got[True]["x"], Xr.grad, rtol=2e-2, atol=2e-2)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(got[True][n].float(), p.grad, rtol=2e-2, atol=5e-2, msg=n)
