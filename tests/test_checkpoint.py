"""wb.checkpoint: save on one mesh and placements, load into any other, bitwise; each rank
reads only the saved pieces that overlap its shard; the format is DCP's (torch's
``torch.distributed.checkpoint`` loads ours and ours loads torch's); the wrappers' state
dicts round-trip.

The pieces a rank needs are found without the library's offset function: the tensor
saved is ``arange(numel)`` (each element its own index), so each stored piece, read
back with ``torch.load``, says which elements it holds, and the target rank's shard
(from ``shard_tensor``) says which it needs."""
import io
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings, strategies as st
from torch import nn

import workbench as wb
from tests.strategies import meshes
from workbench.checkpoint import CheckpointError, load, save

SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.function_scoped_fixture])


@st.composite
def layouts(draw, ndim, mesh):
    opts = [wb.Replicate()] + [wb.Shard(d) for d in range(ndim)]
    return [draw(st.sampled_from(opts)) for _ in range(mesh.ndim)]


@st.composite
def cases(draw):
    shape = tuple(draw(st.lists(st.integers(0, 7), min_size=0, max_size=3)))
    src = draw(meshes(max_ranks=8))
    dst = draw(meshes(max_ranks=8))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int64]))
    return shape, src, draw(layouts(len(shape), src)), dst, draw(layouts(len(shape), dst)), dtype


def piece_ids(path, report_piece):
    """The element indices a stored piece holds (read straight from the file)."""
    file, offset = report_piece
    md = wb.checkpoint.read_metadata(path)
    info = next(i for i in md.storage_data.values()
                if (i.relative_path, i.offset) == (file, offset))
    with open(os.path.join(path, file), "rb") as f:
        f.seek(offset)
        return set(torch.load(io.BytesIO(f.read(info.length))).reshape(-1).tolist())


@SETTINGS
@given(cases())
def test_round_trip_into_any_mesh_and_placements_is_bitwise_and_reads_only_what_is_needed(
        tmp_path_factory, case):
    shape, src, sps, dst, dps, dtype = case
    n = 1
    for s in shape:
        n *= s
    ids = torch.arange(n).reshape(shape)
    x = ids.to(dtype) if dtype != torch.bfloat16 else (ids % 256).to(dtype)
    path = str(tmp_path_factory.mktemp("ck"))
    save(path, {"x": wb.shard_tensor(x, src, sps), "ids": wb.shard_tensor(ids, src, sps)})
    tx = wb.shard_tensor(torch.zeros(shape, dtype=dtype), dst, dps)
    tid = wb.shard_tensor(torch.zeros(shape, dtype=torch.int64), dst, dps)
    report = load(path, {"x": tx, "ids": tid})
    assert torch.equal(tx.full(), x) and tx.placements == tuple(dps) and tx.mesh == dst
    assert torch.equal(tid.full(), ids)
    for r in dst.ranks:
        need = set(tid.local(r).reshape(-1).tolist())
        got = report.pieces(r, "ids")
        held = [piece_ids(path, p) for p in got]
        assert all(h & need for h in held), "a piece read that the rank does not need"
        assert set().union(*held) >= need
        # every stored piece that overlaps is read: none is missed, none twice
        assert len(got) == len(set(got))


def test_eight_ranks_to_three_reads_only_the_overlapping_files(tmp_path):
    x = torch.randn(16, 4)
    save(tmp_path, {"w": wb.shard_tensor(x, wb.Mesh.grid(8, ["x"]), [wb.Shard(0)])})
    t = wb.shard_tensor(torch.zeros(16, 4), wb.Mesh.grid(3, ["x"]), [wb.Shard(0)])
    rep = load(tmp_path, {"w": t})
    assert torch.equal(t.full(), x)
    # rows 0-5, 6-11, 12-15 over pieces of 2 rows written by ranks 0..7
    assert rep.files(0) == {"__0_g0.distcp", "__1_g0.distcp", "__2_g0.distcp"}
    assert rep.files(1) == {"__3_g0.distcp", "__4_g0.distcp", "__5_g0.distcp"}
    assert rep.files(2) == {"__6_g0.distcp", "__7_g0.distcp"}
    assert rep.bytes(2) < rep.bytes(0)


