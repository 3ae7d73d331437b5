"""SPMD rules of the layers around a transformer block: layer_norm, rms_norm, embedding,
cross_entropy, dropout (workbench/parallel/ops_table/{norm,embedding,cross_entropy,dropout}.py).

Reference first (one device), then placements (every combination, tests/spmd_harness.py),
then gradients, then the communication counted against Megatron-LM's."""
import itertools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import workbench as wb
from tests.spmd_harness import MESHES, check_op, placement_options

torch.manual_seed(0)
X3 = torch.randn(5, 3, 6)                      # 5 rows: uneven on 2 and 4 ranks
W6, B6 = torch.randn(6), torch.randn(6)
MESH4 = wb.Mesh.grid(4, ["tp"])


def _fewer_param_layouts(mesh, combo):
    # weight and bias only ever need R (the gather / reduce that brings them there is the
    # reshard planner's, tested there): on the 2x2 mesh vary x with R parameters, and the
    # parameters (together) with a replicated x; the 1-d meshes run every combination
    x, w, b = combo
    rep = (wb.Replicate(),) * 2
    return mesh.ndim == 2 and not ((w == rep and b == rep) or (x == rep and w == b))


def _grad_check(fn, inputs, layouts, mesh, rtol=1e-5, atol=1e-6):
    """Gradients of DistTensor leaves (float inputs) equal one device's for ``layouts``."""
    ref_in = [x.clone().requires_grad_() if x.is_floating_point() else x for x in inputs]
    fn(*ref_in).backward()
    dist_in = []
    for x, ps in zip(inputs, layouts):
        d = wb.shard_tensor(x, mesh, ps)
        dist_in.append(d.requires_grad_() if x.is_floating_point() else d)
    out = fn(*dist_in)
    out.backward()
    for r, d in zip(ref_in, dist_in):
        if r.is_floating_point():
            torch.testing.assert_close(d.grad.full(), r.grad, rtol=rtol, atol=atol)
    return out


def _squares(fn):
    """A scalar loss whose gradient depends on every output element."""
    return lambda *a: (fn(*a) ** 2).sum()


# ---- norms -----------------------------------------------------------------------------------

NORM_CASES = {
    "layer_norm": (lambda x, w, b: F.layer_norm(x, (6,), w, b), [X3, W6, B6]),
    "layer_norm_2d_shape": (lambda x: F.layer_norm(x, (3, 6), eps=1e-3), [X3]),
    "rms_norm": (lambda x, w: F.rms_norm(x, (6,), w, 1e-6), [X3, W6]),
    "rms_norm_no_weight": (lambda x: F.rms_norm(x, [3, 6]), [X3]),
    "ops_rms_norm": (lambda x, w: wb.ops.rms_norm(x, w), [X3, W6]),
    "ops_rms_norm_2d_weight": (lambda x, w: wb.ops.rms_norm(x, w, eps=1e-5),
                               [X3, torch.randn(3, 6)]),
}


@pytest.mark.parametrize("name", sorted(NORM_CASES))
def test_norm_every_placement(name):
    fn, inputs = NORM_CASES[name]
    skip = _fewer_param_layouts if len(inputs) == 3 else (lambda mesh, combo: False)
    assert check_op(fn, inputs, skip=skip) > 0


@pytest.mark.parametrize("xp", [["S(0)", "R"], ["S(1)", "S(0)"], ["R", "R"]])
def test_norm_layouts_and_no_communication(xp):
    mesh = MESHES[2]
    x = wb.shard_tensor(X3, mesh, xp)
    with wb.trace() as tr:
        y = F.layer_norm(x, (6,), W6, B6)
        z = nn.RMSNorm(6)(x)
    assert y.placements == x.placements and z.placements == x.placements
    assert not tr.collectives()                         # rows normalize alone
    # the normalized dim sharded: made whole first (the planner moves the split to
    # another dim by an all-to-all, cheaper than an all-gather)
    with wb.trace() as tr:
        y = F.layer_norm(wb.shard_tensor(X3, mesh, ["S(2)", "R"]), (6,))
    assert not any(p.is_shard(2) for p in y.placements)
    assert len({(e.name, e.args["mesh_dim"]) for e in tr.collectives()}) == 1


