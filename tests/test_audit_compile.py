"""User-trial audit of ``wb.compile``: programs a PyTorch user writes, compiled and run
beside the same program run eagerly on plain tensors (one device): values, gradients,
the result's structure, and what is refused (with the fix) where the graph would
silently differ from eager."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import workbench as wb

R, S = wb.Replicate, wb.Shard
PROFILE = "a100"


def _x(shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _full(t):
    return t.full() if isinstance(t, wb.DistTensor) else t


def _close_tree(got, want):
    """Same structure (types, keys) and values."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, (torch.Tensor, wb.DistTensor)), type(got)
        torch.testing.assert_close(_full(got), want)
        return
    assert type(got) is type(want), (type(got), type(want))
    if isinstance(want, dict):
        assert list(got) == list(want)
        for k in want:
            _close_tree(got[k], want[k])
    elif isinstance(want, (tuple, list)):
        assert len(got) == len(want)
        for a, b in zip(got, want):
            _close_tree(a, b)
    else:
        assert got == want


class _Heads(nn.Module):
    """A module whose forward returns a dict holding a list (a model's output)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l = nn.Linear(6, 6)

    def forward(self, x):
        y = self.l(x)
        return {"logits": y, "aux": [y.relu(), y * 2]}


_OUTS = {
    "dict": lambda a: {"r": a.relu(), "m": a * 2},
    "list": lambda a: [a.relu(), a * 2],
    "one-tuple": lambda a: (a.relu(),),
    "nested": lambda a: (a.relu(), (a * 2, {"z": a - 1})),
    "with a Python value": lambda a: (a.relu(), 3),
}


@pytest.mark.parametrize("method", ["auto", "export", "trace"])
@pytest.mark.parametrize("kind", sorted(_OUTS))
def test_result_keeps_the_programs_structure(kind, method):
    # export flattens the result: a dict came back as a tuple of its values, a 1-tuple
    # as a bare tensor, a list as a tuple
    fn = _OUTS[kind]
    mesh = wb.Mesh.grid((2,))
    xp = _x((4, 6))
    x = wb.shard_tensor(xp, mesh, [S(0)])
    prog = wb.compile(fn, x, method=method, profile=PROFILE)
    assert not prog.eager
    _close_tree(prog(x), fn(xp))


def test_module_returning_a_dict_of_a_list():
    m = _Heads()
    mesh = wb.Mesh.grid((2,))
    xp = _x((4, 6))
    x = wb.shard_tensor(xp, mesh, [S(0)])
    prog = wb.compile(m, x, profile=PROFILE)
    assert prog.graph.method == "export"
    got = prog(x)
    _close_tree(got, m(xp))
    got["aux"][0].sum().backward()
    g = _full(m.l.weight.grad).clone()
    m.zero_grad()
    m(xp)["aux"][0].sum().backward()
    torch.testing.assert_close(g, m.l.weight.grad)


def _scaled(a, b=None, scale=2.0):
    out = a * scale
    return out if b is None else out + b


def test_call_with_keyword_arguments():
    # CompiledProgram.__call__ took no keywords (TypeError: unexpected keyword argument)
    mesh = wb.Mesh.grid((2,))
    ap, bp = _x((4, 6)), _x((4, 6), 1)
    a, b = (wb.shard_tensor(t, mesh, [S(0)]) for t in (ap, bp))
    prog = wb.compile(_scaled, a, profile=PROFILE)
    torch.testing.assert_close(prog(a=a).full(), _scaled(ap))
    torch.testing.assert_close(prog(a, scale=2.0).full(), _scaled(ap))   # its default
    with pytest.raises(ValueError, match="'scale' is given.*default 2.0.*compile again"):
        prog(a, scale=3.0)                 # the graph holds 2.0: never a silent 2.0
    with pytest.raises(ValueError, match="'b' is given"):
        prog(a, b=b)
    with pytest.raises(TypeError, match="unexpected keyword argument 'c'"):
        prog(a, c=1)


def test_compile_with_keyword_example_inputs():
    mesh = wb.Mesh.grid((2,))
    ap, bp = _x((4, 6)), _x((4, 6), 1)
    a, b = (wb.shard_tensor(t, mesh, [S(0)]) for t in (ap, bp))
    prog = wb.compile(_scaled, a, kwargs={"b": b, "scale": 3.0}, profile=PROFILE)
    want = _scaled(ap, bp, 3.0)
    torch.testing.assert_close(prog(a, b=b, scale=3.0).full(), want)
    torch.testing.assert_close(prog(a, b, 3.0).full(), want)
    with pytest.raises(ValueError, match="argument 2"):
        prog(a, b)                         # scale back at its default: another value
    with pytest.raises(TypeError, match="kwargs="):
        wb.compile(_scaled, a, kwargs=[b])


def test_keyword_only_argument_is_refused_unless_default():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(6, 6)

        def forward(self, x, *, mask=None):
            return self.l(x) if mask is None else self.l(x) * mask
    m = M()
    mesh = wb.Mesh.grid((2,))
    xp = _x((4, 6))
    x = wb.shard_tensor(xp, mesh, [S(0)])
    prog = wb.compile(m, x, profile=PROFILE)
    torch.testing.assert_close(prog(x, mask=None).full(), m(xp))
    with pytest.raises(TypeError, match="'mask' is keyword-only"):
        prog(x, mask=x)
    with pytest.raises(TypeError, match="'mask' is keyword-only"):
        wb.compile(m, x, kwargs={"mask": x}, profile=PROFILE)


def _normalised(a, w):
    with torch.no_grad():                  # a scale that gets no gradient
        s = (a * w).abs().amax()
    return (a * w / s).sum()


@pytest.mark.parametrize("level", ["O0", "O1", "O2"])
def test_no_grad_block_inside_the_program(level):
    # the captured graph ignored the no_grad block: w's gradient flowed through the
    # scale (0.67 off on this probe)
    mesh = wb.Mesh.grid((2,))
    ap, wp = _x((4, 6)), _x((6,), 1)
    a = wb.shard_tensor(ap, mesh, [S(0)])
    w = wb.shard_tensor(wp, mesh, [R()]).requires_grad_()
    prog = wb.compile(_normalised, a, w, level=level, profile=PROFILE)
    assert not prog.eager and any(not n.grad for n in prog.graph.nodes)
    out = prog(a, w)
    out.backward()
    wr = wp.clone().requires_grad_()
    ref = _normalised(ap, wr)
    ref.backward()
    torch.testing.assert_close(out.full(), ref)
    torch.testing.assert_close(w.grad.full(), wr.grad)


def test_compiled_under_no_grad_is_the_program_not_the_mode():
    # compile inside torch.no_grad() captured every value as not requiring grad: the
    # step's schedule then had no backward at all
    mesh = wb.Mesh.grid((2,))
    m = wb.parallelize(nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 6)), mesh,
                       {"0": "colwise", "2": "rowwise"})
    x = wb.shard_tensor(_x((4, 6)), mesh, [R()])
    with torch.no_grad():
        quiet = wb.compile(m, x, profile=PROFILE)
    loud = wb.compile(m, x, profile=PROFILE)
    assert all(n.grad for n in quiet.graph.nodes)
    assert str(quiet.schedule) == str(loud.schedule)
    assert any(it.phase == "backward" for it in quiet.schedule.items)
    out = quiet(x)
    assert out.requires_grad
    with torch.no_grad():
        assert not quiet(x).requires_grad


class _Counter(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l = nn.Linear(6, 6)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)                 # a buffer written in place
        return self.l(x)


def test_in_place_write_to_a_buffer_runs_eagerly():
    # capture ran the write once (calls was 1 after compile) and the graph never again
    # (still 1 after two calls; eager: 2)
    m = _Counter()
    mesh = wb.Mesh.grid((2,))
    xp = _x((4, 6))
    x = wb.shard_tensor(xp, mesh, [S(0)])
    prog = wb.compile(m, x, profile=PROFILE)
    assert prog.eager and "add_" in str(prog) and "did not make" in str(prog)
    assert m.calls.item() == 0             # compile wrote nothing
    prog(x)
    out = prog(x)
    assert m.calls.item() == 2
    torch.testing.assert_close(out.full(), m.l(xp))


def test_writes_into_tensors_the_program_made_are_captured():
    def f(a):
        mask = torch.ones(a.shape[-1])
        mask[0] = 0.0                      # made by the program: a constant, captured
        return a * mask
    mesh = wb.Mesh.grid((2,))
    xp = _x((4, 6))
    x = wb.shard_tensor(xp, mesh, [S(0)])
    prog = wb.compile(f, x, profile=PROFILE)
    assert not prog.eager
    torch.testing.assert_close(prog(x).full(), f(xp))


def test_closure_module_parameters_are_not_frozen():
    # a function that calls a module it closes over: its parameters became constants of
    # the graph, and backward silently left them without gradient
    torch.manual_seed(0)
    m = nn.Linear(6, 3)
    mesh = wb.Mesh.grid((2,))
    ap, wp = _x((4, 6)), _x((3,), 1)
    a = wb.shard_tensor(ap, mesh, [S(0)])
    w = wb.shard_tensor(wp, mesh, [R()]).requires_grad_()

    def f(a, w):
        return (m(a) * w).sum()
    prog = wb.compile(f, a, w, profile=PROFILE)
    assert prog.eager and "requires grad" in str(prog) and "compile the module" in str(prog)
    prog(a, w).backward()
    got = _full(m.weight.grad).clone()
    m.zero_grad()
    f(ap, wp).backward()
    torch.testing.assert_close(got, m.weight.grad)


def test_closure_dist_tensor_parameter_is_named():
    # was "capture ... raised RuntimeError: Tensor on device cpu is not on the expected
    # device meta!"
    mesh = wb.Mesh.grid((2,))
    m = wb.parallelize(nn.Sequential(nn.Linear(6, 4)), mesh, {"0": "colwise"})
    x = wb.shard_tensor(_x((4, 6)), mesh, [R()])
    prog = wb.compile(lambda a: m(a).relu(), x, profile=PROFILE)
    assert prog.eager and "a DistTensor that requires grad (4, 6)" in str(prog)
    torch.testing.assert_close(prog(x).full(), m(x).relu().full())


def test_python_argument_of_another_type_is_refused():
    # int_tensor * 2 is int64, int_tensor * 2.0 float32: 2 == 2.0 let the call run the
    # graph captured with 2 (an int64 result where eager gives float32)
    mesh = wb.Mesh.grid((2,))
    ip = torch.arange(6).reshape(2, 3)
    i = wb.shard_tensor(ip, mesh, [S(0)])
    prog = wb.compile(lambda a, k: a * k, i, 2, profile=PROFILE)
    assert prog(i, 2).dtype == torch.int64
    with pytest.raises(ValueError, match="argument 1"):
        prog(i, 2.0)


class _Obj:
    def __init__(self, scale):
        self.scale = scale


def _cfg_dataclass(scale):
    import dataclasses

    @dataclasses.dataclass
    class Cfg:
        scale: float
    return Cfg(scale)


@pytest.mark.parametrize("kind", ["dict", "dataclass", "object"])
def test_argument_holding_python_values_is_checked_on_each_call(kind):
    # the graph holds what capture read from the argument (cfg.scale): a call with
    # another (or a mutated) one ran with the captured 2.0 (9.7 off)
    mesh = wb.Mesh.grid((2,))
    xp = _x((4, 6))
    x = wb.shard_tensor(xp, mesh, [S(0)])
    if kind == "dict":
        make, read = (lambda s: {"scale": s}), (lambda c: c["scale"])
    else:
        make = _cfg_dataclass if kind == "dataclass" else _Obj
        read = (lambda c: c.scale)

    def f(a, c):
        return a * read(c)
    c = make(2.0)
    prog = wb.compile(f, x, c, profile=PROFILE)
    torch.testing.assert_close(prog(x, c).full(), f(xp, c))
    if kind != "object":                  # an equal one (an object: the same one)
        torch.testing.assert_close(prog(x, make(2.0)).full(), xp * 2.0)
    with pytest.raises(ValueError, match="argument 1"):
        prog(x, make(5.0))
    if kind == "dict":
        c["scale"] = 5.0
    else:
        c.scale = 5.0
    with pytest.raises(ValueError, match="argument 1"):
        prog(x, c)


class _Twice(nn.Module):
    """A graph break, and a child the forward calls twice with other shapes."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l = nn.Linear(6, 6)
        self.k = nn.Linear(6, 6)

    def forward(self, x):
        y = self.l(x)
        if y.sum() > 0:                    # the break
            y = y * 2
        return self.k(self.l(torch.cat([y, y], 0)))


