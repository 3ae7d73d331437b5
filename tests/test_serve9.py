"""Train-to-serve probed as a user would (serve9): the defects found, each held to a
single-device reference (torch's own ``torch.distributed.checkpoint`` helpers on the
plain module, ``generate`` without a cache).  Checkpoints between layouts (the
state-dict helpers on ZeRO, TP, FSDP; torch's DCP), sampling's filter, generation on a
pipeline-split model, the KV cache at its capacity.  Paged attention and continuous
batching (random arrivals, preemption, budgets, seeded sampling, tp 2) matched
``generate`` token for token in every probe: their tests are test_paged_attention.py,
test_serve_engine.py and the audits."""
import copy
import warnings

import pytest
import torch
import torch.distributed.checkpoint.state_dict as tsd
from torch import nn

import workbench as wb
from workbench.checkpoint import get_state_dict

MESH = wb.Mesh.grid(3, ["dp"])


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(5, 10)
        self.l2 = nn.Linear(10, 3)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x)))


X = [torch.randn(6, 5, generator=torch.Generator().manual_seed(i)) for i in range(2)]


def _trained(zero: bool):
    """Two AdamW steps, then ``zero_grad()`` (every training loop's last line)."""
    torch.manual_seed(0)
    m = Net()
    if zero:
        m = wb.DistributedDataParallel(m, MESH)
        o = wb.ZeroRedundancyOptimizer(m.parameters(), torch.optim.AdamW, MESH, lr=1e-2)
    else:
        o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for x in X:
        o.zero_grad()
        y = m(wb.shard_tensor(x, MESH, ["S(0)"]) if zero else x)
        loss = (y ** 2).mean()
        (loss.full() if isinstance(loss, wb.DistTensor) else loss).backward()
        o.step()
    o.zero_grad()
    return m, o


def _full(v):
    return v.full() if isinstance(v, wb.DistTensor) else v


def test_get_state_dict_of_a_zero_optimizer_after_zero_grad_takes_no_step():
    """Its states live in the ranks' own optimizers (the wrapper's ``state`` is empty, as
    torch's ZeRO's): get_state_dict took them for a fresh optimizer's and ran torch's
    state-initializing step (lr 0, zero gradients) twice: step 2 saved as 4, Adam's
    moments multiplied by beta1^2 and beta2^2, in the optimizer itself too."""
    pm, po = _trained(zero=False)
    _, want = tsd.get_state_dict(pm, po)                    # torch's, on one device
    m, o = _trained(zero=True)
    before = copy.deepcopy(o.state_dict())
    _, got = get_state_dict(m, o)
    for i, (fqn, st) in enumerate(want["state"].items()):
        assert torch.equal(got["state"][fqn]["step"], st["step"])      # 2, as torch's
        for name, v in st.items():          # DDP's mean of 3 ranks' gradients: rounding
            torch.testing.assert_close(_full(got["state"][fqn][name]), v)
            assert torch.equal(_full(got["state"][fqn][name]), before["state"][i][name])
    after = o.state_dict()
    for i, st in before["state"].items():
        for name, v in st.items():
            assert torch.equal(after["state"][i][name], v), (i, name)


def test_a_fresh_zero_optimizer_gets_the_states_torch_gives_a_fresh_one():
    torch.manual_seed(0)
    pm = Net()
    _, want = tsd.get_state_dict(pm, torch.optim.AdamW(pm.parameters(), lr=1e-2))
    torch.manual_seed(0)
    m = wb.DistributedDataParallel(Net(), MESH)
    _, got = get_state_dict(m, wb.ZeroRedundancyOptimizer(m.parameters(), torch.optim.AdamW,
                                                           MESH, lr=1e-2))
    for fqn, st in want["state"].items():
        for name, v in st.items():
            assert torch.equal(_full(got["state"][fqn][name]), v), (fqn, name)


