"""User-trial audit of checkpointing: what a PyTorch user does with ``state_dict`` /
``load_state_dict`` / ``wb.checkpoint`` (save at one layout, load at another, continue),
each held to one device's run or to torch's own behaviour."""
import copy

import pytest
import torch

import workbench as wb
from workbench.parallel.strategies.laid_out_whole import storage  # the rows (habits13)
from workbench.checkpoint import CheckpointError, load, save
from workbench.models.config import get_config
from workbench.models.data import get_batch
from workbench.recipes.hybrid import Hybrid


def _pipeline(kw, seed=0):
    st = Hybrid(**kw)
    model = st.build_model(get_config("tiny"), seed)
    return st, model, st.build_optimizer(model, 3e-3, 0.01)


def _steps(st, model, opts, steps):
    out = []
    for step in steps:
        x, y = get_batch(get_config("tiny"), 8, 0, step)
        for o in opts:
            o.zero_grad()
        out.append(float(st.forward_backward(model, x, y)))
        st.optimizer_step(opts)
    return out


def _full(sd):
    return {k: (v.full() if isinstance(v, wb.DistTensor) else v).clone() for k, v in sd.items()}


@pytest.mark.parametrize("kw", [dict(dp=2, zero=3), dict(dp=2, zero=1)], ids=["zero3", "zero1"])
def test_stage_optimizers_state_dict_carries_adams_moments(kw):
    # Hybrid(zero=3)'s stage optimizer is a Zero3: its state_dict() was the stage's
    # WEIGHTS, so a fresh run loaded them and restarted AdamW from zero moments; the loss
    # two steps after resuming differed (only the second: the first reads the weights)
    want = _steps(*_pipeline(kw), range(4))
    st, model, opts = _pipeline(kw)
    got = _steps(st, model, opts, range(2))
    msd, osd = _full(model.state_dict()), [copy.deepcopy(o.state_dict()) for o in opts]
    assert all("state" in s and "param_groups" in s for s in osd)
    assert any(s["state"] for s in osd)
    st2, model2, opts2 = _pipeline(kw, seed=1)
    model2.load_state_dict(msd)
    for o, s in zip(opts2, osd):
        o.load_state_dict(s)
    got += _steps(st2, model2, opts2, range(2, 4))
    assert got == want


def test_zero3_stage_optimizer_refuses_a_models_state_dict():
    st, model, opts = _pipeline(dict(dp=2, zero=3))
    with pytest.raises(ValueError, match="model.load_state_dict"):
        opts[0].load_state_dict(_full(model.state_dict()))


@pytest.mark.parametrize("dist", [False, True], ids=["tensor", "disttensor"])
def test_loading_into_a_meta_target_raises_instead_of_doing_nothing(tmp_path, dist):
    # a copy_ into a meta tensor is a no-op: load returned as if it had loaded
    save(tmp_path, {"w": torch.randn(3, 2), "k": 1})
    t = torch.empty(3, 2, device="meta")
    if dist:
        t = wb.shard_tensor(t, wb.Mesh.grid(2, ["x"]), [wb.Shard(0)])
    state = {"w": t, "k": 0}
    with pytest.raises(CheckpointError, match=r"'w'.*meta device.*to_empty"):
        load(tmp_path, state)
    assert state["k"] == 0                      # nothing changed before the error


def _mlp(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.GELU(), torch.nn.Linear(6, 2))


WRAPPERS = {
    "ddp": lambda m, mesh: wb.DistributedDataParallel(m, mesh),
    "ddp.module": lambda m, mesh: wb.DistributedDataParallel(m, mesh),
    "fsdp": lambda m, mesh: wb.FullyShardedDataParallel(m, mesh),
}


@pytest.mark.parametrize("which", list(WRAPPERS))
def test_checkpoint_load_in_place_reaches_every_replica_and_shard(tmp_path, which):
    # DCP's contract (and torch's: the state dict's tensors are the parameters, FSDP2's
    # DTensors the shards): a load into model.state_dict() changes the model.  DDP's
    # simulated state dict is rank 0's row: only that replica changed (the others kept
    # their values, so the forward differed from one device's while full_state_dict()
    # said it matched); FSDP's are gathered copies: nothing changed
    ref = _mlp(0)
    save(tmp_path, {"model": ref.state_dict()})
    mesh = wb.Mesh.grid(3, ["dp"])
    w = WRAPPERS[which](_mlp(1), mesh)
    if which == "ddp":
        sd = {k[len("module."):]: v for k, v in w.state_dict().items()}
    else:
        sd = (w.module if which == "ddp.module" else w).state_dict()
    load(tmp_path, {"model": sd})
    x = torch.randn(6, 4)
    torch.testing.assert_close(w(wb.shard_tensor(x, mesh, [wb.Shard(0)])).full(), ref(x))
    for k, v in w.full_state_dict().items():
        assert torch.equal(v, ref.state_dict()[k]), k
    if which.startswith("ddp"):                 # every rank's row
        assert all(torch.equal(storage(w.module[0].weight)[r], ref[0].weight)
                   for r in range(3))


