"""Review of the library changes merged since 4568877 (reviewer revD): custom
``torch.autograd.Function`` on DistTensors, ``torch.autocast``, DDP's replica writes, FSDP's
reduce_dtype, the compile search.

Each test named for a defect failed before its fix (named in its docstring); each result
is held to plain torch's."""
import pytest
import torch

import workbench as wb
from workbench import Replicate, Shard
from tests.test_ddp_writes import write_then_scale_matches

BF = torch.bfloat16


def _x(shape, seed=0, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# ---- custom Function: a forward with a non-tensor output ---------------------------------

class _ScaleAndCount(torch.autograd.Function):
    """Returns (2 x, the number of elements): torch passes None to backward for the int."""

    @staticmethod
    def forward(ctx, x):
        return x * 2, x.numel()

    @staticmethod
    def backward(ctx, g, g_count):
        assert g_count is None, g_count
        return g * 2


@pytest.mark.parametrize("kind", ["S0", "R"])
def test_custom_function_backward_gets_none_for_a_non_tensor_output(kind):
    """custom_function._Bridge.backward passed the user's backward one gradient per
    DistTensor / tensor output only: a forward returning (tensor, int) got backward(ctx, g)
    and raised TypeError 'missing 1 required positional argument' where torch passes
    (g, None) (torch.autograd.Function.backward's docs)."""
    mesh = wb.Mesh.grid((2,))
    x = _x((5, 3))
    xr = x.clone().requires_grad_()
    yr, nr = _ScaleAndCount.apply(xr)
    (yr * yr).sum().backward()
    d = wb.shard_tensor(x, mesh, [Shard(0) if kind == "S0" else Replicate()]).requires_grad_()
    y, n = _ScaleAndCount.apply(d)
    assert n == nr == 15
    (y * y).sum().backward()
    torch.testing.assert_close(d.grad.full(), xr.grad)


# ---- autocast: in-place and out= ops are not autocast ------------------------------------

_M1, _M2, _A = _x((3, 4), 1), _x((4, 3), 2), _x((3, 3), 3)
_WRITES = {
    "addmm_": lambda f: f(_A.clone()).addmm_(f(_M1), f(_M2)),
    "baddbmm_": lambda f: f(_A.expand(2, 3, 3).contiguous()).baddbmm_(
        f(_M1.expand(2, 3, 4).contiguous()), f(_M2.expand(2, 4, 3).contiguous())),
    "addbmm_": lambda f: f(_A.clone()).addbmm_(f(_M1.expand(2, 3, 4).contiguous()),
                                               f(_M2.expand(2, 4, 3).contiguous())),
    "mm(out=)": lambda f: (lambda o: (torch.mm(f(_M1), f(_M2), out=o), o)[1])(
        f(torch.zeros(3, 3))),
    "matmul(out=)": lambda f: (lambda o: (torch.matmul(f(_M1), f(_M2), out=o), o)[1])(
        f(torch.zeros(3, 3))),
}


@pytest.mark.parametrize("name", list(_WRITES))
def test_in_place_and_out_matmuls_are_not_autocast(name):
    """dispatch._writes computed an in-place method (x.addmm_) or an out= call by its
    out-of-place op, which the autocast hook cast to bfloat16: the float32 result held
    bfloat16-rounded values (0.2500 where torch gives 0.2507).  torch.autocast casts
    out-of-place ops only ('In-place variants and calls that explicitly supply an out=...
    Tensor ... won't go through autocasting', torch.amp docs)."""
    mesh = wb.Mesh.grid((2,))
    fn = _WRITES[name]
    with torch.autocast("cpu", dtype=BF):
        ref = fn(lambda t: t)
        got = fn(lambda t: wb.shard_tensor(t, mesh, [Replicate()]))
    assert got.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(got.full(), ref)


# ---- autocast: cat / stack's promote policy ------------------------------------------------

@pytest.mark.parametrize("dtypes", [(torch.float16,), (torch.float16, torch.float32),
                                    (torch.float16, torch.float64)])
def test_promote_of_a_float16_under_bfloat16_autocast_raises_as_torch(dtypes):
    """autocast.cast_args promoted cat / stack's inputs to their widest dtype, so a
    float16 input under bfloat16 autocast gave a result (float32, or float16) where torch
    raises 'Unexpected floating ScalarType in at::autocast::prioritize' (its promote
    starts at the autocast dtype, ignores float64, prefers float32, and refuses another
    lower-precision dtype)."""
    mesh = wb.Mesh.grid((2,))
    ts = [torch.ones(2, 3, dtype=d) for d in dtypes]
    with torch.autocast("cpu", dtype=BF):
        with pytest.raises(RuntimeError, match="prioritize"):
            torch.cat(ts)
        with pytest.raises(RuntimeError, match=r"cat\(\).*float16.*autocast"):
            torch.cat([wb.shard_tensor(t, mesh, [Replicate()]) for t in ts])
    assert all(t.dtype == d for t, d in zip(ts, dtypes))          # inputs untouched


@pytest.mark.parametrize("dtypes", [(BF, torch.float64), (torch.float32, torch.float64),
                                    (BF, torch.float32), (BF, BF)])
def test_promote_keeps_torchs_dtypes_and_values(dtypes):
    mesh = wb.Mesh.grid((2,))
    ts = [_x((2, 3), k).to(d) for k, d in enumerate(dtypes)]
    for op in (torch.cat, torch.stack):
        with torch.autocast("cpu", dtype=BF):
            ref = op(ts)
            got = op([wb.shard_tensor(t, mesh, [Replicate()]) for t in ts])
        assert got.dtype == ref.dtype
        torch.testing.assert_close(got.full(), ref)


# ---- DDP replica writes: a step that raised ------------------------------------------------

def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.GELU(), torch.nn.Linear(6, 2))


