"""User-trial audit of pipeline parallelism as a training loop sees it (auditpp2).

A user's loop over the hybrid recipe (``build_model`` / ``build_optimizer`` /
``forward_backward`` / ``optimizer_step``) and over ``run_pipeline``, held to one device:
gradient clipping over every stage, zero_grad, gradient accumulation, evaluation,
state dicts, and micro-batches that do not split evenly.
"""
import copy
import math

import pytest
import torch
from torch import nn

import workbench as wb
from workbench.models import build_model, get_batch, get_config
from workbench.recipes.hybrid import Hybrid
from workbench.sim_mesh.trace import trace

S = wb.schedules


def _cfg(n_layer=2, **over):
    return get_config("tiny").replace(n_layer=n_layer, **over)


def _one_device_norm(cfg, batches, norm_type=2.0):
    """Total gradient norm of one device after backward on each (x, y) of ``batches``."""
    model = build_model(cfg, seed=0).train()
    for x, y in batches:
        model(x, y)[1].backward()
    return float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()],
                                               norm_type))


def _full_state(model):
    """The model's state dict in one device's tensors (DistTensors gathered)."""
    return {k: v.full() if isinstance(v, wb.DistTensor) else v
            for k, v in model.state_dict().items()}


def _assert_params_equal(model, ref, atol):
    got = _full_state(model)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), atol=atol, rtol=0, msg=name)


def _pipeline(cfg, **kw):
    st = Hybrid(**kw)
    model = st.build_model(cfg, 0)
    return st, model, st.build_optimizer(model, 3e-3, 0.01)


LAYOUTS = [dict(pp=2), dict(pp=2, schedule="gpipe"), dict(pp=2, dp=2),
           dict(pp=2, dp=2, zero=1), dict(pp=2, dp=2, zero=2), dict(pp=2, dp=2, zero=3),
           dict(pp=2, tp=2, sp=True), dict(pp=2, schedule="dualpipe", microbatches=4),
           dict(pp=2, schedule="zb-v", n_layer=4), dict(pp=2, schedule="zb-h1")]


def _ids(kw):
    return "-".join(f"{k}{v}" for k, v in kw.items())


@pytest.mark.parametrize("kw", LAYOUTS, ids=_ids)
def test_clip_grad_norm_over_every_stage_is_one_devices(kw):
    kw = dict(kw)
    cfg = _cfg(kw.pop("n_layer", 2))
    x, y = get_batch(cfg, 8, 0, 0)
    ref = _one_device_norm(cfg, [(x, y)])
    st, model, opts = _pipeline(cfg, **kw)
    st.forward_backward(model, x, y)
    with trace() as tr:
        total = st.clip_grad_norm_(opts, 0.5)
    assert float(total) == pytest.approx(ref, rel=1e-5)
    # every stage scaled by the same coefficient: the clipped gradients' norm is max_norm
    assert float(st.clip_grad_norm_(opts, math.inf)) == pytest.approx(0.5, rel=1e-5)
    # the stages' parts combined by one scalar all-reduce over the pipeline ranks (plain
    # data parallelism: the model-parallel group, tensor and pipeline ranks, Megatron-LM's;
    # ZeRO-1/2: every rank, dp too, Megatron-LM's distributed optimizer: fixlist9)
    assert any(e.label in ("clip_grad norm over pp", "clip_grad norm over tp x pp",
                           "clip_grad norm over dp x tp x pp") for e in tr.collectives())


@pytest.mark.parametrize("zero", [0, 2, 3])
def test_clip_grad_norm_inf_norm_and_a_step_match_one_device(zero):
    cfg = _cfg()
    ref = build_model(cfg, seed=0).train()
    ref_opt = wb.ops.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.01)
    st, model, opts = _pipeline(cfg, pp=2, dp=2, zero=zero)
    for step in range(2):
        x, y = get_batch(cfg, 8, 0, step)
        ref(x, y)[1].backward()
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, math.inf)
        ref_opt.step()
        ref_opt.zero_grad()
        st.forward_backward(model, x, y)
        got = st.clip_grad_norm_(opts, 0.05, math.inf)
        st.optimizer_step(opts)
        assert float(got) == pytest.approx(float(want), rel=1e-5)
    _assert_params_equal(model, ref, atol=1e-4)