def test_child_called_twice_with_other_shapes_stays_eager():
    # the child was compiled for its first call's inputs and the second call raised
    # 'compiled program called with inputs of other shapes': the program could not run
    m = _Twice()
    mesh = wb.Mesh.grid((2,))
    xp = _x((4, 6))
    x = wb.shard_tensor(xp, mesh, [S(0)])
    prog = wb.compile(m, x, profile=PROFILE)
    assert prog.eager and set(prog.parts) == {"k"}
    out = prog(x)
    torch.testing.assert_close(out.full(), m(xp))
    out.sum().backward()
    g = _full(m.l.weight.grad).clone()
    m.zero_grad()
    m(xp).sum().backward()
    torch.testing.assert_close(g, m.l.weight.grad)


def test_mesh_argument_must_be_a_mesh():
    with pytest.raises(TypeError, match="compile\\(mesh='x'\\).*wb.Mesh"):
        wb.compile(lambda t: t.relu(), torch.ones(2), mesh="x")


def test_compiled_module_answers_for_its_module_in_a_training_loop():
    # torch.compile(model) is a module: its parameters() go to the optimizer, its
    # state_dict() is saved; the compiled program had no such attribute (AttributeError)
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))
    ref = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))
    ref.load_state_dict(m.state_dict())
    mesh = wb.Mesh.grid((2,))
    xp = _x((4, 6))
    x = wb.shard_tensor(xp, mesh, [S(0)])
    prog = wb.compile(m, x, profile=PROFILE)
    opt = torch.optim.AdamW(prog.parameters(), lr=0.1)
    ropt = torch.optim.AdamW(ref.parameters(), lr=0.1)
    for _ in range(3):
        prog.zero_grad()
        loss = prog(x).pow(2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(prog.parameters(), 0.1)
        opt.step()
        ropt.zero_grad()
        rloss = ref(xp).pow(2).mean()
        rloss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        ropt.step()
        torch.testing.assert_close(loss.full(), rloss)
    assert list(prog.state_dict()) == list(ref.state_dict())
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(prog.state_dict()[k], v)
    assert prog.eval() is prog and not m.training        # returns the program
    with pytest.raises(ValueError, match="train/eval mode"):
        prog(x)
    assert prog.train() is prog
    torch.testing.assert_close(prog(x).full(), ref(xp))
    fn = wb.compile(lambda a: a.relu(), x, profile=PROFILE)
    with pytest.raises(AttributeError, match="no module"):
        fn.parameters()


class _Scaled(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        torch.manual_seed(0)
        self.cfg = cfg
        self.l = nn.Linear(6, 6)

    def forward(self, x):
        return self.l(x) * self.cfg["scale"]


_TABLE = {"scale": 2.0}


def _read_table(a):
    return a * _TABLE["scale"]


def test_a_config_the_program_reads_is_checked_on_each_call():
    # the graph holds self.cfg["scale"] / a global table's entry as read at capture; a
    # change was silently ignored (4.7 off) where a changed number is refused
    mesh = wb.Mesh.grid((2,))
    xp = _x((4, 6))
    x = wb.shard_tensor(xp, mesh, [S(0)])
    m = _Scaled({"scale": 2.0})
    prog = wb.compile(m, x, profile=PROFILE)
    torch.testing.assert_close(prog(x).full(), m(xp))
    m.cfg["scale"] = 3.0
    with pytest.raises(ValueError, match="module attribute cfg changed since capture"):
        prog(x)
    m.cfg["scale"] = 2.0
    torch.testing.assert_close(prog(x).full(), m(xp))
    fprog = wb.compile(_read_table, x, profile=PROFILE)
    try:
        _TABLE["scale"] = 4.0
        with pytest.raises(ValueError, match="global _TABLE changed since capture"):
            fprog(x)
    finally:
        _TABLE["scale"] = 2.0
    torch.testing.assert_close(fprog(x).full(), xp * 2.0)


class _Broken(nn.Module):
    """A graph break between two children."""

    def __init__(self, second=None):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.5))
        self.b = second if second is not None else nn.Linear(6, 6)

    def forward(self, x):
        y = self.a(x)
        if y.sum() > 0:                    # the break
            y = y * 2
        return self.b(y)


