"""CNN ops on DistTensors: conv1d / conv2d / conv3d / torch.convolution, max / avg /
adaptive-avg pooling, batch_norm (training with global statistics and running statistics
updated as torch does; evaluation), group_norm and instance_norm.

Every op is held to one device (values, dtype, shape, and the gradients of the input, the
weight and the bias) on meshes of 1, 2, 3 (uneven batch of 5) and 2x2 ranks in the layouts
R / S(0) / S(1) / S(2) / P; placements and communication are counted where the answer is
known; the validator forces every candidate of every rule (0 wrong); a small CNN
(conv-bn-relu-pool-linear) trains two steps on DistTensors exactly as plain torch; the
costs are held to PyTorch's own FLOP counter (``torch.utils.flop_counter``)."""
from collections import Counter

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import workbench as wb
from workbench.parallel.validate_inputs import distribute

M1, M2, M3 = (wb.Mesh.grid(n, ["a"]) for n in (1, 2, 3))
M22 = wb.Mesh.grid((2, 2), ["a", "b"])
R, S0, S1, S2, P = wb.Replicate(), wb.Shard(0), wb.Shard(1), wb.Shard(2), wb.Partial()
LAYOUTS = [(M1, (S0,))] + [(M2, (p,)) for p in (R, S0, S1, S2, P)] + \
          [(M3, (p,)) for p in (S0, S1, S2, P)] + \
          [(M22, ps) for ps in ((S0, S1), (S1, S0), (P, S0), (S2, R))]


def _g(seed):
    return torch.Generator().manual_seed(seed)


def rn(*shape, seed=0):
    return torch.randn(shape, generator=_g(seed), dtype=torch.float64)


X1, X2, X3 = rn(5, 4, 9, seed=1), rn(5, 4, 7, 6, seed=2), rn(5, 4, 4, 3, 3, seed=3)
W1, W2, W3 = rn(6, 4, 3, seed=4), rn(6, 4, 3, 3, seed=5), rn(6, 4, 2, 2, 2, seed=6)
WG = rn(6, 2, 3, 3, seed=7)                    # groups=2
WD = rn(4, 1, 3, 3, seed=8)                    # depthwise
B6, C4A, C4B = rn(6, seed=9), rn(4, seed=10), rn(4, seed=11)
RM, RV = rn(4, seed=12), rn(4, seed=13).abs() + 0.5

# name -> (f(x, *params), x, params): params are plain leaves (an nn.Module's parameters)
OPS = {
    "conv1d": (lambda x, w, b: F.conv1d(x, w, b, padding=1), X1, (W1, B6)),
    "conv1d_stride": (lambda x, w: F.conv1d(x, w, stride=2, dilation=2), X1, (W1,)),
    "conv2d": (lambda x, w, b: F.conv2d(x, w, b, padding=1), X2, (W2, B6)),
    "conv2d_strided": (lambda x, w, b: F.conv2d(x, w, b, stride=2), X2, (W2, B6)),
    "conv2d_same": (lambda x, w: F.conv2d(x, w, padding="same"), X2, (W2,)),
    "conv2d_groups": (lambda x, w, b: F.conv2d(x, w, b, groups=2, padding=1), X2, (WG, B6)),
    "conv2d_depthwise": (lambda x, w: F.conv2d(x, w, groups=4), X2, (WD,)),
    "conv3d": (lambda x, w, b: F.conv3d(x, w, b, padding=1), X3, (W3, B6)),
    "convolution": (lambda x, w, b: torch.convolution(x, w, b, [1, 1], [1, 1], [1, 1], False,
                                                      [0, 0], 1), X2, (W2, B6)),
    "max_pool1d": (lambda x: F.max_pool1d(x, 3, 2, 1), X1, ()),
    "max_pool2d": (lambda x: F.max_pool2d(x, 3, 2, 1), X2, ()),
    "max_pool2d_ceil": (lambda x: F.max_pool2d(x, 2, ceil_mode=True), X2, ()),
    "avg_pool1d": (lambda x: F.avg_pool1d(x, 2), X1, ()),
    "avg_pool2d": (lambda x: F.avg_pool2d(x, 3, 2, 1, count_include_pad=False), X2, ()),
    "avg_pool2d_divisor": (lambda x: F.avg_pool2d(x, 2, divisor_override=3), X2, ()),
    "adaptive_avg_pool1d": (lambda x: F.adaptive_avg_pool1d(x, 4), X1, ()),
    "adaptive_avg_pool2d": (lambda x: F.adaptive_avg_pool2d(x, (3, 2)), X2, ()),
    "adaptive_avg_pool2d_1": (lambda x: F.adaptive_avg_pool2d(x, 1), X2, ()),
    "batch_norm": (lambda x, w, b: F.batch_norm(x, None, None, w, b, True), X2, (C4A, C4B)),
    "batch_norm_1d": (lambda x: F.batch_norm(x, None, None, training=True, eps=1e-3), X1, ()),
    "batch_norm_eval": (lambda x, w, b: F.batch_norm(x, RM, RV, w, b, False), X2, (C4A, C4B)),
    "group_norm": (lambda x, w, b: F.group_norm(x, 2, w, b), X2, (C4A, C4B)),
    "group_norm_3d": (lambda x: F.group_norm(x, 4, eps=1e-3), X3, ()),
    "instance_norm": (lambda x, w, b: F.instance_norm(x, weight=w, bias=b), X2, (C4A, C4B)),
    "instance_norm_eval": (lambda x: F.instance_norm(x, RM, RV, use_input_stats=False), X1, ()),
    "layer_norm_of_a_cnn": (lambda x: F.layer_norm(x, (7, 6)), X2, ()),
}