def test_clip_error_if_nonfinite_as_torch():
    cfg = _cfg()
    x, y = get_batch(cfg, 8, 0, 0)
    st, model, opts = _pipeline(cfg, pp=2)
    st.forward_backward(model, x, y)
    model.layers[1].attn.wq.weight._local.grad.fill_(float("nan"))
    with pytest.raises(RuntimeError, match="non-finite"):
        st.clip_grad_norm_(opts, 1.0, error_if_nonfinite=True)
    assert math.isnan(float(st.clip_grad_norm_(opts, 1.0)))


def test_one_stage_optimizer_refuses_to_clip_alone():
    # each stage clipped by its own norm scales the stages differently: silently wrong
    cfg = _cfg()
    x, y = get_batch(cfg, 8, 0, 0)
    st, model, opts = _pipeline(cfg, pp=2, dp=2, zero=1)
    st.forward_backward(model, x, y)
    with pytest.raises(RuntimeError, match=r"strategy\.clip_grad_norm_\(optimizers"):
        opts[0].clip_grad_norm_(1.0)


def test_data_parallel_one_buffer_gradients_clip_in_place():
    # Hybrid(dp=2) all-reduces its gradients in one buffer: the reduced gradients were
    # stride-0 views, so clip_grad_norm_'s mul_ raised "more than one element ..."
    cfg = _cfg()
    x, y = get_batch(cfg, 8, 0, 0)
    ref = _one_device_norm(cfg, [(x, y)])
    st, model, opts = _pipeline(cfg, dp=2)
    st.forward_backward(model, x, y)
    assert float(opts[0].clip_grad_norm_(0.5)) == pytest.approx(ref, rel=1e-5)
    assert float(opts[0].clip_grad_norm_(math.inf)) == pytest.approx(0.5, rel=1e-5)


@pytest.mark.parametrize("kw", [dict(pp=2), dict(pp=2, tp=2), dict(pp=2, dp=2, zero=2),
                                dict(pp=2, schedule="dualpipe", microbatches=4)], ids=_ids)
@pytest.mark.parametrize("set_to_none", [False, True])
def test_zero_grad_clears_every_stage(kw, set_to_none):
    # model.zero_grad() crashed (the root module held DistTensors torch's zero_grad cannot
    # read), left ZeRO-2's reduced gradient shards, and left DualPipe's second copy
    cfg = _cfg()
    x, y = get_batch(cfg, 8, 0, 0)
    st, model, opts = _pipeline(cfg, **kw)
    st.forward_backward(model, x, y)
    model.zero_grad(set_to_none=set_to_none)
    st.forward_backward(model, x, y)
    got = float(st.clip_grad_norm_(opts, math.inf))
    assert got == pytest.approx(_one_device_norm(cfg, [(x, y)]), rel=1e-5)


@pytest.mark.parametrize("kw", [dict(pp=2), dict(pp=2, dp=2, zero=2),
                                dict(pp=2, schedule="interleaved", n_layer=4)], ids=_ids)
def test_gradient_accumulation_over_two_calls(kw):
    kw = dict(kw)
    cfg = _cfg(kw.pop("n_layer", 2))
    x, y = get_batch(cfg, 8, 0, 0)
    halves = [(x[:4], y[:4]), (x[4:], y[4:])]
    st, model, opts = _pipeline(cfg, **kw)
    for a, b in halves:
        st.forward_backward(model, a, b)
    got = float(st.clip_grad_norm_(opts, math.inf))
    assert got == pytest.approx(_one_device_norm(cfg, halves), rel=1e-5)


@pytest.mark.parametrize("kw", [dict(pp=2), dict(pp=2, schedule="zb-h1"),
                                dict(pp=2, schedule="dualpipe", microbatches=4),
                                dict(pp=2, dp=2, zero=3), dict(tp=2)], ids=_ids)
