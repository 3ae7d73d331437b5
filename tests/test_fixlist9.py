"""Small defects left by the last session (fixlist9), each held to one device or to the
simulator's own program."""
import pytest
import torch
from torch import nn

import workbench as wb

PLAN = {"0": "colwise", "2": "rowwise"}          # Megatron's MLP over tp


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))


def _batch(i=0):
    g = torch.Generator().manual_seed(1 + i)
    return torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)


def _one_device_sgd(batches, lr=0.1):
    """One device's parameters after one SGD step on the sum of ``batches``' gradients."""
    m = _mlp()
    for i in batches:
        x, y = _batch(i)
        ((m(x) - y) ** 2).mean().backward()
    torch.optim.SGD(m.parameters(), lr=lr).step()
    return {n: p.detach() for n, p in m.named_parameters()}


def _dp_tp():
    mesh = wb.Mesh([[0, 1], [2, 3]], ["dp", "tp"])
    model = wb.parallelize(_mlp(), mesh, PLAN, mesh_dim="tp")
    return mesh, model


def _shard(mesh, i=0):
    return [wb.shard_tensor(t, mesh, [wb.Shard(0), wb.Replicate()]) for t in _batch(i)]


def _zero(model, mesh, overlap_comm):
    return wb.ZeroRedundancyOptimizer(wb.dist_parameters(model), torch.optim.SGD, mesh, "dp",
                                      partition="chunks", overlap_comm=overlap_comm, lr=0.1)


def _assert_one_device(model, ref):
    for n, p in wb.dist_parameters(model):
        torch.testing.assert_close(p.full(), ref[n], rtol=1e-5, atol=1e-6, msg=n)


# ---- 1. ZeRO-1/2 does not sum a gradient already summed over dp -----------------------------
@pytest.mark.parametrize("overlap_comm", [False, True], ids=["zero1", "zero2"])
@pytest.mark.parametrize("no_sync", [False, True], ids=["", "no_sync"])
def test_ddp_over_zero_chunks_sums_once(overlap_comm, no_sync):
    # torch's habit: DistributedDataParallel sums the gradients, ZeroRedundancyOptimizer
    # steps its share.  Was: DDP's all-reduce, then ZeRO's reduce-scatter of the sum again:
    # the step 2.0x one device's (dp 2), silently
    mesh, model = _dp_tp()
    opt = _zero(model, mesh, overlap_comm)
    ddp = wb.DistributedDataParallel(model, mesh, "dp")
    batches = [0, 1] if no_sync else [0]
    if no_sync:                          # accumulate one micro-batch locally, sum at the last
        with ddp.no_sync():
            x, y = _shard(mesh, 0)
            ((ddp(x) - y) ** 2).mean().backward()
    with wb.trace() as tr:
        x, y = _shard(mesh, batches[-1])
        ((ddp(x) - y) ** 2).mean().backward()
        opt.step()
    _assert_one_device(model, _one_device_sgd(batches))
    kinds = sorted(e.name for e in tr.collectives() if e.ranks == (0, 2))
    assert kinds == ["all_gather", "all_reduce"]      # DDP's sum, ZeRO's gather: no 2nd sum


@pytest.mark.parametrize("overlap_comm", [False, True], ids=["zero1", "zero2"])
def test_zero_chunks_built_after_a_ddp_backward_sums_once(overlap_comm):
    # the optimizer built after DDP's backward carries DDP's summed gradients (was: each
    # replica's copy of the sum taken as its own gradient and summed again: 2.0x)
    mesh, model = _dp_tp()
    ddp = wb.DistributedDataParallel(model, mesh, "dp")
    x, y = _shard(mesh)
    ((ddp(x) - y) ** 2).mean().backward()
    _zero(model, mesh, overlap_comm).step()
    _assert_one_device(model, _one_device_sgd([0]))


@pytest.mark.parametrize("overlap_comm", [False, True], ids=["zero1", "zero2"])
def test_ddp_over_zero_chunks_clip_reads_the_model_norm(overlap_comm):
    mesh, model = _dp_tp()
    opt = _zero(model, mesh, overlap_comm)
    ddp = wb.DistributedDataParallel(model, mesh, "dp")
    x, y = _shard(mesh)
    ((ddp(x) - y) ** 2).mean().backward()
    m = _mlp()
    xr, yr = _batch(0)
    ((m(xr) - yr) ** 2).mean().backward()
    want = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
    torch.testing.assert_close(opt.clip_grad_norm_(0.05), want, rtol=1e-5, atol=1e-7)
    opt.step()
    torch.optim.SGD(m.parameters(), lr=0.1).step()
    _assert_one_device(model, {n: p.detach() for n, p in m.named_parameters()})


# ---- 2. AveragedModel(wrapped, avg_fn=...) -------------------------------------------------
AVG_FNS = {
    "ema": lambda: torch.optim.swa_utils.get_ema_avg_fn(0.9),     # decay * e + (1 - d) * p
    "swa": torch.optim.swa_utils.get_swa_avg_fn,                  # e + (p - e) / (n + 1)
    "own": lambda: (lambda e, p, n: torch.lerp(p * 0.5, e, 0.75) + 0.5 * p)}