@pytest.mark.parametrize("bad", ["shape", "missing", "unexpected"])
def test_a_set_model_state_dict_that_fails_leaves_a_plain_module_as_it_was(bad):
    """torch's load_state_dict copies every value that fits, then raises; the wrappers
    (DDP, FSDP, tensor parallel) check first and change nothing.  The plain module, the
    one-device reference, now changes nothing either, with torch's error."""
    from workbench.checkpoint import set_model_state_dict
    torch.manual_seed(0)
    m = Net()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    sd = {k: v + 1 for k, v in before.items()}
    if bad == "shape":
        sd["l2.weight"] = torch.zeros(4, 10)
    elif bad == "missing":
        del sd["l2.bias"]
    else:
        sd["l3.weight"] = torch.zeros(1)
    word = {"shape": "size mismatch for l2.weight", "missing": 'Missing key.*"l2.bias"',
            "unexpected": 'Unexpected key.*"l3.weight"'}[bad]
    with pytest.raises(RuntimeError, match=word):
        set_model_state_dict(m, sd)
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k
    m2 = wb.DistributedDataParallel(Net(), MESH)        # the wrapper's, for comparison
    with pytest.raises(RuntimeError, match=word.replace("l2", "(module.)?l2")):
        set_model_state_dict(m2, sd)


@pytest.mark.parametrize("which", ["plain", "fsdp", "zero"])
def test_an_optimizer_state_of_another_shape_is_refused_naming_it(which):
    """torch's Optimizer.load_state_dict takes moments of any shape; the next step then
    failed on a broadcast ("The size of tensor a (3) must match ...")."""
    from workbench.checkpoint import set_optimizer_state_dict
    torch.manual_seed(0)
    m = Net()
    if which == "fsdp":
        m = wb.FullyShardedDataParallel(m, MESH)
    if which == "zero":
        m = wb.DistributedDataParallel(m, MESH)
        o = wb.ZeroRedundancyOptimizer(m.parameters(), torch.optim.AdamW, MESH, lr=1e-2)
    else:
        o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    _, osd = get_state_dict(m, o)           # the states as zeros, as torch's
    before = copy.deepcopy(o.state_dict())
    bad = copy.deepcopy(osd)
    bad["state"]["l1.weight"]["exp_avg"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"'exp_avg' of 'l1.weight' has shape \(3, 3\).*"
                                         r"\(10, 5\)"):
        set_optimizer_state_dict(m, o, bad)
    after = o.state_dict()
    for i, st in before["state"].items():
        for name, v in st.items():
            assert torch.equal(_full(after["state"][i][name]), _full(v)), (i, name)


# ---- sampling -----------------------------------------------------------------------------

def test_filter_logits_refuses_greedy_params_and_logits_of_another_rank():
    """filter_logits(logits, SamplingParams()) divided by temperature 0: [[inf, nan, -inf]]
    silently (HF's TemperatureLogitsWarper refuses 0); 1-d logits were an IndexError."""
    from workbench.serve import SamplingParams, filter_logits
    with pytest.raises(ValueError, match="temperature=0"):
        filter_logits(torch.tensor([[1.0, 0.0, -2.0]]), SamplingParams())
    with pytest.raises(ValueError, match=r"shape \(3,\); give the last position's \(B, V\)"):
        filter_logits(torch.tensor([1.0, 0.0, -2.0]), SamplingParams(1.0, top_k=2))
    got = filter_logits(torch.tensor([[1.0, 0.0, -2.0]]), SamplingParams(0.5, top_k=2))
    assert torch.equal(got, torch.tensor([[2.0, 0.0, float("-inf")]]))


def _chunked_zero(steps):
    """ZeRO-1 in chunks over dp beside tensor parallelism over tp (test_dp_family's)."""
    mesh = wb.Mesh([[0, 1], [2, 3]], ["dp", "tp"])
    torch.manual_seed(0)
    model = wb.parallelize(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)),
                           mesh, {"0": "colwise", "2": "rowwise"}, mesh_dim="tp")
    opt = wb.ZeroRedundancyOptimizer(wb.dist_parameters(model), torch.optim.AdamW, mesh, "dp",
                                     partition="chunks", lr=1e-2)
    g = torch.Generator().manual_seed(1)
    x = wb.shard_tensor(torch.randn(8, 16, generator=g), mesh, [wb.Shard(0), wb.Replicate()])
    for _ in range(steps):
        opt.zero_grad()
        (model(x) ** 2).mean().backward()
        opt.step()
    return model, opt