def _weights(shape):
    return torch.linspace(-1.0, 2.0, torch.Size(shape).numel(),
                          dtype=torch.float64).reshape(shape)


def as_one_device(fn, mesh, ps, x, params):
    """fn on x laid out as ps (params plain leaves) equals fn on one device: values, dtype,
    shape, requires_grad, and the gradients of x and of every parameter."""
    x0 = x.clone().requires_grad_()
    p0 = [p.clone().requires_grad_() for p in params]
    ref = fn(x0, *p0)
    t = distribute(x, mesh, list(ps)).requires_grad_()
    p1 = [p.clone().requires_grad_() for p in params]
    out = fn(t, *p1)
    where = f"mesh {tuple(mesh.shape)} {[str(p) for p in ps]}"
    assert isinstance(out, wb.DistTensor), where
    assert (out.dtype, out.shape, out.requires_grad) == (ref.dtype, ref.shape, True), where
    torch.testing.assert_close(out.full(), ref.detach(), msg=lambda m: f"{where}: {m}")
    wts = _weights(ref.shape)
    (ref * wts).sum().backward()
    (out * wts).sum().backward()
    torch.testing.assert_close(t.grad.full(), x0.grad, msg=lambda m: f"x grad, {where}: {m}")
    for k, (a, b) in enumerate(zip(p1, p0)):
        torch.testing.assert_close(a.grad, b.grad, msg=lambda m: f"param {k} grad, {where}: {m}")
    return out


@pytest.mark.parametrize("name", sorted(OPS))
def test_op_equals_one_device_on_every_mesh_and_layout(name):
    fn, x, params = OPS[name]
    for mesh, ps in LAYOUTS:
        as_one_device(fn, mesh, ps, x, params)


def test_weights_as_dist_tensors_get_one_devices_gradients():
    # a replicated weight leaf meets batch-sharded samples: its gradient is the all-reduce
    # of the ranks' partial sums (traced), equal to one device's
    x0, w0, b0 = (t.clone().requires_grad_() for t in (X2, W2, B6))
    F.conv2d(x0, w0, b0, padding=1).pow(2).sum().backward()
    for mesh, ps in ((M2, [S0]), (M3, [S0]), (M22, [S0, S1])):
        x = wb.shard_tensor(X2, mesh, ps).requires_grad_()
        w = wb.shard_tensor(W2, mesh, [R] * mesh.ndim).requires_grad_()
        b = wb.shard_tensor(B6, mesh, [R] * mesh.ndim).requires_grad_()
        F.conv2d(x, w, b, padding=1).pow(2).sum().backward()
        for got, want in ((x, x0), (w, w0), (b, b0)):
            torch.testing.assert_close(got.grad.full(), want.grad)


# ---- placements and communication ------------------------------------------------------

