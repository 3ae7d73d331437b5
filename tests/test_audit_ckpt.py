"""User-trial audit of checkpointing: what a PyTorch user does with ``state_dict`` /
``load_state_dict`` / ``wb.checkpoint`` (save at one layout, load at another, continue),
each held to one device's run or to torch's own behaviour."""
import copy

import pytest
import torch

import workbench as wb
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
