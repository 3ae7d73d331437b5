"""par9: expert, context and pipeline parallelism probed against one device (values and
gradients in float32), for silent wrong answers and unclear errors.  Each test here
failed before its fix."""
import pytest
import torch

from workbench.models import build_model, get_batch, get_config
from workbench.ops.moe import router_topk
from workbench.recipes import Hybrid
from workbench.train import train


# ---- MoE: a renormalised top-1 gate is exactly 1, its gradient exactly 0 ----------------------

@pytest.mark.parametrize("gating", ["softmax", "sigmoid"])
def test_top1_renormalised_gate_has_torchs_exactly_zero_gradient(gating):
    """p_i / sum of the k chosen is softmax over the chosen logits (Mixtral; Megatron-LM's
    topk then softmax): torch's softmax of one element gives a gate of 1 and a gradient of
    exactly 0.  ``top / top.sum()`` left rounding (6e-8 on these logits), the only
    gradient the router of a top-1 layer without aux loss gets."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(3, 7, 4, generator=g, requires_grad=True)
    w, e, _, _ = router_topk(z, 1, gating)
    (w * torch.randn(w.shape, generator=g)).sum().backward()
    assert torch.equal(w, torch.ones_like(w))
    assert torch.equal(z.grad, torch.zeros_like(z))
    # k = 2 still the renormalised probabilities (the same numbers as before, to rounding)
    w2, e2, _, _ = router_topk(z.detach(), 2, gating)
    score = torch.softmax(z.detach(), -1) if gating == "softmax" else torch.sigmoid(z.detach())
    top = score.gather(-1, e2)
    torch.testing.assert_close(w2, top / top.sum(-1, keepdim=True), rtol=1e-6, atol=1e-7)


def test_top1_router_without_aux_loss_gets_no_gradient_and_layouts_agree():
    """A top-1 MoE model with no aux loss: the router's gradient is exactly zero on one
    device (was 3e-11 of rounding, which AdamW's normalised step made into router moves of
    ~lr/300 a step, different on each layout: one device and Hybrid(dp=4) or
    Hybrid(ep=4) 1e-4 apart in the second step's loss)."""
    cfg = get_config("tiny").replace(n_layer=2, dropout=0.1, moe_experts=4, moe_topk=1,
                                     moe_capacity_factor=None, moe_aux_loss_coef=0.0)
    model = build_model(cfg, seed=0).train()
    x, y = get_batch(cfg, 8, 0, 0)
    model(x, y)[1].backward()
    for block in model.layers:
        assert torch.equal(block.mlp.router.weight.grad,
                           torch.zeros_like(block.mlp.router.weight))
    ref = [r["loss"] for r in train(cfg, steps=2, timing=False)]
    got = [r["loss"] for r in train(cfg, steps=2, timing=False, strategy=Hybrid(ep=4))]
    assert got == pytest.approx(ref, abs=2e-6)


# ---- PP: a pipeline stage whose parameters are all frozen ---------------------------------------

def _freeze_first_stage(model):
    for n, p in model.named_parameters():
        if n.startswith("layers.0.") or n == "tok_emb.weight":
            p.requires_grad_(False)


@pytest.mark.parametrize("kw", [dict(pp=2), dict(pp=2, dp=2, zero=3)], ids=["pp2", "pp2-zero3"])
def test_a_frozen_first_stage_steps_as_torch_optim(kw):
    """Fine-tuning with stage 0 (embedding and layer 0) frozen: the later stage trains as on
    one device, where torch.optim steps the trainable parameters; the frozen stage's
    optimizer has nothing to step.  Its DataParallel / Zero3 raised "no parameter has a
    gradient; call loss.backward() first" after a backward, in every optimizer_step."""
    cfg = get_config("tiny").replace(n_layer=2)
    ref = build_model(cfg, seed=0).train()
    _freeze_first_stage(ref)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=3e-3,
                            weight_decay=0.01)
    st = Hybrid(**kw)
    model = st.build_model(cfg, 0)
    _freeze_first_stage(model)
    opts = st.build_optimizer(model, 3e-3, 0.01)
    for step in range(2):
        x, y = get_batch(cfg, 8, step, 0)
        opt.zero_grad()
        want = ref(x, y)[1]
        want.backward()
        opt.step()
        for o in opts:
            o.zero_grad()
        got = st.forward_backward(model, x, y)
        st.optimizer_step(opts)
        assert float(got) == pytest.approx(float(want), abs=2e-5)
    state = {k: v.full() if hasattr(v, "full") else v for k, v in model.state_dict().items()}
    for n, p in ref.named_parameters():
        torch.testing.assert_close(state[n], p.detach(), atol=2e-5, rtol=0, msg=n)


