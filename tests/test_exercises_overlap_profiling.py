"""The checks of notebooks 10 and 12: right answers pass, common mistakes get their hint,
and the checks' hand formulas agree with the library (which they must not call)."""
import pytest
import torch

import workbench as wb
from workbench.exercises import checks_overlap_profiling as C
from workbench.exercises.feedback import CheckError, reset_tries
from workbench.parallel.strategies.overlap import expected_hidden_share
from workbench.parallel.strategies.overlap_multicopy import multi_copy_estimate
from workbench.sim_mesh import cost
from workbench.sim_mesh.profiles import Link, Profile
from workbench.sim_mesh.trace import trace


@pytest.fixture(autouse=True)
def _fresh():
    reset_tries()
    yield
    reset_tries()


def fails(fn, *args, match, **kw):
    with pytest.raises(CheckError, match=match):
        fn(*args, **kw)


def test_hidden_share():
    C.check_hidden_share(0.525)
    fails(C.check_hidden_share, 0.75, match="at most C/M")
    fails(C.check_hidden_share, 0.7, match=r"multiply by \(1 - 1/k\)")
    fails(C.check_hidden_share, "x", match="should be a number")
    fails(C.check_hidden_share, 52.5, match="percentage")            # 52.5% for 0.525
    fails(C.check_hidden_share, 0.25 * 0.7, match=r"the other \(1 - 1/k\)")   # 1/k, not 1 - 1/k
    fails(C.check_hidden_share, -0.525, match="between 0 \\(none hidden\\) and 1")   # a sign slip
    for c, m, k in [(1.2, 2.0, 4), (3.0, 1.0, 8), (1.0, 1.0, 1)]:
        want = expected_hidden_share(c, m, k)
        C.check_hidden_share(want, compute_ms=c, comm_ms=m, k=k)


def test_multi_copy_forward():
    C.check_multi_copy_forward_ms(8.0)
    fails(C.check_multi_copy_forward_ms, 12.0, match="one copy of the whole batch")
    fails(C.check_multi_copy_forward_ms, 7.5, match="here one is longer")
    fails(C.check_multi_copy_forward_ms, 8000.0, match="1,000 times too large: a unit slip")
    fails(C.check_multi_copy_forward_ms, 0.008, match="1,000 times too small: a unit slip")


def test_multi_copy_forward_without_a_formula_says_how_to_schedule():
    """Exercise 2 is a schedule drawn by hand: a wrong time no mistake explains is told
    how to walk the two streams, not to "compare each factor with the formula"."""
    with pytest.raises(CheckError, match="walk the two streams") as err:
        C.check_multi_copy_forward_ms(9.3)
    assert "formula" not in str(err.value)


@pytest.mark.parametrize("link", [2e10, 1e11, 1e12])
def test_hand_schedule_equals_the_clock(link):
    """On a flat profile the library's two-copy forward takes the hand schedule's time."""
    prof = Profile(name="flat", description="test", peak_flops={"float32": 1e14, "bfloat16": 1e14, "float16": 1e14},
                   memory_bandwidth=1e18, memory_bytes=10 ** 12, devices_per_node=64,
                   intra_node=Link("l", link, 0.0), inter_node=Link("l", link, 0.0))
    r = multi_copy_estimate(2, 256, 512, 8, 2048, wb.Mesh.grid(4, ("tp",)), "tp",
                            profile=prof, dtype=torch.float32)
    d = {(e.stream, e.label): e.duration for e in r.forward.events}
    a, f, m = d["compute", "attention A"], d["compute", "ffn A"], d["comm", "attention A"]
    assert d["comm", "ffn B"] == pytest.approx(m)
    assert r.forward.total == pytest.approx(C._two_copy_schedule(a, f, m))


def test_best_chunks():
    C.check_best_chunks(4)
    C.check_best_chunks(4.0)                   # an integral float is that int
    fails(C.check_best_chunks, 32, match="pays the link latency again")
    fails(C.check_best_chunks, 1, match="more chunks would still hide")
    fails(C.check_best_chunks, 3, match="not one of the candidates")
    C.check_best_chunks(32, latency_us=0.0, launch_us=0.0)   # no overhead: more is better