@pytest.mark.parametrize("steps", [0, 2])
def test_state_dict_helpers_name_a_chunked_zero_optimizer_and_the_way_that_works(
        tmp_path, steps):
    """Its groups hold flat chunks, not the model's parameters: get_state_dict failed with
    step()'s "no parameter has a gradient; call loss.backward() first" (trained), or named
    its chunks "not among model.named_parameters()" (fresh).  The way named, saving it as
    itself into the same layout, gives its states back."""
    from workbench.checkpoint import get_optimizer_state_dict, load, save
    model, opt = _chunked_zero(steps)
    before = copy.deepcopy(opt.state_dict())
    for fn in (lambda: get_state_dict(model, opt), lambda: get_optimizer_state_dict(model, opt)):
        with pytest.raises(NotImplementedError, match=r"partition='chunks'.*same layout"):
            fn()
    if not steps:
        return
    after = opt.state_dict()
    assert all(torch.equal(after["state"][i][n], v) for i, st in before["state"].items()
               for n, v in st.items())
    save(tmp_path, {"optim": opt})
    model2, opt2 = _chunked_zero(1)
    load(tmp_path, {"optim": opt2})
    got = opt2.state_dict()
    assert all(torch.equal(got["state"][i][n], v) for i, st in before["state"].items()
               for n, v in st.items())


def test_a_state_initializing_step_that_fails_leaves_the_lr_as_it_was():
    """get_state_dict gives a fresh optimizer its states with one step at lr 0 (torch's
    _init_optim_state); LBFGS's step wants a closure and raised, and the lr stayed 0 (as
    with torch's own helper): the next training step then moved nothing."""
    torch.manual_seed(0)
    m = Net()
    o = torch.optim.LBFGS(m.parameters(), lr=0.5)
    with pytest.raises(TypeError, match="closure"):
        get_state_dict(m, o)
    assert o.param_groups[0]["lr"] == 0.5
    assert all(p.grad is None for p in m.parameters())


# ---- torch's own dcp.save / dcp.load with these helpers, tensor parallel -------------------

def _tp(n, steps):
    """Net with Megatron's MLP split over ``n`` ranks (10 features on 4: 3, 3, 3, 1), AdamW
    over its DistTensor parameters, ``steps`` steps."""
    torch.manual_seed(0)
    m = Net()
    wb.parallelize_module(m, wb.Mesh.grid(n, ["tp"]), {"l1": wb.ColwiseParallel(),
                                                      "l2": wb.RowwiseParallel()})
    o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for x in X[:steps]:
        o.zero_grad()
        y = m(x)
        (y.full() if isinstance(y, wb.DistTensor) else y).pow(2).mean().backward()
        o.step()
    return m, o


@pytest.mark.parametrize("flat", [False, True], ids=["nested", "flattened"])
def test_torchs_dcp_moves_tensor_parallel_optimizer_states_between_layouts(tmp_path, flat):
    """get_optimizer_state_dict over tensor-parallel parameters holds DistTensors, which
    torch's DCP cannot read: dcp.save raised (TypeError inside a CheckpointException) and
    dcp.load "expected BytesStorageMetadata".  The model's dict was already read as
    Stateful (full tensors); the optimizer's now is too: TP 4 (uneven) to TP 2, bitwise."""
    import torch.distributed.checkpoint as dcp
    from workbench.checkpoint import StateDictOptions, set_state_dict
    opts = StateDictOptions(flatten_optimizer_state_dict=flat)
    full = StateDictOptions(full_state_dict=True)
    m, o = _tp(4, 2)
    msd, osd = get_state_dict(m, o, options=opts)
    with warnings.catch_warnings():     # torch: no process group, "assuming ... single process"
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path))
    m2, o2 = _tp(2, 0)
    msd2, osd2 = get_state_dict(m2, o2, options=opts)
    state = {"model": msd2, "optim": osd2}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(tmp_path))
    set_state_dict(m2, o2, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=opts)
    (wm, wo), (gm, go) = get_state_dict(m, o, options=full), get_state_dict(m2, o2, options=full)
    assert all(torch.equal(gm[k], v) for k, v in wm.items())
    for fqn, st in wo["state"].items():
        for name, v in st.items():
            assert torch.equal(go["state"][fqn][name], v), (fqn, name)


def test_top_p_keeps_every_token_tied_with_the_last_one_kept_as_documented():
    from workbench.serve import SamplingParams, filter_logits
    x = torch.log(torch.tensor([[0.5, 0.25, 0.25, 1e-3]]))
    got = filter_logits(x, SamplingParams(1.0, top_p=0.6))
    assert (got > float("-inf")).tolist() == [[True, True, True, False]]
    got = filter_logits(x, SamplingParams(1.0, top_p=0.45))     # reached by the first alone
    assert (got > float("-inf")).tolist() == [[True, False, False, False]]


