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
    """An op export cannot map (here aten.slice): capture traces instead, and the module
    keeps its own buffer."""
    class Sliced(_Scaled):
        def forward(self, x):
            return self.lin(x)[:, :4] * self.scale[:4]

    mesh = wb.Mesh.grid((2,), ("dp",))
    m = Sliced()
    xp, x = _x((4, 8), mesh)
    buf = m.scale
    prog = wb.compile(m, x, profile=PROFILE)
    assert prog.graph.method == "trace" and "slice" in prog.graph.notes[0]
    assert m.scale is buf and not buf.is_meta
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
