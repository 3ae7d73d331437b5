"""User-trial audit (auditd2s): dynamic-to-static (``wb.compile``) and pipeline parallelism
(``wb.schedules.run_pipeline``) with a user's own modules, held to one device.
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import workbench as wb

S = wb.schedules
R, Sh = wb.Replicate(), wb.Shard


# ---- pipeline: a user's nn.Sequential cut into stages ----------------------------------

def _data(rows=8, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, d, generator=g), torch.randn(rows, d, generator=g)


def _one_device(mods, X, T):
    ref = nn.Sequential(*copy.deepcopy(mods))
    loss = F.mse_loss(ref(X), T)
    loss.backward()
    return loss.item(), ref


def _pipeline(sched, mods, X, T, m, mesh_size=1, place=R, split_params=True):
    """Run ``mods`` (one module per layer-stage) under ``sched``; stage meshes of
    ``mesh_size`` ranks, micro-batches laid out as ``place``."""
    p = sched.p
    meshes = [wb.Mesh([r * mesh_size + i for i in range(mesh_size)], ["dp"]) for r in range(p)]
    stages = [wb.parallelize(mod, meshes[sched.placement(s, 0)[0]])
              for s, mod in enumerate(mods)]
    last = meshes[sched.placement(len(mods) - 1, 0)[0]]
    xs = [wb.shard_tensor(c, meshes[0], [place]) for c in X.chunk(m)]
    ts = [wb.shard_tensor(c, last, [place]) for c in T.chunk(m)]
    run = S.run_pipeline(sched, stages, meshes, xs, lambda out, i: F.mse_loss(out, ts[i]),
                         params=[list(st.parameters()) for st in stages] if split_params
                         else None)
    return run, stages


def _assert_one_devices_grads(stages, ref):
    got = [q for st in stages for q in st.parameters()]
    want = list(ref.parameters())
    assert len(got) == len(want)
    for q, w in zip(got, want):
        if w.grad is None:                       # frozen: no gradient, as one device
            assert q.grad is None
        else:
            torch.testing.assert_close(q.grad.full(), w.grad, atol=1e-6, rtol=1e-5)


def _relu_stage():
    torch.manual_seed(0)
    return [nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)]


def _frozen_middle():
    torch.manual_seed(0)
    mods = [nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)]
    mods[1].requires_grad_(False)
    return mods


def _frozen_first():
    torch.manual_seed(0)
    mods = [nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)]
    mods[0].requires_grad_(False)
    return mods


@pytest.mark.parametrize("make", [_relu_stage, _frozen_middle, _frozen_first],
                         ids=["parameterless", "frozen-middle", "frozen-first"])
@pytest.mark.parametrize("schedule", ["zb_h1", "1f1b"])
def test_pipeline_stage_without_trainable_parameters(make, schedule):
    # A stage without trainable parameters (an activation on its own, a frozen block):
    # ZB-H1's W ran torch.autograd.backward(inputs=[]) ("`inputs` argument to
    # `backward()` cannot be empty") or into the frozen weights ("can't retain_grad on
    # Tensor that has requires_grad=False"); a frozen first stage fed data has an output
    # without grad_fn and 1F1B's B raised ("element 0 of tensors does not require grad").
    # One device trains such a model: W now computes the trainable weights' gradients
    # (none: the graph is freed) and a stage nothing behind trains is not backpropagated.
    mods = make()
    X, T = _data()
    want, ref = _one_device(mods, X, T)
    sched = S.zb_h1(3, 4) if schedule == "zb_h1" else S.one_f_one_b(3, 4)
    run, stages = _pipeline(sched, copy.deepcopy(mods), X, T, 4)
    assert run.loss == pytest.approx(want, rel=1e-6)
    _assert_one_devices_grads(stages, ref)


def test_pipeline_zb_v_with_an_activation_stage():
    torch.manual_seed(0)
    mods = [nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Linear(4, 4)]
    X, T = _data()
    want, ref = _one_device(mods, X, T)
    run, stages = _pipeline(S.zb_v(2, 4), copy.deepcopy(mods), X, T, 4)
    assert run.loss == pytest.approx(want, rel=1e-6)
    _assert_one_devices_grads(stages, ref)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
def test_pipeline_micro_batches_uneven_over_a_stages_data_parallel_ranks(schedule):
    # 10 rows in m = 2 micro-batches of 5, each sharded over a 2-rank stage mesh (3 + 2
    # rows): the backward raised NotImplementedError ("uneven stage outputs: use a batch
    # that divides the mesh"; 10 does) after the last stage had accumulated its gradients.
    # Uneven shards are DistTensor's torch.chunk layout everywhere else: the backward now
    # seeds each shard's own gradient.
    torch.manual_seed(0)
    mods = [nn.Linear(4, 4), nn.Linear(4, 4)]
    X, T = _data(rows=10)
    want, ref = _one_device(mods, X, T)
    sched = {"gpipe": S.gpipe, "1f1b": S.one_f_one_b, "zb_h1": S.zb_h1}[schedule](2, 2)
    run, stages = _pipeline(sched, copy.deepcopy(mods), X, T, 2, mesh_size=2, place=Sh(0))
    assert run.loss == pytest.approx(want, rel=1e-6)
    _assert_one_devices_grads(stages, ref)


def _two_stages():
    meshes = [wb.Mesh([r], ["pp"]) for r in range(2)]
    torch.manual_seed(0)
    stages = [wb.parallelize(nn.Linear(4, 4), meshes[0]),
              wb.parallelize(nn.Linear(4, 4), meshes[1])]
    X, T = _data()
    xs = [wb.shard_tensor(c, meshes[0], [R]) for c in X.chunk(4)]
    ts = [wb.shard_tensor(c, meshes[1], [R]) for c in T.chunk(4)]
    return stages, meshes, xs, ts


@pytest.mark.parametrize("forward_only", [False, True])
@pytest.mark.parametrize("bad,err,match", [
    (lambda o, t: F.mse_loss(o, t, reduction="none"), ValueError, r"shape \(2, 4\).*reduction='mean'"),
    (lambda o, t: 1.0, TypeError, "returned a float.*one-element tensor")],
    ids=["per-sample", "float"])
def test_pipeline_loss_fn_must_return_one_number(forward_only, bad, err, match):
    # A per-sample loss (reduction="none") raised torch's "only one element tensors can
    # be converted to Python scalars" from inside the executor; a Python float an
    # AttributeError ('float' object has no attribute 'detach'). Both now name loss_fn,
    # what it returned and the fix, before any backward ran.
    stages, meshes, xs, ts = _two_stages()
    with pytest.raises(err, match=match):
        S.run_pipeline(S.one_f_one_b(2, 4), stages, meshes, xs,
                       lambda out, i: bad(out, ts[i]), forward_only=forward_only)
    assert all(q.grad is None for st in stages for q in st.parameters())


def test_pipeline_stage_returning_a_tuple_names_the_tuple():
    # the refusal said "parallelize each stage's module on its mesh": it was parallelized
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x)
            return y, y * 2
    stages, meshes, xs, ts = _two_stages()
    stages[0] = wb.parallelize(Two(), meshes[0])
    with pytest.raises(TypeError, match="stages\\[0\\] returned a tuple of 2.*one DistTensor"):
        S.run_pipeline(S.one_f_one_b(2, 4), stages, meshes, xs,
                       lambda out, i: F.mse_loss(out, ts[i]))


# ---- dynamic to static: wb.compile on ordinary user programs ---------------------------

def test_compile_a_draw_from_a_torch_generator_runs_eagerly():
    # torch.export lifts a torch.Generator the program draws from into its constants, and
    # capture read it as a tensor: AttributeError "'torch._C.Generator' object has no
    # attribute 'is_meta'" out of wb.compile. It is a random draw: a graph break that
    # names it, and the program runs eagerly with one device's values.
    mesh = wb.Mesh.grid((2,))
    gen = torch.Generator()

    def noisy(t):                   # a random scale, one per call
        return t * torch.rand((), generator=gen)

    x = wb.shard_tensor(torch.randn(4, 6), mesh, [Sh(0)])
    prog = wb.compile(noisy, x)
    assert prog.eager and "random" in str(prog)
    gen.manual_seed(0)
    got = prog(x).full()
    gen.manual_seed(0)
    torch.testing.assert_close(got, noisy(x.full()))


def test_compile_captures_dot_T_and_mT():
    # x @ w.T, the commonest spelling of a linear, was a graph break ("getset_descriptor.
    # __get__ has no entry in the op table"): the whole program ran eagerly. .T is the
    # permute DistTensor.T runs, .mT the transpose of the last two dims.
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(5, 6))
            self.v = nn.Parameter(torch.randn(3, 4, 5))

        def forward(self, x):
            return (x @ self.w.T) @ self.v.mT.sum(0)

    torch.manual_seed(0)
    ref = M()
    m = wb.parallelize(copy.deepcopy(ref), wb.Mesh.grid((2,)), {"w": ["S(0)"]})
    xp = torch.randn(4, 6)
    x = wb.shard_tensor(xp, wb.Mesh.grid((2,)), [R])
    for method in ("auto", "trace"):
        m.zero_grad()
        prog = wb.compile(m, x, method=method)
        assert not prog.eager, str(prog)
        prog(x).sum().backward()
        r = copy.deepcopy(ref)
        r(xp).sum().backward()
        torch.testing.assert_close(prog(x).full(), r(xp))
        torch.testing.assert_close(m.w.grad.full(), r.w.grad)
        torch.testing.assert_close(m.v.grad.full(), r.v.grad)


def test_compile_an_error_on_meta_tensors_names_the_users_line():
    # a shape error met while capturing was reported as "graph break at ?:0"
    def bad(a, b):
        h = a * 2
        return h @ b            # (4, 6) @ (5, 3)

    x = wb.shard_tensor(torch.randn(4, 6), wb.Mesh.grid((2,)), [Sh(0)])
    prog = wb.compile(bad, x, torch.randn(5, 3))
    brk = prog.breaks[0]
    assert brk.line == bad.__code__.co_firstlineno + 2 and "h @ b" in str(prog)
    with pytest.raises(RuntimeError):           # eager's own error when it runs
        prog(x, torch.randn(5, 3))


class _Attention(nn.Module):
    def __init__(self, d=16, h=2, seq=8):
        super().__init__()
        self.h = h
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.register_buffer("mask", torch.ones(seq, seq, dtype=torch.bool).triu(1))

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = (t.view(B, T, self.h, D // self.h).transpose(1, 2)
                   for t in self.qkv(x).split(D, -1))
        s = (q @ k.transpose(-2, -1)) * (D // self.h) ** -0.5
        return torch.softmax(s.masked_fill(self.mask, float("-inf")), -1) @ v


@pytest.mark.parametrize("change", ["fill_", "replace"])
def test_compile_fused_attention_refuses_a_changed_mask(change):
    # O1's fusion pass turns softmax(q k^T * d^-0.5 masked by the causal buffer) @ v into
    # flash_attention(causal=True) and the graph no longer reads the buffer: after
    # model.mask.fill_(False) (bidirectional) or a new mask, the compiled program kept
    # computing causal attention, 1.556 off eager; O0 followed the buffer. Now refused.
    torch.manual_seed(0)
    m = _Attention()
    xp = torch.randn(2, 8, 16)
    x = wb.shard_tensor(xp, wb.Mesh.grid((2,)), [Sh(0)])
    prog = wb.compile(m, x, level="O1")
    assert "attention x1" in prog.passes()
    torch.testing.assert_close(prog(x).full(), m(xp), atol=1e-6, rtol=1e-5)
    m.mask = torch.ones(8, 8, dtype=torch.bool).triu(1)      # the same mask: still runs
    torch.testing.assert_close(prog(x).full(), m(xp), atol=1e-6, rtol=1e-5)
    if change == "fill_":
        m.mask.fill_(False)
    else:
        m.mask = torch.ones(8, 8, dtype=torch.bool).tril(-1)
    with pytest.raises(ValueError, match="'mask' was a causal mask.*compile again"):
        prog(x)
    o0 = wb.compile(m, x, level="O0")                          # O0 reads the buffer
    torch.testing.assert_close(o0(x).full(), m(xp))


_MASK = torch.ones(8, 8, dtype=torch.bool).triu(1)


def _attend(q, k, v):
    s = (q @ k.transpose(-2, -1)) * 4 ** -0.5
    return torch.softmax(s.masked_fill(_MASK, float("-inf")), -1) @ v


def test_compile_fused_attention_refuses_a_changed_global_mask():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 8, 4, generator=g) for _ in range(3))
    mesh = wb.Mesh.grid((2,))
    qd, kd, vd = (wb.shard_tensor(t, mesh, [Sh(0)]) for t in (q, k, v))
    prog = wb.compile(_attend, qd, kd, vd, level="O1")
    assert "attention x1" in prog.passes()
    torch.testing.assert_close(prog(qd, kd, vd).full(), _attend(q, k, v), atol=1e-6, rtol=1e-5)
    try:
        _MASK.fill_(False)
        with pytest.raises(ValueError, match="causal mask.*compile again"):
            prog(qd, kd, vd)
    finally:
        _MASK.copy_(torch.ones(8, 8, dtype=torch.bool).triu(1))


def _rms(eps_add=None, mean_dtype=None):
    def norm(a, w):
        m = a.pow(2).mean(-1, keepdim=True, dtype=mean_dtype)
        return a * torch.rsqrt(eps_add(m) if eps_add else m + 1e-6) * w
    return norm


def _att(softmax_dtype=None):
    def att(q, k, v):
        return torch.softmax((q @ k.transpose(-2, -1)) * 0.5, -1, dtype=softmax_dtype) @ v
    return att


_G = torch.Generator().manual_seed(0)
_X = torch.randn(4, 6, generator=_G)
_W = torch.linspace(0.5, 1.5, 6)
_Q = torch.randn(2, 2, 8, 4, generator=_G)
NEAR_MISSES = {
    # the RMSNorm pattern with eps added by add(..., alpha=1000): the fused op added eps
    # alone (0.0029 off); a mean taken in float64: float32 came back (eager: float64)
    "rms-add-alpha": (_rms(eps_add=lambda m: torch.add(m, 1e-6, alpha=1000.0)), (_X, _W)),
    "rms-mean-float64": (_rms(mean_dtype=torch.float64), (_X, _W)),
    # bfloat16 activations by a float32 norm weight (eager promotes to float32): compile
    # raised rms_norm's "inputs must share one dtype"
    "rms-bf16-x-fp32-w": (_rms(), (_X.bfloat16(), _W)),
    # softmax(..., dtype=float64) @ a float64 v: compile raised flash_attention's
    # "inputs must share one dtype"
    "attention-softmax-float64": (_att(torch.float64), (_Q, _Q, _Q.double())),
}


@pytest.mark.parametrize("name", list(NEAR_MISSES))
def test_compile_fusion_leaves_near_misses_alone(name):
    fn, args = NEAR_MISSES[name]
    mesh = wb.Mesh.grid((2,))
    dargs = [wb.shard_tensor(a, mesh, [Sh(0)]) if a.dim() > 1 else a for a in args]
    prog = wb.compile(fn, *dargs, level="O1")
    assert "nothing to fuse" in prog.passes()
    got, want = prog(*dargs).full(), fn(*args)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want)


def test_compile_a_broken_modules_child_refusal_names_the_module_compiled():
    # a module whose forward breaks runs eagerly and calls its compiled children; a batch
    # of another size was refused as "compiled program (Linear) ... compile it again": a
    # Linear the user never compiled. The refusal names the child and the module to compile.
    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.out = nn.Linear(4, 2)

        def forward(self, x):
            h = self.lin(x)
            if h.abs().amax() > 100:          # a graph break
                h = h / 2
            return self.out(h)

    torch.manual_seed(0)
    m = Gate()
    mesh = wb.Mesh.grid((2,))
    prog = wb.compile(m, wb.shard_tensor(torch.randn(4, 4), mesh, [Sh(0)]))
    assert prog.eager and set(prog.parts) == {"lin", "out"}
    x6 = wb.shard_tensor(torch.randn(6, 4), mesh, [Sh(0)])
    with pytest.raises(ValueError, match="the child 'lin' of Gate.*compile Gate again"):
        prog(x6)


@pytest.mark.parametrize("form", ["tuple", "dict"])
def test_pipeline_first_stage_taking_several_inputs(form):
    # run_pipeline's inputs are "whatever stage 0 accepts": a (features, mask) pair or a
    # dict raised AttributeError "'tuple' object has no attribute 'shape'" (the keyed
    # dropout rows read inputs[i].shape). The rows are the first tensor's.
    torch.manual_seed(0)
    mods = [nn.Linear(4, 4), nn.Linear(4, 4)]
    X, T = _data()
    M = (torch.arange(32).reshape(8, 4) % 3 != 0).float()
    ref = nn.Sequential(*copy.deepcopy(mods))
    want = F.mse_loss(ref[1](ref[0](X) * M), T)
    want.backward()
    meshes = [wb.Mesh([r], ["pp"]) for r in range(2)]
    s0, s1 = (wb.parallelize(copy.deepcopy(m), meshes[i]) for i, m in enumerate(mods))
    pairs = [(wb.shard_tensor(a, meshes[0], [R]), wb.shard_tensor(b, meshes[0], [R]))
             for a, b in zip(X.chunk(4), M.chunk(4))]
    if form == "tuple":
        xs, first = pairs, (lambda xm: s0(xm[0]) * xm[1])
    else:
        xs, first = [{"x": a, "mask": b} for a, b in pairs], (lambda d: s0(d["x"]) * d["mask"])
    ts = [wb.shard_tensor(c, meshes[1], [R]) for c in T.chunk(4)]
    run = S.run_pipeline(S.one_f_one_b(2, 4), [first, s1], meshes, xs,
                         lambda out, i: F.mse_loss(out, ts[i]))
    assert run.loss == pytest.approx(want.item(), rel=1e-6)
    _assert_one_devices_grads([s0, s1], ref)


def _fn_stages(bias=True):
    meshes = [wb.Mesh([r], ["pp"]) for r in range(2)]
    torch.manual_seed(0)
    mods = [nn.Linear(4, 4, bias=bias), nn.Linear(4, 4, bias=bias)]
    ref = nn.Sequential(*copy.deepcopy(mods))
    st = [wb.parallelize(copy.deepcopy(m), meshes[i]) for i, m in enumerate(mods)]
    X, T = _data()
    xs = [wb.shard_tensor(c, meshes[0], [R]) for c in X.chunk(4)]
    ts = [wb.shard_tensor(c, meshes[1], [R]) for c in T.chunk(4)]
    return ref, st, meshes, xs, ts, X, T


@pytest.mark.parametrize("as_functions", [True, False], ids=["functions", "modules"])
def test_pipeline_split_backward_params_flat_list_is_refused(as_functions):
    # params=[every parameter] (one flat list, not one list per stage) with a stage of one
    # weight each: function stages trained silently with no gradient at all (W walked a
    # DistTensor as its weights); module stages raised "params[0] leaves out ['weight']"
    # about the weight the user had given
    ref, st, meshes, xs, ts, X, T = _fn_stages(bias=False)
    stages = [(lambda x, s=s: s(x)) for s in st] if as_functions else st
    flat = [q for s in st for q in s.parameters()]
    with pytest.raises(TypeError, match=r"params\[0\] is a DistTensor, not a list.*one list "
                                        "per stage"):
        S.run_pipeline(S.zb_h1(2, 4), stages, meshes, xs,
                       lambda out, i: F.mse_loss(out, ts[i]), params=flat)
    assert all(q.grad is None for q in flat)


def test_pipeline_split_backward_function_stage_weight_left_out_is_refused():
    # a function stage's params that leave out its bias: W computed the weights only and
    # the biases silently got no gradient (one device's are nonzero); now refused at the
    # stage's first forward, before any backward
    ref, st, meshes, xs, ts, X, T = _fn_stages()
    stages = [(lambda x, s=s: s(x)) for s in st]
    with pytest.raises(ValueError, match=r"stages\[0\] computes with 1 trainable tensor.*"
                                         r"add them to params\[0\]"):
        S.run_pipeline(S.zb_h1(2, 4), stages, meshes, xs,
                       lambda out, i: F.mse_loss(out, ts[i]), params=[[s.weight] for s in st])
    assert all(q.grad is None for s in st for q in s.parameters())
    # listed whole, the function stages train as one device
    F.mse_loss(ref(X), T).backward()
    S.run_pipeline(S.zb_h1(2, 4), stages, meshes, xs, lambda out, i: F.mse_loss(out, ts[i]),
                   params=[list(s.parameters()) for s in st])
    _assert_one_devices_grads(st, ref)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb_h1", "zb_v", "interleaved"])
def test_pipeline_zero_costs_order_runs(schedule):
    # run_pipeline(costs=dict(f=0, b=0)) (simulate takes costs >= 0) raised KeyError (0, 0):
    # every simulated start was 0 and the order sorted by start ran rank 0's B0 before the
    # gradient it needs. The order is now the starts' order, each action after what it needs
    # (the same order as before wherever actions take time).
    torch.manual_seed(0)
    v = 2 if schedule in ("zb_v", "interleaved") else 1
    mods = [nn.Linear(4, 4) for _ in range(2 * v)]
    X, T = _data()
    want, ref = _one_device(mods, X, T)
    sched = {"1f1b": S.one_f_one_b, "gpipe": S.gpipe, "zb_h1": S.zb_h1, "zb_v": S.zb_v,
             "interleaved": lambda p, m: S.interleaved_1f1b(p, m, 2)}[schedule](2, 4)
    meshes = [wb.Mesh([r], ["pp"]) for r in range(2)]
    stages = [wb.parallelize(mod, meshes[sched.placement(s, 0)[0]])
              for s, mod in enumerate(copy.deepcopy(mods))]
    last = meshes[sched.placement(len(mods) - 1, 0)[0]]
    xs = [wb.shard_tensor(c, meshes[0], [R]) for c in X.chunk(4)]
    ts = [wb.shard_tensor(c, last, [R]) for c in T.chunk(4)]
    run = S.run_pipeline(sched, stages, meshes, xs, lambda out, i: F.mse_loss(out, ts[i]),
                         params=[list(st.parameters()) for st in stages],
                         costs=dict(f=0.0, b=0.0, w=0.0) if sched.split_backward
                         else dict(f=0.0, b=0.0))
    assert run.loss == pytest.approx(want, rel=1e-6)
    _assert_one_devices_grads(stages, ref)


def test_simulate_a_string_cost_is_refused():
    # simulate(f="12") read the string as a list: per-rank costs 1.0 and 2.0, silently
    # (f="1" was refused as "<list of 1>" needing p entries)
    sched = S.one_f_one_b(2, 4)
    for bad in ("12", "1"):
        with pytest.raises(ValueError, match="give a number"):
            S.simulate(sched, f=bad)
    assert S.simulate(sched, f=[1, 2]).makespan == S.simulate(sched, f=[1.0, 2.0]).makespan


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-v"])
@pytest.mark.parametrize("frozen", ["tok_emb", "layers.0"])
def test_hybrid_zero_bubble_with_frozen_parameters_as_one_device(schedule, frozen):
    # fine-tuning habit: model.<part>.requires_grad_(False) before build_optimizer. With a
    # split backward (zb-h1, zb-v) the recipe's W backpropagated into the frozen weights:
    # RuntimeError "can't retain_grad on Tensor that has requires_grad=False"
    from workbench.models import build_model, get_batch, get_config
    from workbench.recipes.hybrid import Hybrid
    cfg = get_config("tiny").replace(n_layer=4)
    ref = build_model(cfg, seed=0).train()
    st = Hybrid(pp=2, schedule=schedule)
    model = st.build_model(cfg, 0)
    for m in (ref, model):
        for n, q in m.named_parameters():
            if n.startswith(frozen):
                q.requires_grad_(False)
    opts = st.build_optimizer(model, 3e-3, 0.0)
    x, y = get_batch(cfg, 8, 0, 0)
    want = ref(x, y)[1]
    want.backward()
    got = st.forward_backward(model, x, y)
    st.finish_gradient_synchronization(opts)
    assert float(got) == pytest.approx(want.item(), rel=1e-6)
    grads = dict(model.named_parameters())
    for n, q in ref.named_parameters():
        g = grads[n].grad
        if q.grad is None:
            assert g is None, n
        else:
            torch.testing.assert_close(g.full() if isinstance(g, wb.DistTensor) else g,
                                       q.grad, atol=1e-6, rtol=1e-5, msg=n)


def test_compile_a_library_error_on_meta_tensors_names_the_users_call():
    # wb.plan_reshard inside the program raises on capture's meta tensors: the break was
    # "at ?:0"; it names the user's call, not workbench's own raise (wb.reshard was the
    # example here; it is captured since compile15, tests/test_compile15.py)
    mesh = wb.Mesh.grid((2,))

    def f(a):
        n = wb.plan_reshard(a * 2, mesh, [R]).total_bytes
        return a.relu() * n

    x = wb.shard_tensor(torch.randn(4, 6), mesh, [Sh(0)])
    prog = wb.compile(f, x)
    assert prog.eager and prog.breaks[0].line == f.__code__.co_firstlineno + 1
    assert "wb.plan_reshard(a * 2" in str(prog)
    torch.testing.assert_close(prog(x).full(), f(x).full())


def test_pipeline_stage_meshes_of_two_shapes_are_refused():
    # a 2-rank first stage sending to a 1-rank last stage: the values arrived, but the
    # trace recorded only rank 0's send (0 -> 2) and gradient (2 -> 0): rank 1's shard moved
    # for free on the clock. Stage meshes must share one shape (as under torch.distributed).
    torch.manual_seed(0)
    meshes = [wb.Mesh([0, 1], ["dp"]), wb.Mesh([2], ["dp"])]
    st = [wb.parallelize(nn.Linear(4, 4), meshes[i]) for i in range(2)]
    X, T = _data()
    xs = [wb.shard_tensor(c, meshes[0], [Sh(0)]) for c in X.chunk(2)]
    ts = [wb.shard_tensor(c, meshes[1], [Sh(0)]) for c in T.chunk(2)]
    with pytest.raises(ValueError, match=r"meshes\[1\] has shape \(1,\) and meshes\[0\] \(2,\)"):
        S.run_pipeline(S.one_f_one_b(2, 2), st, meshes, xs, lambda out, i: F.mse_loss(out, ts[i]))
    with pytest.raises(TypeError, match=r"meshes\[0\] is a int"):
        S.run_pipeline(S.one_f_one_b(2, 2), st, [0, 1], xs, lambda out, i: F.mse_loss(out, ts[i]))