def _run(fn, mesh, ps, x, *params, backward=False):
    t = distribute(x, mesh, list(ps))
    if backward:
        t.requires_grad_()
        params = [wb.shard_tensor(p, mesh, [R] * mesh.ndim).requires_grad_() for p in params]
    with wb.trace() as tr:
        out = fn(t, *params)
        if backward:            # a gradient laid out as the output: no loss to reduce
            out.backward(wb.shard_tensor(_weights(out.shape), mesh, list(out.placements)))
    ref = fn(x, *[p.full() if isinstance(p, wb.DistTensor) else p for p in params])
    torch.testing.assert_close(out.full().detach(), ref)
    return out, Counter(tr.counts())


PLACED = [   # (case, fn, params, layout, output placements, collectives)
    ("conv data parallel", lambda x, w, b: F.conv2d(x, w, b, padding=1), (W2, B6), (S0,),
     (S0,), {}),
    ("conv input channels: partial sums", lambda x, w: F.conv2d(x, w), (W2,), (S1,), (P,), {}),
    ("depthwise conv along whole groups", lambda x, w: F.conv2d(x, w, groups=4), (WD,), (S1,),
     (S1,), {}),
    ("conv of a partial input", lambda x, w: F.conv1d(x, w), (W1,), (P,), (P,), {}),
    ("max pool of samples", lambda x: F.max_pool2d(x, 2), (), (S0,), (S0,), {}),
    ("avg pool of channels", lambda x: F.avg_pool2d(x, 2), (), (S1,), (S1,), {}),
    ("avg pool of a partial sum", lambda x: F.adaptive_avg_pool2d(x, 1), (), (P,), (P,), {}),
    ("max pool of a partial max", lambda x: F.max_pool1d(x, 3), (), (wb.Partial("max"),),
     (wb.Partial("max"),), {}),
    ("batch norm: global statistics, two all-reduces",
     lambda x, w, b: F.batch_norm(x, None, None, w, b, True), (C4A, C4B), (S0,), (S0,),
     {"all_reduce": 2}),
    ("batch norm over a sharded spatial dim", lambda x: F.batch_norm(x, None, None, None, None,
                                                                       True), (), (S2,), (S2,),
     {"all_reduce": 2}),
    ("batch norm of channels: local statistics",
     lambda x, w, b: F.batch_norm(x, None, None, w, b, True), (C4A, C4B), (S1,), (S1,), {}),
    ("batch norm in eval mode passes", lambda x: F.batch_norm(x, RM, RV), (), (S0,), (S0,), {}),
    ("group norm of samples", lambda x: F.group_norm(x, 2), (), (S0,), (S0,), {}),
    ("group norm along whole groups", lambda x: F.group_norm(x, 2), (), (S1,), (S1,), {}),
    ("instance norm of channels", lambda x: F.instance_norm(x), (), (S1,), (S1,), {}),
]


ONE_D = ("conv of a partial input", "max pool of a partial max")


@pytest.mark.parametrize("case,fn,params,ps,want,comms", PLACED, ids=[c[0] for c in PLACED])
def test_placements_and_communication(case, fn, params, ps, want, comms):
    x = X1[:4] if case in ONE_D else rn(4, 4, 6, 6, seed=20)        # even on 2 ranks
    out, counts = _run(fn, M2, ps, x, *params)
    assert out.placements == want, (case, out.placements)
    assert counts == Counter(comms), (case, counts)


def test_data_parallel_conv_all_reduces_the_weight_and_bias_gradients():
    # DTensor's conv backward: grad_weight and grad_bias Partial, here reduced as they leave
    x = rn(4, 4, 6, 6, seed=21)
    _, counts = _run(lambda t, w, b: F.conv2d(t, w, b), M2, [S0], x, W2, B6, backward=True)
    assert counts == Counter({"all_reduce": 2}), counts          # dW, db; nothing forward


def test_batch_norm_backward_all_reduces_its_statistics_gradients():
    x = rn(4, 4, 6, 6, seed=22)
    _, counts = _run(lambda t: F.batch_norm(t, None, None, None, None, True), M2, [S0], x,
                     backward=True)
    assert counts == Counter({"all_reduce": 4}), counts   # mean, var; and their gradients