def test_compiled_children_run_their_hooks_once():
    # the compiled child was the child's forward: the child's __call__ ran its hooks
    # around the graph, which holds them too (446 off with an output hook x10)
    m = _Broken().eval()
    m.b.register_forward_hook(lambda mod, i, o: o * 10)
    m.a.register_forward_pre_hook(lambda mod, i: (i[0] + 1,))
    mesh = wb.Mesh.grid((2,))
    xp = _x((4, 6))
    x = wb.shard_tensor(xp, mesh, [S(0)])
    prog = wb.compile(m, x, profile=PROFILE)
    assert prog.eager and set(prog.parts) == {"a", "b"}
    torch.testing.assert_close(prog(x).full(), m(xp))
    assert isinstance(m.a, nn.Sequential) and isinstance(m.b, nn.Linear)   # put back


class _Count(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x):
        self.n.add_(1)                     # its own capture is refused: it stays eager
        return x * 1


def test_finding_the_childrens_inputs_leaves_no_mark():
    # compile ran the broken forward once to find its children's inputs: it drew dropout
    # masks from the global generator, recorded into the caller's trace and wrote buffers;
    # an eager child (here one that writes its buffer) then recursed without end
    m = _Broken(_Count())
    mesh = wb.Mesh.grid((2,))
    xp = _x((4, 6))
    x = wb.shard_tensor(xp, mesh, [S(0)])
    torch.manual_seed(0)
    want = torch.rand(3)
    torch.manual_seed(0)
    with wb.trace(profile=PROFILE) as tr:
        prog = wb.compile(m, x, profile=PROFILE)
    assert torch.equal(torch.rand(3), want)
    assert not tr.events and m.b.n.item() == 0
    torch.manual_seed(1)
    got = prog(x).full()
    torch.manual_seed(1)
    torch.testing.assert_close(got, m(xp))
    assert m.b.n.item() == 2