@pytest.mark.parametrize("name,layouts", [
    ("layer_norm", (["S(0)"], ["R"], ["R"])),          # sequence parallel: weight grad all-reduced
    ("layer_norm", (["S(2)"], ["R"], ["R"])),          # normalized dim sharded: made whole first
    ("rms_norm", (["S(1)"], ["R"])),
    ("ops_rms_norm", (["S(0)"], ["R"])),
    ("ops_rms_norm", (["R"], ["R"])),                  # the fused op itself
])
def test_norm_gradients(name, layouts):
    fn, inputs = NORM_CASES[name]
    with wb.trace() as tr:
        _grad_check(_squares(fn), inputs, layouts, MESH4)
    if layouts[0] == ["S(0)"]:                          # the weight's gradient is summed
        assert tr.counts()["all_reduce"] >= 1          # over ranks: a traced all-reduce


# ---- dropout ---------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,dtype", [((5, 6), torch.float32), ((3, 4, 7), torch.float64),
                                         ((1000,), torch.float32)])
def test_aten_dropout_is_one_bernoulli_draw_for_the_global_shape(shape, dtype):
    """The identity the rule relies on (ATen's CPU dropout), bitwise."""
    x = torch.randn(shape, dtype=dtype)
    for p, s in itertools.product([0.1, 0.5, 0.9], [0, 1, 42]):
        torch.manual_seed(s)
        a = F.dropout(x, p)
        torch.manual_seed(s)
        noise = torch.empty_like(x).bernoulli_(1 - p).div_(1 - p)
        assert torch.equal(a, x * noise)


def _layouts(mesh, ndim):
    opts = placement_options(ndim, partial=False)
    return list(itertools.product(opts, repeat=mesh.ndim))


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: str(m.shape))
def test_dropout_sharded_equals_one_device_bitwise(mesh):
    x = torch.randn(5, 6)
    for ps in _layouts(mesh, 2):
        for seed, p in [(0, 0.5), (7, 0.1), (123, 0.9)]:
            torch.manual_seed(seed)
            ref = F.dropout(x, p)
            after_ref = torch.rand(3)                   # the generator advanced as on one device
            torch.manual_seed(seed)
            y = F.dropout(wb.shard_tensor(x, mesh, ps), p)
            assert y.placements == tuple(ps)
            assert torch.equal(torch.rand(3), after_ref)
            assert torch.equal(y.full(), ref), (mesh.shape, ps, seed)


def _seeded(fn, seed=3):
    def run(*a):
        torch.manual_seed(seed)
        return fn(*a)
    return run


@pytest.mark.parametrize("fn", [
    lambda x: F.dropout(x, 0.3),
    lambda x: torch.dropout(x, 0.6, True),
    lambda x: nn.Dropout(0.25)(x),
    lambda x: F.dropout(x, 0.3, training=False),       # identity: every placement passes
    lambda x: F.dropout(x, 0.0),
    lambda x: F.dropout(x, 1.0),
], ids=["F", "torch", "module", "eval", "p0", "p1"])
def test_dropout_every_placement(fn):
    # Partial inputs included: x * mask is linear in x, so P(sum) passes
    assert check_op(_seeded(fn), [torch.randn(5, 6)]) > 0


