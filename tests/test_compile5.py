"""wb.compile: a module's buffers under torch.export capture; O0's gradient reductions.

Each compiled result is held to the same module run eagerly on plain tensors (one device).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import workbench as wb

R, S = wb.Replicate, wb.Shard
PROFILE = "a100"


class _Scaled(nn.Module):
    """A linear and a buffer (persistent or not) that scales its output."""

    def __init__(self, persistent=True):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.lin = nn.Linear(8, 8)
        with torch.no_grad():
            self.lin.weight.copy_(torch.randn(8, 8, generator=g) * 0.3)
        self.register_buffer("scale", 1 + torch.rand(8, generator=g), persistent=persistent)

    def forward(self, x):
        return self.lin(x) * self.scale


class _Shared(nn.Module):
    """One buffer registered on two submodules."""

    def __init__(self):
        super().__init__()
        self.a, self.b = _Scaled(), _Scaled()
        self.b.scale = self.a.scale

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class _Block(nn.Module):
    """Notebook 16's attention block: plain torch ops, a causal-mask buffer."""

    def __init__(self, d=16, f=32, h=2, seq=8):
        super().__init__()
        self.h = h
        self.norm_w = nn.Parameter(torch.ones(d))
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.up = nn.Linear(d, 2 * f, bias=False)
        self.down = nn.Linear(f, d)
        self.register_buffer("causal", torch.ones(seq, seq, dtype=torch.bool).triu(1))

    def forward(self, x):
        B, T, D = x.shape
        n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm_w
        q, k, v = (t.view(B, T, self.h, D // self.h).transpose(1, 2)
                   for t in self.qkv(n).split(D, -1))
        s = (q @ k.transpose(-2, -1)) * (D // self.h) ** -0.5
        a = torch.softmax(s.masked_fill(self.causal, float("-inf")), -1) @ v
        x = x + self.o(a.transpose(1, 2).reshape(B, T, D))
        g, u = self.up(x).chunk(2, -1)
        return x + self.down(F.silu(g) * u)


def _x(shape, mesh, seed=1):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    return x, wb.shard_tensor(x, mesh, [S(0)])


@pytest.mark.parametrize("persistent", [True, False])
def test_a_module_with_a_buffer_is_captured_by_export(persistent):
    """Before: the parameters were meta twins and the buffer a CPU tensor, torch.export
    failed (FakeTensorDeviceMismatchError) and capture fell back to tracing."""
    mesh = wb.Mesh.grid((2,), ("dp",))
    m = _Scaled(persistent)
    xp, x = _x((4, 8), mesh)
    buf = m.scale
    prog = wb.compile(m, x, profile=PROFILE)
    assert prog.graph.method == "export", prog.graph.notes
    assert not prog.graph.notes
    assert m.scale is buf and not buf.is_meta                    # the buffer put back
    assert all(not p.is_meta for p in m.parameters())
    [const] = prog.graph.consts.values()                         # the module's own tensor
    assert const.data_ptr() == buf.data_ptr()
    torch.testing.assert_close(prog(x).full(), m(xp))
    with torch.no_grad():                                        # the buffer as it is now
        m.scale.mul_(3)
    torch.testing.assert_close(prog(x).full(), m(xp))


def test_a_buffer_on_two_submodules_is_one_constant_and_both_come_back():
    mesh = wb.Mesh.grid((2,), ("dp",))
    m = _Shared()
    xp, x = _x((4, 8), mesh)
    prog = wb.compile(m, x, profile=PROFILE)
    assert prog.graph.method == "export", prog.graph.notes
    assert len(prog.graph.consts) == 1
    assert m.b.scale is m.a.scale and not m.a.scale.is_meta
    torch.testing.assert_close(prog(x).full(), m(xp))


def test_a_failed_export_puts_the_buffers_back():
    """Export stops at a data-dependent branch (a graph break): the module keeps its own
    buffer, and runs eagerly with it."""
    class Branchy(_Scaled):
        def forward(self, x):
            y = self.lin(x) * self.scale
            if y.sum() > 0:
                y = y * 2
            return y

    mesh = wb.Mesh.grid((2,), ("dp",))
    m = Branchy()
    xp, x = _x((4, 8), mesh)
    buf = m.scale
    prog = wb.compile(m, x, profile=PROFILE, method="export")
    assert prog.breaks and "y.sum() > 0" in prog.breaks[0].code
    assert m.scale is buf and not buf.is_meta
    assert all(not p.is_meta for p in m.parameters())
    torch.testing.assert_close(prog(x).full(), m(xp))


@pytest.mark.parametrize("level", ["O0", "O1"])
def test_notebook16_attention_block_is_captured_by_export_as_tracing_captures_it(level):
    """The causal mask is a buffer: export was refused; with it (and split, chunk,
    masked_fill mapped), the exported program fuses, places and prices as the traced one."""
    torch.manual_seed(0)
    m = _Block()
    mesh = wb.Mesh.grid((2,), ("dp",))
    xp, x = _x((4, 8, 16), mesh)
    ex = wb.compile(m, x, level=level, profile=PROFILE)
    tr = wb.compile(m, x, level=level, profile=PROFILE, method="trace")
    assert ex.graph.method == "export", ex.graph.notes
    assert [n.op for n in ex.graph.nodes] == [n.op for n in tr.graph.nodes]
    if level == "O1":
        assert "flash_attention" in [n.op for n in ex.graph.nodes]   # causal mask read
    assert str(ex.step()) == str(tr.step())
    torch.testing.assert_close(ex(x).full(), m(xp), rtol=1e-5, atol=1e-5)


# ---- O0: a gather repeated for a second reader reduces the gradient once, as eager --------

class _TwoReaders(nn.Module):
    """h = x * scale read by two column-parallel linears: op by op, each gathers h."""

    def __init__(self, d=8, f=16):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.scale = nn.Parameter(1 + torch.rand(d, generator=g))
        self.a, self.b = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False)
        with torch.no_grad():
            for lin in (self.a, self.b):
                lin.weight.copy_(torch.randn(f, d, generator=g) * 0.3)

    def forward(self, x):
        h = x * self.scale
        return self.a(h) * self.b(h)


def _two_readers(mesh):
    return wb.parallelize(_TwoReaders(), mesh, {"a": "colwise", "b": "colwise"})


def _comm(tr):
    from collections import Counter
    return Counter((e.name, e.args.get("buffer_bytes")) for e in tr.events
                   if e.stream == "comm" and 0 in e.ranks)


def _step(fn, x):
    with wb.trace(profile=PROFILE) as tr:
        out = fn(x)
        out.full().sum().backward()          # (.full(): one all_gather, outside)
    return out, tr


def test_o0_gathers_for_each_reader_and_reduces_the_gradient_once_as_eager():
    """Before: the O0 program marked each gathered copy with its own way back and
    reduce-scattered h's gradient twice (eager: once, after autograd summed the readers);
    the schedule and the greedy price counted two as well."""
    mesh = wb.Mesh.grid((2,), ("tp",))
    xp = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    x = wb.shard_tensor(xp, mesh, [S(0)])
    eager_m, comp_m = _two_readers(mesh), _two_readers(mesh)
    ref, tr_e = _step(eager_m, x)
    o0 = wb.compile(comp_m, x, level="O0", profile=PROFILE)
    gathers = [i for i in o0.program if type(i).__name__ == "Reshard"]
    assert len(gathers) == 2                  # O0 keeps each reader's gather
    out, tr_c = _step(o0, x)
    ran = _comm(tr_c)
    assert ran == _comm(tr_e)
    assert ran[("reduce_scatter", 128)] == 1 and ran[("all_gather", 128)] == 2
    torch.testing.assert_close(out.full(), ref.full())
    for (name, p), q in zip(comp_m.named_parameters(), eager_m.parameters()):
        torch.testing.assert_close(p.grad.full(), q.grad.full(), msg=name)
    # the schedule prices what the run records (but the .full() outside), and the greedy
    # estimate is the schedule's step
    priced = {}
    for it in o0.schedule.items:
        if it.kind == "comm":
            priced[(it.coll, it.nbytes)] = priced.get((it.coll, it.nbytes), 0) + 1
    ran[("all_gather", 256)] -= 1
    assert priced == dict(+ran)
    assert o0.greedy.time == pytest.approx(o0.step().time, rel=1e-12, abs=0)


def test_o1_keeps_one_gather_and_one_reduction():
    mesh = wb.Mesh.grid((2,), ("tp",))
    xp = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    x = wb.shard_tensor(xp, mesh, [S(0)])
    eager_m, comp_m = _two_readers(mesh), _two_readers(mesh)
    ref, _ = _step(eager_m, x)
    o1 = wb.compile(comp_m, x, level="O1", profile=PROFILE, pin={"output": [S(1)]})
    out, tr = _step(o1, x)
    ran = _comm(tr)
    ran[("all_gather", 256)] -= 1
    priced = {}
    for it in o1.schedule.items:
        if it.kind == "comm":
            priced[(it.coll, it.nbytes)] = priced.get((it.coll, it.nbytes), 0) + 1
    assert priced == dict(+ran)
    assert o1.assignment.time == pytest.approx(o1.step().time, rel=1e-12, abs=0)
    torch.testing.assert_close(out.full(), ref.full())
    for (name, p), q in zip(comp_m.named_parameters(), eager_m.parameters()):
        torch.testing.assert_close(p.grad.full(), q.grad.full(), msg=name)


def _tiny_llama():
    """Notebook 16's tiny Llama on a 2 x 2 (dp, tp) mesh: a function building the
    tensor-parallel model afresh, and its ids and targets sharded over dp."""
    from workbench.models import build_model, get_config
    cfg = get_config("tiny")
    mesh = wb.Mesh.grid((2, 2), ("dp", "tp"))

    def llama():
        m = build_model(cfg, seed=0)
        return wb.parallelize(m, mesh, m.tp_plan(2), mesh_dim="tp")
    g = torch.Generator().manual_seed(0)
    ids, targets = (torch.randint(0, cfg.vocab_size, (4, 32), generator=g) for _ in range(2))
    xi, yi = (wb.shard_tensor(t, mesh, [S(0), R()]) for t in (ids, targets))
    return llama, xi, yi


def test_tiny_llama_o0_records_the_eager_step():
    """Notebook 16's repro: the O0 program recorded 53 collectives and 336.32 us, eager
    51 and 327.97 (each MLP input's gradient reduced once per gathered copy)."""
    llama, xi, yi = _tiny_llama()
    runs = []
    for fn in (llama(), wb.compile(llama(), xi, yi, level="O0", profile=PROFILE)):
        with wb.trace(profile=PROFILE) as tr:
            _, loss = fn(xi, yi)
            loss.backward()
        runs.append((loss.full().item(), _comm(tr), tr))
    (le, ce, tre), (lc, cc, trc) = runs
    assert lc == pytest.approx(le, rel=1e-6)
    assert cc == ce
    assert trc.time() == pytest.approx(tre.time(), rel=1e-9)


def test_tiny_llama_greedy_price_is_the_eager_step_less_the_loss_outside():
    """The search's price of the dispatcher's placements (``prog.greedy``, summed by
    ``compile.kernels``) is the eager step less what the loss runs outside the program,
    its two all-reduces of the target count (notebook 16): each kernel priced as the
    dispatcher prices it, a matmul's forward and backward GEMMs with their shapes and a
    bias's sum on its own roofline (the sum priced the backward's kernels on one
    roofline and the forward GEMM without its shape: 0.02 us apart)."""
    llama, xi, yi = _tiny_llama()
    with wb.trace(profile=PROFILE) as tre:
        _, loss = llama()(xi, yi)
        loss.backward()
    outside = [e for e in tre.events if e.label == "cross_entropy: global count of targets"
               and 0 in e.ranks]
    assert len(outside) == 2
    prog = wb.compile(llama(), xi, yi, level="O0", profile=PROFILE)
    assert prog.greedy.time == pytest.approx(
        tre.time() - sum(e.duration for e in outside), rel=1e-9)