def test_fusion_needs_the_memory_efficiency():
    """Leaving out memory_efficiency moves the unfused time by 1e-4 of it (5002.6 vs
    5003.0 us): it is rejected and named; a rounded right answer still passes."""
    p = wb.get_profile("ascend-910b")
    bw = p.memory_bandwidth * p.memory_efficiency
    right_u = 1000 * (4096 / bw + p.launch_overhead) * 1e6
    right_f = (1000 * 4096 / bw + p.launch_overhead) * 1e6
    no_eff = 1000 * (4096 / p.memory_bandwidth + p.launch_overhead) * 1e6
    assert round(no_eff, 1) == 5002.6 and round(right_u, 1) == 5003.0
    fails(C.check_fusion_us, no_eff, right_f, match="x memory_efficiency")
    # the message tells the two apart, not "5003 us ... expected 5003 us"
    fails(C.check_fusion_us, no_eff, right_f, match=r"is 5002\.6 us: ")
    fails(C.check_fusion_us, no_eff, right_f, match=r"expected 5003 us")      # 3rd try
    fails(C.check_fusion_us, 1000 * p.launch_overhead * 1e6, right_f, match="launches alone")
    fails(C.check_fusion_us, right_u, p.launch_overhead * 1e6, match="launch alone")
    C.check_fusion_us(round(right_u, 1), right_f)
    C.check_fusion_us(round(right_u), right_f)


def test_fusion_agrees_with_the_clock():
    n, nbytes = 1000, 4096
    unfused = cost.compute_time(0, nbytes, "ascend-910b", "bfloat16") * n * 1e6
    fused = cost.compute_time(0, n * nbytes, "ascend-910b", "bfloat16") * 1e6
    C.check_fusion_us(unfused, fused)
    fails(C.check_fusion_us, fused, fused, match="n launches")
    fails(C.check_fusion_us, unfused, unfused, match="launches once")


def _trace():
    with trace("a100") as tr:
        tr.record_compute([0, 1], "mm", 3e-6)
        tr.record_compute([0, 1], "add", 1e-6)
        tr.record_compute([0, 1], "add", 1e-6)
        tr.record_compute([0, 1], "add", 1e-6)
        tr.record_collective([0, 1], "all_reduce", 4e-6)
        tr.record_compute([0], "mm", 1e-6)
    return tr


def test_top_op_and_idle_share():
    tr = _trace()
    C.check_top_op("mm", tr)
    fails(C.check_top_op, "add", tr, match="most FREQUENT")
    fails(C.check_top_op, "gelu", tr, match="no compute event")
    fails(C.check_top_op, "aten::mm", tr, match=r"not aten's kernels\): add, mm( \(|$)")
    C.check_idle_share(4 / 11, tr, rank=0)         # busy 7 of 11 us
    C.check_idle_share(1 - tr.busy(0, "compute") / tr.time(), tr)
    fails(C.check_idle_share, 7 / 11, tr, match="BUSY share")
    fails(C.check_top_op, "mm", [1], match="pass the Trace")


def test_idle_share_from_idle_gaps_is_told_about_the_tail():
    """idle_gaps counts the gaps between a rank's kernels; the step also idles after the
    last kernel (the gradient all-reduce): that answer gets that diagnosis, and a wrong
    answer no mistake explains is told the method, not "the formula"."""
    from workbench.npu.profiler import idle_gaps
    with trace("a100") as tr:
        tr.record_compute([0, 1], "mm", 2e-6)
        tr.record_collective([0, 1], "all_reduce", 3e-6)
        tr.record_compute([0, 1], "mm", 2e-6)
        tr.record_collective([0, 1], "all_reduce", 4e-6)
    assert tr.time() == pytest.approx(11e-6)
    C.check_idle_share(7 / 11, tr)                             # busy 4 of 11 us
    gaps = idle_gaps(tr.to_chrome_trace(), 0, 0)
    from_gaps = sum(e - s for s, e in gaps) / (tr.time() * 1e6)
    assert from_gaps == pytest.approx(3 / 11)
    fails(C.check_idle_share, from_gaps, tr, match="4.0 us after its last kernel")
    fails(C.check_idle_share, 7.0, tr, match="idle TIME in microseconds")   # 7 of 11 us
    fails(C.check_idle_share, 7e-6, tr, match="idle TIME in seconds")
    with pytest.raises(CheckError, match="merge rank 0's compute intervals") as err:
        C.check_idle_share(0.55, tr)
    assert "formula" not in str(err.value)


def test_top_op_says_when_counting_would_have_given_it_too(capsys):
    """In a launch-bound trace the most frequent op is also the longest: the right answer
    says so (a student who counted events is told why that worked here)."""
    with trace("a100") as tr:
        tr.record_compute([0], "mm", 3e-6)
        tr.record_compute([0], "add", 1.2e-6)
        tr.record_compute([0], "add", 1.2e-6)
        tr.record_compute([0], "add", 1.2e-6)
    C.check_top_op("add", tr)
    assert "also the most frequent op" in capsys.readouterr().out
    C.check_top_op("mm", _trace())
    assert "most frequent" not in capsys.readouterr().out