def test_spatially_sharded_inputs_are_gathered_first():
    # a window straddles the shard edge: the planner moves dim 2 whole, never a wrong value
    x = rn(4, 4, 6, 6, seed=23)
    for fn in (lambda t: F.conv2d(t, W2, padding=1), lambda t: F.max_pool2d(t, 3, 1, 1),
               lambda t: F.adaptive_avg_pool2d(t, 4), lambda t: F.group_norm(t, 2),
               lambda t: F.instance_norm(t)):
        out, counts = _run(fn, M2, [S2], x)
        assert not any(p.is_shard(2) for p in out.placements), out.placements
        assert sum(counts.values()) == 1, counts


def test_uneven_batch_norm_gathers_instead_of_syncing():
    # 5 samples on 3 ranks (2, 2, 1): the statistics' all-reduces need every rank's shard at
    # once; the input is moved to an even layout instead (exact)
    out, counts = _run(lambda t: F.batch_norm(t, None, None, None, None, True), M3, [S0], X2)
    assert sum(counts.values()) >= 1 and "all_reduce" not in counts, counts


def test_uneven_channels_leave_a_rank_an_empty_block():
    # 4 channels on 3 ranks are torch.chunk's 2, 2, 0: the empty block contributes nothing
    for fn in (lambda t: F.conv2d(t, W2), lambda t: F.max_pool2d(t, 2),
               lambda t: F.batch_norm(t, None, None, training=True), lambda t: F.group_norm(t, 1)):
        as_one_device(lambda t: fn(t), M3, (S1,), X2, ())


def test_uneven_filters_leave_a_rank_no_output_channels():
    # 4 filters on 3 ranks (2, 2, 0): the output's channels split alike, gradients exact
    w0, b0 = W2[:4].clone().requires_grad_(), B6[:4].clone().requires_grad_()
    F.conv2d(X2, w0, b0).pow(2).sum().backward()
    w = wb.shard_tensor(W2[:4], M3, [S0]).requires_grad_()
    b = wb.shard_tensor(B6[:4], M3, [S0]).requires_grad_()
    y = F.conv2d(wb.shard_tensor(X2, M3, [R]), w, b)
    assert y.placements == (S1,)
    torch.testing.assert_close(y.full(), F.conv2d(X2, W2[:4], B6[:4]))
    y.pow(2).sum().backward()
    torch.testing.assert_close(w.grad.full(), w0.grad)
    torch.testing.assert_close(b.grad.full(), b0.grad)


@pytest.mark.parametrize("dtype", [torch.bool, torch.int64, torch.float64])
def test_empty_pools_keep_torchs_dtype(dtype):
    # torch pools an EMPTY bool or integer input without its dtype check and returns its
    # own dtype (random sweep seed 1007444: an empty bool pool came back int64, the empty
    # block's graph link x.sum() promoting it)
    for fn in (lambda t: F.adaptive_avg_pool1d(t, 2), lambda t: F.avg_pool1d(t, 2)):
        x = torch.zeros(0, 5, 4, dtype=dtype)
        try:
            ref = fn(x)
        except (RuntimeError, NotImplementedError) as e:   # avg_pool1d checks it: so do we
            for mesh, ps in ((M2, [S0]), (M3, [S1]), (M1, [R])):
                with pytest.raises(type(e)):
                    fn(wb.shard_tensor(x, mesh, ps))
            continue
        for mesh, ps in ((M2, [S0]), (M3, [S1]), (M1, [R])):
            out = fn(wb.shard_tensor(x, mesh, ps))
            assert out.dtype == ref.dtype and out.shape == ref.shape, (out.dtype, ref.dtype)


# ---- batch norm's running statistics ---------------------------------------------------

@pytest.mark.parametrize("mesh,ps", [(M1, [S0]), (M2, [S0]), (M3, [S0]), (M22, [S0, S2]),
                                     (M2, [S1]), (M2, [P]), (M22, [S1, S0])])
def test_batch_norm_updates_running_statistics_as_torch(mesh, ps):
    rm0, rv0, rm1, rv1 = RM.clone(), RV.clone(), RM.clone(), RV.clone()
    for step in range(2):                       # the second step reads the first's update
        ref = F.batch_norm(X2 * (step + 1), rm0, rv0, C4A, C4B, True, 0.3)
        out = F.batch_norm(distribute(X2 * (step + 1), mesh, ps), rm1, rv1, C4A, C4B, True, 0.3)
        torch.testing.assert_close(out.full(), ref)
        torch.testing.assert_close(rm1, rm0)
        torch.testing.assert_close(rv1, rv0)