def test_a_stage_optimizer_still_refuses_a_step_before_backward():
    """(The refusal kept where a parameter trains: a step before any backward.)"""
    cfg = get_config("tiny").replace(n_layer=2)
    st = Hybrid(pp=2)
    model = st.build_model(cfg, 0)
    opts = st.build_optimizer(model, 3e-3, 0.01)
    with pytest.raises(RuntimeError, match="call loss.backward"):
        st.optimizer_step(opts)


def test_interleaved_layers_not_dividing_are_named_in_hybrids_words_at_build():
    """Hybrid(pp=2, schedule="interleaved") on 2 layers: build_model raised the model's
    ``pipeline_stages`` error ("n_stages=4 does not divide n_layer=2 ... give sizes="),
    arguments the user never wrote; now Hybrid's own (pp x virtual)."""
    cfg = get_config("tiny").replace(n_layer=2)
    for kw in (dict(schedule="interleaved"), dict(schedule="zb-v")):
        with pytest.raises(ValueError, match=r"pp=2 x 2 chunks = 4 stages do not divide "
                                             r"n_layer=2; pick pp x virtual") as e:
            Hybrid(pp=2, **kw).build_model(cfg, 0)
        assert "sizes=" not in str(e.value)


def test_micro_batch_errors_under_expert_parallelism_name_dp_and_ep_as_given():
    """Hybrid(ep=4, pp=2, microbatches=4) on 8 sequences: the error named "dp=4", which
    the user never typed (dp=1 x ep=4 data-parallel ranks)."""
    cfg = get_config("tiny").replace(n_layer=2, moe_experts=4)
    with pytest.raises(ValueError, match=r"microbatches=4: at most batch_size // dp = 2 "
                                         r"\(batch_size=8, dp=1 x ep=4 = 4 data-parallel"):
        Hybrid(ep=4, pp=2, microbatches=4).check(cfg, 8)
    with pytest.raises(ValueError, match=r"batch_size=12 does not divide into dp=1 x ep=2 = "
                                         r"2 data-parallel ranks x 4 micro-batches"):
        Hybrid(ep=2, pp=2, microbatches=4).check(cfg, 12)


# ---- torch.autocast: the parallel layer's output in one device's dtype -------------------------

def test_expert_parallel_output_under_autocast_says_the_dtype_it_holds():
    """Under ``torch.autocast("cpu", bfloat16)`` the experts' GEMMs run in bfloat16 and one
    device's MoE output is bfloat16; the EP dispatcher's DistTensor said float32 (x's)
    over bfloat16 local rows."""
    import copy
    import workbench as wb
    from workbench.models.moe import MoE
    from workbench.parallel.module import parallelize
    from workbench.parallel.strategies.expert_parallel import expert_mesh, expert_parallel
    cfg = get_config("tiny", d_model=8, n_head=2, d_ff=12, moe_experts=4, moe_topk=2,
                     moe_capacity_factor=1.0, moe_aux_loss_coef=0.1)
    g = torch.Generator().manual_seed(0)
    m = MoE(cfg).train()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    x = torch.randn(4, 6, 8, generator=g)
    ref = copy.deepcopy(m)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = ref(x)
    mesh = wb.Mesh.grid((4, 1), ["dp", "tp"])
    m.token_dispatcher = expert_parallel(m.experts, expert_mesh(mesh, 2))
    parallelize(m, mesh, {})
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = m(wb.shard_tensor(x, mesh, [wb.Shard(0), wb.Replicate()]))
    assert want.dtype == torch.bfloat16
    assert got.dtype == got._local.dtype == torch.bfloat16
    torch.testing.assert_close(got.full(), want, rtol=0, atol=0)