@pytest.mark.parametrize("kind", ["ddp", "fsdp", "fsdp_units", "fully_shard"])
@pytest.mark.parametrize("avg", list(AVG_FNS))
def test_averaged_model_with_an_avg_fn_is_one_devices(kind, avg):
    # was: torch's broadcasting error ("output with shape [8, 6] doesn't match the
    # broadcast shape [4, 8, 6]" on DDP's rows, "size of tensor a (6) must match ... (12)"
    # on FSDP's chunks): the avg_fn's 0.1 * p was a plain tensor of the storage's shape
    from torch.optim.swa_utils import AveragedModel
    from tests.test_habits6 import batches, mlp, mse, wrap
    from tests.test_habits7 import dist
    ref, m = mlp(), mlp()
    ema, rema = (AveragedModel(x, avg_fn=AVG_FNS[avg]()) for x in (m, ref))
    mesh, w = wrap(kind, m)
    opt, ropt = (torch.optim.SGD(x.parameters(), lr=0.1) for x in (w, ref))
    for x, y in batches(3):
        for o, model, e, xx, yy in ((opt, w, ema, dist(x, mesh), dist(y, mesh)),
                                    (ropt, ref, rema, x, y)):
            o.zero_grad()
            mse(model(xx), yy).backward()
            o.step()
            e.update_parameters(model)
    assert int(ema.n_averaged) == 3
    for a, b in zip(ema.parameters(), rema.parameters()):
        assert type(a) is type(b) and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_pointwise_reads_keep_plain_what_was_plain():
    # a copy of the storage stays plain and storage-shaped (habits7), a scaled parameter
    # keeps the storage's values; beside the module's shape it is one device's value
    from tests.test_habits6 import mlp, wrap
    from workbench.parallel.strategies.laid_out_whole import storage   # rank 0's row: [0]
    mesh, w = wrap("ddp", mlp())
    p = w.module[0].weight
    with torch.no_grad():
        # a copy keeps the storage's shape; its reductions read the module's (habits11)
        assert p.detach().clone().shape == p.shape
        assert p.detach().clone().sum() == storage(p)[0].sum()
        # unary: the storage's shape, its layout kept (habits11: a reduction of it, e.g.
        # p.abs().mean(), reads the module's values)
        assert (-p).shape == p.shape and (-p).sum() == -storage(p)[0].sum()
        half = p * 0.5
        # (the storages compared: torch.testing reads a laid-out value as the module's,
        # habits10)
        torch.testing.assert_close(half.as_subclass(torch.Tensor),
                                   (p.detach() * 0.5).as_subclass(torch.Tensor))
        one = torch.ones(8, 6)
        got = half + one
        assert got.shape == (8, 6) and type(got) is torch.Tensor
        torch.testing.assert_close(got, storage(p)[0] * 0.5 + 1)


# ---- 4. ZeRO-1/2's clip: one all-reduce over every rank (Megatron-LM's distributed optimizer)
@pytest.mark.parametrize("kw", [dict(dp=2, tp=2, zero=1), dict(dp=2, tp=2, zero=2),
                                dict(dp=2, pp=2, zero=1), dict(dp=2, pp=2, zero=2)],
                         ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
def test_zero_clip_records_one_all_reduce_over_every_rank(kw):
    # the torchrun clip's program (pipeline_clip_dist): was one all-reduce per mesh dim of
    # each stage (dp 2 x tp 2: (0, 2), (1, 3), (0, 1), (2, 3)), then one over pp
    from workbench.models import get_batch, get_config
    from workbench.recipes.hybrid import Hybrid
    cfg = get_config("tiny")
    h = Hybrid(**kw)
    model = h.build_model(cfg, 0)
    opts = h.build_optimizer(model, 1e-3, 0.0)
    x, y = get_batch(cfg, 8, 0, 0)
    h.forward_backward(model, x, y)
    with wb.trace() as tr:
        h.clip_grad_norm_(opts, 0.01)
    ev = [(e.name, e.label, sorted(e.ranks)) for e in tr.collectives() if e.name == "all_reduce"]
    assert ev == [("all_reduce", "clip_grad norm over dp x tp x pp", [0, 1, 2, 3])]


# ---- 3 and 4 on torch.distributed: one gloo launch (tests/dist_scripts/fixlist9_check.py) --
@pytest.mark.slow
def test_torchrun_reports_and_clips_as_the_simulator(tmp_path_factory):
    """2 gloo processes.  report (tiny, pp 2, one step): every process's step_report is the
    simulator's record (the slowest rank's modeled step, the largest state bytes); was each
    process's own, rank 0's printed: state_bytes 930816 for the simulator's 931840 (stage 1
    holds the head), and rank 1's modeled_ms 0.273639 for 0.305441.  zero<k>_clip (tiny,
    dp 2, ZeRO-1/2, one step with Hybrid.clip_grad_norm_): the same collectives (name,
    label, ranks) as the simulator's trace; was the simulator's 'clip_grad norm' against
    torchrun's 'clip_grad norm over dp x tp x pp'."""
    import importlib.util
    import os
    from tests.torchrun_support import json_rows, two_proc
    out, text = two_proc(tmp_path_factory, "fixlist9_check.py")    # one launch: 2-process parts
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {(r["rank"], r["case"]): r for r in json_rows(text)}
    assert len(rows) == 6, sorted(rows)
    path = os.path.join(os.path.dirname(__file__), "dist_scripts", "fixlist9_check.py")
    spec = importlib.util.spec_from_file_location("fixlist9_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sim = mod.report(False)
    for rank in (0, 1):
        got = rows[rank, "report"]
        assert got["loss"] == pytest.approx(sim["loss"], rel=1e-6)
        for key in ("modeled_ms", "comm_bytes", "state_bytes"):
            assert got[key] == sim[key], (rank, key, got[key], sim[key])
    for zero in (1, 2):
        want = mod.zero_clip(False, zero)
        for rank in (0, 1):
            got = rows[rank, f"zero{zero}_clip"]
            assert got["collectives"] == want["collectives"], (zero, rank)
            assert got["norm"] == pytest.approx(want["norm"], rel=1e-5)
            assert got["params"] == pytest.approx(want["params"], rel=1e-6)
            assert got["modeled_ms"] == pytest.approx(want["modeled_ms"], rel=1e-9)
