"""The lead's probes of session 9: torch's FSDP + TP order on simulated ranks."""
import pytest
import torch
from torch import nn

import workbench as wb


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))


def test_fully_shard_after_tp_on_a_world_mesh_slice_names_the_whole_mesh_form():
    """PyTorch's tutorial order, parallelize_module(m, world["tp"]) then fully_shard(m,
    mesh=world["dp"]): on simulated ranks world["tp"] is one data-parallel group's slice,
    so it is refused, naming the call that works (it said to pass world_mesh['dp'], which
    the user had passed)."""
    world = wb.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    m = _mlp()
    wb.parallelize_module(m, world["tp"], {"0": wb.ColwiseParallel(), "2": wb.RowwiseParallel()})
    before = [p.full_tensor().clone() for p in m.parameters()]
    with pytest.raises(ValueError, match=r"world_mesh\['tp'\].*parallelize_module\(model, "
                                         r"world_mesh, plan\).*fully_shard\(\.\.\., mesh="
                                         r"world_mesh\['dp'\]\)"):
        wb.fully_shard(m, mesh=world["dp"])
    assert all(torch.equal(p.full_tensor(), b) for p, b in zip(m.parameters(), before))


def test_the_named_form_trains_as_one_device():
    world = wb.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ref, m = _mlp(), _mlp()
    wb.parallelize_module(m, world, {"0": wb.ColwiseParallel(), "2": wb.RowwiseParallel()})
    wb.fully_shard(m, mesh=world["dp"])
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    ref(x).pow(2).mean().backward()
    out = m(x)
    (out.full_tensor() if hasattr(out, "full_tensor") else out).pow(2).mean().backward()
    for p, r in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), r.grad, rtol=0, atol=1e-6)


@pytest.mark.parametrize("wrapper", ["DistributedDataParallel", "FullyShardedDataParallel"])
@pytest.mark.parametrize("whole", [False, True])
def test_ddp_and_fsdp_after_tp_on_a_slice_name_the_whole_mesh_form(wrapper, whole):
    world = wb.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    m = _mlp()
    wb.parallelize_module(m, world["tp"], {"0": wb.ColwiseParallel(), "2": wb.RowwiseParallel()})
    with pytest.raises(ValueError, match=rf"world_mesh\['tp'\].*parallelize_module\(model, "
                                         rf"world_mesh, plan\).*{wrapper}\(model, world_mesh"):
        getattr(wb, wrapper)(m, world if whole else world["dp"])
    # the named form works
    m = _mlp()
    wb.parallelize_module(m, world, {"0": wb.ColwiseParallel(), "2": wb.RowwiseParallel()})
    getattr(wb, wrapper)(m, world)


@pytest.mark.parametrize("wrapper", ["DistributedDataParallel", "FullyShardedDataParallel",
                                     "fully_shard"])
@pytest.mark.parametrize("model", ["linear", "mlp"])
def test_functional_call_on_a_wrapper_raises_and_leaves_it_working(wrapper, model):
    """torch.func.functional_call(wrapped, params, x): FSDP over a Linear computed with its
    own shards and ignored ``params`` (1.17 off one device's call with zeros), silently;
    every wrapper now raises (naming functional_call, or in torch's own AttributeError for
    names the wrapper does not hold, with ours chained), and trains as before afterwards."""
    from torch.func import functional_call
    mesh = wb.init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    make = (lambda: nn.Linear(4, 2)) if model == "linear" else _mlp
    torch.manual_seed(3)
    ref = make()
    m = make()
    m.load_state_dict(ref.state_dict())
    d = wb.fully_shard(m, mesh=mesh) if wrapper == "fully_shard" else \
        getattr(wb, wrapper)(m, mesh)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(2))
    zeros = {n: torch.zeros(p.shape) for n, p in d.named_parameters()}
    with pytest.raises((RuntimeError, AttributeError)) as e:
        functional_call(d, zeros, (x,))
    chain = [e.value, e.value.__cause__, e.value.__context__]
    assert any("functional_call" in str(c) for c in chain if c is not None), chain
    out = d(x)
    out = out.full_tensor() if hasattr(out, "full_tensor") else out
    torch.testing.assert_close(out, ref(x), rtol=0, atol=1e-6)
