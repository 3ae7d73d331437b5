"""adamw: the functional step and the AdamW optimizer on every backend against
torch.optim.AdamW and the float32 reference."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import workbench.ops as ops
from workbench.ops.testing import assert_close

HYPER = dict(lr=1e-2, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.1)


def state(shapes, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    make = lambda s: torch.randn(*s, generator=gen).to(dtype)   # noqa: E731
    params = [make(s) for s in shapes]
    exp_avgs = [make(s) * 0.1 for s in shapes]
    exp_avg_sqs = [make(s).abs() * 0.01 for s in shapes]
    grads = [make(s) for s in shapes]
    return params, grads, exp_avgs, exp_avg_sqs


def torch_step(params, grads, exp_avgs, exp_avg_sqs, step, lr, beta1, beta2, eps, weight_decay):
    """torch.optim.AdamW, loaded with the same moments and step count, as ground truth."""
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    opt = torch.optim.AdamW(ps, lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay,
                            foreach=False)
    for p, g, m, v in zip(ps, grads, exp_avgs, exp_avg_sqs):
        p.grad = g.clone()
        opt.state[p] = dict(step=torch.tensor(float(step - 1)), exp_avg=m.clone(),
                            exp_avg_sq=v.clone())
    opt.step()
    return [p.detach() for p in ps], [opt.state[p]["exp_avg"] for p in ps], \
        [opt.state[p]["exp_avg_sq"] for p in ps]


@settings(max_examples=20, deadline=None)
@given(shapes=st.lists(st.lists(st.integers(1, 9), min_size=1, max_size=3), min_size=1,
                       max_size=4), step=st.integers(1, 50),
       backend=st.sampled_from(["reference", "unfused", "native"]))
def test_functional_step_matches_torch_adamw(shapes, step, backend):
    params, grads, exp_avgs, exp_avg_sqs = state(shapes, seed=step)
    want = torch_step(params, grads, exp_avgs, exp_avg_sqs, step, **HYPER)
    with ops.use(backend):
        ops.adamw(params, grads, exp_avgs, exp_avg_sqs, step, **HYPER)
    for got, exp in zip((params, exp_avgs, exp_avg_sqs), want):
        for a, b in zip(got, exp):
            assert_close(a, b, backend)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", ["unfused", "native"])
def test_low_precision_paths_match_the_reference(dtype, backend):
    shapes = [(7, 5), (13,), (3, 3, 3)]
    ref = state(shapes, dtype)
    got = state(shapes, dtype)
    with ops.use("reference"):
        ops.adamw(*ref, 3, **HYPER)
    with ops.use(backend):
        ops.adamw(*got, 3, **HYPER)
    for which in (0, 2, 3):                  # params, exp_avgs, exp_avg_sqs
        for a, b in zip(got[which], ref[which]):
            assert a.dtype == dtype
            assert_close(a, b, f"{backend} {dtype}")


def test_native_handles_mixed_devices_dtypes_and_non_contiguous_params():
    params, grads, exp_avgs, exp_avg_sqs = state([(4, 6), (6, 4)])
    params[1] = params[1].T.contiguous().T           # a transposed view
    params.append(torch.randn(5, dtype=torch.float64))
    for seq, make in ((grads, torch.randn), (exp_avgs, torch.zeros), (exp_avg_sqs, torch.zeros)):
        seq.append(make(5, dtype=torch.float64))
    want = torch_step(params, grads, exp_avgs, exp_avg_sqs, 1, **HYPER)
    with ops.use("native"):
        ops.adamw(params, grads, exp_avgs, exp_avg_sqs, 1, **HYPER)
    for a, b in zip(params, want[0]):
        assert_close(a, b)


def test_optimizer_class_trains_like_torch_adamw():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    twin = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    twin.load_state_dict(model.state_dict())
    model[2].bias.requires_grad_(False)              # a parameter without grad is skipped
    twin[2].bias.requires_grad_(False)
    ours = ops.AdamW(model.parameters(), lr=3e-2, betas=(0.9, 0.99), weight_decay=0.05)
    theirs = torch.optim.AdamW(twin.parameters(), lr=3e-2, betas=(0.9, 0.99), weight_decay=0.05)
    x, y = torch.randn(32, 6), torch.randn(32, 1)
    losses = []
    for _ in range(20):
        for net, opt in ((model, ours), (twin, theirs)):
            opt.zero_grad()
            loss = ((net(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
        losses.append(loss.item())
    for a, b in zip(model.parameters(), twin.parameters()):
        assert_close(a, b)
    assert losses[-1] < losses[0]
    assert ours.state[model[0].weight]["step"] == 20


def test_optimizer_closure_returns_the_loss():
    p = torch.nn.Parameter(torch.ones(3))
    opt = ops.AdamW([p], lr=0.1)

    def closure():
        opt.zero_grad()
        loss = (p ** 2).sum()
        loss.backward()
        return loss
    assert opt.step(closure).item() == 3.0
    assert (p < 1).all()


@pytest.mark.parametrize("kwargs, message", [
    (dict(step=0), "step=0; it counts steps from 1"),
    (dict(lr=-1.0), r"lr=-1.0; it must be in \[0, inf\)"),
    (dict(beta1=1.0), r"beta1=1.0; it must be in \[0, 1\)"),
])
def test_bad_hyperparameters_are_named(kwargs, message):
    args = dict(step=1, **HYPER)
    args.update(kwargs)
    step = args.pop("step")
    with pytest.raises(ValueError, match=message):
        ops.adamw(*state([(2,)]), step, **args)


def test_mismatched_lists_are_named():
    p, g, m, v = state([(2,), (3,)])
    with pytest.raises(ValueError, match="one entry per parameter"):
        ops.adamw(p, g[:1], m, v, 1, lr=0.1)
    with pytest.raises(ValueError, match=r"grads\[1\].shape=\(2,\) differs"):
        ops.adamw(p, [g[0], g[0]], m, v, 1, lr=0.1)
    with pytest.raises(TypeError, match=r"exp_avgs\[0\] must be a floating-point tensor"):
        ops.adamw(p, g, [m[0].long(), m[1]], v, 1, lr=0.1)


@pytest.mark.parametrize("backend", ["reference", "unfused", "native"])
@pytest.mark.parametrize("contiguous", [True, False])
def test_every_path_bumps_the_version_of_what_it_writes(backend, contiguous):
    """A step writes params and moments in place; autograd's version counter says so on
    every path, as for any in-place op (torch.autograd.graph.increment_version).  Failed
    before on the native path for contiguous tensors: torch._fused_adamw_ left p._version
    0 (the foreach kernels, taken for non-contiguous ones, bump it), so a gradient way's
    meeting point from the last step (gather_backward_dist._stand_in) was reused."""
    params, grads, exp_avgs, exp_avg_sqs = state([(4, 6), (5,)])
    if not contiguous:
        params = [p.t() if p.dim() == 2 else p for p in params]
        grads, exp_avgs, exp_avg_sqs = ([t.t() if t.dim() == 2 else t for t in seq]
                                        for seq in (grads, exp_avgs, exp_avg_sqs))
    before = [[t._version for t in seq] for seq in (params, exp_avgs, exp_avg_sqs)]
    with ops.use(backend):
        ops.adamw(params, grads, exp_avgs, exp_avg_sqs, 3, **HYPER)
    after = [[t._version for t in seq] for seq in (params, exp_avgs, exp_avg_sqs)]
    for b, a in zip(before, after):
        assert all(y > x for x, y in zip(b, a)), (before, after)
