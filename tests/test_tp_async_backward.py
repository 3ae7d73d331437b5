"""Megatron's f all-reduces the input gradient asynchronously, beside the column-parallel
linear's weight-gradient GEMM and its bias's sum (``LinearWithGradAccumulationAndAsync
Communication``: ``grad_output.sum(dim=0)`` after the wgrad, before ``handle.wait()``):
on the simulated clock the all-reduce starts when the dgrad ends and the wgrad and the
bias's sum hide min(all-reduce, their work) of it; the compute is each op's backward."""
import pytest
import torch
from torch import nn

import workbench as wb
from workbench.parallel.ops_table.costs import backward_bytes
from workbench.parallel.strategies.tensor_parallel import tensor_parallel_region
from workbench.sim_mesh import cost as sim_cost

H, T = 512, 512                            # hidden size, tokens (b = 4, s = 128)
BF16 = torch.bfloat16


class Block(nn.Module):
    """Megatron's MLP: column-parallel fc1, row-parallel fc2, f before and g after."""

    def __init__(self, first=None):
        super().__init__()
        self.first = first
        self.fc1 = nn.Linear(H, 4 * H, dtype=BF16)
        self.fc2 = nn.Linear(4 * H, H, dtype=BF16)

    def forward(self, x):
        if self.first is not None:
            x = self.first(x)
        return self.fc2(torch.relu(self.fc1(x)))


def _run(first=None, dp=1, sp=False, zero=0):
    mesh = wb.Mesh.grid((dp, 2), ["dp", "tp"]) if dp > 1 else wb.Mesh.grid(2, ["tp"])
    torch.manual_seed(0)
    m = Block(first)
    wb.parallelize(m, mesh, {"fc1": "colwise", "fc2": "rowwise"}, mesh_dim="tp")
    tensor_parallel_region(m, mesh, "tp", sp=sp)
    if dp > 1 and zero == 3:        # parameters sharded over dp, gathered by hooks
        from workbench.parallel.strategies.zero3 import Zero3
        Zero3(m, mesh, "dp")
    elif dp > 1:        # each dp rank its own replica (gradients reduced in step())
        from workbench.parallel.strategies.data_parallel import DataParallel
        DataParallel(list(wb.dist_parameters(m)), mesh, "dp", zero=zero)
    x = torch.randn(dp * 4, 128, H, dtype=BF16)
    tp_place = wb.Shard(1) if sp else wb.Replicate()          # sp: the sequence split
    place = [wb.Shard(0), tp_place] if dp > 1 else [tp_place]
    xs = wb.shard_tensor(x, mesh, place).requires_grad_()
    with wb.trace("a100") as tr:
        m(xs).sum().backward()
    return tr, m, xs


def _f_all_reduce(tr, kind="all_reduce"):
    (ar,) = [e for e in tr.events if e.name == kind and e.label.startswith("f: ")
             and 0 in e.ranks]
    return ar


def _fc1_backward(tr):
    lin = [e for e in tr.events if e.name == "linear" and e.args.get("phase") == "backward"
           and 0 in e.ranks]
    return lin[-3], lin[-2], lin[-1]     # fc1's: the last linear backward recorded


def _alone(ev):
    return ev.args.get("alone", ev.duration)


@pytest.mark.parametrize("dp", [1, 2])
def test_f_all_reduce_hidden_by_the_wgrad(dp):
    tr, _, _ = _run(dp=dp)
    dgrad, wgrad, bias = _fc1_backward(tr)
    ar = _f_all_reduce(tr)
    assert [e.args["part"] for e in (dgrad, wgrad, bias)] == ["dgrad", "wgrad", "bias"]
    assert ar.start == dgrad.end == wgrad.start             # beside the wgrad
    assert bias.start == wgrad.end                          # then the bias's sum
    assert ar.args["overlaps"] == "wgrad"
    want = sim_cost.price("all_reduce", T * H * 2, [0, 1], "a100")
    assert ar.duration == pytest.approx(want, rel=1e-12)
    hidden = min(ar.end, bias.end) - wgrad.start
    assert hidden > 0 and hidden == pytest.approx(min(ar.duration, bias.end - wgrad.start),
                                                  rel=1e-12)
    # the step ends when both have: the compute stream waited for the all-reduce
    for r in (0, 1):
        assert tr.now(r) == max(ar.end, bias.end)
    # every tp group's (dp 2: two) runs beside the wgrad and the sum, which run on the SMs
    # NCCL leaves
    fs = [e for e in tr.events if e.label.startswith("f: ")]
    assert len(fs) == dp and all(e.args["overlaps"] == "wgrad" for e in fs)
    work = _alone(wgrad) + _alone(bias)
    assert wgrad.args["alone"] < wgrad.duration
    assert bias.end - wgrad.start == pytest.approx(
        min(ar.duration, work * 108 / 84) + max(0.0, work - ar.duration * 84 / 108),
        rel=1e-12)