def test_dropout_partial_passes_and_eval_is_identity():
    x = wb.shard_tensor(torch.randn(4, 6), MESH4, ["R"])
    p = wb.reshard(x, MESH4, ["P(sum)"])
    a = wb.reshard(x, MESH4, ["P(avg)"])
    with wb.trace() as tr:
        assert F.dropout(p, 0.5).placements == (wb.Partial("sum"),)
        assert F.dropout(p, 0.5, training=False).placements == (wb.Partial("sum"),)
        torch.manual_seed(5)
        y = F.dropout(a, 0.5)
        assert y.placements == (wb.Partial("avg"),)
    assert not tr.collectives()
    torch.manual_seed(5)
    torch.testing.assert_close(y.full(), F.dropout(x.full(), 0.5))
    # P(max) is reduced first
    assert F.dropout(wb.reshard(x, MESH4, ["P(max)"]), 0.5).placements != (wb.Partial("max"),)


def test_dropout_gradient_and_errors():
    x = torch.randn(6, 5)
    for ps in (["S(0)"], ["S(1)"], ["R"]):
        _grad_check(_seeded(_squares(lambda t: F.dropout(t, 0.4))), [x], [ps], MESH4)
    d = wb.shard_tensor(x, MESH4, ["S(0)"])        # in place: the same object, one device's mask
    torch.manual_seed(2)
    ref = F.dropout(x, 0.5)
    torch.manual_seed(2)
    assert F.dropout(d, 0.5, inplace=True) is d and d.placements == (wb.Shard(0),)
    torch.testing.assert_close(d.full(), ref)
    with pytest.raises(ValueError, match="p=1.5"):
        F.dropout(wb.shard_tensor(x, MESH4, ["S(0)"]), 1.5)


# ---- embedding -------------------------------------------------------------------------------

VOCAB, HID = 7, 6                                       # 7 rows: uneven on 2 and 4 ranks
EMB = torch.randn(VOCAB, HID)
IDS = torch.randint(0, VOCAB, (5, 3))


def test_embedding_every_table_placement():
    assert check_op(lambda w: F.embedding(IDS, w), [EMB]) > 0
    assert check_op(lambda w: F.embedding(IDS, w, padding_idx=-1), [EMB]) > 0


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: str(m.shape))
def test_embedding_every_ids_placement(mesh):
    """ids are integers (the harness shards float inputs only): loop over their layouts."""
    for ps in _layouts(mesh, IDS.dim()):
        ids = wb.shard_tensor(IDS, mesh, ps)
        check_op(lambda w: F.embedding(ids if isinstance(w, wb.DistTensor) else IDS, w),
                 [EMB], meshes=[mesh], max_combos=None if mesh.ndim == 1 else 12)


@pytest.mark.parametrize("wp,out", [(["S(0)"], wb.Partial("sum")), (["S(1)"], wb.Shard(2)),
                                    (["R"], wb.Replicate()), (["P(sum)"], wb.Partial("sum"))])
def test_embedding_layouts(wp, out):
    w = wb.reshard(wb.shard_tensor(EMB, MESH4, ["R"]), MESH4, wp)
    with wb.trace() as tr:
        y = F.embedding(wb.shard_tensor(IDS, MESH4, ["R"]), w)
    assert y.placements == (out,) and not tr.collectives()
    torch.testing.assert_close(y.full(), F.embedding(IDS, EMB))
    y = F.embedding(wb.shard_tensor(IDS, MESH4, ["S(1)"]), wb.shard_tensor(EMB, MESH4, ["R"]))
    assert y.placements == (wb.Shard(1),)


@pytest.mark.parametrize("ip,wp", [(["R"], ["S(0)"]), (["S(0)"], ["R"]), (["R"], ["S(1)"]),
                                   (["S(1)", "R"], ["R", "S(0)"])])
def test_embedding_gradients(ip, wp):
    mesh = MESH4 if len(ip) == 1 else MESHES[2]
    ids = IDS.clone()
    ids[0, 0] = 2                                       # padding row: no gradient
    with wb.trace() as tr:
        _grad_check(lambda i, w: (F.embedding(i, w, padding_idx=2) ** 2).sum(), [ids, EMB],
                    [ip, wp], mesh)
    if wp == ["R"]:                                     # data parallel: gradient all-reduced
        assert tr.counts()["all_reduce"] >= 1