def test_running_statistics_as_dist_tensors_are_written_in_place():
    rm0, rv0 = RM.clone(), RV.clone()
    ref = F.batch_norm(X2, rm0, rv0, None, None, True, 0.1)
    for xs, ss in (([S1], [S0]), ([S0], [R]), ([S1], [R])):
        rm, rv = wb.shard_tensor(RM, M2, ss), wb.shard_tensor(RV, M2, ss)
        out = F.batch_norm(wb.shard_tensor(X2, M2, xs), rm, rv, training=True)
        torch.testing.assert_close(out.full(), ref)
        assert rm.placements == tuple(ss)
        torch.testing.assert_close(rm.full(), rm0)
        torch.testing.assert_close(rv.full(), rv0)
    x = wb.shard_tensor(X2, M2, [S1])
    out = F.batch_norm(x, wb.shard_tensor(RM, M2, [S0]), wb.shard_tensor(RV, M2, [S0]),
                       training=True)
    assert out.placements == (S1,)                 # channels with their statistics: no move
    with pytest.raises(ValueError, match="running statistics"):
        F.batch_norm(x, distribute(RM, M2, [P]), distribute(RV, M2, [P]), training=True)


# ---- a small CNN trained on DistTensors ------------------------------------------------

class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.conv2, self.gn = nn.Conv2d(4, 4, 3, padding=1, groups=2), nn.GroupNorm(2, 4)
        self.pool, self.head = nn.MaxPool2d(2), nn.Linear(16, 3)

    def forward(self, x):
        x = self.pool(F.relu(self.bn1(self.conv1(x))))                  # (N, 4, 3, 3)
        x = F.adaptive_avg_pool2d(F.relu(self.gn(self.conv2(x))), 2)     # (N, 4, 2, 2)
        return self.head(torch.flatten(x, 1))


@pytest.mark.parametrize("mesh,ps", [(M2, [S0]), (M3, [S0]), (M22, [S0, R])])
def test_a_small_cnn_trains_as_on_one_device(mesh, ps):
    torch.manual_seed(0)
    ref = SmallCNN().double()
    model = SmallCNN().double()
    model.load_state_dict(ref.state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ref, model)]
    x, y = rn(6 if mesh is not M3 else 5, 3, 6, 6, seed=30), torch.tensor([0, 2, 1, 1, 0, 2])
    y = y[:x.shape[0]]
    for step in range(2):
        losses = []
        for m, opt, inp in ((ref, opts[0], x), (model, opts[1], distribute(x, mesh, ps))):
            opt.zero_grad()
            loss = F.cross_entropy(m(inp), y)
            loss.backward()
            opt.step()
            losses.append(loss.full() if isinstance(loss, wb.DistTensor) else loss)
        torch.testing.assert_close(losses[1], losses[0].detach(), msg=f"step {step}")
        for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
            torch.testing.assert_close(a, b, msg=f"{name} after step {step}")
    model.eval(), ref.eval()
    torch.testing.assert_close(model(distribute(x, mesh, ps)).full(), ref(x).detach())