def test_sequence_parallel_reduce_scatter_hidden_by_the_wgrad():
    """Sequence parallel: f all-gathers the sequence forward; its backward reduce-scatter
    of the input gradient (Korthikanti et al. sec. 4.2.2) runs beside the wgrad too.
    fc1 kept the sequence SHARD of its input, so its backward first all-gathers it again
    (Megatron-LM's ``LinearWithGradAccumulationAndAsyncCommunication``: issued before
    the dgrad GEMM, waited for before the wgrad GEMM); the reduce-scatter queues behind
    it on the tp group's stream, so both start when the dgrad and the gather are done."""
    tr, _, _ = _run(sp=True)
    dgrad, wgrad, bias = _fc1_backward(tr)
    rs = _f_all_reduce(tr, "reduce_scatter")
    (ag,) = [e for e in tr.events if e.label == "f: re-gather" and 0 in e.ranks]
    assert ag.name == "all_gather" and ag.args["overlaps"] == "dgrad"
    assert ag.start == dgrad.start                      # issued with the dgrad
    assert ag.duration == pytest.approx(
        sim_cost.price("all_gather", T * H * 2, [0, 1], "a100"), rel=1e-12)
    assert wgrad.start == rs.start == max(dgrad.end, ag.end)
    assert rs.args["overlaps"] == "wgrad"
    assert rs.duration == pytest.approx(
        sim_cost.price("reduce_scatter", T * H * 2, [0, 1], "a100"), rel=1e-12)
    hidden = min(rs.end, bias.end) - wgrad.start
    assert hidden > 0 and hidden == pytest.approx(min(rs.duration, bias.end - wgrad.start),
                                                  rel=1e-12)


def test_compute_is_each_ops_backward_cost():
    """Each linear's dgrad + wgrad + its bias's sum: its backward FLOPs and bytes
    (``wb.ops.cost("linear")`` on one rank's shards), split by hand: dgrad reads dY and W
    and writes dX, wgrad reads X and writes dW, the sum reads dY again and writes the
    bias's gradient; each a kernel on its roofline."""
    tr, _, _ = _run()
    x, h1 = torch.empty(T, H, dtype=BF16), torch.empty(T, 2 * H, dtype=BF16)
    shapes = {"fc1": (x, torch.empty(2 * H, H, dtype=BF16), torch.empty(2 * H, dtype=BF16),
                      h1),
              "fc2": (h1, torch.empty(H, 2 * H, dtype=BF16), torch.empty(H, dtype=BF16),
                      torch.empty(T, H, dtype=BF16))}
    bwd = [e for e in tr.events if e.name == "linear" and e.args.get("phase") == "backward"
           and 0 in e.ranks]
    assert len(bwd) == 6                                 # fc2 then fc1, three events each
    for (d, w, b), name in zip((bwd[:3], bwd[3:]), ("fc2", "fc1")):
        xi, wi, bi, out = shapes[name]
        (M, K), N = xi.shape, wi.shape[0]
        c = wb.ops.cost("linear", xi, wi, bi)
        assert (d.flops, w.flops, b.flops) == (2 * M * K * N, 2 * M * K * N, M * N)
        assert d.flops + w.flops + b.flops == c.backward_flops
        assert (d.bytes, w.bytes, b.bytes) == (2 * (M * N + N * K + M * K),
                                               2 * (M * K + N * K), 2 * (N + M * N))
        assert d.bytes + w.bytes + b.bytes == backward_bytes(
            [xi, wi, bi], [out], c.saved_bytes_fused) + 2 * M * N       # dY read again
        for ev, cls in ((d, "matmul"), (w, "matmul"), (b, "reduction")):
            # priced alone; a wgrad or sum beside f's all-reduce lasts longer
            assert ev.args["op_class"] == cls
            assert _alone(ev) == sim_cost.compute_time(ev.flops, ev.bytes, tr.profile, BF16,
                                                       cls)
            assert ev.duration >= _alone(ev)


def test_blocking_when_something_runs_between_dgrad_and_the_all_reduce():
    """f's input feeds a GELU before fc1 (not the linear): its backward runs after fc1's
    wgrad, so the input gradient is ready only then and the all-reduce blocks."""
    tr, _, _ = _run(first=nn.GELU())
    ar = _f_all_reduce(tr)
    (gelu,) = [e for e in tr.events if e.name == "gelu" and e.args.get("phase") == "backward"
               and 0 in e.ranks]
    assert ar.args["overlaps"] == "" and ar.start >= gelu.end