@pytest.mark.parametrize("kw", [dict(dp=2, zero=3), dict(dp=2, tp=2, zero=3)],
                         ids=["zero3", "tp2-zero3"])
def test_checkpoint_load_in_place_reaches_zero3_shards(tmp_path, kw):
    one = Hybrid(tp=2)
    src = one.build_model(get_config("tiny"), 0)
    ref = _full(src.state_dict())
    save(tmp_path, {"model": src.state_dict()})
    st, model, opts = _pipeline(kw, seed=1)
    load(tmp_path, {"model": model.state_dict()})
    got = _full(model.state_dict())
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    # and the shards the optimizer steps: the loss is the source model's
    x, y = get_batch(get_config("tiny"), 8, 0, 0)
    want = float(one.forward_backward(src, x, y))
    assert float(st.forward_backward(model, x, y)) == pytest.approx(want, rel=1e-6)


def test_a_wrappers_state_dict_still_pickles(tmp_path):
    # the write-back is kept beside the values, not on them (torch.save pickles __dict__)
    mesh = wb.Mesh.grid(2, ["dp"])
    for w in (wb.DistributedDataParallel(_mlp(0), mesh), wb.FullyShardedDataParallel(_mlp(0), mesh)):
        torch.save(w.state_dict(), tmp_path / "sd.pt")
        back = torch.load(tmp_path / "sd.pt", weights_only=False)
        assert set(back) == set(w.state_dict())
    ddp = wb.DistributedDataParallel(_mlp(0), mesh)
    torch.save(ddp.module.state_dict(), tmp_path / "m.pt")
    plain = _mlp(3)
    plain.load_state_dict(torch.load(tmp_path / "m.pt"))      # weights_only=True
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(),
                                                 _mlp(0).state_dict().values()))


@pytest.mark.parametrize("which", ["ddp", "fsdp"])
def test_checkpoint_load_in_place_of_a_torch_optimizers_state(tmp_path, which):
    # torch.optim's state_dict() over the wrapper's parameters gives one device's shapes;
    # DDP's were rank 0's rows: an in-place load left the other replicas' moments stale
    torch.manual_seed(1)
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    ref = _mlp(0)
    ro = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for i in range(4):
        ro.zero_grad()
        ((ref(x) - y) ** 2).mean().backward()
        ro.step()
        if i == 1:
            save(tmp_path, {"model": ref.state_dict(), "optim": ro.state_dict()})
    mesh = wb.Mesh.grid(3, ["dp"])
    w = WRAPPERS[which](_mlp(4), mesh)
    opt = torch.optim.AdamW(w.parameters(), lr=1e-2)

    def step():
        opt.zero_grad()
        out = w(wb.shard_tensor(x, mesh, [wb.Shard(0)]))
        ((out - wb.shard_tensor(y, mesh, [wb.Shard(0)])) ** 2).mean().backward()
        opt.step()
    step()                                      # a fresh optimizer has no state to fill
    load(tmp_path, {"model": (w.module if which == "ddp" else w).state_dict(),
                    "optim": opt.state_dict()})
    step()
    step()
    for k, v in w.full_state_dict().items():
        torch.testing.assert_close(v, ref.state_dict()[k], msg=k)


@pytest.mark.parametrize("kw", [dict(pp=2, schedule="dualpipe", microbatches=4), dict(pp=2)],
                         ids=["dualpipe", "pp2"])
def test_checkpoint_load_in_place_into_a_pipeline_gives_the_checkpoints_loss(tmp_path, kw):
    # DualPipe keeps a second copy of every stage (loaded by model.load_state_dict's hook):
    # a load in place into model.state_dict() left copy 1 at its init, so half of the
    # micro-batches ran on other weights (loss 4.30677 for 4.33097)
    from workbench.models.config import build_model
    cfg = get_config("tiny")
    plain = build_model(cfg, 0)
    save(tmp_path, {"model": plain.state_dict()})
    x, y = get_batch(cfg, 8, 0, 0)
    with torch.no_grad():
        want = float(plain(x, y)[1])
    st, model, opts = _pipeline(kw, seed=5)
    load(tmp_path, {"model": model.state_dict()})
    assert float(st.forward_backward(model, x, y)) == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("a,b", [(dict(dp=2), dict(dp=4)),
                                 (dict(dp=2, zero=3), dict(dp=4, zero=3)),
                                 (dict(dp=2, zero=2), dict(dp=2, zero=0))],
                         ids=["dp2-to-dp4", "zero3-dp2-to-dp4", "zero2-to-zero0"])