class _Act(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l = nn.Linear(6, 6)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(self.l(x))


def test_a_replaced_or_added_submodule_is_refused():
    # m.act = nn.Tanh() after compile: the graph silently kept running relu
    mesh = wb.Mesh.grid((2,))
    xp = _x((4, 6))
    x = wb.shard_tensor(xp, mesh, [S(0)])
    m = _Act()
    prog = wb.compile(m, x, profile=PROFILE)
    m.act = nn.Tanh()
    with pytest.raises(ValueError, match=r"replaced since capture: act \(ReLU -> Tanh\)"):
        prog(x)
    m.act = nn.ReLU()
    with pytest.raises(ValueError, match="act"):           # another ReLU object
        prog(x)
    seq = nn.Sequential(nn.Linear(6, 6), nn.ReLU())
    sprog = wb.compile(seq, x, profile=PROFILE)
    seq.append(nn.Sigmoid())               # was refused as 'another train/eval mode'
    with pytest.raises(ValueError, match=r"2 \(none -> Sigmoid\)"):
        sprog(x)


@pytest.mark.parametrize("level", ["O0", "O1", "O2"])
def test_plain_tensor_program_returns_plain_tensors(level):
    # a module and inputs without DistTensor, placed on mesh=: the result was a Replicate
    # DistTensor where the module gives a tensor (assert_close(prog(x), model(x)) failed)
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    x = _x((5, 6)).requires_grad_()
    prog = wb.compile(m, x, mesh=wb.Mesh.grid((2,)), level=level, profile=PROFILE)
    y = prog(x)
    assert type(y) is torch.Tensor and y.requires_grad
    y.pow(2).sum().backward()
    gx, gw = x.grad.clone(), m[0].weight.grad.clone()
    x.grad = None
    m.zero_grad()
    ref = m(x)
    ref.pow(2).sum().backward()
    torch.testing.assert_close(y, ref)
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(gw, m[0].weight.grad)
    f = wb.compile(lambda a, b: {"s": (a @ b).relu(), "t": [a.sum()]}, x.detach(),
                   _x((6, 2)), mesh=wb.Mesh.grid((2,)), profile=PROFILE)
    _close_tree(f(x.detach(), _x((6, 2))), {"s": (x.detach() @ _x((6, 2))).relu(),
                                             "t": [x.detach().sum()]})
    assert type(f(x.detach(), _x((6, 2)))["s"]) is torch.Tensor


class _Times10Back(torch.autograd.Function):
    """Forward x * 2, backward grad * 10: a gradient only its backward knows."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 10


class _Custom(nn.Module):
    def __init__(self, kind):
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        self.a = nn.Sequential(nn.Linear(6, 6), nn.Tanh())
        self.b = nn.Linear(6, 2)

    def forward(self, x):
        if self.kind == "function":
            return self.b(_Times10Back.apply(self.a(x)))
        import torch.utils.checkpoint as cp
        return self.b(cp.checkpoint(self.a, x, use_reentrant=True))


@pytest.mark.parametrize("method", ["auto", "trace"])
@pytest.mark.parametrize("kind", ["function", "reentrant checkpoint"])
def test_custom_autograd_function_runs_eagerly(kind, method):
    # export inlined the Function's forward: the graph's gradient was the forward's (8
    # where the Function's backward gives 40); tracing recorded it under no_grad (no
    # gradient at all). Reentrant checkpoint is such a Function.
    m = _Custom(kind)
    x = _x((4, 6)).requires_grad_()
    prog = wb.compile(m, x, mesh=wb.Mesh.grid((2,)), method=method, profile=PROFILE)
    assert prog.eager and "autograd.Function" in str(prog)
    prog(x).pow(2).sum().backward()
    got = m.a[0].weight.grad.clone()
    m.zero_grad()
    m(x).pow(2).sum().backward()
    torch.testing.assert_close(got, m.a[0].weight.grad)


def test_workbench_fused_ops_are_captured():
    # wb.ops' own autograd Functions are op-table entries: they pass
    mesh = wb.Mesh.grid((2,))
    xp, wp = _x((4, 8)), _x((8,), 1)
    x = wb.shard_tensor(xp, mesh, [S(0)])
    w = wb.shard_tensor(wp, mesh, [R()])
    prog = wb.compile(lambda a, b: wb.ops.rms_norm(a, b, eps=1e-6), x, w, profile=PROFILE)
    assert not prog.eager
    torch.testing.assert_close(prog(x, w).full(), wb.ops.rms_norm(xp, wp, eps=1e-6))


def _writes_in_place(a):
    b = a * 2
    b.view(-1).add_(1)                     # the refused line
    return b


def test_a_capture_refusal_names_the_users_line():
    import inspect
    mesh = wb.Mesh.grid((2,))
    x = wb.shard_tensor(_x((4, 6)), mesh, [S(0)])
    prog = wb.compile(_writes_in_place, x, profile=PROFILE)
    lines, first = inspect.getsourcelines(_writes_in_place)
    want = first + next(i for i, ln in enumerate(lines) if "add_" in ln)
    brk = prog.breaks[0]
    assert brk.file.endswith("test_audit_compile.py") and brk.line == want
    # a write through a view of a traced tensor is refused (compile13: a plain b.add_(1)
    # into a tensor the program made now compiles, recorded as functionalization does)
    assert brk.code == "b.view(-1).add_(1)                     # the refused line"
    torch.testing.assert_close(prog(x).full(), _writes_in_place(x.full()))