def test_a_channel_parallel_cnn_trains_as_on_one_device():
    # conv1's filters split over mesh dim "b" (its output channels sharded), samples over
    # "a": parameters are DistTensors (wb.parallelize), updated in place
    torch.manual_seed(0)
    ref, model = SmallCNN().double(), SmallCNN().double()
    model.load_state_dict(ref.state_dict())
    split = ["R", "S(0)"]
    wb.parallelize(model, M22, {"conv1.weight": split, "conv1.bias": split,
                                "bn1.weight": split, "bn1.bias": split})
    x, y = rn(6, 3, 6, 6, seed=31), torch.tensor([0, 2, 1, 1, 0, 2])
    assert model.conv1(distribute(x, M22, [S0, R])).placements == (S0, S1)
    for step in range(2):
        for m, inp in ((ref, x), (model, distribute(x, M22, [S0, R]))):
            m.zero_grad()
            F.cross_entropy(m(inp), y).backward()
            with torch.no_grad():
                for p in m.parameters():
                    p.sub_(0.1 * p.grad)
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        a = a.full() if isinstance(a, wb.DistTensor) else a
        torch.testing.assert_close(a, b, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dtypes_as_torch(dtype):
    # bfloat16 activations with float32 norm parameters (torch's mixed batch norm): torch's
    # output dtypes; statistics in float32, as torch's kernels
    x = X2.to(dtype)
    for fn in (lambda t: F.conv2d(t, W2.to(dtype), B6.to(dtype), padding=1),
               lambda t: F.batch_norm(t, None, None, C4A.float(), C4B.float(), True),
               lambda t: F.batch_norm(t, RM.float(), RV.float(), C4A.float(), None),
               lambda t: F.group_norm(t, 2), lambda t: F.avg_pool2d(t, 2)):
        ref = fn(x)
        for mesh, ps in ((M2, [S0]), (M2, [S1]), (M3, [S0])):
            out = fn(wb.shard_tensor(x, mesh, ps))
            assert out.dtype == ref.dtype, (out.dtype, ref.dtype)
            tol = dict(rtol=2e-2, atol=6e-2) if dtype == torch.bfloat16 else {}   # 1 ulp of ~8
            torch.testing.assert_close(out.full(), ref, **tol)


# ---- errors ------------------------------------------------------------------------------

@pytest.mark.parametrize("fn,err", [
    (lambda t: F.conv2d(t, W2[:, :3]), RuntimeError),                   # channels mismatch
    (lambda t: F.conv2d(t, WG, groups=3), RuntimeError),                # 4 % 3
    (lambda t: F.conv1d(t, W2), RuntimeError),                          # 4-d weight
    (lambda t: F.max_pool2d(t, 9), RuntimeError),                       # output too small
    (lambda t: F.batch_norm(t[:1, :, :1, :1], None, None, training=True), ValueError),
    (lambda t: F.batch_norm(t, None, None), RuntimeError),              # eval needs stats
    (lambda t: F.group_norm(t, 3), RuntimeError),                       # 4 channels
])
def test_bad_arguments_raise_as_torch(fn, err):
    with pytest.raises(err):
        fn(X2)
    with pytest.raises(err):
        fn(wb.shard_tensor(X2, M3, [S0]))


@pytest.mark.parametrize("fn,match", [
    (lambda t: F.max_pool2d(t, 2, return_indices=True), "max_pool2d_with_indices"),
    (lambda t: torch.convolution(t, W2.transpose(0, 1), None, [1, 1], [0, 0], [1, 1], True,
                                 [0, 0], 1), "transposed"),
    (lambda t: F.instance_norm(t, RM.clone(), RV.clone()), "running statistics"),
])
def test_unsupported_calls_raise_naming_the_fix(fn, match):
    with pytest.raises(NotImplementedError, match=match):
        fn(wb.shard_tensor(X2, M2, [S0]))


# ---- costs: held to PyTorch's own FLOP counter -------------------------------------------

def _torch_flops(fn, *ts):
    with FlopCounterMode(display=False) as fwd:
        y = fn(*ts)
    with FlopCounterMode(display=False) as bwd:
        y.backward(torch.ones_like(y))
    return fwd.get_total_flops(), bwd.get_total_flops()


@pytest.mark.parametrize("fn,shapes", [
    (lambda x, w: F.conv2d(x, w, padding=1), ((4, 4, 6, 6), (6, 4, 3, 3))),
    (lambda x, w: F.conv1d(x, w, stride=2, dilation=2), ((4, 4, 9), (6, 4, 3))),
    (lambda x, w: F.conv3d(x, w), ((4, 4, 4, 3, 3), (6, 4, 2, 2, 2))),
])
def test_conv_flops_are_torchs_flop_counter_split_over_the_batch(fn, shapes):
    x, w = (torch.randn(s, generator=_g(40), requires_grad=True) for s in shapes)
    want_f, want_b = _torch_flops(fn, x, w)
    xt = wb.shard_tensor(x.detach(), M2, [S0]).requires_grad_()
    wt = wb.shard_tensor(w.detach(), M2, [R]).requires_grad_()
    with wb.trace() as tr:
        y = fn(xt, wt)
        y.backward(wb.shard_tensor(torch.ones(y.shape), M2, [S0]))
    evs = [e for e in tr.events if e.stream == "compute" and e.name.startswith("conv")]
    fwd = [e for e in evs if e.label == "forward"]
    parts = {e.args.get("part") for e in evs if e.label == "backward"}
    assert parts == {"dgrad", "wgrad"}               # priced as an implicit GEMM's two kernels
    assert sum(e.flops for e in fwd) == want_f // 2   # each rank half the batch
    assert sum(e.flops for e in evs if e.label == "backward") == want_b // 2


def test_grouped_conv_flops_count_each_group_once():
    # 2 N C_out L_out (C_in / groups) k; backward twice that (torch's flop counter prices a
    # grouped weight gradient as if groups were 1, so the formula is checked directly)
    x = wb.shard_tensor(torch.randn(4, 4, 9), M2, [S0]).requires_grad_()
    w = torch.randn(6, 2, 3, requires_grad=True)
    with wb.trace() as tr:
        y = F.conv1d(x, w, stride=2, groups=2)                  # (4, 6, 4)
        y.backward(wb.shard_tensor(torch.ones(y.shape), M2, [S0]))
    evs = [e for e in tr.events if e.stream == "compute" and e.name == "conv1d"]
    macs = 2 * 6 * 4 * 2 * 3                                    # per rank: N=2 samples
    assert [e.flops for e in evs if e.label == "forward"] == [2 * macs]
    assert sum(e.flops for e in evs if e.label == "backward") == 4 * macs


# ---- the validator: every candidate of every rule, forced ----------------------------------

CNN_OPS = ("conv1d", "conv2d", "conv3d", "convolution", "max_pool1d", "max_pool2d",
           "avg_pool1d", "avg_pool2d", "adaptive_avg_pool1d", "adaptive_avg_pool2d",
           "batch_norm", "group_norm", "instance_norm")


def test_validator_finds_no_wrong_candidate():
    # a fixed-seed choice of input layouts per sample and mesh (2, 3 and 2x2 ranks; Partial
    # inputs of unequal parts), every candidate the rule offers forced and held to one device
    from workbench.parallel.validate import validate
    rep = validate(ops=CNN_OPS, max_layouts=2, missing=False)
    assert sorted(rep.ops) == sorted(CNN_OPS) and not rep.skipped
    assert rep.runs > 500
    assert rep.wrong == [], rep.format()


# the op table's enumeration (tests/test_op_table.py): float32, every input laid out
CONV_SAMPLES = {
    "conv1d": (lambda x, w, b: F.conv1d(x, w, b, padding=1), [X1.float(), W1.float(), B6.float()]),
    "conv2d": (lambda x, w: F.conv2d(x, w, groups=2), [X2.float(), WG.float()]),
    "conv3d": (lambda x, w: F.conv3d(x, w), [X3.float(), W3.float()]),
    "convolution": (lambda x, w: torch.convolution(x, w, None, [2, 2], [0, 0], [1, 1], False,
                                                   [0, 0], 1), [X2.float(), W2.float()]),
    "max_pool1d": (lambda x: F.max_pool1d(x, 2), [X1.float()]),
    "max_pool2d": (lambda x: F.max_pool2d(x, 3, 2, 1), [X2.float()]),
    "avg_pool1d": (lambda x: F.avg_pool1d(x, 3, 2), [X1.float()]),
    "avg_pool2d": (lambda x: F.avg_pool2d(x, 2), [X2.float()]),
    "adaptive_avg_pool1d": (lambda x: F.adaptive_avg_pool1d(x, 2), [X1.float()]),
    "adaptive_avg_pool2d": (lambda x: F.adaptive_avg_pool2d(x, 1), [X2.float()]),
    "batch_norm": (lambda x, w: F.batch_norm(x, None, None, w, None, True), [X2.float(),
                                                                              C4A.float()]),
    "group_norm": (lambda x: F.group_norm(x, 2), [X2.float()]),
    "instance_norm": (lambda x: F.instance_norm(x), [X1.float()]),
}


@pytest.mark.slow
def test_on_torch_distributed_too(tmp_path_factory):
    # one process per rank (gloo): batch norm's all-reduces are the process group's
    from tests.torchrun_support import json_rows, two_proc
    out, text = two_proc(tmp_path_factory, "cnn_check.py")      # one launch: 2-process checks
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json_rows(text)
    assert len(rows) == 2 and all(all(v for key, v in r.items() if key != "rank")
                                  for r in rows), rows
