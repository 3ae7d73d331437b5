"""The compute clock: roofline with per-op-class efficiency, launch cost, dtypes, and
every profile number cited (profiles/*.json ``citations``)."""
import json
import math
from importlib import resources

import pytest
import torch
from hypothesis import given, settings, strategies as st

from workbench.sim_mesh import cost
from workbench.sim_mesh.profiles import OP_CLASSES, dtype_name, get_profile, list_profiles

PROFILES = ["a100", "h100", "ascend-910b"]
FEW = settings(max_examples=40, deadline=None)


def _numbers(data, prefix=""):
    """Paths of every number in a profile's JSON, and of the measurement it prices from
    (``measured``'s file and kernel) and of the published table it prices attention from
    (``attention_table``) and the NCCL release its collective tables follow
    (``topology.nccl_version``): the keys ``citations`` must hold."""
    for k, v in data.items():
        path = f"{prefix}{k}"
        if isinstance(v, dict):
            yield from _numbers(v, path + ".")
        elif isinstance(v, (int, float)) and not isinstance(v, bool) or \
                path.startswith("measured.") or path in ("attention_table",
                                                         "topology.nccl_version") and v:
            yield path


@pytest.mark.parametrize("name", list_profiles())
def test_every_profile_number_cites_its_source(name):
    data = json.loads(resources.files("workbench.sim_mesh").joinpath(
        f"profiles/{name}.json").read_text())
    cited = data["citations"]
    missing = [p for p in _numbers({k: v for k, v in data.items() if k != "citations"})
               if p not in cited]
    assert not missing, f"{name}: numbers without a citation: {missing}"
    assert all(isinstance(s, str) and len(s) > 10 for s in cited.values())
    assert not set(cited) - set(_numbers(data)), "a citation names no number"


@pytest.mark.parametrize("name", PROFILES)
def test_efficiency_is_profile_data_for_every_class(name):
    p = get_profile(name)
    assert set(p.efficiency) == set(OP_CLASSES)
    assert all(0 < e <= 1 for e in p.efficiency.values()) and 0 < p.memory_efficiency <= 1
    assert p.launch_overhead > 0


def test_matmul_efficiency_from_published_measurements():
    # A100: an 8192^3 cuBLAS product on random inputs, 258 of 312 TFLOP/s (He 2024; the
    # card is power-limited: 295 on zeros); H100: the MAMF table's 792.1 of 989 (used
    # only where its measured file prices nothing: fp32 / tf32)
    a, h = get_profile("a100"), get_profile("h100")
    assert a.efficiency["matmul"] == pytest.approx(258 / 312, abs=1e-3)
    assert h.efficiency["matmul"] == pytest.approx(792.1 / 989, abs=1e-3)
    n = 8192
    flops, nbytes = 2 * n ** 3, 3 * n * n * 2
    t = cost.compute_time(flops, nbytes, a, torch.bfloat16, "matmul", launches=1)
    assert flops / (t - a.launch_overhead) == pytest.approx(258e12, rel=1e-3)


@FEW
@given(flops=st.floats(0, 1e15), nbytes=st.floats(0, 1e12),
       cls=st.sampled_from(OP_CLASSES), launches=st.integers(0, 100),
       name=st.sampled_from(PROFILES), dtype=st.sampled_from(["bf16", "fp32", "fp16"]))
def test_roofline_formula(flops, nbytes, cls, launches, name, dtype):
    p = get_profile(name)
    want = max(flops / (p.peak(dtype) * p.efficiency[cls]),
               nbytes / (p.memory_bandwidth * p.memory_efficiency)) + launches * p.launch_overhead
    assert cost.compute_time(flops, nbytes, p, dtype, op_class=cls,
                             launches=launches) == pytest.approx(want, rel=1e-12, abs=1e-18)


def test_positional_signature_still_works():
    a = get_profile("a100")
    assert cost.compute_time(1e9, 1e6, a, torch.float32) == cost.compute_time(
        1e9, 1e6, a, torch.float32, "elementwise", 1)


@pytest.mark.parametrize("name", PROFILES)
def test_launch_cost_dominates_many_small_kernels(name):
    p = get_profile(name)
    n = 1024                                   # 1,024 adds of 1,024 bf16 elements
    many = sum(cost.compute_time(n, 3 * 2 * n, p, "bf16") for _ in range(1024))
    fused = cost.compute_time(n * 1024, 3 * 2 * n * 1024, p, "bf16")
    assert many == pytest.approx(1024 * p.launch_overhead, rel=0.05)   # launch-bound
    assert many > 10 * fused                   # one fused kernel does the same work


@pytest.mark.parametrize("name", PROFILES)
def test_float64_slower_than_float32(name):
    p = get_profile(name)
    n = 2 ** 24                                 # an elementwise add of n elements
    t64 = cost.compute_time(n, 3 * 8 * n, p, torch.float64)
    t32 = cost.compute_time(n, 3 * 4 * n, p, torch.float32)
    assert t64 > t32
    m = 4096                                    # a square matmul: never faster in float64
    g64 = cost.compute_time(2 * m ** 3, 3 * 8 * m * m, p, "float64", "matmul")
    g32 = cost.compute_time(2 * m ** 3, 3 * 4 * m * m, p, "float32", "matmul")
    assert g64 >= g32


