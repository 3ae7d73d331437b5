"""Review findings (revA): each a defect found reading today's change, held to torch."""
import pytest
import torch

import workbench as wb


def _x():
    m = wb.Mesh([0, 1], ["dp"])
    return wb.shard_tensor(torch.arange(4.0), m, [wb.Shard(0)])


def test_to_copy_true_is_a_copy_as_torch():
    # torch: x.to(x.dtype, copy=True) is a new tensor; writing to it leaves x alone
    ref = torch.arange(4.0)
    ref_y = ref.to(torch.float32, copy=True)
    ref_y.add_(1)
    assert torch.equal(ref, torch.arange(4.0))
    x = _x()
    y = x.to(torch.float32, copy=True)
    assert y is not x
    y.add_(1)
    assert torch.equal(x.full(), torch.arange(4.0))
    assert torch.equal(y.full(), ref_y)
    z = x.to(dtype=torch.float32, copy=True)
    z.mul_(0)
    assert torch.equal(x.full(), torch.arange(4.0))


def test_to_same_dtype_without_copy_is_self_as_torch():
    x = _x()
    assert x.to(torch.float32) is x and x.float() is x


def _zero_model(overlap_comm):
    from tests.test_dp_family import PLAN, batch, mesh2d, mlp
    mesh = mesh2d()
    torch.manual_seed(0)
    model = wb.parallelize(mlp(), mesh, PLAN, mesh_dim="tp")
    opt = wb.ZeroRedundancyOptimizer(wb.dist_parameters(model), torch.optim.SGD, mesh, "dp",
                                     partition="chunks", overlap_comm=overlap_comm, lr=0.1)
    x, y = batch()
    xd = wb.shard_tensor(x, mesh, [wb.Shard(0), wb.Replicate()])
    yd = wb.shard_tensor(y, mesh, [wb.Shard(0), wb.Replicate()])
    return model, opt, lambda: ((model(xd) - yd) ** 2).mean().backward()



@pytest.mark.parametrize("overlap_comm", [False, True])
def test_zero_clip_then_model_zero_grad_drops_the_reduced_shards(overlap_comm):
    # a step skipped after clipping (e.g. a non-finite norm), then model.zero_grad():
    # as torch, the next step must see only the next backward's gradient.  ZeRO-1's
    # clip had moved the gradients into shards that model.zero_grad() did not reach,
    # so they were added to the next step's gradient, silently.
    model, opt, backward = _zero_model(overlap_comm)
    backward()
    norm1 = float(opt.clip_grad_norm_(1e9))
    model.zero_grad()
    backward()
    norm2 = float(opt.clip_grad_norm_(1e9))
    assert norm2 == pytest.approx(norm1, rel=1e-6)


def test_ops_rms_norm_eps_none_on_dist_tensors_as_on_one_device():
    # wb.ops.rms_norm(x, w, eps=None) is F.rms_norm's default eps on one device; on
    # DistTensors it raised a TypeError ("eps=None must be a number")
    m = wb.Mesh([0, 1], ["dp"])
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 6, generator=g), torch.randn(6, generator=g)
    xd = wb.shard_tensor(x, m, [wb.Shard(0)])
    wd = wb.shard_tensor(w, m, [wb.Replicate()])
    torch.testing.assert_close(wb.ops.rms_norm(xd, wd, eps=None).full(),
                               wb.ops.rms_norm(x, w, eps=None))


def test_zero_chunks_load_state_dict_restores_the_learning_rate():
    # torch.optim: load_state_dict restores each group's hyperparameters (a scheduler's
    # lr) and state_dict saves the current ones.  ChunkedZeroOptimizer loaded them into
    # its inner optimizer only; its own param_groups (which step copies into the inner
    # one) kept the constructor's lr, so a resumed run stepped with the wrong lr.
    model, opt, backward = _zero_model(False)
    opt.param_groups[0]["lr"] = 0.01            # as an lr scheduler sets it
    sd = opt.state_dict()
    assert sd["param_groups"][0]["lr"] == 0.01  # saved before any step: the current lr
    backward()
    opt.step()
    sd = opt.state_dict()
    model2, opt2, _ = _zero_model(False)        # a fresh run built with lr=0.1
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["lr"] == 0.01
    assert opt2.optimizer.param_groups[0]["lr"] == 0.01


def test_data_parallel_without_parameters_refuses_a_state_to_load():
    # DataParallel over no parameters holds no optimizer: loading a state into it was
    # silently ignored (torch.optim refuses an empty parameter list outright)
    from workbench.parallel.strategies.data_parallel import DataParallel
    dp = DataParallel([], wb.Mesh([0, 1], ["dp"]))
    dp.load_state_dict(dp.state_dict())                 # its own (empty) state: fine
    sd = {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 1.0, "params": [0]}]}
    with pytest.raises(ValueError, match="no parameters"):
        dp.load_state_dict(sd)