def test_a_replicated_chunk_is_written_once(tmp_path):
    mesh = wb.Mesh.grid((2, 2), ["dp", "tp"])
    save(tmp_path, {"w": wb.shard_tensor(torch.randn(4, 4), mesh, [wb.Replicate(), wb.Shard(1)])})
    md = wb.checkpoint.read_metadata(tmp_path)
    assert len(md.state_dict_metadata["w"].chunks) == 2
    assert sorted(n for n in os.listdir(tmp_path) if n.endswith(".distcp")) == \
        ["__0_g0.distcp", "__1_g0.distcp"]          # ranks (0, 0) and (0, 1) write


def test_partial_is_saved_reduced():
    mesh = wb.Mesh.grid(2, ["x"])
    parts = [torch.tensor([1.0, 2.0]), torch.tensor([10.0, 20.0])]
    p = wb.from_local(parts, mesh, [wb.Partial("sum")])
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        save(d, {"p": p})
        t = torch.zeros(2)
        load(d, {"p": t})
    assert t.tolist() == [11.0, 22.0]


def test_nested_state_and_python_values_round_trip(tmp_path):
    state = {"model": {"w": torch.randn(3, 2)}, "step": 7, "rng": torch.get_rng_state(),
             "opt": {"state": {0: {"exp_avg": torch.ones(3), "step": torch.tensor(2.0)}},
                     "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": [0]}]}}
    save(tmp_path, state)
    tgt = {"model": {"w": torch.zeros(3, 2)}, "step": 0, "rng": torch.zeros_like(state["rng"]),
           "opt": {"state": {0: {"exp_avg": torch.zeros(3), "step": torch.tensor(0.0)}},
                   "param_groups": [{"lr": 0.0, "betas": (0.0, 0.0), "params": [0]}]}}
    load(tmp_path, tgt)
    assert torch.equal(tgt["model"]["w"], state["model"]["w"]) and tgt["step"] == 7
    assert torch.equal(tgt["rng"], state["rng"])
    assert tgt["opt"]["state"][0]["step"].item() == 2.0
    assert tgt["opt"]["param_groups"] == state["opt"]["param_groups"]


def test_the_flattened_keys_are_dcps():
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    state = {"a": {"b": torch.ones(1), "c": [torch.ones(1), 2], "d": [1, 2]}, "e": 3,
             "f": {0: {"g": torch.ones(1)}}}
    ours, ours_paths = wb.checkpoint.format.flatten(state)
    theirs, their_paths = flatten_state_dict(state)
    assert list(ours) == list(theirs) and ours_paths == their_paths


def test_torch_dcp_loads_ours_and_ours_loads_torchs(tmp_path):
    x, y = torch.randn(6, 4), torch.randn(3)
    mesh = wb.Mesh.grid((2, 2), ["a", "b"])
    save(tmp_path / "ours", {"x": wb.shard_tensor(x, mesh, [wb.Shard(0), wb.Shard(1)]),
                             "n": {"y": y, "k": 5}})
    sd = {"x": torch.zeros(6, 4), "n": {"y": torch.zeros(3), "k": 0}}
    with pytest.warns(UserWarning):         # "assuming the intent is to load in a single process"
        dcp.load(sd, checkpoint_id=str(tmp_path / "ours"), no_dist=True)
    assert torch.equal(sd["x"], x) and torch.equal(sd["n"]["y"], y) and sd["n"]["k"] == 5
    with pytest.warns(UserWarning):
        dcp.save({"x": x, "n": {"y": y, "k": 6}}, checkpoint_id=str(tmp_path / "torch"),
                 no_dist=True)
    t = wb.shard_tensor(torch.zeros(6, 4), wb.Mesh.grid(3, ["t"]), [wb.Shard(0)])
    st_ = {"x": t, "n": {"y": torch.zeros(3), "k": 0}}
    load(tmp_path / "torch", st_)
    assert torch.equal(t.full(), x) and torch.equal(st_["n"]["y"], y) and st_["n"]["k"] == 6


PLAN = {"0": "colwise", "2": "rowwise"}


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))


