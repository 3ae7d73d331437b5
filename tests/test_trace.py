"""Trace: events, the modeled clock, Chrome trace export."""
import dataclasses
import json

import pytest
import torch

import workbench as wb
from workbench.sim_mesh import cost


def test_collective_events_priced_and_counted(tmp_path):
    mesh = wb.Mesh.grid((2, 4), ("dp", "tp"))
    x = wb.shard_tensor(torch.randn(8, 16), mesh, [wb.Replicate(), wb.Shard(1)])
    with wb.trace(profile="ascend-910b") as tr:
        y = wb.reshard(x, mesh, [wb.Replicate(), wb.Replicate()])
    assert tr.counts() == {"all_gather": 2}          # one event per tp group
    ev = tr.collectives()[0]
    assert ev.ranks in [(0, 1, 2, 3), (4, 5, 6, 7)]
    nbytes = 8 * 16 * 4                               # the gathered output per rank
    assert ev.bytes == cost.wire_bytes("all_gather", nbytes, 4) == 384
    assert ev.duration == cost.price("all_gather", nbytes, ev.ranks, wb.get_profile("ascend-910b"))
    assert tr.time() == ev.duration                   # both groups ran at once
    assert torch.equal(y.local(5), x.full())

    doc = tr.to_chrome_trace(tmp_path / "t.json")
    loaded = json.loads((tmp_path / "t.json").read_text())
    assert loaded == json.loads(json.dumps(doc))
    xs = [e for e in loaded["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == 8                               # one per rank taking part
    for e in xs:
        assert {"name", "pid", "tid", "ts", "dur", "cat"} <= e.keys()
        assert e["dur"] >= 0 and isinstance(e["pid"], int)
    names = {(e["pid"], e["args"]["name"]) for e in loaded["traceEvents"] if e["ph"] == "M"
             and e["name"] == "thread_name"}
    assert (0, "comm") in names and (0, "compute") in names


def test_clock_blocking_and_overlap():
    tr = wb.Trace()
    tr.record_compute([0, 1], "matmul", 5.0)
    h = tr.record_collective([0, 1], "all_reduce", 3.0, overlap=True)
    # runs while the all-reduce is in flight, on the 84 SMs NCCL's 24 leave (of 108):
    # ranks 0 and 1 share a node (kernel_cost.collective_sms)
    ev = tr.record_compute([0, 1], "matmul", 2.0)
    assert tr.now(0, "compute") == pytest.approx(5.0 + 2.0 * 108 / 84)
    assert ev.duration == pytest.approx(2.0 * 108 / 84) and ev.args["alone"] == 2.0
    assert tr.now(0, "comm") == 8.0
    tr.wait(h)
    assert tr.now(0, "compute") == 8.0
    tr.record_collective([0, 1], "all_reduce", 1.0)   # blocking: waits for both streams
    assert tr.now(1, "compute") == 9.0 == tr.time()
    # past the collective's end the op runs at full speed again: 3 s beside it (2.33 s
    # of work), the rest alone
    tr.record_compute([0], "x", 0.0)
    h = tr.record_collective([0, 1], "all_reduce", 3.0, overlap=True)
    tr.record_compute([0], "long", 5.0)
    assert tr.now(0, "compute") == pytest.approx(9.0 + 3.0 + (5.0 - 3.0 * 84 / 108))
    # a profile without SM figures: compute beside a collective runs as alone
    bare = dataclasses.replace(tr.profile, topology=dataclasses.replace(
        tr.profile.topology, collective_sms=0, collective_sms_intra=0))
    tr = wb.Trace(bare)
    tr.record_compute([0, 1], "matmul", 5.0)
    tr.record_collective([0, 1], "all_reduce", 3.0, overlap=True)
    ev = tr.record_compute([0, 1], "matmul", 2.0)
    assert tr.now(0, "compute") == 7.0 and "alone" not in ev.args


def test_nothing_recorded_outside_trace():
    assert wb.current_trace() is None
    mesh = wb.Mesh.grid(2)
    wb.reshard(wb.shard_tensor(torch.ones(4), mesh, ["S(0)"]), mesh, ["R"])
    assert wb.current_trace() is None