def test_evaluate_is_one_devices_eval_loss_and_leaves_no_gradient(kw):
    cfg = _cfg(dropout=0.2)
    x, y = get_batch(cfg, 8, 0, 0)
    ref = build_model(cfg, seed=0).eval()
    with torch.no_grad():
        want = ref(x, y)[1]
    st, model, opts = _pipeline(cfg, **kw)
    model.eval()
    got = st.evaluate(model, x, y)
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    assert all(p.grad is None for _, p in wb.dist_parameters(model))
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"strategy\.evaluate"):
        st.forward_backward(model, x, y)


@pytest.mark.parametrize("kw", [dict(pp=2), dict(pp=2, schedule="zb-v", n_layer=4),
                                dict(tp=2)], ids=_ids)
def test_evaluate_without_targets_gives_one_devices_logits(kw):
    kw = dict(kw)
    cfg = _cfg(kw.pop("n_layer", 2))
    x, _ = get_batch(cfg, 8, 0, 0)
    ref = build_model(cfg, seed=0).eval()
    st, model, _ = _pipeline(cfg, **kw)
    model.eval()
    got = st.evaluate(model, x)
    assert isinstance(got, torch.Tensor) and not got.requires_grad
    torch.testing.assert_close(got, ref(x)[0].detach(), atol=1e-5, rtol=1e-5)


def test_calling_a_pipelined_model_names_evaluate():
    # model(x) ran every stage's layers on one mesh: "rms_norm: inputs live on different
    # meshes ..., reshard one onto the other's mesh first"
    cfg = _cfg()
    x, _ = get_batch(cfg, 8, 0, 0)
    st, model, _ = _pipeline(cfg, pp=2)
    with pytest.raises(RuntimeError, match=r"strategy\.evaluate\(model, x\)"):
        model(x)


def test_evaluate_between_steps_changes_nothing():
    cfg = _cfg(dropout=0.1)
    runs = []
    for evaluate in (False, True):
        st, model, opts = _pipeline(cfg, pp=2)
        losses = []
        for step in range(2):
            x, y = get_batch(cfg, 8, 0, step)
            torch.manual_seed(step)         # dropout's masks
            losses.append(float(st.forward_backward(model, x, y)))
            if evaluate:                # an evaluation between backward and step
                model.eval()
                st.evaluate(model, x, y)
                model.train()
            st.optimizer_step(opts)
        runs.append(losses)
    assert runs[0] == runs[1]


def _toy(p=2, m=4):
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)) for _ in range(p)]
    meshes = [wb.Mesh([r], ["pp"]) for r in range(p)]
    mods = [wb.parallelize(copy.deepcopy(layer), meshes[s]) for s, layer in enumerate(layers)]
    return layers, meshes, mods


@pytest.mark.parametrize("make", [S.gpipe, S.one_f_one_b, S.zb_h1])
def test_run_pipeline_forward_only(make):
    p, m = 2, 4
    layers, meshes, mods = _toy(p, m)
    X, T = torch.randn(8, 8), torch.randn(8, 8)
    xs = [wb.shard_tensor(c, meshes[0], ["R"]) for c in X.chunk(m)]
    ts = [wb.shard_tensor(c, meshes[-1], ["R"]) for c in T.chunk(m)]
    for mod in mods:
        mod.eval()
    ref = nn.Sequential(*copy.deepcopy(layers)).eval()
    run = S.run_pipeline(make(p, m), mods, meshes, xs, lambda out, i: ((out - ts[i]) ** 2).mean(),
                         forward_only=True)
    out = torch.cat([o.full() for o in run.outputs])
    torch.testing.assert_close(out, ref(X).detach())
    assert not out.requires_grad
    assert run.loss == pytest.approx(float(((ref(X) - T) ** 2).mean().detach()), rel=1e-6)
    assert all(q.grad is None for mod in mods for _, q in wb.dist_parameters(mod))
    assert all(a.kind == "F" for _, a in run.order)
    bare = S.run_pipeline(make(p, m), mods, meshes, xs, None, forward_only=True)
    with pytest.raises(ValueError, match="no loss"):
        bare.loss