def test_a_stage_optimizer_state_from_another_layout_is_refused_untouched(a, b):
    # torch.optim's load_state_dict compares no shapes: the states of another layout loaded
    # silently and the next step failed in adamw with the optimizer half replaced
    st, model, opts = _pipeline(a)
    _steps(st, model, opts, range(1))
    saved = opts[0].state_dict()
    st2, model2, opts2 = _pipeline(b, seed=1)
    _steps(st2, model2, opts2, range(1))
    before = copy.deepcopy(opts2[0].state_dict())
    with pytest.raises(ValueError, match=r"exp_avg.*another layout.*resume_training"):
        opts2[0].load_state_dict(saved)
    after = opts2[0].state_dict()
    assert all(torch.equal(after["state"][i][k], v) for i, s in before["state"].items()
               for k, v in s.items() if isinstance(v, torch.Tensor))


def test_a_zero1_state_dict_in_module_shapes_loads_on_another_dp_size():
    # ZeRO-1/2's optimizer state_dict() holds each state in its parameter's shape (as
    # torch's consolidated ZeroRedundancyOptimizer state dict; habits13b), so dp 4 cuts a
    # dp 2 save into its own chunks: gathered back it is the saved dict, value for value
    st, model, opts = _pipeline(dict(dp=2, zero=1))
    _steps(st, model, opts, range(1))
    saved = copy.deepcopy(opts[0].state_dict())
    st2, model2, opts2 = _pipeline(dict(dp=4, zero=1), seed=1)
    _steps(st2, model2, opts2, range(1))
    opts2[0].load_state_dict(saved)
    back = opts2[0].state_dict()
    assert back["state"].keys() == saved["state"].keys()
    for i, s in saved["state"].items():
        for k, v in s.items():
            got = back["state"][i][k]
            assert torch.equal(got, v) if isinstance(v, torch.Tensor) else got == v, (i, k)


def test_saving_a_meta_tensor_names_the_key(tmp_path):
    mesh = wb.Mesh.grid(2, ["x"])
    for v in (torch.empty(3, device="meta"),
              wb.shard_tensor(torch.empty(4, 2, device="meta"), mesh, [wb.Shard(0)])):
        with pytest.raises(CheckpointError, match=r"save: 'model.w' is on the meta device"):
            save(tmp_path / "ck", {"model": {"w": v}, "k": 1})
    assert not (tmp_path / "ck").exists()       # nothing written


def _meta_mlp():
    with torch.device("meta"):
        return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.GELU(), torch.nn.Linear(6, 2))


@pytest.mark.parametrize("cls", [wb.DistributedDataParallel, wb.FullyShardedDataParallel])
def test_wrapping_a_meta_module_is_refused(cls):
    # FSDP over a meta module wrapped, then load_state_dict said "All keys matched" and
    # copied nothing; to_empty afterwards swapped in parameters the wrapper did not hold
    with pytest.raises(ValueError, match=r"meta device.*before wrapping"):
        cls(_meta_mlp(), wb.Mesh.grid(2, ["dp"]))


def test_loading_into_a_parallelized_meta_module_raises():
    # (the dry run parallelizes on meta: that stays allowed; a load into it copied nothing)
    tp = wb.parallelize(_meta_mlp(), wb.Mesh.grid(2, ["tp"]), {"0": "colwise", "2": "rowwise"},
                        mesh_dim="tp")
    with pytest.raises(RuntimeError, match=r"'0.weight'.*meta device"):
        tp.load_state_dict(_mlp(0).state_dict())


@pytest.mark.parametrize("into", ["ddp", "ddp.module", "fsdp.module"])
def test_fsdps_disttensor_state_dict_loads_into_the_other_wrappers(into):
    # FSDP's state_dict() (FSDP2's Shard(0) DistTensors) into DDP was "len() of a 0-d
    # DistTensor", into ddp.module a size mismatch against the rows' (N, *shape)
    src = wb.FullyShardedDataParallel(_mlp(0), wb.Mesh.grid(2, ["dp"]))
    mesh = wb.Mesh.grid(3, ["dp"])
    w = (wb.DistributedDataParallel if into.startswith("ddp") else wb.FullyShardedDataParallel)(
        _mlp(1), mesh)
    sd = src.state_dict()
    if into == "ddp":
        w.load_state_dict({"module." + k: v for k, v in sd.items()})
    else:
        w.module.load_state_dict(sd)
    for k, v in _mlp(0).state_dict().items():
        assert torch.equal(w.full_state_dict()[k], v), k


def test_python_values_that_save_accepts_load_back_as_dcp_reads_them(tmp_path):
    # the values were pickled by save, then read with torch.load(weights_only=True): a
    # numpy RNG state or a config saved fine and never loaded (DCP's load_bytes reads
    # them with weights_only=False)
    import argparse
    import numpy as np
    rng = np.random.RandomState(0).get_state()
    state = {"np_rng": rng, "cfg": get_config("tiny"), "args": argparse.Namespace(lr=0.1)}
    save(tmp_path, state)
    back = {"np_rng": None, "cfg": None, "args": None}
    load(tmp_path, back)
    assert back["cfg"] == get_config("tiny") and back["args"].lr == 0.1
    assert back["np_rng"][0] == rng[0] and (back["np_rng"][1] == rng[1]).all()
