"""Communication at scale: the pipelined hierarchical all-reduce (exact, and priced as
fill/drain + (c-1) x the slowest phase), TP over idle NICs, and the comm_scale sweep."""
import importlib.util
import pathlib

import pytest
import torch

import workbench as wb
from workbench.sim_mesh import collectives as C
from workbench.sim_mesh import cost
from workbench.sim_mesh.hierarchical import hierarchical_all_reduce, plan_pipelined_all_reduce
from workbench.sim_mesh.nic_assist import nic_assisted, nic_share
from workbench.sim_mesh.profiles import get_profile

NPU, A100 = get_profile("ascend-910b"), get_profile("a100")
GiB = 2 ** 30


@pytest.mark.parametrize("name", ["a100", "h100", "ascend-910b"])
@pytest.mark.parametrize("n", [2 ** 10, 2 ** 20, 2 ** 27, GiB])
def test_plan_is_the_clocks_pipelined_price(name, n):
    plan = plan_pipelined_all_reduce(n, range(32), name)
    assert plan.seconds == pytest.approx(cost.price("all_reduce", n, range(32), name,
                                                    "pipelined"), rel=1e-12)
    assert plan.hierarchical == pytest.approx(cost.price("all_reduce", n, range(32), name,
                                                         "hierarchical"), rel=1e-12)
    assert plan.flat_ring == cost.price("all_reduce", n, range(32), name, "ring")
    # max-of-phases plus fill/drain, plus the last all-gather's wait behind the previous
    # one when the all-gather outlasts the inter-node all-reduce
    x, y, z, c = plan.reduce_scatter, plan.all_reduce, plan.all_gather, plan.chunks
    wait = max(0.0, z - y) if c > 1 else 0.0
    assert plan.seconds == pytest.approx((x + y + z) + (c - 1) * max(x + z, y) + wait)


def test_phases_are_hccl_mesh_and_a_nic_ring():
    # 910B, 4 servers x 8 NPUs, 4 chunks: HCCL Mesh inside (user guide: alpha + n/p beta
    # per HCCS link), a ring of n/(c k) over the 4 servers' RoCE NICs between them
    n, c, k, m = GiB, 4, 8, 4
    plan = plan_pipelined_all_reduce(n, range(32), NPU, chunks=c)
    link = NPU.intra_node.bandwidth / 7
    a_in, a_out, nic = NPU.intra_node.latency, NPU.inter_node.latency, NPU.inter_node.bandwidth
    assert plan.reduce_scatter == pytest.approx(a_in + n / c / k / link)
    assert plan.all_gather == pytest.approx(a_in + n / c / k / link)
    # between servers HCCL takes ring or H-D_R (recursive halving-doubling, 2 log2 m
    # steps), whichever is faster: for m = 4 the H-D's 4 latencies beat the ring's 6
    ring = 2 * (m - 1) * a_out + 2 * (m - 1) / m * (n / c / k) / nic
    hd = 2 * 2 * a_out + 2 * (m - 1) / m * (n / c / k) / nic
    assert plan.all_reduce == pytest.approx(min(ring, hd)) and hd < ring
    # large messages: the pipeline hides the faster phase; far faster than the flat ring
    best = plan_pipelined_all_reduce(n, range(32), NPU)
    assert best.seconds < 0.7 * best.hierarchical and best.speedup > 5
    assert best.seconds >= max(best.chunks * best.bottleneck, best.fill_drain)


@pytest.mark.parametrize("name,n,c", [("ascend-910b", GiB, 8), ("a100", 2 ** 26, 16),
                                      ("h100", 2 ** 20, 3)])
def test_timeline_respects_links_and_dependencies(name, n, c):
    plan = plan_pipelined_all_reduce(n, range(64), name, chunks=c)
    tl = plan.timeline()
    assert len(tl) == 3 * c
    assert max(ph.end for ph in tl) == pytest.approx(plan.seconds)
    for link in ("intra", "inter"):          # one phase at a time on each kind of link
        spans = sorted((ph.start, ph.end) for ph in tl if ph.link == link)
        assert all(a[1] <= b[0] + 1e-15 for a, b in zip(spans, spans[1:]))
    by = {(ph.chunk, ph.name): ph for ph in tl}
    for i in range(c):                        # RS, then AR, then AG, chunk by chunk
        assert by[(i, "reduce_scatter")].end <= by[(i, "all_reduce")].start + 1e-15
        assert by[(i, "all_reduce")].end <= by[(i, "all_gather")].start + 1e-15