@pytest.mark.parametrize("via", ["sdpa", "flash"])
def test_ring_attention_under_autocast_runs_in_bfloat16_as_one_device(via):
    """One device's attention under CPU autocast runs in bfloat16 (torch's lower-precision
    list; the dispatcher casts attention on DistTensors the same way); the ring, entered
    through ``context_parallel`` before the dispatcher, computed float32 inputs in float32
    and returned float32.  Now bfloat16 out, float32 gradients for float32 leaves."""
    import torch.nn.functional as F
    import workbench as wb
    from workbench.parallel.strategies import context_parallel as cp
    p, n = 2, 8
    mesh = wb.Mesh(list(range(p)), ["cp"])
    g = torch.Generator().manual_seed(0)
    q, k, v, go = (torch.randn(1, 2, n, 4, generator=g) for _ in range(4))
    run = (lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True)) \
        if via == "sdpa" else (lambda a, b, c: wb.ops.flash_attention(a, b, c, causal=True))
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = run(*ref_in)
    (want.float() * go).sum().backward()
    dist = [cp.to_ring_layout(wb.shard_tensor(t, mesh, [wb.Replicate()]), "cp", 2)
            .requires_grad_() for t in (q, k, v)]     # to_ring_layout records the order (seq_order.py, test_cp11.py)
    with cp.context_parallel(mesh, "cp"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = run(*dist)
        # the gradient laid out as got, its order recorded (a hand-sharded one is refused)
        (got.float() * cp.to_ring_layout(wb.shard_tensor(go, mesh, [wb.Replicate()]), "cp",
                                         2)).sum().backward()
    inv = torch.argsort(cp.slot_positions(n, p))
    assert want.dtype == got.dtype == torch.bfloat16
    torch.testing.assert_close(got.full()[:, :, inv], want, rtol=2e-2, atol=1e-2)
    for d, r in zip(dist, ref_in):
        assert d.grad.dtype == torch.float32
        torch.testing.assert_close(d.grad.full()[:, :, inv], r.grad, rtol=3e-2, atol=3e-2)


# ---- CP: Ulysses on keys longer than the queries -----------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
def test_ulysses_balanced_with_keys_longer_than_queries_is_sdpa(causal):
    """q of 8 tokens against k, v of 16, each in the load-balanced ring order: the
    all-to-all's un-permutation used the queries' length for the keys too, keeping 8 of
    the 16 keys (0.7 off SDPA, 1.9 causal, silently).  Each tensor is now put back in its
    own order; gradients of q, k and v are SDPA's."""
    import torch.nn.functional as F
    import workbench as wb
    from workbench.parallel.strategies import context_parallel as cp
    p = 2
    mesh = wb.Mesh(list(range(p)), ["cp"])
    g = torch.Generator().manual_seed(0)
    q, go = (torch.randn(1, 4, 8, 4, generator=g) for _ in range(2))
    k, v = (torch.randn(1, 4, 16, 4, generator=g) for _ in range(2))
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*ref_in, is_causal=causal)
    (want * go).sum().backward()
    dist = [wb.shard_tensor(cp.ring_order(t, p, 2), mesh, [wb.Shard(2)]).requires_grad_()
            for t in (q, k, v)]
    got = cp.ulysses_attention(*dist, "cp", causal=causal)
    (got * wb.shard_tensor(cp.ring_order(go, p, 2), mesh, [wb.Shard(2)])).sum().backward()
    for t, d, r in zip(["out", "q", "k", "v"], [got, *dist], [want, *ref_in]):
        n = r.shape[2]
        inv = torch.argsort(cp.slot_positions(n, p))
        torch.testing.assert_close((d if t == "out" else d.grad).full()[:, :, inv],
                                   r.detach() if t == "out" else r.grad, rtol=1e-5,
                                   atol=1e-5, msg=t)


