"""ZeRO-3's backward prefetch: issued when the forward's last module ends, in the forward's
order reversed, up to ``prefetch_numel``; the gathered copies counted while they live."""
import pytest
import torch
from torch import nn

import workbench as wb
from workbench.parallel.strategies.data_parallel import DataParallel
from workbench.parallel.strategies.zero3 import Zero3

DP = 2
H = 256
NUMEL = H * H + H                       # one Linear(H, H): weight and bias
BYTES = 4 * NUMEL                       # its float32 copy, gathered whole on each rank


def _run(prefetch_numel, freeze=()):
    torch.manual_seed(0)
    mesh = wb.Mesh.grid(DP, ["dp"])
    m = nn.Sequential(*[nn.Linear(H, H) for _ in range(3)])
    wb.parallelize(m, mesh, {})
    z = Zero3(m, mesh, "dp", prefetch_numel=prefetch_numel)
    for i in freeze:
        for e in z.entries:
            if e[0] is m[i]:
                e[3].requires_grad_(False)
    x = DataParallel([], mesh, "dp").shard_batch(torch.randn(8, H))
    with wb.trace() as tr:
        y = m(x)
        fwd_end = tr.now(mesh.ranks[0])
        y.sum().backward()
        z.finish_gradient_synchronization()
    return z, tr, fwd_end


def _regathers(tr):
    return [e for e in tr.collectives() if e.label == "zero-3 re-gather"]


def _issued_at(z, t):
    """How many gathers were issued at time ``t`` (their buffers held: the ledger grows)."""
    tl = [(s, b) for s, b in z.live.timeline]
    return sum(1 for (_, a), (s, b) in zip([(None, 0)] + tl, tl)
               if s == pytest.approx(t) and b > a)


def test_backward_gathers_start_at_the_end_of_the_forward():
    """With room for all three modules, their backward gathers are issued when the last
    forward ends (before any backward compute), the last module's first."""
    z, tr, fwd_end = _run(prefetch_numel=10 * NUMEL)
    rg = _regathers(tr)
    assert len(rg) == 3
    # all three issued at the forward's end (their buffers held from then on), and run back
    # to back on the comm stream from there, beside the loss's backward
    assert _issued_at(z, fwd_end) == 3
    assert rg[0].start == pytest.approx(fwd_end)
    assert all(b.start == pytest.approx(a.end) for a, b in zip(rg, rg[1:]))
    # each module's backward (last module first: two GEMMs and the bias's sum each, the
    # first module, which reads data, no input gradient) waits for its own gather only
    lin = sorted((e for e in tr.events if e.stream == "compute" and 0 in e.ranks
                  and e.name == "linear" and e.args.get("phase") == "backward"),
                 key=lambda e: e.start)
    assert [e.args["part"] for e in lin] == ["dgrad", "wgrad", "bias"] * 2 + ["wgrad", "bias"]
    for j, g in enumerate(rg):
        prev = lin[3 * j - 1].end if j else fwd_end
        assert lin[3 * j].start == pytest.approx(max(g.end, prev))


@pytest.mark.parametrize("budget, at_end", [(0, 0), (1, 1), (NUMEL, 1), (NUMEL + 1, 2),
                                            (10 * NUMEL, 3)])
def test_the_forward_end_prefetch_respects_prefetch_numel(budget, at_end):
    """Modules are gathered ahead while fewer than ``prefetch_numel`` elements are (at
    least one when it is > 0, DeepSpeed's coordinator); 0 prefetches nothing."""
    z, tr, fwd_end = _run(prefetch_numel=budget)
    rg = _regathers(tr)
    assert len(rg) == 3                                 # every module re-gathered once
    assert _issued_at(z, fwd_end) == at_end


def test_gathered_copies_are_counted_while_they_live():
    """The ledger: one copy at a time in forward without prefetch; with the backward
    prefetch at the forward's end all three are held at once; all freed at the end."""
    z, _, _ = _run(prefetch_numel=0)
    assert z.live.peak == BYTES
    assert z.live.bytes == 0 and z.live.timeline[-1][1] == 0
    z, _, fwd_end = _run(prefetch_numel=10 * NUMEL)
    assert z.live.peak == 3 * BYTES
    # at the end of the forward the last module's copy is freed, and the three backward
    # copies are gathered
    at_end = [b for t, b in z.live.timeline if t == pytest.approx(fwd_end)]
    assert at_end == [0, BYTES, 2 * BYTES, 3 * BYTES]
    assert z.live.bytes == 0
    times = [t for t, _ in z.live.timeline]
    assert times == sorted(times)


def test_a_frozen_module_frees_its_copy_when_the_next_backward_starts():
    z, _, _ = _run(prefetch_numel=0, freeze=(1,))
    assert z.live.peak == BYTES
    # freed before the first module's backward gathered: never two backward copies
    assert max(b for _, b in z.live.timeline) == BYTES
    assert z.live.bytes == 0


def test_no_backward_prefetch_without_grad():
    torch.manual_seed(0)
    mesh = wb.Mesh.grid(DP, ["dp"])
    m = nn.Sequential(*[nn.Linear(H, H) for _ in range(2)])
    wb.parallelize(m, mesh, {})
    z = Zero3(m, mesh, "dp")
    x = DataParallel([], mesh, "dp").shard_batch(torch.randn(8, H))
    with wb.trace() as tr, torch.no_grad():
        m(x)
    assert not _regathers(tr)
    assert z.live.bytes == 0
