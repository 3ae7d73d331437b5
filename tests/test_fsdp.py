"""FullyShardedDataParallel on simulated ranks: the shard is the nn.Parameter the
optimizer steps; fp32 equals DDP bitwise, bf16/fp16 compute equals one device
computing in that dtype within 1e-4; the collectives are FSDP's."""
import pytest
import torch
from torch import nn

import workbench as wb
from workbench.parallel.strategies.laid_out_whole import storage_shape
from tests.dist_scripts.wrappers_model import data, loss_fn, make, one_device, wrapped
from workbench.parallel.strategies.laid_out_whole import storage_numel


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("n", [2, 4])
def test_fp32_equals_ddp_bitwise_and_one_device(n, opt):
    mesh = wb.Mesh.grid(n, ["dp"])
    got = wrapped("fsdp", opt, mesh)
    ddp = wrapped("ddp", opt, mesh)
    ref = one_device(opt)
    for name in ref:
        assert torch.equal(got[name], ddp[name]), name
        torch.testing.assert_close(got[name], ref[name], rtol=1e-6, atol=1e-6, msg=name)
    assert torch.equal(got["frozen"], ref["frozen"]) and torch.equal(got["unused"], ref["unused"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [2, 4])
def test_low_precision_compute_within_1e_4_of_one_device(n, dtype):
    got = wrapped("fsdp", "adamw", wb.Mesh.grid(n, ["dp"]), compute_dtype=dtype)
    ref = one_device("adamw", dtype)
    for name in ref:
        assert got[name].dtype == torch.float32                    # master weights stay fp32
        assert (got[name] - ref[name]).abs().max() < 1e-4, name


def test_the_shards_are_the_parameters_and_hold_fp32_grads():
    mesh = wb.Mesh.grid(4, ["dp"])
    fsdp = wb.FullyShardedDataParallel(make(), mesh, compute_dtype=torch.bfloat16)
    # the shards' storage (a user's p.shape is the module's: habits13)
    shapes = {n: storage_shape(p) for n, p in fsdp.named_parameters()}
    # 12*8 = 96 -> 4 rows of 24; hid.bias 8 -> 4 x 2; unused 3 -> padded to 4 -> 4 x 1
    assert shapes == {"frozen": (4, 2), "unused": (4, 1), "emb.weight": (4, 24),
                      "hid.weight": (4, 16), "hid.bias": (4, 2)}
    ids, y = data(1)[0]
    loss_fn(fsdp(wb.shard_tensor(ids, mesh, ["S(0)"])), wb.shard_tensor(y, mesh, ["S(0)"])) \
        .backward()
    assert fsdp.module.hid.weight.grad.dtype == torch.float32
    assert fsdp.module.unused.grad is None and fsdp.module.frozen.grad is None
    opt = torch.optim.AdamW(fsdp.parameters())
    opt.step()
    assert opt.state[fsdp.module.hid.weight]["exp_avg"].dtype == torch.float32


def test_collectives_gather_forward_reduce_scatter_backward_root_kept():
    mesh = wb.Mesh.grid(2, ["dp"])
    fsdp = wb.FullyShardedDataParallel(make(), mesh, compute_dtype=torch.bfloat16)
    ids, y = data(1)[0]
    with wb.trace() as tr:
        out = fsdp(wb.shard_tensor(ids, mesh, ["S(0)"]))
        fwd = [e.label for e in tr.collectives()]
        loss_fn(out, wb.shard_tensor(y, mesh, ["S(0)"])).backward()
    ev = [e for e in tr.collectives() if e.label.startswith("fsdp")]
    # one collective per unit (here the root, the whole module), in bf16 (2 bytes), over
    # the padded flat parameters: frozen 8, unused 4, emb 96, hid.weight 64, hid.bias 8
    # (the storage's elements: p.numel() is the module's, as torch FSDP2's DTensor's)
    padded = {n: storage_numel(p) for n, p in fsdp.named_parameters()}
    assert [x for x in fwd if x.startswith("fsdp")] == ["fsdp params root"]
    assert ev[0].args["buffer_bytes"] == 2 * sum(padded.values()) == 2 * 180
    # backward: the root (here the whole module) stays gathered from forward, as torch's
    # root (FSDP2 _fsdp_state.py:203-207, FSDP1 _runtime_utils.py:493-500): nothing is
    # gathered again (before, the weights linear saved were re-gathered) ...
    assert [e.label for e in ev if e.name == "all_gather"] == ["fsdp params root"]
    # ... and the gradients of the trainable, used parameters reduce-scattered in one
    rs = [e for e in ev if e.name == "reduce_scatter"]
    assert [e.label for e in rs] == ["fsdp grad root"]
    assert rs[0].args["buffer_bytes"] == 2 * sum(padded[n] for n in ["emb.weight", "hid.weight",
                                                                     "hid.bias"])


def test_full_state_dict_round_trips_the_initial_weights():
    m = make()
    want = {n: t.clone() for n, t in m.state_dict().items()}
    fsdp = wb.FullyShardedDataParallel(m, wb.Mesh.grid(4, ["dp"]))
    got = fsdp.full_state_dict()
    assert list(got) == list(want)
    assert all(torch.equal(got[n], want[n]) for n in want)


class Indexing(nn.Module):
    """A module that uses its weight by indexing and a transposed matmul only."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(10, 6))

    def forward(self, ids):
        h = self.table[ids]                      # (B, 6)
        return h @ self.table.T                  # (B, 10)


def test_any_module_that_indexes_its_weights():
    torch.manual_seed(0)
    m, ref = Indexing(), Indexing()
    ref.load_state_dict(m.state_dict())
    mesh = wb.Mesh.grid(2, ["dp"])
    fsdp = wb.FullyShardedDataParallel(m, mesh)
    ids = torch.tensor([1, 2, 3, 9])
    out = fsdp(wb.shard_tensor(ids, mesh, ["S(0)"]))
    torch.testing.assert_close(out.full(), ref(ids))
    out.sum().backward()
    ref(ids).sum().backward()
    torch.testing.assert_close(m.table.grad.reshape(-1)[:60].view(10, 6), ref.table.grad)


def test_bad_compute_dtype_is_named():
    with pytest.raises(ValueError, match="compute_dtype=torch.int8"):
        wb.FullyShardedDataParallel(make(), wb.Mesh.grid(2, ["dp"]), compute_dtype=torch.int8)


@pytest.mark.parametrize("wrapper", ["DistributedDataParallel", "FullyShardedDataParallel"])
def test_on_a_2d_mesh_along_its_second_dim(wrapper):
    """dp is the mesh's second dim; the module is replicated along the first."""
    mesh = wb.Mesh.grid((2, 2), ("tp", "dp"))
    # the toy's unused parameter: torch DDP trains it only with find_unused_parameters
    kw = {"find_unused_parameters": True} if wrapper == "DistributedDataParallel" else {}
    w = getattr(wb, wrapper)(make(), mesh, dim="dp", **kw)
    opt = torch.optim.AdamW(w.parameters(), lr=1e-3, weight_decay=0.1)
    ps = [wb.Replicate(), wb.Shard(0)]
    with wb.trace() as tr:
        for ids, y in data(5):
            opt.zero_grad()
            loss_fn(w(wb.shard_tensor(ids, mesh, ps)), wb.shard_tensor(y, mesh, ps)).backward()
            opt.step()
    got, ref = w.full_state_dict(), one_device("adamw")
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-6, atol=1e-6, msg=name)
    # every collective runs on the groups along dp: ranks (0, 1) and (2, 3)
    assert {e.ranks for e in tr.collectives() if e.label.startswith(("ddp", "fsdp"))} == \
        {(0, 1), (2, 3)} == set(mesh.groups("dp"))


def test_inputs_sharded_on_another_mesh_dim_are_refused():
    mesh = wb.Mesh.grid((2, 2), ("tp", "dp"))
    w = wb.FullyShardedDataParallel(make(), mesh, dim="dp")
    ids = data(1)[0][0]
    with pytest.raises(ValueError, match="on mesh dim 'tp'"):
        w(wb.shard_tensor(ids, mesh, [wb.Shard(1), wb.Shard(0)]))
    with pytest.raises(ValueError, match="lives on"):
        w(wb.shard_tensor(ids, wb.Mesh.grid(4, ["dp"]), ["S(0)"]))