# ---- PP: a stage whose output does not depend on its input -------------------------------------

@pytest.mark.parametrize("kind", ["1f1b", "zb_h1"])
def test_a_stage_ignoring_its_input_is_named_not_an_attribute_error(kind):
    """stages[1] computes from its weight alone (a user's detach): its input gets no
    gradient, and the executor failed with "'NoneType' object has no attribute
    'placements'" sending it back."""
    import torch.nn.functional as F
    import workbench as wb
    from workbench.parallel.schedules.execute import run_pipeline
    meshes = [wb.Mesh([r], ["pp"]) for r in range(2)]
    g = torch.Generator().manual_seed(0)
    w0, w1 = (wb.shard_tensor(torch.randn(4, 4, generator=g), meshes[i], [wb.Replicate()])
              .requires_grad_() for i in range(2))
    stages = [lambda x: torch.tanh(F.linear(x, w0)), lambda x: F.linear(x.detach(), w1)]
    xs = [wb.shard_tensor(torch.randn(2, 4, generator=g), meshes[0], [wb.Replicate()])
          for _ in range(2)]
    sched = getattr(wb.schedules, "one_f_one_b" if kind == "1f1b" else "zb_h1")(2, 2)
    with pytest.raises(ValueError, match=r"stage 1's input got no gradient in micro-batch 0's "
                                         r"backward: stages\[1\] computes its output without"):
        run_pipeline(sched, stages, meshes, xs, lambda out, i: out.sum(),
                     params=[[w0], [w1]])


def test_expert_parallel_on_a_mesh_without_ep_names_expert_mesh():
    """``expert_parallel(experts, mesh)`` with the data-parallel mesh itself said only
    "mesh dim 'ep' not in dim_names ['dp']"; now it names ``expert_mesh(mesh, ep)``."""
    import workbench as wb
    from workbench.parallel.strategies.expert_parallel import expert_parallel
    model = build_model(get_config("tiny").replace(n_layer=1, moe_experts=4))
    with pytest.raises(ValueError, match=r"has no 'ep' dim; give the expert mesh .*"
                                         r"expert_mesh\(mesh, ep\)"):
        expert_parallel(model.layers[0].mlp.experts, wb.Mesh.grid(2, ["dp"]))


def test_sigmoid_router_with_underflowing_scores_stays_finite():
    """Every sigmoid score of a token below float32's smallest number (logits under -103):
    s / sum s was 0 / 0, NaN gates and a NaN aux loss, whose gradient made the router NaN.
    As softmax(log s) (the same numbers) they are the float64 reference's."""
    z = -110.0 - torch.tensor([[[0.0, 1.0, 2.0, 3.0], [0.0, 0.5, 2.0, 4.0]]])
    a = z.clone().requires_grad_()
    w, e, _, aux = router_topk(a, 2, "sigmoid")
    (w.sum() + aux.sum()).backward()
    w64, e64, _, aux64 = router_topk(z.double(), 2, "sigmoid")
    assert torch.equal(e, e64)
    torch.testing.assert_close(w, w64.float(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(aux, aux64.float(), rtol=1e-6, atol=1e-7)
    assert torch.isfinite(a.grad).all()


def test_context_parallel_dropout_refusal_names_a_layout_that_runs():
    """The refusal of dropout under cp said "or cp=1", which ContextParallel itself refuses
    ("the sequence is not split"); it names Hybrid with the same dp and tp."""
    from workbench.recipes.context_parallel import ContextParallel
    cfg = get_config("tiny").replace(n_layer=2, dropout=0.1)
    with pytest.raises(ValueError, match=r"dropout=0.1: attention dropout on the ring is not "
                                         r"built.*without context parallelism: "
                                         r"Hybrid\(dp=2, tp=1\)") as e:
        ContextParallel(cp=2, dp=2).check(cfg, 8)
    assert "cp=1" not in str(e.value)
