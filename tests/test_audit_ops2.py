"""User-trial audit of the ops a user calls directly, beyond AdamW and rms_norm
(test_audit_ops.py): the mixture-of-experts ops (router_topk, moe_dispatch, moe_combine,
attach_aux_loss, the MoE layer) and paged attention, each held to plain PyTorch written
here (values, gradients, dtypes), and what cannot be computed refused with the fix."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import workbench as wb
from workbench.models import get_config
from workbench.models.moe import MoE
from workbench.ops.moe import capacity, moe_combine, moe_dispatch, router_topk


# ---- the MoE ops against a loop over tokens -------------------------------------------------

def _loop_router(logits, k, gating, cap):
    """Per group: the k best experts of each token, its gates renormalised over them, its
    place in each expert's buffer (first choices of all tokens before second ones, GShard
    Algorithm 1), -1 past ``cap``; the Switch aux loss E sum f_i P_i."""
    G, S, E = logits.shape
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    s = torch.softmax(z, -1) if gating == "softmax" else torch.sigmoid(z)
    p = s / s.sum(-1, keepdim=True)
    top, idx = s.topk(k, -1)
    slots = torch.full((G, S, k), -1, dtype=torch.long)
    for g in range(G):
        used = [0] * E
        for j in range(k):
            for t in range(S):
                e = int(idx[g, t, j])
                if cap is None or used[e] < cap:
                    slots[g, t, j] = used[e]
                used[e] += 1
    f = F.one_hot(idx, E).sum((1, 2)).to(p.dtype) / (S * k)
    aux = E * (f * p.mean(1)).sum(-1)
    return (top / top.sum(-1, keepdim=True)).to(logits.dtype), idx, slots, aux.to(logits.dtype)


def _loop_moe(x, w, idx, slots, W):
    """Each token: the sum over its kept choices of gate x (token @ its expert's W)."""
    G, S, _ = x.shape
    rows = [[sum((w[g, t, j].to(x.dtype) * (x[g, t] @ W[int(idx[g, t, j])])
                  for j in range(idx.shape[-1]) if slots[g, t, j] >= 0),
                 torch.zeros(W.shape[-1], dtype=x.dtype)) for t in range(S)] for g in range(G)]
    return torch.stack([torch.stack(r) for r in rows])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("G,S,E,k,cf,gating", [
    (2, 7, 4, 1, None, "softmax"),      # top-1
    (2, 7, 4, 4, None, "sigmoid"),      # k = E: every expert
    (1, 5, 3, 2, 0.5, "softmax"),       # capacity overflow: drops
    (2, 9, 5, 3, 0.3, "sigmoid"),       # capacity 2 of 9 tokens: most choices dropped
    (1, 1, 6, 2, None, "softmax")])     # one token: four experts get none
def test_router_dispatch_combine_equal_a_loop_values_and_gradients(dtype, G, S, E, k, cf,
                                                                   gating):
    g = torch.Generator().manual_seed(S * 10 + E)
    logits = torch.randn(G, S, E, generator=g).to(dtype).requires_grad_()
    x = torch.randn(G, S, 3, generator=g).to(dtype).requires_grad_()
    W = torch.randn(E, 3, 2, generator=g).to(dtype).requires_grad_()
    C = capacity(S, E, k, cf)
    w, e, sl, aux = router_topk(logits, k, gating, None if cf is None else C)
    wr, er, slr, auxr = _loop_router(logits, k, gating, None if cf is None else C)
    assert torch.equal(e, er) and torch.equal(sl, slr)
    assert w.dtype == aux.dtype == dtype
    y = moe_combine(torch.einsum("gech,ehf->gecf", moe_dispatch(x, e, sl, E, C), W), w, e, sl)
    yr = _loop_moe(x, wr, er, slr, W)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else {}
    assert_close(w, wr, **tol)
    assert_close(aux, auxr, **tol)
    assert_close(y, yr, **tol)
    gy = torch.randn(y.shape, generator=g).to(dtype)
    got = torch.autograd.grad((y * gy).sum() + aux.sum(), (logits, x, W))
    want = torch.autograd.grad((yr * gy).sum() + auxr.sum(), (logits, x, W))
    for a, b in zip(got, want):
        assert_close(a, b, **tol)


def test_tied_router_scores_route_to_the_lower_experts_with_first_choices_first():
    # ties go to the lower expert index (torch.argmax's rule, Switch's and GShard's argmax;
    # ops/moe.py: torch.topk leaves the order of equal scores to the backend's kernel, on
    # CPU the higher index first): every token picks experts 0 then 1, and GShard's
    # priority gives the first choices of tokens 0 and 1 expert 0's two slots first
    logits = torch.zeros(1, 4, 4, requires_grad=True)                 # every score equal
    w, e, sl, aux = router_topk(logits, 2, capacity=2)
    assert e.tolist() == [[[0, 1]] * 4]
    assert sl.tolist() == [[[0, 0], [1, 1], [-1, -1], [-1, -1]]]
    assert_close(w, torch.full((1, 4, 2), 0.5))
    assert_close(aux, torch.ones(1))                                   # 4 * sum(f_i / 4)


def _routes():
    x = torch.randn(1, 4, 2)
    w, e, sl, _ = router_topk(torch.randn(1, 4, 3), 1)                 # capacity = 4 tokens
    return x, w, e, sl


def test_combine_refuses_routes_outside_its_buffers_instead_of_reading_another_expert():
    """A slot past y's capacity read the next expert's row (the rows are flat, E C of
    them): expert 0's slot C is expert 1's slot 0. Now named, as dispatch does."""
    w = torch.ones(1, 2, 1)
    e, sl = torch.zeros(1, 2, 1, dtype=torch.long), torch.tensor([[[0], [2]]])
    y = torch.arange(8.).reshape(1, 2, 2, 2)                           # E = 2, C = 2
    with pytest.raises(ValueError, match="moe_combine: a route falls outside 2 experts x 2 "
                                         "slots"):
        moe_combine(y, w, e, sl)
    with pytest.raises(ValueError, match="outside 1 experts x 2 slots"):
        moe_combine(y[:, :1], w, e + 1, sl.clamp(max=1))               # expert 1 of 1


def test_dispatch_and_combine_refuse_slots_below_minus_one():
    x, w, e, sl = _routes()
    with pytest.raises(ValueError, match="-1 = dropped"):
        moe_dispatch(x, e, sl - 5, 3, 4)
    with pytest.raises(ValueError, match="-1 = dropped"):
        moe_combine(torch.randn(1, 3, 4, 2), w, e, sl - 5)


def test_dispatch_refuses_two_tokens_in_one_slot_instead_of_summing_them():
    x, w, e, sl = _routes()
    e, sl = torch.zeros_like(e), torch.zeros_like(sl)                  # all in expert 0 slot 0
    with pytest.raises(ValueError, match="expert 0's slot 0; each slot holds one token"):
        moe_dispatch(x, e, sl, 3, 4)


@pytest.mark.parametrize("factor", [0, -1.0, 0.0, float("nan"), float("inf"), True, "1.25"])
def test_capacity_refuses_a_factor_that_is_not_a_positive_number(factor):
    with pytest.raises(ValueError, match=f"capacity: factor={factor!r}"):
        capacity(8, 4, 2, factor)
    assert capacity(8, 4, 2, 1.25) == 5 and capacity(8, 4, 2, None) == 8


# ---- the MoE layer as a user builds it ------------------------------------------------------

def _cfg(**kw):
    return get_config("tiny", d_model=16, n_head=2, d_ff=24, moe_experts=4, moe_topk=2, **kw)


@pytest.mark.parametrize("preset", ["tiny", "gpt-tiny"])
def test_a_moe_layer_built_alone_is_initialized_as_linear_layers_are(preset):
    """Its experts were torch.empty: uninitialized memory (1e37 seen) in the output."""
    torch.manual_seed(0)
    cfg = get_config(preset, d_model=16, n_head=2, d_ff=24, moe_experts=4, moe_topk=2)
    m = MoE(cfg)
    for name, p in m.experts.named_parameters():
        fan_in = 16 if name in ("w1", "w3", "fc1_weight", "fc1_bias") else 24
        p = p.detach()
        assert 0 < float(p.abs().max()) <= 1 / math.sqrt(fan_in), name
        assert float(p.std()) > 0.5 / math.sqrt(3 * fan_in), name       # U(-b, b): std b/sqrt 3
    y = m(torch.randn(2, 5, 16)).detach()
    assert torch.isfinite(y).all() and float(y.abs().max()) < 10


def test_a_moe_layers_output_can_be_changed_in_place_and_aux_still_trains_the_router():
    """The aux loss was attached to the output through a custom autograd Function, so the
    output was a view that refused ``y += x`` in training mode."""
    torch.manual_seed(0)
    m = MoE(_cfg(moe_aux_loss_coef=0.1, moe_capacity_factor=1.0)).train()
    x = torch.randn(2, 6, 16)
    gy = torch.randn(2, 6, 16)
    y = m(x)
    y += x                                                            # a user's residual
    (y * gy).sum().backward()
    got = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    m.eval()                                                          # the same output, no aux
    y_ref = m(x) + x
    logits = m.router(x)
    aux = router_topk(logits, 2, "softmax", capacity(6, 4, 2, 1.0))[3]
    ((y_ref * gy).sum() + 0.1 * aux.mean()).backward()
    for a, p in zip(got, m.parameters()):
        assert_close(a, p.grad)
    assert float(m.router.weight.grad.abs().sum()) > 0


# ---- paged attention --------------------------------------------------------------------------

def _paged(lengths, Hq, Hkv, D, Sq, bs, dtype, seed=0):
    """A pool with the sequences' blocks scattered, its table, and the contiguous keys."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // bs) for n in lengths]
    nb = sum(need) + 3
    perm = torch.randperm(nb, generator=g)
    kp = torch.randn(nb, Hkv, bs, D, generator=g).to(dtype)
    vp = torch.randn(nb, Hkv, bs, D, generator=g).to(dtype)
    table = torch.full((len(lengths), max(need)), -7, dtype=torch.int32)   # padding unread
    start = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[start:start + n].int()
        start += n
    q = torch.randn(len(lengths), Hq, Sq, D, generator=g).to(dtype)
    return q, kp, vp, table, torch.tensor(lengths)


def _sdpa_on_gathered(q, kp, vp, table, lens):
    out = []
    for b, n in enumerate(lens.tolist()):
        k = kp[table[b].long()[:-(-n // kp.shape[2])]].transpose(0, 1).flatten(1, 2)[:, :n]
        v = vp[table[b].long()[:-(-n // kp.shape[2])]].transpose(0, 1).flatten(1, 2)[:, :n]
        Sq = q.shape[2]
        keep = torch.ones(Sq, n, dtype=torch.bool).tril(n - Sq)          # bottom-right causal
        out.append(F.scaled_dot_product_attention(q[b:b + 1].double(), k[None].double(),
                                                  v[None].double(), attn_mask=keep,
                                                  enable_gqa=True))
    return torch.cat(out)


@pytest.mark.parametrize("backend", ["reference", "unfused", "native"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lengths,Hq,Hkv,Sq,bs", [([5, 9], 4, 2, 1, 4), ([13], 2, 1, 13, 3),
                                                 ([1, 7, 3], 6, 3, 1, 16)])
def test_paged_attention_in_half_precision_equals_sdpa_on_the_gathered_cache(
        backend, dtype, lengths, Hq, Hkv, Sq, bs):
    q, kp, vp, table, lens = _paged(lengths, Hq, Hkv, 8, Sq, bs, dtype)
    with wb.ops.use(backend):
        out = wb.ops.paged_attention(q, kp, vp, table, lens)
    assert out.dtype == dtype and out.shape == q.shape
    assert_close(out.double(), _sdpa_on_gathered(q, kp, vp, table, lens), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("what", ["block_table", "seq_lens"])
def test_paged_attention_refuses_bool_tables_that_would_read_block_one(what):
    q, kp, vp, table, lens = _paged([5, 9], 2, 2, 8, 1, 4, torch.float32)
    args = dict(block_table=table, seq_lens=lens)
    args[what] = args[what] > 0
    with pytest.raises(ValueError, match=f"{what} of shape .* and dtype torch.bool"):
        wb.ops.paged_attention(q, kp, vp, **args)


@pytest.mark.parametrize("backend", ["reference", "unfused", "native"])
def test_paged_attention_of_no_sequences_is_empty_as_sdpa(backend):
    q, kp, vp, table, lens = _paged([5], 2, 2, 8, 1, 4, torch.float32)
    with wb.ops.use(backend):
        out = wb.ops.paged_attention(q[:0], kp, vp, table[:0], lens[:0])
    assert out.shape == (0, 2, 1, 8) and out.dtype == q.dtype


def test_block_tables_name_an_unknown_sequence_and_give_an_empty_batch_a_2d_table():
    tables = wb.ops.BlockTables(wb.ops.BlockAllocator(4), block_size=2)
    tables.add("a")
    for call in (lambda: tables.free("b"), lambda: tables.table(["b"]),
                 lambda: tables.seq_lens(["a", "b"])):
        with pytest.raises(KeyError, match="sequence 'b' is not in the table; add it first"):
            call()
    assert tables.table([]).shape == (0, 1) and tables.seq_lens([]).shape == (0,)


@pytest.mark.parametrize("args,message", [
    (([3.5, 2], 4, 8, 10), "lengths .3.5, 2.: give whole numbers"),     # was read as 3
    (([3, 5], 0, 8, 10), "block_size=0: give an int >= 1"),            # was ZeroDivisionError
    (([3, 5], 4, 8, 0), "bytes_per_token=0: give an int >= 1")])
def test_paged_memory_refuses_what_it_would_count_wrong(args, message):
    with pytest.raises(ValueError, match=message):
        wb.ops.paged_memory(*args)
    assert wb.ops.paged_memory([3, torch.tensor(5)], 4, 8, 10).blocks_in_use == 3


class _RoundedKVCache(wb.serve.KVCache):
    """The contiguous cache, its keys and values rounded to ``dtype`` as they are stored."""

    def __init__(self, model, dtype):
        super().__init__(model.cfg.n_layer, model.cfg.seq_len)
        self.dtype = dtype

    def update(self, layer, k, v):
        return super().update(layer, k.to(self.dtype).to(k.dtype), v.to(self.dtype).to(v.dtype))


def test_a_paged_cache_in_another_dtype_than_the_model_attends_in_the_models():
    """PagedKVCache(dtype=...) took the dtype, then every attend raised paged_attention's
    'inputs must share one dtype' (q in the model's dtype, the pools in the cache's)."""
    from workbench.models import build_model
    cfg = get_config("tiny", n_head=4, n_kv_head=2)
    model = build_model(cfg, seed=0).eval()
    idx = torch.randint(0, cfg.vocab_size, (2, 5), generator=torch.Generator().manual_seed(0))
    paged = wb.serve.PagedKVCache(cfg, 2, num_blocks=16, block_size=3, dtype=torch.bfloat16)
    rounded = _RoundedKVCache(model, torch.bfloat16)
    logits = {}
    with torch.no_grad():
        for name, cache in (("paged", paged), ("rounded", rounded)):
            logits[name] = [model(idx, cache=cache)[0],                        # prefill
                            model(idx[:, :1], cache=cache)[0]]                 # one decode step
    for got, want in zip(logits["paged"], logits["rounded"]):
        assert got.dtype == torch.float32
        assert_close(got, want)
    assert paged.memory().bytes_per_token == 2 * cfg.n_layer * 2 * cfg.head_dim * 2   # bf16


@pytest.mark.parametrize("shape", [(0, 5, 16), (2, 0, 16)])
@pytest.mark.parametrize("cf", [None, 1.0])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_a_moe_layer_takes_an_empty_batch_or_sequence_as_a_linear_layer_does(shape, cf, mode):
    """A batch of 0 divided the aux scale by 0 (ZeroDivisionError); a sequence of 0 made
    capacity 0 (moe_dispatch refused it) or the aux loss 0 / 0 = nan."""
    torch.manual_seed(0)
    m = getattr(MoE(_cfg(moe_capacity_factor=cf, moe_shared_experts=1)), mode)()
    x = torch.randn(shape, requires_grad=True)
    y = m(x)
    y.sum().backward()
    assert y.shape == shape and x.grad.shape == shape
    assert m.last_stats["aux_loss"] == 0.0 and m.last_stats["routed"] == 0
    assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)
    assert_close(router_topk(torch.randn(2, 0, 4), 2)[3], torch.zeros(2))
    assert capacity(0, 4, 2, None) == capacity(0, 4, 2, 1.0) == 1