@pytest.mark.parametrize("sp,seq", [(False, 6), (True, 6), (True, 5)])
def test_input_gradient_is_the_single_device_one(sp, seq):
    """The math of f is unchanged: the input gradient summed over tp (float32, small);
    a sequence that does not split evenly (uneven shards) keeps the blocking path, with
    ``regather=False`` (the re-gather raises there: fixlist6, tests/test_fixlist6.py)."""
    mesh = wb.Mesh.grid(2, ["tp"])
    torch.manual_seed(0)
    fc1, fc2 = nn.Linear(16, 32), nn.Linear(32, 16)
    ref = nn.Sequential(fc1, nn.ReLU(), fc2)
    x = torch.randn(3, seq, 16, requires_grad=True)
    ref(x).sum().backward()
    par = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    par.load_state_dict(ref.state_dict())
    wb.parallelize(par, mesh, {"0": "colwise", "2": "rowwise"}, mesh_dim="tp")
    uneven = sp and seq % 2 == 1
    tensor_parallel_region(par, mesh, "tp", sp=sp, regather=not uneven)
    place = [wb.Shard(1) if sp else wb.Replicate()]
    xs = wb.shard_tensor(x.detach(), mesh, place).requires_grad_()
    with wb.trace("a100") as tr:
        par(xs).sum().backward()
    kind = "reduce_scatter" if sp else "all_reduce"
    assert _f_all_reduce(tr, kind).args.get("overlaps") == ("wgrad" if seq % 2 == 0 else None)
    torch.testing.assert_close(xs.grad.full(), x.grad)


def test_async_collective_starts_when_its_data_is_ready():
    """``Trace.record_collective(ready=)``: an async collective whose data was produced
    before the compute clock starts then (or when the comm stream frees), not after."""
    from workbench.sim_mesh.trace import Trace
    tr = Trace("a100")
    tr.record_compute([0, 1], "dgrad", 2.0)
    tr.record_compute([0, 1], "wgrad", 3.0)
    h = tr.record_collective([0, 1], "all_reduce", 4.0, overlap=True, ready=2.0)
    assert tr.events[-1].start == 2.0 and h.end == 6.0
    # the wgrad, recorded before it, runs beside it on 84 of the 108 SMs (NCCL holds 24
    # for a group inside one node: kernel_cost.collective_sms)
    assert tr.now(0) == pytest.approx(2.0 + 3.0 * 108 / 84) and tr.now(0, "comm") == 6.0
    wgrad = tr.events[1]
    assert wgrad.args["alone"] == 3.0 and wgrad.end == tr.now(0)
    tr.wait(h)
    assert tr.now(0) == 6.0                      # hidden: min(4, 3) = 3 of the 4
    tr.record_collective([0, 1], "all_reduce", 1.0, overlap=True, ready=0.0)
    assert tr.events[-1].start == 6.0            # after the stream's previous collective


@pytest.mark.parametrize("zero, label", [(2, "zero-2 grad (async)"), (3, "zero-3 params")])
def test_zero_reduce_scatter_after_the_input_gradients_all_reduce(zero, label):
    """ZeRO-2/3 with TP: fc1's weight gradient exists only after the wgrad, so its
    reduce-scatter is issued after f's all-reduce of the input gradient (Megatron launches
    that one before the wgrad GEMM), though autograd runs the gradient's hook first; the
    all-reduce starts when the dgrad ends and the compute waits for it alone."""
    tr, _, _ = _run(dp=2, zero=zero)
    dgrad, wgrad, bias = _fc1_backward(tr)
    ar = _f_all_reduce(tr)
    comm0 = [e for e in tr.collectives() if 0 in e.ranks]
    rs = [e for e in comm0 if e.name == "reduce_scatter" and e.label == label][-2:]
    assert all(e.start >= wgrad.end for e in rs)            # fc1's weight and bias
    assert ar.args["overlaps"] == "wgrad"
    assert comm0.index(ar) < min(comm0.index(e) for e in rs)      # issued first
    # on the tp group's stream, free when the dgrad ends (the dp group's reduce-scatters,
    # fc2's still running, on their own stream)
    assert ar.start == dgrad.end
    assert all(e.start >= wgrad.end for e in rs)
    for r in (0, 1):
        assert tr.now(r) == max(ar.end, bias.end)           # nothing else waited for