def test_embedding_errors():
    w = wb.shard_tensor(EMB, MESH4, ["S(0)"])
    with pytest.raises(NotImplementedError, match="max_norm"):
        F.embedding(IDS, w, max_norm=1.0)
    with pytest.raises(TypeError, match="int64"):
        F.embedding(IDS.float(), w)


# ---- cross-entropy ---------------------------------------------------------------------------

T6 = torch.randint(0, 8, (6,))
T6[2] = -100                                            # one ignored target
CE_CASES = {
    "rows6_classes8": (torch.randn(6, 8), T6, {}),
    "rows5_classes7": (torch.randn(5, 7), torch.randint(0, 7, (5,)), {}),
    "smoothing_ignore": (torch.randn(6, 8), T6, {"label_smoothing": 0.1}),
    "k_dim": (torch.randn(4, 8, 3), torch.randint(0, 8, (4, 3)), {"ignore_index": 5}),
    "unbatched": (torch.randn(8), torch.tensor(3), {}),
}


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("case", sorted(CE_CASES))
def test_cross_entropy_every_logits_placement(case, reduction):
    x, t, kw = CE_CASES[case]
    assert check_op(lambda z: F.cross_entropy(z, t, reduction=reduction, **kw), [x]) > 0


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: str(m.shape))
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_cross_entropy_every_target_placement(mesh, reduction):
    x, t, kw = CE_CASES["k_dim"]
    for ps in _layouts(mesh, t.dim()):
        tt = wb.shard_tensor(t, mesh, ps)
        check_op(lambda z: F.cross_entropy(z, tt if isinstance(z, wb.DistTensor) else t,
                                           reduction=reduction, **kw),
                 [x], meshes=[mesh], max_combos=None if mesh.ndim == 1 else 10)


@pytest.mark.parametrize("xp,tp,out,inside", [
    (["S(1)"], ["R"], wb.Replicate(), {"all_reduce": 3}),           # vocabulary parallel
    (["S(0)"], ["S(0)"], wb.Partial("sum"), {"all_reduce": 1}),     # the global count
    (["S(0)"], ["R"], wb.Partial("sum"), {}),                       # counted locally
    (["R"], ["R"], wb.Replicate(), {}),
])
def test_cross_entropy_layouts_and_collectives(xp, tp, out, inside):
    x, t = torch.randn(8, 8), torch.randint(0, 8, (8,))     # 8 rows, 8 classes: even on 4
    t[3] = -100
    with wb.trace() as tr:
        loss = F.cross_entropy(wb.shard_tensor(x, MESH4, xp), wb.shard_tensor(t, MESH4, tp))
    assert loss.placements == (out,) and dict(tr.counts()) == inside
    torch.testing.assert_close(loss.full(), F.cross_entropy(x, t))


@pytest.mark.parametrize("case", ["rows6_classes8", "smoothing_ignore", "k_dim"])
@pytest.mark.parametrize("xp,tp", [(["S(1)"], ["R"]), (["S(0)"], ["S(0)"]), (["S(0)"], ["R"]),
                                   (["R"], ["S(0)"])])
def test_cross_entropy_gradients(case, xp, tp):
    x, t, kw = CE_CASES[case]
    _grad_check(lambda z, y: F.cross_entropy(z, y, **kw), [x, t], [xp, tp], MESH4)
    _grad_check(lambda z, y: (F.cross_entropy(z, y, reduction="none", **kw) ** 2).sum(),
                [x, t], [xp, tp], MESH4)


def test_cross_entropy_2d_mesh_vocab_and_rows():
    mesh = MESHES[2]
    x, t, kw = CE_CASES["smoothing_ignore"]
    for xp, tp in [(["S(0)", "S(1)"], ["S(0)", "R"]), (["S(1)", "S(1)"], ["R", "R"])]:
        _grad_check(lambda z, y: F.cross_entropy(z, y, **kw), [x, t], [xp, tp], mesh)