def test_run_pipeline_under_no_grad_names_forward_only():
    p, m = 2, 4
    _, meshes, mods = _toy(p, m)
    xs = [wb.shard_tensor(c, meshes[0], ["R"]) for c in torch.randn(8, 8).chunk(m)]
    with torch.no_grad(), pytest.raises(RuntimeError, match="forward_only=True"):
        S.run_pipeline(S.one_f_one_b(p, m), mods, meshes, xs, lambda out, i: out.sum())


def test_uneven_micro_batches_raise_naming_the_fix():
    # 7 rows in 4 micro-batches (2, 2, 2, 1): each loss weighs 1/4, so the last row would
    # weigh twice the others: not one device's mean
    p, m = 2, 4
    _, meshes, mods = _toy(p, m)
    xs = [wb.shard_tensor(c, meshes[0], ["R"]) for c in torch.randn(7, 8).chunk(m)]
    before = [q.full().clone() for mod in mods for _, q in wb.dist_parameters(mod)]
    with pytest.raises(ValueError, match=r"\[2, 2, 2, 1\] rows.*divides by m=4"):
        S.run_pipeline(S.one_f_one_b(p, m), mods, meshes, xs, lambda out, i: out.mean())
    assert all(q.grad is None for mod in mods for _, q in wb.dist_parameters(mod))
    after = [q.full() for mod in mods for _, q in wb.dist_parameters(mod)]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("kw", [dict(pp=2), dict(pp=2, schedule="dualpipe", microbatches=4)],
                         ids=_ids)
def test_state_dict_into_a_fresh_pipeline_and_one_device(kw):
    # DualPipe's second copy of the stages was left at its init by load_state_dict
    cfg = _cfg()
    st, model, opts = _pipeline(cfg, **kw)
    x, y = get_batch(cfg, 8, 0, 0)
    st.forward_backward(model, x, y)
    st.optimizer_step(opts)
    sd = model.state_dict()
    one = build_model(cfg, seed=1)
    one.load_state_dict(_full_state(model))
    fresh = Hybrid(**kw)
    model2 = fresh.build_model(cfg, 1)          # another init: the load must replace it
    opts2 = fresh.build_optimizer(model2, 3e-3, 0.01)
    model2.load_state_dict(sd)
    x, y = get_batch(cfg, 8, 0, 1)
    want = _one_norm_of(one, x, y)
    fresh.forward_backward(model2, x, y)
    assert float(fresh.clip_grad_norm_(opts2, math.inf)) == pytest.approx(want, rel=1e-5)


def _one_norm_of(model, x, y):
    model.train()
    model(x, y)[1].backward()
    return float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))


def _steps(st, model, opts, cfg, steps):
    losses = []
    for step in steps:
        x, y = get_batch(cfg, 8, 0, step)
        losses.append(float(st.forward_backward(model, x, y)))
        st.optimizer_step(opts)
    return losses


@pytest.mark.parametrize("kw", [dict(pp=2), dict(pp=2, dp=2, zero=2),
                                dict(pp=2, schedule="dualpipe", microbatches=4)], ids=_ids)
def test_model_and_optimizer_state_dicts_resume_a_fresh_pipeline(kw):
    # the stage optimizers (DataParallel) had no state_dict / load_state_dict / zero_grad
    cfg = _cfg()
    st, model, opts = _pipeline(cfg, **kw)
    want = _steps(st, model, opts, cfg, range(3))
    st, model, opts = _pipeline(cfg, **kw)
    got = _steps(st, model, opts, cfg, range(2))
    msd = _full_state(model)
    osd = [copy.deepcopy(o.state_dict()) for o in opts]
    fresh = Hybrid(**kw)
    model2 = fresh.build_model(cfg, 1)
    opts2 = fresh.build_optimizer(model2, 3e-3, 0.01)
    model2.load_state_dict(msd)
    for o, sd in zip(opts2, osd):
        o.load_state_dict(sd)
    got += _steps(fresh, model2, opts2, cfg, [2])
    assert got == want