# ---- a pipeline-trained model, served -----------------------------------------------------

def test_generate_on_a_pipeline_split_model_names_the_way_to_serve_it():
    """generate(model) of Hybrid(pp=2) failed inside the model's forward, naming
    training's calls (strategy.forward_backward / evaluate); the way named now,
    serve_model(cfg, state_dict=model.state_dict()), gives one device's tokens."""
    from workbench.models import build_model
    from workbench.models.config import get_config
    from workbench.recipes.hybrid import Hybrid
    from workbench.serve import Engine, generate, serve_model
    cfg = get_config("tiny", dtype="float32")
    idx = torch.randint(0, cfg.vocab_size, (2, 5), generator=torch.Generator().manual_seed(0))
    want = generate(build_model(cfg, seed=4).eval(), idx, 6)
    piped = Hybrid(pp=2).build_model(cfg, seed=4)
    with pytest.raises(TypeError, match=r"pipeline stages.*serve_model\(model.cfg, tp=\.\.\., "
                                        r"state_dict=model.state_dict\(\)\)"):
        generate(piped, idx, 6)
    with pytest.raises(TypeError, match=r"state_dict=model.state_dict\(\)"):
        Engine(piped, 8, 4)
    served = serve_model(piped.cfg, tp=2, state_dict=piped.state_dict())
    assert torch.equal(generate(served.model, served.place(idx), 6).full(), want)


# ---- the KV cache at its capacity ---------------------------------------------------------

def test_a_cache_at_its_capacity_raises_naming_the_fix_and_keeps_what_it_held():
    """Never wraps: a decode past max_len raises before any layer stores (the cache's
    tokens still equal the cacheless decode's), naming what to do."""
    from workbench.models import build_model
    from workbench.models.config import get_config
    from workbench.serve import KVCache, generate
    cfg = get_config("tiny", dtype="float32", n_kv_head=2)
    m = build_model(cfg, seed=0).eval()
    idx = torch.randint(0, cfg.vocab_size, (2, 4), generator=torch.Generator().manual_seed(0))
    cache = KVCache(cfg.n_layer, max_len=7)
    out = generate(m, idx, 3, cache=cache)              # 7 tokens, 6 held (the last not fed)
    assert torch.equal(out, generate(m, idx, 3, use_cache=False))
    with pytest.raises(ValueError, match=r"6 held \+ 2 new tokens exceed max_len=7 \(nothing "
                                         r"was stored\); ask for fewer tokens"):
        generate(m, torch.cat([out, out[:, -1:]], 1), 1, cache=cache)
    assert all(k.shape[2] == 6 for k in cache.keys + cache.values)
    assert torch.equal(generate(m, out, 1, cache=cache), generate(m, out, 1, use_cache=False))


@pytest.mark.parametrize("source", ["tp4", "fsdp"])
def test_set_state_dict_takes_disttensors_of_another_mesh_into_tensor_parallel(source):
    """The module docstring: the set_* functions take DistTensors 'whatever the layout
    that saved it'; into a tensor-parallel module, those of another mesh (TP 4's, FSDP's
    on dp=3) were refused with 'the DistTensor lives on Mesh(tp=4 ...); load its .full()
    instead'.  They are gathered first, as into a plain module."""
    from workbench.checkpoint import StateDictOptions, set_state_dict
    if source == "tp4":
        m, o = _tp(4, 2)
    else:
        torch.manual_seed(0)
        m = wb.FullyShardedDataParallel(Net(), MESH)
        o = torch.optim.AdamW(m.parameters(), lr=1e-2)
        for x in X:
            o.zero_grad()
            m(wb.shard_tensor(x, MESH, ["S(0)"])).full().pow(2).mean().backward()
            o.step()
    msd, osd = get_state_dict(m, o)
    m2, o2 = _tp(2, 0)
    set_state_dict(m2, o2, model_state_dict=msd, optim_state_dict=osd)
    full = StateDictOptions(full_state_dict=True)
    (wm, wo), (gm, go) = get_state_dict(m, o, options=full), get_state_dict(m2, o2, options=full)
    assert all(torch.equal(gm[k], v) for k, v in wm.items())
    for fqn, st in wo["state"].items():
        for name, v in st.items():
            assert torch.equal(go["state"][fqn][name], v), (fqn, name)