def test_float64_on_the_910b_runs_on_the_ai_cpu():
    n = get_profile("ascend-910b")
    assert "float64" not in n.peak_flops and n.compute_path("float64")[0] == "AI CPU"
    size = 2 ** 24
    t64 = cost.compute_time(size, 3 * 8 * size, n, "float64")
    t32 = cost.compute_time(size, 3 * 4 * size, n, "float32")
    assert t64 > 20 * t32
    m = 4096
    g64 = cost.compute_time(2 * m ** 3, 3 * 8 * m * m, n, "float64", "matmul")
    g32 = cost.compute_time(2 * m ** 3, 3 * 4 * m * m, n, "float32", "matmul")
    assert g64 > 100 * g32
    # the GPUs run float64 GEMMs on their tensor cores at the FP32 rate, not 100x slower
    a = get_profile("a100")
    assert cost.compute_time(2 * m ** 3, 0, a, "float64", "matmul") == pytest.approx(
        cost.compute_time(2 * m ** 3, 0, a, "float32", "matmul"))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.uint8, "int8"])
def test_integer_dtypes_are_priced_by_bandwidth(dtype):
    a = get_profile("a100")
    n = 2 ** 20
    size = torch.empty((), dtype=dtype).element_size() if isinstance(dtype, torch.dtype) else 1
    t = cost.compute_time(n, 2 * size * n, a, dtype, "elementwise", launches=0)
    assert t == pytest.approx(2 * size * n / (a.memory_bandwidth * a.memory_efficiency))


def test_explain_compute_names_the_bound():
    a = get_profile("a100")
    gemm = cost.explain_compute(2 * 8192 ** 3, 3 * 2 * 8192 ** 2, a, "bf16", "matmul")
    assert gemm["bound"] == "compute" and gemm["engine"] == "main"
    add = cost.explain_compute(2 ** 26, 3 * 2 * 2 ** 26, a, "bf16")
    assert add["bound"] == "memory"
    tiny = cost.explain_compute(8, 48, a, "bf16")
    assert tiny["bound"] == "launch" and tiny["seconds"] == pytest.approx(
        tiny["memory"] + tiny["launch"])
    f64 = cost.explain_compute(2 ** 20, 3 * 8 * 2 ** 20, "ascend-910b", "float64")
    assert f64["engine"] == "AI CPU"


def test_dtype_names():
    assert dtype_name(torch.float64) == dtype_name("double") == "float64"
    assert dtype_name(torch.int64) == dtype_name("long") == "int64"
    assert dtype_name(torch.bool) == "bool"
    with pytest.raises(ValueError, match=r"dtype=.*complex64.*float64"):
        dtype_name(torch.complex64)


@pytest.mark.parametrize("call, match", [
    (lambda: cost.compute_time(1, 1, "a100", "bf16", "gemm"),
     r"op_class='gemm'.*matmul.*attention.*elementwise"),
    (lambda: cost.compute_time(1, 1, "a100", "bf16", "matmul", launches=-1), r"launches=-1"),
    (lambda: cost.compute_time(1, 1, "a100", "bf16", "matmul", launches=1.5), r"launches=1.5"),
    (lambda: cost.compute_time(1, math.nan, "a100", "bf16"), r"bytes_moved=nan"),
    (lambda: cost.compute_time(1, 1, "a100", torch.complex64), r"complex64"),
])
def test_compute_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_profile_data_errors():
    import dataclasses
    a = get_profile("a100")
    with pytest.raises(ValueError, match=r"efficiency has op class 'gemm'"):
        dataclasses.replace(a, efficiency={"gemm": 0.5})
    with pytest.raises(ValueError, match=r"memory_efficiency=1.5.*\(0, 1\]"):
        dataclasses.replace(a, memory_efficiency=1.5)
    n = get_profile("ascend-910b")
    with pytest.raises(ValueError, match=r"full mesh of 4 devices has 3 links"):
        dataclasses.replace(n, devices_per_node=4)
    bare = dataclasses.replace(a, peak_flops={k: v for k, v in a.peak_flops.items()
                                              if k != "float64"})
    with pytest.raises(ValueError, match=r"cannot price dtype='float64'.*slow_paths"):
        cost.compute_time(1, 1, bare, torch.float64)


_interval = st.tuples(st.floats(0, 10), st.floats(0, 5)).map(lambda p: (p[0], p[0] + p[1]))


@settings(max_examples=200, deadline=None)
@given(t=st.floats(0, 10), work=st.floats(0, 10), rate=st.floats(0.05, 1.0),
       busy=st.lists(_interval, max_size=6))
def test_compute_beside_collectives_is_bounded_and_exact(t, work, rate, busy):
    """``cost.finish_beside``: compute slows to ``rate`` inside the busy intervals only,
    so it ends between alone (t + work) and all of it slowed (t + work / rate), and
    what it did (full speed outside the intervals, ``rate`` inside) adds up to ``work``."""
    end = cost.finish_beside(t, work, rate, busy)
    assert t + work - 1e-9 <= end <= t + work / rate + 1e-9
    # integrate the speed over [t, end] on a fine partition of the interval edges
    edges = sorted({t, end, *(min(max(x, t), end) for iv in busy for x in iv)})
    done = 0.0
    for a, b in zip(edges, edges[1:]):
        mid = (a + b) / 2
        inside = any(s <= mid < e for s, e in busy)
        done += (b - a) * (rate if inside else 1.0)
    assert done == pytest.approx(work, abs=1e-7)
    if not any(e > t and s < t + work for s, e in busy):
        assert end == t + work                       # nothing beside it: as alone
