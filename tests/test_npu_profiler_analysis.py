"""Reading Chrome traces: top ops and idle gaps, on hand-built traces, the simulator's
own trace and a real CPU profile."""
import json

import pytest
import torch

import workbench as wb
import workbench.npu as npu
from workbench.npu.profiler import complete_events, idle_gaps, top_ops


def doc(*events):
    return {"traceEvents": [{"ph": "M", "name": "process_name", "pid": 0, "tid": 0}] + [
        {"ph": "X", "name": n, "cat": c, "pid": p, "tid": t, "ts": ts, "dur": d}
        for n, c, p, t, ts, d in events]}


D = doc(("mm", "compute", 0, 0, 0.0, 10.0), ("add", "compute", 0, 0, 12.0, 1.0),
        ("mm", "compute", 0, 0, 20.0, 10.0), ("all_reduce", "comm", 0, 1, 10.0, 15.0),
        ("add", "compute", 0, 0, 13.0, 1.0), ("gelu", "compute", 1, 0, 0.0, 50.0))


def test_top_ops_sums_by_name_most_first():
    assert top_ops(D, 3) == [("gelu", 50.0, 1), ("mm", 20.0, 2), ("all_reduce", 15.0, 1)]
    assert top_ops(D, 10, cat="comm") == [("all_reduce", 15.0, 1)]
    assert [n for n, _, _ in top_ops(D, 10)] == ["gelu", "mm", "all_reduce", "add"]


def test_idle_gaps_between_merged_events():
    # compute of pid 0: [0,10] [12,13] [13,14] [20,30] -> idle (10,12) and (14,20)
    assert idle_gaps(D, 0, 0) == [(10.0, 12.0), (14.0, 20.0)]
    assert idle_gaps(D, 0, 0, min_us=3) == [(14.0, 20.0)]
    assert idle_gaps(D, 0, 1) == []


def test_bad_sources_and_arguments():
    with pytest.raises(ValueError, match="give a Chrome trace"):
        complete_events([1, 2])
    with pytest.raises(ValueError, match="does not exist"):
        complete_events("/nonexistent/t.json")
    with pytest.raises(ValueError, match=r"n=0 must be an int >= 1"):
        top_ops(D, 0)
    with pytest.raises(ValueError, match=r"no events on pid=7, tid=0"):
        idle_gaps(D, 7, 0)


def test_simulator_trace_reads_like_its_events():
    mesh = wb.Mesh.grid(2, ("tp",))
    x = wb.shard_tensor(torch.ones(4, 8), mesh, [wb.Shard(1)])
    w = wb.shard_tensor(torch.ones(8, 4), mesh, [wb.Shard(0)])
    with wb.trace("a100") as tr:
        y = wb.reshard(x @ w, mesh, [wb.Replicate()])        # a matmul, then an all-reduce
    chrome = tr.to_chrome_trace()
    want = {}
    for e in tr.events:
        want[e.name] = want.get(e.name, 0.0) + e.duration * 1e6 * len(e.ranks)
    got = {n: t for n, t, _ in top_ops(chrome, 50)}
    assert got.keys() == want.keys() and len(want) >= 2
    assert all(got[k] == pytest.approx(want[k]) for k in want)
    assert torch.equal(y.local(0), torch.full((4, 4), 8.0))


def test_real_cpu_profile(tmp_path):
    a = torch.randn(64, 64)
    with npu.profile(tmp_path / "t.json", device="cpu") as prof:
        for _ in range(3):
            a = (a @ a).relu()
    names = [n for n, _, _ in top_ops(prof, 50)]
    assert "aten::mm" in names and "aten::relu" in names
    calls = {n: c for n, _, c in top_ops(prof, 50)}
    assert calls["aten::mm"] == 3
    assert complete_events(json.loads((tmp_path / "t.json").read_text())) == complete_events(prof)
