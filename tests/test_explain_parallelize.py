"""explain() tables and parallelize() on nn.Modules."""
import pytest
import torch
from torch import nn

import workbench as wb


def test_explain_matmul_relu_rows():
    mesh = wb.Mesh.grid(4, ["x"])
    a = wb.shard_tensor(torch.randn(8, 12), mesh, [wb.Replicate()])
    b = wb.shard_tensor(torch.randn(12, 6), mesh, [wb.Shard(0)])
    t = wb.explain(lambda a, b: torch.relu(a @ b), a, b, profile="ascend-910b")
    assert [r.op for r in t.rows] == ["matmul", "relu"]
    mm, relu = t.rows
    assert mm.outputs == ((wb.Partial("sum"),),) and mm.collectives == ()
    assert relu.inputs == ((wb.Partial("sum"),),)
    assert [k for k, _ in relu.collectives] == ["reduce_scatter"]
    assert relu.bytes == 3 * 8 * 6 * 4 // 4 and t.total_bytes == relu.bytes
    text = str(t)
    assert "reduce_scatter on x" in text and text.splitlines()[0].startswith("op")
    assert "<table>" in t._repr_html_() and "partial sums" in t.reasons()
    assert text.splitlines()[-1] in t._repr_html_()      # the total, in the HTML table too
    torch.testing.assert_close(t.result.full(), torch.relu(a.full() @ b.full()))


def test_parallelize_megatron_mlp_matches_single_device():
    torch.manual_seed(0)
    mesh = wb.Mesh.grid((2, 4), ("dp", "tp"))
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
    ref = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
    ref.load_state_dict(model.state_dict())
    wb.parallelize(model, mesh, {"0": "colwise", "2": "rowwise"}, mesh_dim="tp")
    names = dict(wb.dist_parameters(model))
    assert names["0.weight"].placements == (wb.Replicate(), wb.Shard(0))
    assert names["2.weight"].placements == (wb.Replicate(), wb.Shard(1))
    assert names["2.bias"].placements == (wb.Replicate(), wb.Replicate())
    X = torch.randn(8, 16)
    x = wb.shard_tensor(X, mesh, [wb.Shard(0), wb.Replicate()])      # data parallel batch
    with wb.trace() as tr:
        y = model(x)
        assert y.placements == (wb.Shard(0), wb.Partial("sum"))      # no forward comm yet
        assert tr.collectives() == []
        (y ** 2).sum().backward()
    r = ref(X)
    (r ** 2).sum().backward()
    torch.testing.assert_close(y.full(), r, rtol=1e-5, atol=1e-6)
    for (n, p), (n2, q) in zip(wb.dist_parameters(model), ref.named_parameters()):
        torch.testing.assert_close(p.grad.full(), q.grad, rtol=1e-5, atol=1e-5, msg=n)
    # data-parallel gradient all-reduces appear in backward, one per parameter used per rank
    assert tr.counts()["all_reduce"] >= 4


def test_parallelize_errors():
    mesh = wb.Mesh.grid(2)
    with pytest.raises(ValueError, match="match no module"):
        wb.parallelize(nn.Linear(2, 2), mesh, {"fc9": "colwise"})
    with pytest.raises(ValueError, match="colwise/rowwise apply"):
        wb.parallelize(nn.Sequential(nn.LayerNorm(4)), mesh, {"0": "colwise"})
    # an int key (nn.Sequential's index) gets the fix, not "object of type 'int' has no len()"
    lin = nn.Sequential(nn.Linear(2, 2))
    before = lin[0].weight.detach().clone()
    with pytest.raises(TypeError, match=r"plan key 0 \(int\).*as strings, e.g. '0'"):
        wb.parallelize(lin, mesh, {0: "colwise"})
    assert not isinstance(lin[0].weight, wb.DistTensor) and torch.equal(lin[0].weight, before)