@pytest.mark.parametrize("name", ["a100", "h100", "ascend-910b"])
def test_timeline_is_feasible_and_ends_at_the_price_for_any_chunks(name):
    # the all-gather outlasting the all-reduce (z > y: one NVLink node pair at 4 MiB on
    # the A100s) used to put the last two all-gathers on the NVLink at once
    seen_wait = False
    for p in (16, 64):
        for n in (2 ** 16, 2 ** 22, 2 ** 24, GiB):
            for c in (1, 2, 3, 8):
                plan = plan_pipelined_all_reduce(n, range(p), name, chunks=c)
                tl = plan.timeline()
                seen_wait |= plan.all_gather > plan.all_reduce and c > 1
                assert max(ph.end for ph in tl) == pytest.approx(plan.seconds)
                for link in ("intra", "inter"):
                    spans = sorted((ph.start, ph.end) for ph in tl if ph.link == link)
                    assert all(a[1] <= b[0] + 1e-15 for a, b in zip(spans, spans[1:]))
                by = {(ph.chunk, ph.name): ph for ph in tl}
                for i in range(c):
                    assert by[(i, "reduce_scatter")].end <= by[(i, "all_reduce")].start + 1e-15
                    assert by[(i, "all_reduce")].end <= by[(i, "all_gather")].start + 1e-15
    assert seen_wait or name == "ascend-910b"


def test_trace_of_an_intra_bound_pipeline_is_the_price():
    plan = plan_pipelined_all_reduce(2 ** 22, range(16), A100, chunks=2)
    assert plan.all_gather > plan.all_reduce           # the case that waits
    mesh = wb.Mesh.grid((16,), ["dp"])
    x = torch.ones(16, 2 ** 20)                         # 4 MiB per rank
    with wb.trace("a100") as tr:
        hierarchical_all_reduce(x, mesh, 0, chunks=2)
    assert tr.time() == pytest.approx(plan.seconds)
    assert "last all-gather's wait" in str(plan)


@pytest.mark.parametrize("shape,axis,chunks", [((32,), 0, 4), ((2, 16), 1, 3), ((16, 2), 0, None),
                                               ((8,), 0, 2)])
def test_hierarchical_all_reduce_is_an_all_reduce(shape, axis, chunks):
    mesh = wb.Mesh.grid(shape, [f"d{i}" for i in range(len(shape))])
    g = torch.Generator().manual_seed(len(shape) + axis)
    # integer values: any summation order gives the same float, so equality is exact
    x = torch.randint(-8, 8, shape + (5, 3), generator=g).float()
    ref = C.all_reduce(x, mesh, axis)
    got = hierarchical_all_reduce(x, mesh, axis, chunks=chunks, profile="ascend-910b")
    assert got.shape == ref.shape and torch.equal(got, ref)
    # random floats: the same sum up to rounding; max is exact
    xf = torch.randn(shape + (7,), generator=g, dtype=torch.float64)
    torch.testing.assert_close(hierarchical_all_reduce(xf, mesh, axis, chunks=chunks),
                               C.all_reduce(xf, mesh, axis))
    assert torch.equal(hierarchical_all_reduce(xf, mesh, axis, op="max", chunks=chunks),
                       C.all_reduce(xf, mesh, axis, "max"))


def test_hierarchical_all_reduce_gradient_is_the_all_reduces():
    mesh = wb.Mesh.grid((16,), ["dp"])
    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, 6, 5, generator=g, dtype=torch.float64)
    w = torch.randn(1, 6, 5, generator=g, dtype=torch.float64)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    (hierarchical_all_reduce(a, mesh, 0, chunks=3, profile="a100") * w).sum().backward()
    (C.all_reduce(b, mesh, 0) * w).sum().backward()
    torch.testing.assert_close(a.grad, b.grad)


def test_hierarchical_all_reduce_records_the_pipelined_timeline():
    mesh = wb.Mesh.grid((32,), ["dp"])
    x = torch.ones(32, 1024, 256)               # 1 MiB per rank
    with wb.trace("ascend-910b") as tr:
        y = hierarchical_all_reduce(x, mesh, 0, chunks=4)
    assert torch.equal(y, torch.full((1, 1024, 256), 32.0))
    plan = plan_pipelined_all_reduce(2 ** 20, range(32), NPU, chunks=4)
    assert tr.time() == pytest.approx(plan.seconds)
    # per chunk: a reduce-scatter and an all-gather on each of 4 nodes, an all-reduce on
    # each of the 8 rails
    assert tr.counts() == {"reduce_scatter": 16, "all_gather": 16, "all_reduce": 32}
    # every rank sends what a flat ring would: 2 (p-1)/p n in all (the phases move no
    # extra bytes), chunk by chunk
    sent = tr.bytes_per_rank()
    k, m, n = 8, 4, 2 ** 20
    assert sent[0] == 2 * (k - 1) * n // k + 2 * (m - 1) * n // (k * m)