@pytest.mark.parametrize("zero", [0, 1])
def test_stage_optimizer_zero_grad(zero):
    cfg = _cfg()
    x, y = get_batch(cfg, 8, 0, 0)
    st, model, opts = _pipeline(cfg, pp=2, dp=2, zero=zero)
    st.forward_backward(model, x, y)
    for o in opts:
        o.zero_grad(set_to_none=False)
    st.forward_backward(model, x, y)
    got = float(st.clip_grad_norm_(opts, math.inf))
    assert got == pytest.approx(_one_device_norm(cfg, [(x, y)]), rel=1e-5)
    for o in opts:
        o.zero_grad()
    assert all(p._local.grad is None for o in opts for p in o.params)


@pytest.mark.parametrize("batch,kw,fix", [(3, dict(pp=2), r"divides by 2 \(e\.g\. 4\), or "
                                          r"Hybrid\(microbatches=3\)"),
                                         (6, dict(pp=2, dp=2), r"Hybrid\(microbatches=3\)")])
def test_batch_not_dividing_micro_batches_names_the_fix(batch, kw, fix):
    st = Hybrid(**kw)
    with pytest.raises(ValueError, match=rf"batch_size={batch} does not divide.*{fix}"):
        st.check(_cfg(), batch)
    m = int(fix.split("microbatches=")[1][0])
    Hybrid(**kw, microbatches=m).check(_cfg(), batch)     # the fix it names works


@pytest.mark.parametrize("kw", [dict(pp=2), dict(pp=2, dp=2, zero=1), dict(pp=2, dp=2, zero=3)],
                         ids=_ids)
def test_wb_clip_over_the_model_names_the_pipeline_clip(kw):
    # the wrappers' own advice (clip this DataParallel / these shards) clips one stage
    cfg = _cfg()
    x, y = get_batch(cfg, 8, 0, 0)
    st, model, opts = _pipeline(cfg, **kw)
    st.forward_backward(model, x, y)
    with pytest.raises(RuntimeError, match=r"strategy\.clip_grad_norm_\(optimizers"):
        wb.clip_grad_norm_(model.parameters(), 1.0)
    assert float(st.clip_grad_norm_(opts, 1.0)) == pytest.approx(
        _one_device_norm(cfg, [(x, y)]), rel=1e-5)


def test_split_backward_params_leaving_out_a_weight_raise():
    # ZB-H1's W computed only the listed parameters: a bias left out got no gradient
    p, m = 2, 4
    _, meshes, mods = _toy(p, m)
    xs = [wb.shard_tensor(c, meshes[0], ["R"]) for c in torch.randn(8, 8).chunk(m)]
    params = [[mod[0].weight] for mod in mods]
    with pytest.raises(ValueError, match=r"params\[0\] leaves out \['0\.bias'\]"):
        S.run_pipeline(S.zb_h1(p, m), mods, meshes, xs, lambda out, i: out.pow(2).mean(),
                       params=params)
    assert all(q.grad is None for mod in mods for _, q in wb.dist_parameters(mod))
    params = [[q for _, q in wb.dist_parameters(mod)] for mod in mods]
    S.run_pipeline(S.zb_h1(p, m), mods, meshes, xs, lambda out, i: out.pow(2).mean(),
                   params=params)
    assert all(q.grad is not None for mod in mods for _, q in wb.dist_parameters(mod))


@pytest.mark.parametrize("kw", [dict(pp=2, ep=2), dict(pp=2, ep=2, zero=1)], ids=_ids)
def test_clip_grad_norm_with_experts_split_over_ranks(kw):
    # the experts' optimizers (reduced over edp) are stages' optimizers too
    cfg = _cfg(moe_experts=4, moe_topk=2)
    x, y = get_batch(cfg, 8, 0, 0)
    st, model, opts = _pipeline(cfg, **kw)
    st.forward_backward(model, x, y)
    got = float(st.clip_grad_norm_(opts, 0.1))
    assert got == pytest.approx(_one_device_norm(cfg, [(x, y)]), rel=1e-5)
    assert float(st.clip_grad_norm_(opts, math.inf)) == pytest.approx(0.1, rel=1e-5)


