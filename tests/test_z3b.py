"""DeepSpeed v0.3 ZeRO-3 (``plan.zero3_2021``): the gradient pre-division before each
bucket's reduce-scatters and the per-step work counters, against their source rules."""
import pytest

from workbench.plan import zero3_2021 as Z
from tests.test_zero3_2021 import _gpt, _trace as _zero3_trace


def _trace(h=12288, layers=2, mb=1):
    return _zero3_trace(_gpt(h, layers), "full", mb)


def test_predivide_is_the_whole_ipg_buffer_and_each_large_gradient():
    # stage3.py v0.3.13 reduce_ipg_grads: reduction_list = [ipg_buffer] (+ the
    # extra-large gradient); average_tensor: div_ on each: 2 bytes read + 2 written
    bw = 2e12
    buf = Z.REDUCE_BUCKET_NUMEL
    assert Z.predivide_seconds([12288], bw) == pytest.approx(4 * buf / bw)
    # however little of the buffer the bucket fills, the whole buffer is divided
    assert Z.predivide_seconds([12288, 49152, 12288], bw) == Z.predivide_seconds([1], bw)
    # a matrix above reduce_bucket_size is not copied into the buffer: its own
    # gradient is divided as well (fc1 of GPT-3 175B: 604 M elements)
    assert Z.predivide_seconds([604e6], bw) == pytest.approx(4 * (buf + 604e6) / bw)
    assert Z.predivide_seconds([604e6, 12288], bw) == Z.predivide_seconds([604e6], bw)
    assert Z.predivide_seconds([604e6], bw) * 1e3 == pytest.approx(1.34, abs=0.01)


def test_reduce_scatter_starts_after_the_predivision(monkeypatch):
    # one backward module whose gradient is ready at once: c10d's NCCL stream waits for
    # the reduction stream, so the reduce-scatter's copies start after the div_ pass
    tr = [Z.Entry("A", (("a", 2 * 10**8),), 0.0, "b")]
    bw = 1e12
    with_div = Z.simulate(tr, 2, lambda n: 0.0, lambda n: 0.0, bw)
    monkeypatch.setattr(Z, "predivide_seconds", lambda numels, mem_bw: 0.0)
    without = Z.simulate(tr, 2, lambda n: 0.0, lambda n: 0.0, bw)
    div = 4 * (Z.REDUCE_BUCKET_NUMEL + 2e8) / bw
    host = 2 * (Z.RS_LOOP_S + Z.RECORD_COPY_S)
    assert with_div["seconds"] - without["seconds"] == pytest.approx(div, abs=host)
    assert with_div["work"]["predivide"] == pytest.approx(div)
    assert without["work"]["predivide"] == 0.0


def test_work_counters_are_the_host_loops_and_nccl_time():
    # per list collective: DeepSpeed's loop (p narrow) and c10d's p recordStream + copy_;
    # NCCL's seconds as priced; all linear in p except NCCL's
    tr = _trace()
    out = {}
    for p in (384, 1536):
        r = Z.simulate(tr, p, lambda n: 1e-3, lambda n: 2e-3, 2e12)
        w = r["work"]
        assert w["ag_loop"] == pytest.approx(r["gathers"] * p * Z.AG_LOOP_S)
        assert w["rs_loop"] == pytest.approx(r["reduce_scatters"] * p * Z.RS_LOOP_S)
        assert w["record_copy"] == pytest.approx(
            (r["gathers"] + r["reduce_scatters"]) * p * Z.RECORD_COPY_S)
        assert w["nccl"] == pytest.approx(r["gathers"] * 1e-3 + r["reduce_scatters"] * 2e-3)
        assert w["release"] >= Z.RELEASE_S          # at least one blocking release
        out[p] = w
    for k in ("ag_loop", "rs_loop", "record_copy"):
        assert out[1536][k] == pytest.approx(4 * out[384][k])
    assert out[1536]["nccl"] == pytest.approx(out[384]["nccl"])