def test_hierarchical_all_reduce_bad_input():
    with pytest.raises(ValueError, match="same number"):
        plan_pipelined_all_reduce(1024, [0, 1, 8], "a100")
    with pytest.raises(ValueError, match="chunks=0"):
        plan_pipelined_all_reduce(1024, range(16), "a100", chunks=0)
    mesh = wb.Mesh([[0, 8], [1, 9]], ["a", "b"])          # groups along "a" straddle nodes
    x = torch.ones(2, 2, 4)
    with pytest.raises(ValueError, match="not ordered node by node"):
        hierarchical_all_reduce(x, wb.Mesh([8, 0], ["dp"]), 0, profile="a100")
    assert torch.equal(hierarchical_all_reduce(x, mesh, 1, profile="a100"),
                       C.all_reduce(x, mesh, 1))


# ---- tensor parallelism over idle NICs ------------------------------------------

def test_nic_share_is_bandwidth_proportional():
    # A100: NCCL's 235 GB/s on NVLink, 24 GB/s per HDR NIC (one per GPU)
    assert nic_share("a100") == pytest.approx(24 / (24 + 0.783 * 300))
    assert nic_share("ascend-910b") == pytest.approx(25 / (25 + 196))


@pytest.mark.parametrize("name", ["a100", "h100", "ascend-910b"])
def test_nic_assisted_prices_both_parts(name):
    prof, n = get_profile(name), 2 ** 28
    r = nic_assisted("all_reduce", n, range(8), name)
    s = r.nic_share
    assert r.baseline == cost.price("all_reduce", n, range(8), name)
    assert r.intra_seconds == cost.price("all_reduce", (1 - s) * n, range(8), name)
    # the NIC part: a ring over the 8 NICs, 2(p-1) alpha + 2 (p-1)/p s n / B_nic
    a, nic = prof.inter_node.latency, prof.inter_node.effective_bandwidth
    assert r.nic_seconds == pytest.approx(14 * a + 2 * 7 / 8 * s * n / nic)
    assert r.seconds == max(r.intra_seconds, r.nic_seconds)
    assert 1.03 < r.speedup < 1 / (1 - s)       # large: gains, at most the bytes moved off
    small = nic_assisted("all_reduce", 2 ** 16, range(8), name)
    assert small.speedup < 1                    # small: the NIC ring's latency loses
    assert nic_assisted("all_gather", n, range(8), name, share=0).seconds == \
        cost.price("all_gather", n, range(8), name)


def test_nic_assisted_bad_input():
    with pytest.raises(ValueError, match="one node"):
        nic_assisted("all_reduce", 1024, range(16), "a100")
    with pytest.raises(ValueError, match="share=1.5"):
        nic_assisted("all_reduce", 1024, range(8), "a100", share=1.5)
    with pytest.raises(ValueError, match="broadcast"):
        nic_assisted("broadcast", 1024, range(8), "a100")


# ---- the sweep -------------------------------------------------------------------

def _bench():
    path = pathlib.Path(__file__).parents[1] / "benchmarks" / "comm_scale.py"
    spec = importlib.util.spec_from_file_location("comm_scale", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_comm_scale_sweep_reads_the_clock_and_the_formula():
    b = _bench()
    data = b.sweep(["a100", "ascend-910b"], ranks=[8, 64], sizes=[2 ** 20, GiB])
    n, clock, formula, alg = data["a100"][8][1]
    assert clock == cost.bus_bandwidth("all_reduce", GiB, 8,
                                       cost.choose("all_reduce", GiB, range(8), "a100").seconds)
    # one node, large: both near NCCL's 235 GB/s busbw (published 232.5, nccl-tests #175)
    assert 225e9 < clock < 235e9 and 225e9 < formula < 235e9
    # HCCL mesh inside a server: the formula is the user guide's Mesh, as the clock prices it
    assert data["ascend-910b"][8][0][1] == pytest.approx(data["ascend-910b"][8][0][2])
    text = b.table(data, show_ranks=(8, 64), show_sizes=(2 ** 20, GiB))
    assert "nccl-tests issue #175" in text and "no published HCCL" in text
    # a figure a profile was fitted to is marked so; an independent one is not
    lines = b.table(b.sweep(["h100"], ranks=[8, 16], sizes=[GiB]), show_ranks=(8, 16),
                    show_sizes=(GiB,)).splitlines()
    fitted = [ln for ln in lines if "FITTED" in ln]
    assert len(fitted) == 1 and "#212" in fitted[0] and "p=8" in fitted[0]
    assert any("#319" in ln and "independent" in ln for ln in lines)