def test_zero_optimizer_after_a_dtype_conversion_names_the_order():
    # the replicas became float64, the optimizer's shards stayed float32: torch's
    # "attempting to assign a gradient with dtype 'double'..." from inside step()
    cfg = _cfg()
    x, y = get_batch(cfg, 8, 0, 0)
    st, model, opts = _pipeline(cfg, pp=2, dp=2, zero=1)
    model.to(torch.float64)
    st.forward_backward(model, x, y)
    with pytest.raises(RuntimeError, match="build the optimizer after converting the model"):
        st.optimizer_step(opts)


@pytest.mark.parametrize("kw", [dict(pp=2, dp=2), dict(pp=2, dp=2, zero=2),
                                dict(pp=2, dp=2, zero=3),
                                dict(pp=2, schedule="dualpipe", microbatches=4)], ids=_ids)
def test_clip_grad_value_over_every_stage_is_one_devices(kw):
    cfg = _cfg()
    x, y = get_batch(cfg, 8, 0, 0)
    ref = build_model(cfg, seed=0).train()
    ref(x, y)[1].backward()
    torch.nn.utils.clip_grad_value_(ref.parameters(), 2e-3)
    want = float(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]))
    st, model, opts = _pipeline(cfg, **kw)
    st.forward_backward(model, x, y)
    with pytest.raises(RuntimeError, match=r"strategy\.clip_grad_value_"):
        wb.clip_grad_value_(model.parameters(), 2e-3)
    st.clip_grad_value_(opts, 2e-3)
    assert float(st.clip_grad_norm_(opts, math.inf)) == pytest.approx(want, rel=1e-5)


def _ignored_targets(y, whole_first_micro_batch=False):
    y = y.clone()
    y[0, :40] = -100                    # F.cross_entropy's ignore_index: padding, prompts
    y[5, :10] = -100
    if whole_first_micro_batch:
        y[:2] = -100
    return y


@pytest.mark.parametrize("kw", [dict(pp=2), dict(pp=2, tp=2), dict(pp=2, dp=2, zero=1),
                                dict(pp=2, schedule="dualpipe", microbatches=4)], ids=_ids)
@pytest.mark.parametrize("whole", [False, True], ids=["some", "a-whole-micro-batch"])
def test_ignored_targets_weigh_micro_batches_by_their_tokens(kw, whole):
    # each micro-batch's mean weighed 1/m: the loss was not one device's mean over the
    # batch's counted tokens (-6.5e-4 here) and the gradients differed (+2.6e-3 in norm)
    cfg = _cfg()
    x, y = get_batch(cfg, 8, 0, 0)
    y = _ignored_targets(y, whole)
    ref = build_model(cfg, seed=0).train()
    want = ref(x, y)[1]
    want.backward()
    want_norm = float(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]))
    st, model, opts = _pipeline(cfg, **kw)
    got = st.forward_backward(model, x, y)
    assert float(got) == pytest.approx(want.item(), rel=1e-6)
    assert float(st.clip_grad_norm_(opts, math.inf)) == pytest.approx(want_norm, rel=1e-5)
    model.eval()
    ref.eval()
    with torch.no_grad():
        assert float(st.evaluate(model, x, y)) == pytest.approx(float(ref(x, y)[1]), rel=1e-6)


def test_plain_tensor_between_stages_names_parallelize():
    # a plain module's output reached the send: "'Tensor' object has no attribute
    # 'placements'"
    torch.manual_seed(0)
    mods = [nn.Linear(4, 4) for _ in range(2)]
    meshes = [wb.Mesh([r], ["pp"]) for r in range(2)]
    xs = list(torch.randn(8, 4).chunk(4))
    with pytest.raises(TypeError, match=r"stages\[0\] returned a Tensor.*wb\.parallelize"):
        S.run_pipeline(S.one_f_one_b(2, 4), mods, meshes, xs, lambda o, i: o.pow(2).mean())
    assert all(p.grad is None for mod in mods for p in mod.parameters())


@pytest.mark.parametrize("kw", [dict(pp=2), dict(pp=2, schedule="dualpipe", microbatches=4),
                                dict(pp=2, schedule="zb-v", n_layer=4)], ids=_ids)