def test_wrappers_state_dicts_round_trip_across_layouts(tmp_path):
    ref = mlp().state_dict()
    mesh = wb.Mesh([[0, 1], [2, 3]], ["dp", "tp"])
    ddp = wb.DistributedDataParallel(wb.parallelize(mlp(), mesh, PLAN, mesh_dim="tp"), mesh, "dp")
    save(tmp_path / "ddp", ddp.state_dict())
    fsdp = wb.FullyShardedDataParallel(mlp(1), wb.Mesh.grid(3, ["dp"]))
    sd = fsdp.state_dict()
    load(tmp_path / "ddp", {"module." + k: v for k, v in sd.items()})
    fsdp.load_state_dict(sd)
    got = fsdp.full_state_dict()
    for k in ref:
        assert torch.equal(got[k], ref[k]), k
    # tp 2 model loaded from the dp x tp one: into its own DistTensors, in place
    tp = wb.parallelize(mlp(2), wb.Mesh.grid(2, ["tp"]), PLAN, mesh_dim="tp")
    w = tp.state_dict()
    load(tmp_path / "ddp", {"module." + k: v for k, v in w.items()})
    for k in ref:
        assert torch.equal(w[k].full() if isinstance(w[k], wb.DistTensor) else w[k], ref[k]), k


def test_zero_redundancy_optimizer_state_round_trips(tmp_path):
    model = mlp()
    opt = wb.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW,
                                     mesh=wb.Mesh.grid(2, ["dp"]), lr=1e-2)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    sd = opt.state_dict()
    save(tmp_path, {"optim": sd})
    fresh = {"optim": {"state": {i: {k: torch.zeros_like(v) for k, v in s.items()}
                                 for i, s in sd["state"].items()},
                       "param_groups": [{**g, "lr": 0.0} for g in sd["param_groups"]]}}
    load(tmp_path, fresh)
    for i, s in sd["state"].items():
        for k, v in s.items():
            assert torch.equal(fresh["optim"]["state"][i][k], v), (i, k)
    assert fresh["optim"]["param_groups"] == sd["param_groups"]


def test_bad_targets_are_clear_errors_and_leave_the_target_untouched(tmp_path):
    save(tmp_path, {"w": torch.ones(4, 2), "k": 1})
    t = torch.zeros(4, 2)
    with pytest.raises(CheckpointError, match="'missing' is not in the checkpoint"):
        load(tmp_path, {"w": t, "missing": torch.zeros(1)})
    assert t.sum() == 0                         # nothing copied before the error
    with pytest.raises(CheckpointError, match=r"size mismatch for 'w'.*\[4, 2\].*\[2, 4\]"):
        load(tmp_path, {"w": torch.zeros(2, 4)})
    with pytest.raises(CheckpointError, match="saved as a Python value"):
        load(tmp_path, {"k": torch.zeros(1)})
    load(tmp_path, {"w": t, "missing": torch.zeros(1)}, strict=False)
    assert t.sum() == 8
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        load(tmp_path / "nowhere", {"w": t})
    with pytest.raises(TypeError, match="give a dict"):
        save(tmp_path, [torch.ones(1)])


@pytest.mark.slow
def test_on_torch_distributed_the_format_is_dcps_both_ways(tmp_path_factory):
    """2 gloo processes under torchrun: each writes its own shard; torch's dcp.load reads
    ours into DTensors, ours reads dcp.save's DTensors, each into another placement."""
    from tests.torchrun_support import json_rows, two_proc
    out, text = two_proc(tmp_path_factory, "checkpoint_check.py {dir}")   # one launch
    assert out.returncode == 0, out.stderr[-3000:]
    rows = sorted(json_rows(text), key=lambda r: r["rank"])
    assert [r["rank"] for r in rows] == [0, 1], text
    for r in rows:
        assert r["ours_to_ours"] and r["ours_to_dcp"] and r["dcp_to_ours"], r
        assert r["files"] == ["__0_g0.distcp", "__1_g0.distcp"]
        assert r["w_files_read"] == r["files"]          # Shard(1) needs a part of every row
    assert [r["own_rows_read"] for r in rows] == [["__0_g0.distcp"], ["__1_g0.distcp"]]