def test_cross_entropy_errors():
    x = wb.shard_tensor(torch.randn(6, 8), MESH4, ["S(1)"])
    with pytest.raises(IndexError, match="out of bounds"):
        F.cross_entropy(x, torch.tensor([0, 1, 2, 3, 4, 9]))
    # class weights and probability targets: composed of table ops, torch's values
    # (tests/test_audit_dt2.py holds them over layouts)
    w, probs = torch.rand(8) + 0.5, torch.rand(6, 8).softmax(-1)
    torch.testing.assert_close(F.cross_entropy(x, T6, weight=w).full(),
                               F.cross_entropy(x.full(), T6, weight=w))
    torch.testing.assert_close(F.cross_entropy(x, probs).full(),
                               F.cross_entropy(x.full(), probs))


# ---- end to end: Megatron's vocabulary-parallel embedding + LM head + loss -------------------

def test_vocab_parallel_embedding_lm_head_cross_entropy_like_megatron():
    """ids -> VocabParallelEmbedding (W_e S(0)) -> ColumnParallelLinear LM head (W_o S(0),
    classes split) -> vocab_parallel_cross_entropy, on 4 ranks.

    Megatron-LM communicates, per step (the activations only):
      forward   1 all-reduce  the embedding output (reduce_from_tensor_model_parallel_region)
                3 all-reduces inside the loss (max logit, target logit, sum of exp)
      backward  1 all-reduce  the gradient of the LM head's input (copy_to_..._region's
                              backward, Megatron's ``f``); the loss's backward
                              (softmax - one_hot) and the embedding's are local.
    Here: the reshard P(sum) -> R before the head is the embedding's all-reduce; the replicated head
    input meets per-rank columns, so its gradient all-reduce is traced; the loss's
    all-reduces are compact (``g``: no backward communication)."""
    torch.manual_seed(1)
    V, H, N = 16, 8, 6
    ids, target = torch.randint(0, V, (N,)), torch.randint(0, V, (N,))
    we, wo = torch.randn(V, H), torch.randn(V, H) / 4
    ref_e, ref_o = we.clone().requires_grad_(), wo.clone().requires_grad_()
    ref = F.cross_entropy(F.linear(F.embedding(ids, ref_e), ref_o), target)
    ref.backward()

    e = wb.shard_tensor(we, MESH4, ["S(0)"]).requires_grad_()
    o = wb.shard_tensor(wo, MESH4, ["S(0)"]).requires_grad_()
    i, y = wb.shard_tensor(ids, MESH4, ["R"]), wb.shard_tensor(target, MESH4, ["R"])
    with wb.trace() as tr:
        h = F.embedding(i, e)
        assert h.placements == (wb.Partial("sum"),)
        # Megatron's reduce_from_tensor_model_parallel_region, explicit as there: at this
        # toy size the planner would rather gather the head (one latency step, not two)
        h = wb.reshard(h, MESH4, ["R"])
        logits = F.linear(h, o)
        assert logits.placements == (wb.Shard(1),)
        loss = F.cross_entropy(logits, y)
        assert loss.placements == (wb.Replicate(),)
        forward = dict(tr.counts())
        loss.backward()
    assert forward == {"all_reduce": 4}
    assert dict(tr.counts()) == {"all_reduce": 5}
    torch.testing.assert_close(loss.full(), ref.detach())
    torch.testing.assert_close(e.grad.full(), ref_e.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(o.grad.full(), ref_o.grad, rtol=1e-5, atol=1e-6)
    assert e.grad.placements == (wb.Shard(0),) and o.grad.placements == (wb.Shard(0),)
    # bytes: each all-reduce of the loss moves one number per row, the embedding's N*H
    sizes = sorted(ev.args["buffer_bytes"] for ev in tr.collectives())
    assert sizes[:3] == [N * 4] * 3 and sizes[3:] == [N * H * 4] * 2
