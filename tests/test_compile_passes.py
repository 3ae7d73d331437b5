"""wb.compile's passes: fusion (numbers unchanged, ops fewer), the O2 schedule passes on
the clock, and the tiny Llama compiled at O2 on dp2 x tp2 against eager."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import workbench as wb
from workbench.compile.schedule import trace_report

R, S = wb.Replicate, wb.Shard


class Block(nn.Module):
    """RMSNorm, attention and a SwiGLU MLP written out in plain torch ops (the patterns)."""

    def __init__(self, d=16, f=32, h=2):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.h = h
        self.norm_w = nn.Parameter(1 + 0.1 * torch.randn(d, generator=g))
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.up = nn.Parameter(torch.randn(2 * f, d, generator=g) * 0.2)
        self.down = nn.Parameter(torch.randn(d, f, generator=g) * 0.2)
        self.b = nn.Parameter(torch.randn(d, generator=g) * 0.1)
        self.register_buffer("causal_mask", torch.ones(8, 8, dtype=torch.bool).triu(1))
        with torch.no_grad():
            self.qkv.weight.copy_(torch.randn(3 * d, d, generator=g) * 0.2)
            self.o.weight.copy_(torch.randn(d, d, generator=g) * 0.2)

    def forward(self, x):
        B, T, D = x.shape
        n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm_w
        q, k, v = self.qkv(n).split(D, -1)
        q, k, v = (t.view(B, T, self.h, D // self.h).transpose(1, 2) for t in (q, k, v))
        s = (q @ k.transpose(-2, -1)) * (D // self.h) ** -0.5
        s = s.masked_fill(self.causal_mask, float("-inf"))
        x = x + self.o((torch.softmax(s, -1) @ v).transpose(1, 2).reshape(B, T, D))
        a, b = (x @ self.up.t()).chunk(2, -1)
        return (F.silu(a) * b) @ self.down.t() + self.b


def test_fusion_patterns_fuse_and_keep_the_numbers():
    mesh = wb.Mesh.grid((2,))
    xp = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1))
    x = wb.shard_tensor(xp, mesh, [S(0)])
    m = Block()
    prog = wb.compile(m, x, level="O1", method="trace")
    name, before, after, saved = prog.log[0]
    assert name == "fuse"
    for what in ("attention x1", "rms_norm x1", "swiglu x1", "bias x1"):
        assert what in saved, saved
    ops = [n.op for n in prog.graph.nodes]
    for fused in ("rms_norm", "flash_attention", "swiglu", "linear"):
        assert fused in ops
    for gone in ("rsqrt", "softmax", "silu", "masked_fill"):
        assert gone not in ops and gone in before
    assert "fused attention (causal)" in after
    ref = m(xp)
    torch.testing.assert_close(prog(x).full(), ref, rtol=1e-5, atol=1e-5)
    o0 = wb.compile(m, x, level="O0", method="trace")
    assert len(o0.graph.nodes) > len(prog.graph.nodes) + 8
    torch.testing.assert_close(o0(x).full(), ref)


def _llama(mesh):
    from workbench.models import build_model, get_config
    m = build_model(get_config("tiny"), seed=0)
    wb.parallelize(m, mesh, m.tp_plan(2), mesh_dim="tp")
    return m


@pytest.fixture(scope="module")
def llama_runs():
    """Eager and compiled (O2) forward + backward of one step of the tiny Llama on dp2 x tp2."""
    mesh = wb.Mesh.grid((2, 2), ("dp", "tp"))
    g = torch.Generator().manual_seed(0)
    ids, tg = (torch.randint(0, 75, (4, 32), generator=g) for _ in range(2))
    x = wb.shard_tensor(ids, mesh, [S(0), R()])
    y = wb.shard_tensor(tg, mesh, [S(0), R()])
    eager_m, comp_m = _llama(mesh), _llama(mesh)
    with wb.trace(profile="a100") as tr:
        _, loss = eager_m(x, y)
        loss.backward()
    prog = wb.compile(comp_m, x, y, level="O2", profile="a100", method="trace")
    with wb.trace(profile="a100") as ctr:
        _, closs = prog(x, y)
        closs.backward()
    return eager_m, comp_m, loss, closs, tr, prog, ctr


def test_tiny_llama_at_o2_gives_eager_loss_and_gradients(llama_runs):
    eager_m, comp_m, loss, closs, _, prog, _ = llama_runs
    torch.testing.assert_close(closs.full(), loss.full())
    grads = dict(eager_m.named_parameters())
    for name, p in comp_m.named_parameters():
        torch.testing.assert_close(p.grad.full(), grads[name].grad.full(), rtol=1e-5,
                                   atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert prog.assignment.time <= prog.greedy.time


def test_tiny_llama_at_o2_less_exposed_communication_and_launch_time(llama_runs):
    _, _, _, _, tr, prog, ctr = llama_runs
    eager = trace_report(tr)
    # run on the simulated ranks at O2, the trace holds one graph launch and sunk kernels
    ran = trace_report(ctr)
    launch = wb.get_profile("a100").launch_overhead
    assert ran.launch == pytest.approx(launch) and ran.kernels == eager.kernels
    assert sum(1 for e in ctr.events if e.label == "launch") == 1
    # the run itself, not only its schedule: less exposed communication, a shorter step
    assert ran.exposed < eager.exposed and ran.time < eager.time
    o2 = prog.step()
    assert o2.exposed < eager.exposed
    assert o2.launch < eager.launch
    assert o2.time < eager.time
    names = [n for n, _, _ in prog.stages]
    assert names == ["O1", "bucket", "overlap", "sink"]
    steps = [rep.time for _, _, rep in prog.stages]
    assert all(b <= a * (1 + 1e-12) for a, b in zip(steps, steps[1:]))     # no pass hurts
    sink = prog.stages[-1][2]
    assert sink.launch == pytest.approx(wb.get_profile("a100").launch_overhead)
    log = prog.passes()
    assert "bucket:" in log and "sink:" in log and "kernel launches replaced" in log


def test_overlap_moves_a_collective_early_when_compute_lies_between():
    """x S(0) on 2 ranks; u = x^T x is computed while ... : the reshard of a value made
    early and read late is issued right after its producer, async."""
    mesh = wb.Mesh.grid((2,))
    xp = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    x = wb.shard_tensor(xp, mesh, [S(0)])
    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))

    def f(a, b):
        y = torch.softmax(a @ b, 1)           # rows sharded: stays S(0)
        z = y
        for _ in range(6):                    # independent work on b alone
            b = torch.tanh(b @ b)
        return torch.softmax(z, 0) + b.sum()  # softmax over the sharded dim: a reshard
    prog = wb.compile(f, x, w, level="O2", profile="a100", method="trace")
    log = dict((n, s) for n, _, _, s in prog.log)
    torch.testing.assert_close(prog(x, w).full(), f(xp, w), rtol=1e-4, atol=1e-5)
    assert "1 collective(s) moved early" in log["overlap"], log["overlap"]
    before, after = prog.stages[1][2], prog.stages[2][2]
    assert after.exposed < before.exposed


def test_overlap_splits_a_collective_with_the_matmul_that_makes_it():
    """A row-parallel matmul's partial sum is reduce-scattered for the relu right after it:
    nothing to hide it behind, so it is split with the matmul in 4 chunks (shapes only: the
    schedule is priced on meta tensors, no data)."""
    mesh = wb.Mesh.grid((2,))
    x = wb.shard_tensor(torch.empty(2048, 4096, device="meta"), mesh, [S(1)])
    w = wb.shard_tensor(torch.empty(4096, 4096, device="meta"), mesh, [S(0)])
    prog = wb.compile(lambda a, b: torch.relu(a @ b), x, w, level="O2", profile="a100",
                      method="trace")
    log = dict((n, s) for n, _, _, s in prog.log)
    assert "1 split with their matmul in 4 chunks" in log["overlap"], log["overlap"]
    sched = prog.stages[2][1]
    assert sum(1 for it in sched.items if it.tag.startswith("split")) == 4
    assert sum(1 for it in sched.items if it.tag.startswith("chunk")) == 4
    before, after = prog.stages[1][2], prog.stages[2][2]
    assert after.exposed < 0.5 * before.exposed and after.time < before.time
