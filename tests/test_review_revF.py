"""Review of the optimizer step on the modeled clock (parallel/step_clock.py,
sim_mesh/optimizer_cost.py): kernel launches counted as torch 2.13 runs them
(torch/optim/adam.py ``_multi_tensor_adam`` and sgd.py ``_multi_tensor_sgd``: the foreach
kernels run once per param group and (device, dtype); a first-step momentum buffer is
``device_grads[i].detach().clone()``, one parameter at a time)."""
import pytest
import torch
from torch import nn

import workbench as wb
from workbench.parallel.strategies.data_parallel import DataParallel
from workbench.sim_mesh.profiles import get_profile

A100 = get_profile("a100")
BW = A100.memory_bandwidth * A100.memory_efficiency
LAUNCH = A100.launch_overhead
D_IN, D_OUT = 20, 6


def _run(make_opt, n=1):
    mesh = wb.Mesh.grid((2,), ["dp"])
    torch.manual_seed(0)
    m = nn.Linear(D_IN, D_OUT)
    wb.parallelize(m, mesh, {})
    dp = DataParallel([p for _, p in wb.dist_parameters(m)], mesh, "dp")
    w, b = list(dp.parameters())
    assert w.shape[-2:] == (D_OUT, D_IN) and b.shape[-1] == D_OUT
    o = make_opt(w, b)
    x = DataParallel([], mesh, "dp").shard_batch(torch.randn(8, D_IN))
    with wb.trace("a100") as tr:
        for _ in range(n):
            m(x).square().mean().backward()
            dp.finish_gradient_synchronization()
            o.step()
            o.zero_grad()
    return [e for e in tr.events if e.name == "optimizer_step"]


def test_two_param_groups_each_run_their_foreach_kernels():
    """GPT-style decay / no-decay groups: torch runs _multi_tensor_adam once per group,
    8 kernels (weight decay's mul_) + 7 kernels, not the last group's 7."""
    (ev,) = _run(lambda w, b: torch.optim.AdamW(
        [{"params": [w], "weight_decay": 0.1}, {"params": [b], "weight_decay": 0.0}],
        lr=1e-3))
    nbytes = (20 * D_IN * D_OUT + 18 * D_OUT) * 4
    assert ev.bytes == nbytes
    assert ev.duration == pytest.approx(nbytes / BW + (8 + 7) * LAUNCH)


def test_two_fused_param_groups_are_two_launches():
    (ev,) = _run(lambda w, b: torch.optim.AdamW(
        [{"params": [w]}, {"params": [b], "weight_decay": 0.0}], lr=1e-3, fused=True))
    nbytes = 7 * (D_IN * D_OUT + D_OUT) * 4
    assert ev.duration == pytest.approx(nbytes / BW + 2 * LAUNCH)


def test_sgd_foreach_first_step_clones_one_parameter_at_a_time():
    """First step with momentum: a clone per parameter (2 here) + the foreach add_(p, g)."""
    first, second = _run(lambda w, b: torch.optim.SGD([w, b], lr=0.1, momentum=0.9), n=2)
    numel = D_IN * D_OUT + D_OUT
    assert first.duration == pytest.approx((3 + 2) * 4 * numel / BW + (2 + 1) * LAUNCH)
    assert second.duration == pytest.approx((3 + 5) * 4 * numel / BW + 3 * LAUNCH)


# ---- backward into some inputs only (ops_table/pricing.py, backward_split.py) ----------
# torch's mm / linear backward computes only the gradients the engine will use
# (Node::task_should_compute_output): torch.autograd.grad(loss, x) and
# loss.backward(inputs=[x]) run the dgrad GEMM, never the wgrad.

@pytest.mark.parametrize("how", ["autograd_grad", "backward_inputs", "weights_only"])
def test_backward_into_some_inputs_prices_only_the_gemms_torch_runs(how):
    mesh = wb.Mesh.grid((2,), ("dp",))
    g = torch.Generator().manual_seed(0)
    x = wb.shard_tensor(torch.randn(64, 32, generator=g), mesh, [wb.Shard(0)]).requires_grad_()
    w = wb.shard_tensor(torch.randn(32, 16, generator=g), mesh,
                        [wb.Replicate()]).requires_grad_()
    with wb.trace("a100") as tr:
        loss = (x @ w).square().mean()
        n0 = len(tr.events)
        if how == "autograd_grad":
            (gx,) = torch.autograd.grad(loss, x)
            assert w.grad is None and gx.shape == x.shape
        elif how == "backward_inputs":
            loss.backward(inputs=[x])
            assert w.grad is None and x.grad is not None
        else:
            loss.backward(inputs=[w])
            assert x.grad is None and w.grad is not None
    parts = [e.args.get("part") for e in tr.events[n0:]
             if e.name == "matmul" and e.args.get("phase") == "backward" and 0 in e.ranks]
    assert parts == (["wgrad"] if how == "weights_only" else ["dgrad"]), parts