def test_async_collective_recorded_after_two_kernels_times_both_again():
    """A wgrad and the bias's sum after it, recorded before the collective on the input
    gradient (ready when the dgrad ended): both are timed again beside it, in order, the
    sum from the stretched wgrad's end; work beside the collective at 84 / 108."""
    from workbench.sim_mesh.trace import Trace
    tr = Trace("a100")
    tr.record_compute([0, 1], "dgrad", 2.0)
    tr.record_compute([0, 1], "wgrad", 3.0)
    tr.record_compute([0, 1], "bias", 1.0)
    h = tr.record_collective([0, 1], "all_reduce", 4.0, overlap=True, ready=2.0)
    _, wgrad, bias, ar = tr.events
    assert (ar.start, ar.end) == (2.0, 6.0)
    assert wgrad.start == 2.0 and wgrad.end == pytest.approx(2.0 + 3.0 * 108 / 84)
    assert bias.start == wgrad.end and bias.args["alone"] == 1.0
    # 4 s of collective leave 4 * 84 / 108 of the 4 s of work done by 6.0: the rest alone
    assert bias.end == pytest.approx(6.0 + 4.0 - 4.0 * 84 / 108)
    assert tr.now(0) == tr.now(1) == bias.end
    tr.wait(h)
    assert tr.now(0) == bias.end
    # nothing is timed again once a rank waited after them (its clock is not theirs)
    from workbench.sim_mesh.trace import Handle
    tr2 = Trace("a100")
    tr2.record_compute([0, 1], "dgrad", 2.0)
    tr2.record_compute([0, 1], "wgrad", 3.0)
    tr2.wait(Handle((0,), 9.0))
    tr2.record_collective([0, 1], "all_reduce", 4.0, overlap=True, ready=2.0)
    assert [e.duration for e in tr2.events[:2]] == [2.0, 3.0]


def test_deferred_collectives_take_the_stream_in_the_order_their_data_came():
    """``Trace.defer``: recorded before the next event, except an async collective whose
    data was ready earlier, which goes first."""
    from workbench.sim_mesh.trace import Trace
    tr = Trace("a100")
    tr.record_compute([0, 1], "dgrad", 2.0)
    tr.record_compute([0, 1], "wgrad", 3.0)
    got = []
    tr.defer(5.0, lambda: got.append(tr.record_collective([0, 1], "reduce_scatter", 1.0,
                                                          overlap=True, ready=5.0)))
    assert got == [] and tr.now(0) == 5.0                   # the compute clock: not yet
    h = tr.record_collective([0, 1], "all_reduce", 4.0, overlap=True, ready=2.0)
    assert [e.name for e in tr._events] == ["dgrad", "wgrad", "all_reduce"]
    tr.wait(h)                                              # the next event: recorded now
    assert [e.name for e in tr.events][-1] == "reduce_scatter"
    assert tr.events[-1].start == 6.0 and got[0].end == 7.0     # after the all-reduce
    # before anything else: a compute event, a blocking collective, a read of the clock
    for nxt in (lambda: tr.record_compute([0, 1], "x", 1.0),
                lambda: tr.record_collective([0, 1], "all_reduce", 1.0),
                lambda: tr.now(0, "comm"), lambda: tr.time()):
        n = len(tr._events)
        tr.defer(tr.now(0), lambda: tr.record_collective([0, 1], "reduce_scatter", 1.0,
                                                         overlap=True))
        nxt()
        assert tr._events[n].name == "reduce_scatter" and not tr._deferred
    # deferred ones go in the order their data was ready, whatever order they came in
    tr.defer(9.0, lambda: tr.record_collective([0, 1], "b", 1.0, overlap=True, ready=9.0))
    tr.defer(8.0, lambda: tr.record_collective([0, 1], "a", 1.0, overlap=True, ready=8.0))
    assert [e.name for e in tr.events][-2:] == ["a", "b"]


def test_each_group_has_its_own_comm_stream():
    """One comm stream per group of ranks (ProcessGroupNCCL: a stream per process group,
    per point-to-point pair): a group's collectives in order, two groups side by side; a
    blocking collective waits for its own group's stream only; "comm" reads the latest."""
    from workbench.sim_mesh.trace import Trace
    tr = Trace("a100")
    dp = tr.record_collective([0, 2], "reduce_scatter", 5.0, overlap=True)
    tp = tr.record_collective([0, 1], "all_reduce", 2.0, overlap=True)
    assert tr.events[-1].start == 0.0 and tp.end == 2.0     # beside the dp one
    tr.record_collective([0, 2], "all_gather", 1.0, overlap=True)
    assert tr.events[-1].start == dp.end == 5.0             # behind the dp one
    assert tr.now(0, "comm") == 6.0 and tr.now(1, "comm") == 2.0
    tr.record_collective([0, 1], "all_reduce", 1.0)             # blocking, on tp
    assert tr.events[-1].start == 2.0 and tr.now(0) == tr.now(1) == 3.0
    tr.record_send(0, 4, "send_recv", 1.0, ready=tr.now(0))    # its own pair's stream
    assert tr.events[-1].start == 3.0 and tr.now(4, "comm") == 4.0
    tr.barrier([0, 1, 2])
    assert {tr.now(r, s) for r in (0, 1, 2) for s in ("compute", "comm")} == {6.0}
    tr.record_collective([0, 1], "all_reduce", 1.0, overlap=True)
    assert tr.events[-1].start == 6.0                        # the barrier held every stream