def test_evaluate_takes_a_batch_of_another_size(kw):
    # a validation batch of 1 or 3 sequences: "batch_size=3 does not divide into dp=1 x 4
    # micro-batches" (forward only, any micro-batch count gives the same values)
    kw = dict(kw)
    cfg = _cfg(kw.pop("n_layer", 2))
    x, y = get_batch(cfg, 8, 0, 0)
    ref = build_model(cfg, seed=0).eval()
    st, model, opts = _pipeline(cfg, **kw)
    model.eval()
    for b in (1, 3) if kw.get("schedule") != "zb-v" else (3, 6):
        with torch.no_grad():
            want = float(ref(x[:b], y[:b])[1])
        assert float(st.evaluate(model, x[:b], y[:b])) == pytest.approx(want, rel=1e-5)
    assert st.m == 4                    # the training step's micro-batches are unchanged


@pytest.mark.parametrize("schedule", ["zb-h1", "dualpipe"])
def test_op_recompute_with_a_split_backward_is_refused_up_front(schedule, capsys):
    # PyTorch's selective activation checkpoint raised "Trying to backward an extra time"
    # from inside the step (a traceback from the command line)
    from workbench.cli import main
    from workbench.train import train
    with pytest.raises(NotImplementedError, match="recompute 'full' or 'selective'"):
        train("tiny", steps=1, batch_size=8, timing=False, recompute="op",
              strategy=Hybrid(pp=2, schedule=schedule))
    assert main(["train", "--preset", "tiny", "--steps", "1", "--pp", "2", "--schedule",
                 schedule, "--recompute", "op"]) == 2
    assert capsys.readouterr().err.startswith("error: recompute='op'")


def test_pipeline_clip_in_bfloat16_and_a_zero_norm():
    cfg = _cfg(dtype="bfloat16")
    x, y = get_batch(cfg, 8, 0, 0)
    ref = build_model(cfg, seed=0).train()
    ref(x, y)[1].backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
    st, model, opts = _pipeline(cfg, pp=2)
    st.forward_backward(model, x, y)
    with pytest.raises(ValueError, match="norm_type=0"):
        st.clip_grad_norm_(opts, 1.0, 0)      # torch's count of nonzero tensors
    got = st.clip_grad_norm_(opts, 1e9)
    assert got.dtype == want.dtype == torch.bfloat16
    assert float(got) == pytest.approx(float(want), rel=1e-2)


@pytest.mark.parametrize("kw", [dict(pp=2, schedule="gpipe"), dict(pp=2),
                                dict(pp=2, schedule="interleaved"), dict(pp=2, schedule="zb-h1"),
                                dict(pp=2, schedule="zb-v"),
                                dict(pp=2, schedule="dualpipe", microbatches=4),
                                dict(pp=2, dp=2, tp=2)], ids=_ids)
def test_every_schedule_trains_with_a_torch_optimizer_as_one_device(kw):
    # DualPipe's two copies were never summed for a torch.optim optimizer (each stage's
    # own finish_gradient_synchronization): the copies drifted apart
    cfg = _cfg(4)
    ref = build_model(cfg, seed=0).train()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    st, model, opts = _pipeline(cfg, **kw)
    opt = torch.optim.SGD([q for o in opts for q in o.parameters()], lr=0.5, momentum=0.9)
    for step in range(3):
        x, y = get_batch(cfg, 8, 0, step)
        want = ref(x, y)[1]
        want.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        got = st.forward_backward(model, x, y)
        st.finish_gradient_synchronization(opts)
        opt.step()
        opt.zero_grad()
        assert float(got) == pytest.approx(want.item(), rel=1e-6)
    _assert_params_equal(model, ref, atol=5e-6)


def test_dualpipe_backward_after_the_copies_were_summed_is_refused():
    cfg = _cfg()
    x, y = get_batch(cfg, 8, 0, 0)
    st, model, opts = _pipeline(cfg, pp=2, schedule="dualpipe", microbatches=4)
    st.forward_backward(model, x, y)
    st.clip_grad_norm_(opts, 1.0)
    with pytest.raises(RuntimeError, match="summed for this step"):
        st.forward_backward(model, x, y)
    st.optimizer_step(opts)
    st.forward_backward(model, x, y)        # a new step: summed once again by its step