def test_ddp_write_then_parameter_write_after_a_step_that_raised():
    """replica_writes._STEPPING was set by the step pre-hook and cleared by the post-hook
    only: a step that raised (its closure, a KeyboardInterrupt) left it set for good, so
    before_write no longer synced a pending state-dict row write and the next forward
    raised 'rows [0, 1] changed' for ``sd[k].fill_(1); p.mul_(0.5)``, which torch runs."""
    mesh = wb.Mesh.grid(2, ["dp"])
    w, ref = wb.DistributedDataParallel(_mlp(), mesh), _mlp()
    opt = torch.optim.SGD(w.parameters(), lr=0.1)

    def closure():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        opt.step(closure)
    x = _x((6, 4), 5)
    w(wb.shard_tensor(x, mesh, [Shard(0)]))              # a forward after the failed step
    write_then_scale_matches(w, ref, x, mesh)


# ---- torch.optim optimizers that are not elementwise, over DDP's rows / FSDP's chunks -----

_X = _x((6, 4), 5)


def _train(wrap, make_opt, steps=3):
    """(the wrapper's output after ``steps`` closure steps of ``make_opt``, one device's)."""
    mesh = wb.Mesh.grid(2, ["dp"])
    w = (wb.DistributedDataParallel if wrap == "ddp" else wb.FullyShardedDataParallel)(
        _mlp(), mesh)
    ref = _mlp()
    xs = wb.shard_tensor(_X, mesh, [Shard(0)])
    for mod, x in ((w, xs), (ref, _X)):
        opt = make_opt(mod.parameters())

        def closure():
            opt.zero_grad()
            loss = (mod(x) ** 2).mean()
            loss.backward()
            return loss.full() if isinstance(loss, wb.DistTensor) else loss
        for _ in range(steps):
            opt.step(closure)
    return w(xs).full(), ref(_X)


@pytest.mark.parametrize("wrap, opt", [("ddp", "LBFGS"), ("fsdp", "Adafactor"),
                                       ("fsdp", "LBFGS")])
def test_an_optimizer_reading_a_whole_parameter_is_refused_on_its_laid_out_storage(wrap, opt):
    """torch.optim.LBFGS over DDP's rows ((N, *shape): its flat gradient and dot products
    counted every replica, the first step's 1 / |g|_1 N times too small) and Adafactor
    over FSDP's chunks ((N, chunk): a 2-d matrix to it, its second moment factored across
    the ranks' chunks) trained silently away from one device (by 1e-2 and 7e-2 after three
    steps); both now refuse before the step changes anything."""
    make = {"LBFGS": lambda ps: torch.optim.LBFGS(ps, lr=0.5, max_iter=3),
            "Adafactor": lambda ps: torch.optim.Adafactor(ps, lr=0.1)}[opt]
    with pytest.raises(NotImplementedError, match=rf"torch.optim.{opt}.*elementwise"):
        _train(wrap, make)


@pytest.mark.parametrize("wrap, opt", [("ddp", "Adafactor"), ("ddp", "AdamW"),
                                       ("fsdp", "Rprop")])
def test_optimizers_exact_on_the_laid_out_storage_still_train_as_one_device(wrap, opt):
    # Adafactor on DDP's equal rows: each row's factored moments are one device's (LBFGS on
    # FSDP's chunks is refused since p.numel() reads the module's: laid_out._WHOLE)
    make = {"LBFGS": lambda ps: torch.optim.LBFGS(ps, lr=0.5, max_iter=3),
            "Adafactor": lambda ps: torch.optim.Adafactor(ps, lr=0.1),
            "AdamW": lambda ps: torch.optim.AdamW(ps, lr=0.1),
            "Rprop": lambda ps: torch.optim.Rprop(ps, lr=0.1)}[opt]
    got, ref = _train(wrap, make)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


# ---- wb.compile: a kernel's launch priced on its dtype's path -----------------------------

class _MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


@pytest.mark.parametrize("level", ["O0", "O1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_compiled_step_prices_the_launches_the_run_records(dtype, level):
    """schedule.replay (and, since kernels.py, the whole-graph search's estimate) priced
    every launch at float32's launch overhead: on ascend-910b float64 runs on the AI CPU
    path (profile slow_paths.float64, 50 us a launch), so a float64 MLP's step was priced
    41 us of compute where its run records 401 us (eight kernels, 45 us short each)."""
    prof = "ascend-910b"
    torch.manual_seed(0)
    m = _MLP().to(dtype)
    mesh = wb.Mesh.grid((2,), ("dp",))
    x = wb.shard_tensor(_x((8, 16), dtype=dtype), mesh, [Shard(0)])
    prog = wb.compile(m, x, level=level, profile=prof)
    step = prog.step()
    with wb.trace(profile=prof) as tr:
        prog(x).sum().backward()
    ran = sum(e.duration for e in tr.events if e.stream == "compute" and 0 in e.ranks
              and e.name != "sum")                        # the loss, outside the program
    assert step.compute == pytest.approx(ran, rel=1e-9)
    assert prog.assignment.time == pytest.approx(step.time, rel=1e-12)


# ---- load_back: the copies a DistTensor-FSDP state_dict() hands out are released ---------

def _zero3():
    from workbench.parallel.strategies.zero3 import Zero3
    m = _mlp()
    mesh = wb.Mesh.grid(2, ["dp"])
    wb.parallelize(m, mesh, {})
    return Zero3(m, mesh, "dp"), m


@pytest.mark.parametrize("via", ["wrapper", "module"])
def test_zero3_state_dict_copies_are_released_by_the_next_state_dict(via):
    """fsdp_dist_habits' state-dict hook flushed with release=False (it runs once per
    submodule) and nothing released at a new call: every state_dict() of a Zero3 /
    DistTensorFSDP model kept its gathered full copies alive until the next forward or
    step (20 copies after five calls of a 2-layer model: five models' worth)."""
    import gc
    import weakref
    z, m = _zero3()
    sd_of = z.state_dict if via == "wrapper" else m.state_dict
    sd = sd_of()
    refs = [weakref.ref(v) for v in sd.values()]
    del sd
    sd_of()
    gc.collect()
    assert all(r() is None for r in refs)
    # a one-line write is still held until it lands (the next state_dict() writes it back)
    key = next(k for k in sd_of() if k.endswith("0.weight"))
    sd_of()[key].fill_(1.5)
    got = sd_of()[key]
    assert torch.all(got.full() == 1.5)
    x = _x((6, 4), 5)
    ref = _mlp()
    ref[0].weight.data.fill_(1.5)
    mesh = wb.Mesh.grid(2, ["dp"])
    torch.testing.assert_close(z(wb.shard_tensor(x, mesh, [Shard(0)])).full(), ref(x))


# ---- DistributedDataParallel(broadcast_buffers=) over DistTensor parameters -----------------

def test_ddp_over_dist_tensor_parameters_takes_broadcast_buffers():
    """ddp.py took broadcast_buffers (True: torch's default; False refused by name) but
    wb.DistributedDataParallel builds DistTensorDDP for a wb.parallelize'd module, whose
    __init__ had no such argument: torch's default given explicitly raised TypeError
    'unexpected keyword argument'."""
    mesh = wb.Mesh.grid(2, ["dp"])
    m = _mlp()
    wb.parallelize(m, mesh, {})
    with pytest.raises(NotImplementedError, match=r"broadcast_buffers=False.*drop the argument"):
        wb.DistributedDataParallel(m, mesh, broadcast_buffers=False)
    w = wb.DistributedDataParallel(m, mesh, broadcast_buffers=True)
    x = _x((6, 4), 5)
    torch.testing.assert_close(w(wb.shard_tensor(x, mesh, [Shard(0)])).full(), _mlp()(x))


# ---- autocast: torch.trace is on torch's CPU float32 list ----------------------------------

@pytest.mark.parametrize("call", [torch.trace, lambda t: t.trace()], ids=["torch", "method"])
def test_trace_runs_in_float32_under_autocast(call):
    """trace is on torch's CPU autocast fp32 list (autocast_mode.cpp, KERNEL_CPU(trace,
    fp32)) but not on autocast.py's: a bfloat16 DistTensor's trace stayed bfloat16 where
    torch's is float32."""
    mesh = wb.Mesh.grid((2,))
    x = _x((5, 5)).to(BF)
    with torch.autocast("cpu", dtype=BF):
        ref = call(x)
        got = call(wb.shard_tensor(x, mesh, [Shard(0)]))
    assert got.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(got.full(), ref)


# ---- load_back.flush: two written copies of one parameter ----------------------------------

@pytest.mark.parametrize("which", ["fsdp", "zero3"])
def test_two_written_state_dict_copies_of_one_parameter_raise(which):
    """load_back.flush wrote back every written copy in turn: two state_dict() calls' copies
    of one parameter, each written in different rows (sd1[k][0] = 1; sd2[k][1] = 2, both
    landing in torch, whose values are views), ended with the last copy's rows only (row 0
    silently back to its old value).  Each copy holds the whole tensor, so both cannot be
    written back: it raises, nothing written; equal copies (a tied weight's two keys
    loaded alike) still land."""
    mesh = wb.Mesh.grid(2, ["dp"])
    if which == "fsdp":
        m = _mlp()
        w = wb.FullyShardedDataParallel(m, mesh)
    else:
        w, m = _zero3()
    key = next(k for k in w.state_dict() if k.endswith("0.weight"))
    before = w.state_dict()[key].full().clone()
    sd1, sd2 = w.state_dict(), w.state_dict()
    sd1[key][0] = 1.0
    sd2[key][1] = 2.0
    x = wb.shard_tensor(_x((6, 4), 5), mesh, [Shard(0)])
    with pytest.raises(RuntimeError, match=r"two state_dict\(\) values.*both written"):
        w(x)
    torch.testing.assert_close(w.state_dict()[key].full(), before)     # nothing written
    sd3, sd4 = w.state_dict(), w.state_dict()
    sd3[key].fill_(0.5)
    sd4[key].fill_(0.5)
    w(x)
    assert torch.all(w.state_dict()[key].full() == 0.5)


# ---- custom Function: a gradient of the broadcast shape is summed, as torch does ----------

class _AddBroadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y):
        return x + y

    @staticmethod
    def backward(ctx, g):
        return g, g                 # g has y's shape; torch sums it to x's (3,) / (1, 3)


@pytest.mark.parametrize("xshape", [(3,), (1, 3), (4, 1)])
@pytest.mark.parametrize("kind", ["S0", "R"])
def test_custom_function_gradient_of_a_broadcast_shape_is_summed_as_torch(xshape, kind):
    """custom_function_grads.input_grad raised 'returned an invalid gradient ... expected
    shape compatible with [3]' for a gradient of the shape the input broadcasts to, which
    torch's engine sums to the input's shape (validate_outputs: is_expandable_to, then
    sum_to)."""
    mesh = wb.Mesh.grid((2,))
    x, y = _x(xshape, 1), _x((4, 3), 2)
    xr, yr = x.clone().requires_grad_(), y.clone().requires_grad_()
    (_AddBroadcast.apply(xr, yr) * _x((4, 3), 3)).sum().backward()
    lay = [Shard(0) if kind == "S0" else Replicate()]
    dx = wb.shard_tensor(x, mesh, [Replicate()]).requires_grad_()
    dy = wb.shard_tensor(y, mesh, lay).requires_grad_()
    out = _AddBroadcast.apply(dx, dy)
    (out * wb.shard_tensor(_x((4, 3), 3), mesh, lay)).sum().backward()
    torch.testing.assert_close(dx.grad.full(), xr.grad)
    torch.testing.assert_close(dy.grad.full(), yr.grad)
    assert tuple(dx.grad.shape) == xshape
