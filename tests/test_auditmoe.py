"""Audit of mixture of experts and expert parallelism against references written here from
the papers, in float64 (outputs and every gradient, the router's included, to 1e-9):

* routing: softmax gates (GShard, Lepikhin et al. 2020, Algorithm 1; Mixtral, Jiang et al.
  2024, sec. 2.1: the k largest renormalised), sigmoid gates (DeepSeek-V3, Liu et al.
  2024, eqs. 13-15), the router's own probability as the gate (Switch, Fedus et al. 2021,
  eq. 2); capacity C = ceil(c S k / E) per sequence, first choices of the whole sequence
  before any second choice, an expert keeping the first C it is sent (GShard Algorithm 1,
  ``position_in_expert`` counting the kept ones only; Switch sec. 2.2);
* the load-balancing loss E sum_i f_i P_i per sequence (Switch eqs. 4-6; f over the S k
  choices before dropping, P the mean router probability) and its gradient; the batch
  mean, and with m micro-batches each layer's share 1/m (``MoE.aux_loss_scale``);
* expert parallelism over dp, over dp x tp, several experts per rank: the same numbers,
  and the all-to-alls carrying exactly the rows that kept a slot (dispatch and combine,
  forward and backward), the per-expert counts exchanged once, in the forward;
* bad arguments refused naming the value and the fix, inputs untouched;
* the planner's all-to-all bytes and activations held to the dry run with a capacity.

Every random configuration is drawn from a seeded ``random.Random``."""
import math
import random

import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from workbench.models import get_config
from workbench.models.moe import MoE
from workbench.ops.moe import capacity, router_topk
from workbench.parallel.module import parallelize
from workbench.parallel.strategies.expert_parallel import expert_mesh, expert_parallel

R, Sh = wb.Replicate(), wb.Shard
F64 = torch.float64


# ---- the reference, from the papers ---------------------------------------------------------

def _expert(arch, P, i, t):
    """Expert i on one token t (h,): SwiGLU (Mixtral) or the GeLU MLP (Switch / GShard)."""
    if arch == "llama":
        return (F.silu(t @ P["w1"][i]) * (t @ P["w3"][i])) @ P["w2"][i]
    return F.gelu(t @ P["fc1_weight"][i] + P["fc1_bias"][i]) @ P["fc2_weight"][i] + \
        P["fc2_bias"][i]


def reference(x, router_weight, P, arch, E, k, gating, cf, normalize):
    """y (B, S, h), aux (B,) and routes [(b, t, choice, expert, kept)], token by token."""
    B, S, h = x.shape
    C = S if cf is None else max(1, min(S, math.ceil(cf * S * k / E)))
    ys, auxes, routes = [], [], []
    for b in range(B):
        z = x[b] @ router_weight.T                                   # (S, E) logits
        if gating == "softmax":
            score = prob = torch.softmax(z, -1)
        else:
            score = torch.sigmoid(z)
            prob = score / score.sum(-1, keepdim=True)               # DeepSeek-V3 s'
        order = [sorted(range(E), key=lambda e: -float(score[t, e].detach()))[:k] for t in range(S)]
        rows = [x.new_zeros(h) for _ in range(S)]
        kept_in = [0] * E                      # GShard's position_in_expert (kept only)
        picked = [0] * E
        for j in range(k):                     # all first choices, then all second ones
            for t in range(S):
                e = order[t][j]
                picked[e] += 1
                gate = score[t, e] / sum(score[t, c] for c in order[t]) if normalize \
                    else score[t, e]
                kept = kept_in[e] < C
                routes.append((b, t, j, e, kept))
                if kept:
                    kept_in[e] += 1
                    rows[t] = rows[t] + gate * _expert(arch, P, e, x[b, t])
        f = torch.tensor(picked, dtype=x.dtype) / (S * k)            # Switch eq. 5
        auxes.append(E * (f * prob.mean(0)).sum())                   # eqs. 4 and 6
        ys.append(torch.stack(rows))
    return torch.stack(ys), torch.stack(auxes), routes


def _draw(seed, lay=None):
    """One seeded configuration: arch, E, k, gating, capacity factor, gate normalisation,
    alpha, shared experts, batch and sequence length; ``lay`` (edp, ep, tp): E a multiple
    of ep (one to three experts per rank) and whole sequences per rank."""
    rnd = random.Random(seed)
    edp, ep, _ = lay or (1, 1, 1)
    E = max(2, ep * rnd.choice([1, 2, 3])) if lay else rnd.choice([2, 3, 4, 6])
    return dict(arch=rnd.choice(["llama", "gpt"]), E=E, k=rnd.randint(1, min(E, 3)),
                gating=rnd.choice(["softmax", "sigmoid"]),
                cf=rnd.choice([None, 0.5, 1.0, 1.25]), norm=rnd.choice([True, False]),
                alpha=rnd.choice([0.0, 0.01, 0.5]), shared=rnd.choice([0, 1]),
                B=edp * ep * rnd.randint(1, 2), S=rnd.randint(2, 8))


def _layer(c, seed):
    cfg = get_config("tiny" if c["arch"] == "llama" else "gpt-tiny", d_model=8, n_head=2,
                     d_ff=12, moe_experts=c["E"], moe_topk=c["k"], moe_gating=c["gating"],
                     moe_capacity_factor=c["cf"], moe_norm_topk=c["norm"],
                     moe_aux_loss_coef=c["alpha"], moe_shared_experts=c["shared"])
    m = MoE(cfg).to(F64).train()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=F64) * 0.5)
    x = torch.randn(c["B"], c["S"], 8, generator=g, dtype=F64)
    gy = torch.randn(c["B"], c["S"], 8, generator=g, dtype=F64)
    return m, x, gy


def _reference_grads(m, c, x, gy):
    """The reference's output and the gradients of sum(y gy) + alpha mean(aux) (the model's
    objective: the layer attaches alpha x the batch mean of the per-sequence loss)."""
    xr = x.clone().requires_grad_()
    y, aux, routes = reference(xr, m.router.weight, dict(m.experts.named_parameters()),
                               c["arch"], c["E"], c["k"], c["gating"], c["cf"], c["norm"])
    if m.shared is not None:
        y = y + m.shared(xr)
    ((y * gy).sum() + c["alpha"] * aux.mean()).backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    return y.detach(), xr.grad, grads, aux.detach(), routes


def _full(t):
    return t.full() if hasattr(t, "full") else t


def _close(a, b, what):
    torch.testing.assert_close(_full(a), b, rtol=1e-9, atol=1e-9, msg=what)


# ---- one device -----------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(8))
def test_moe_layer_is_the_papers_routing_in_float64(seed):
    """Output, input and parameter gradients (router included), drops, loads and the aux
    loss.  The reported aux loss was the float32 rounding of the float64 loss (1e-8 off,
    ``last_stats``' ``aux.float()``); it now keeps the loss's precision."""
    c = _draw(seed)
    m, x, gy = _layer(c, seed)
    want_y, want_gx, want, aux, routes = _reference_grads(m, c, x, gy)
    xa = x.clone().requires_grad_()
    y = m(xa)
    (y * gy).sum().backward()
    assert y.dtype == F64
    _close(y, want_y, "y")
    _close(xa.grad, want_gx, "x.grad")
    for n, p in m.named_parameters():
        _close(p.grad, want[n], n)
    st = m.last_stats
    assert st["dropped"] == sum(not r[4] for r in routes)
    assert st["tokens_per_expert"].tolist() == [sum(r[3] == e for r in routes)
                                                for e in range(c["E"])]
    assert st["aux_loss"] == pytest.approx(c["alpha"] * float(aux.mean()), rel=1e-12,
                                           abs=1e-15)


def test_switch_top1_aux_loss_and_its_gradient_by_hand():
    """Switch eqs. 4-6 for top-1 written out (f_i: share of tokens whose argmax is i; P_i:
    mean probability), value and gradient to the router alone (no task gradient)."""
    c = dict(arch="llama", E=4, k=1, gating="softmax", cf=1.0, norm=False, alpha=0.3,
             shared=0, B=2, S=6)
    m, x, _ = _layer(c, 3)
    y = m(x)
    y.backward(torch.zeros_like(y))             # the aux loss's gradient only
    got = m.router.weight.grad.clone()
    W = m.router.weight.detach().clone().requires_grad_()
    total = 0
    for b in range(2):
        p = torch.softmax(x[b] @ W.T, -1)
        f = torch.bincount(p.argmax(-1), minlength=4).to(F64) / 6
        total = total + 4 * (f * p.mean(0)).sum()
    (0.3 * total / 2).backward()
    _close(got, W.grad, "router.weight.grad")
    assert m.last_stats["aux_loss"] == pytest.approx(0.3 * float(total.detach()) / 2, rel=1e-12)
    assert W.grad.abs().max() > 1e-3


def test_softmax_then_top_k_renormalised_is_mixtrals_softmax_over_the_top_k_logits():
    """The code's claim (ops/moe.py): p = softmax(logits), the k largest renormalised, equals
    Mixtral's G(x) = softmax(TopK(x W_g)) (Jiang et al. 2024, sec. 2.1), gradients included;
    without renormalisation the gates are the k probabilities themselves (Switch eq. 2)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 6, generator=g, dtype=F64)
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    w, e, _, _ = router_topk(a, 2)
    top, idx = b.topk(2, -1)
    ref = torch.softmax(top, -1)
    assert torch.equal(e, idx)
    _close(w, ref, "gates")
    gw = torch.randn(w.shape, generator=g, dtype=F64)
    (w * gw).sum().backward()
    (ref * gw).sum().backward()
    _close(a.grad, b.grad, "d logits")
    w1, e1, _, _ = router_topk(logits, 2, normalize=False)
    _close(w1, torch.softmax(logits, -1).gather(-1, e1), "Switch's p_i")


@pytest.mark.parametrize("m_micro", [2, 3])
def test_micro_batches_with_aux_loss_scale_give_the_whole_batchs_gradients(m_micro):
    """``aux_loss_scale = 1/m`` on m micro-batches whose losses are averaged: the sum of
    their gradients is the whole batch's (the layer's docstring, Megatron-LM's
    ``MoEAuxLossAutoScaler.set_loss_scale``)."""
    c = dict(arch="gpt", E=4, k=2, gating="sigmoid", cf=0.5, norm=True, alpha=0.5,
             shared=0, B=6, S=5)
    m, x, gy = _layer(c, 7)
    (m(x) * gy).sum().backward()
    want = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    m.aux_loss_scale = 1.0 / m_micro
    for xs, gs in zip(x.chunk(m_micro), gy.chunk(m_micro)):
        # the task part as is; the aux part alpha/m x each micro-batch's mean = alpha x
        # the batch mean
        (m(xs) * gs).sum().backward()
    for n, p in m.named_parameters():
        _close(p.grad, want[n], n)


# ---- expert parallelism ---------------------------------------------------------------------

LAYOUTS = [(1, 2, 1), (2, 2, 1), (1, 4, 1), (1, 2, 2), (2, 2, 2), (1, 3, 1)]   # (edp, ep, tp)


@pytest.mark.parametrize("seed,lay", [(100 + i, lay) for i, lay in enumerate(LAYOUTS)] +
                         [(121, (1, 4, 1)), (137, (1, 2, 2))])     # capacity 0.5: drops
def test_expert_parallel_is_the_reference_and_sends_the_routed_rows(seed, lay):
    """Every layout of ``LAYOUTS`` (ep over dp, ep x tp, several experts per rank): output
    and gradients in float64; each all-to-all's matrix of bytes per (source, destination)
    is the rows that kept a slot (dropped ones are not sent), the combine its transpose,
    forward and backward; the per-expert counts (E int64) once per group in the forward
    only.  The simulated dispatcher recorded a second count exchange in the backward
    (which reuses the forward's split sizes: Megatron-LM's ``_AllToAll.backward``, torch's
    ``all_to_all_single`` autograd), and its counts as p int64 instead of E."""
    c = _draw(seed, lay)
    edp, ep, tp = lay
    m, x, gy = _layer(c, seed)
    want_y, want_gx, want, _, routes = _reference_grads(m, c, x, gy)
    assert c["cf"] != 0.5 or not all(r[4] for r in routes)      # drops where meant
    mesh = wb.Mesh.grid((edp * ep, tp), ["dp", "tp"])
    m.token_dispatcher = expert_parallel(m.experts, expert_mesh(mesh, ep))
    parallelize(m, mesh, {})
    X = wb.shard_tensor(x, mesh, [Sh(0), R]).requires_grad_()
    with wb.trace() as tr:
        y = m(X)
        (y * wb.shard_tensor(gy, mesh, [Sh(0), R])).sum().backward()
    _close(y, want_y, "y")
    _close(X.grad, want_gx, "x.grad")
    for n, p in m.named_parameters():
        _close(p.grad, want[n], n)
    # bytes rank j of an ep group sends rank r: its kept routes to r's experts, h float64
    per_rank, local = c["B"] // (edp * ep), c["E"] // ep
    sent = {a: [[0] * ep for _ in range(ep)] for a in range(edp)}
    for b, _, _, e, kept in routes:
        a, j = divmod(b // per_rank, ep)
        sent[a][j][e // local] += 8 * 8 * kept
    for label in ("EP dispatch (forward)", "EP combine (forward)", "EP dispatch (backward)",
                  "EP combine (backward)"):
        got = sorted(str(ev.args["send_bytes"]) for ev in tr.events if ev.label == label)
        mats = [sent[a] if "dispatch" in label else [list(r) for r in zip(*sent[a])]
                for a in range(edp) for _ in range(tp)]
        assert got == sorted(map(str, mats)), label
    counts = [ev for ev in tr.events if (ev.label or "").startswith("EP counts")]
    assert [ev.label for ev in counts] == ["EP counts (forward)"] * (edp * tp)
    assert {ev.args["buffer_bytes"] for ev in counts} == {8 * c["E"]}


# ---- errors ---------------------------------------------------------------------------------

@pytest.mark.parametrize("args,match", [
    ((8, 0, 1, 1.0), r"num_experts=0 must be an int >= 1"),
    ((8, 4, 5, 1.0), r"k=5 > num_experts=4.*lower k to at most 4"),
    ((8, 4, 0, 1.0), r"k=0 must be an int >= 1"),
    ((-1, 4, 1, 1.0), r"tokens=-1 must be an int >= 0"),
    ((2.5, 4, 1, None), r"tokens=2.5 must be an int"),
    ((8, 4, 1, 0), r"factor=0 must be a finite number > 0"),
    ((8, 4, 1, -1.25), r"factor=-1.25 must be a finite number > 0")])
def test_capacity_refuses_what_has_no_capacity(args, match):
    """``capacity(8, 0, 1, 1.0)`` raised ZeroDivisionError; ``capacity(8, 4, 5, 1.0)`` (k > E)
    returned 8, ``capacity(-1, ...)`` and ``capacity(8, 4, 0, ...)`` returned 1."""
    with pytest.raises(ValueError, match=match):
        capacity(*args)


@pytest.mark.parametrize("ep,match", [
    (0, r"ep=0; give an int >= 1"), (-2, r"ep=-2; give an int >= 1"),
    (2.0, r"ep=2.0; give an int >= 1"), (3, r"ep=3 does not divide the 4 data-parallel "
                                          r"ranks.*use ep in \[1, 2, 4\]")])
def test_expert_mesh_refuses_a_bad_ep_with_the_fix(ep, match):
    """``expert_mesh(mesh, 0)`` raised ZeroDivisionError, ``-2`` torch's "invalid shape
    dimension", ``2.0`` a TypeError from ``reshape``; ``3`` named no fix."""
    mesh = wb.Mesh.grid((4, 1), ["dp", "tp"])
    with pytest.raises(ValueError, match=match):
        expert_mesh(mesh, ep)


def test_bad_moe_arguments_are_refused_and_leave_the_inputs_untouched():
    c = dict(arch="llama", E=6, k=2, gating="softmax", cf=None, norm=True, alpha=0.0,
             shared=0, B=2, S=3)
    m, x, _ = _layer(c, 0)
    logits = torch.randn(2, 3, 6, dtype=F64)
    saved = logits.clone()
    with pytest.raises(ValueError, match=r"k=7 > 6 experts.*lower k to at most 6"):
        router_topk(logits, 7)
    with pytest.raises(ValueError, match=r"capacity=0 must be an int >= 1"):
        router_topk(logits, 2, capacity=0)
    assert torch.equal(logits, saved)
    with pytest.raises(ValueError, match=r"moe_topk=7 > moe_experts=6"):
        get_config("tiny", moe_experts=6, moe_topk=7)
    with pytest.raises(ValueError, match=r"moe_capacity_factor=0"):
        get_config("tiny", moe_experts=6, moe_capacity_factor=0)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    em = expert_mesh(wb.Mesh.grid((4, 1), ["dp", "tp"]), 4)
    with pytest.raises(ValueError, match=r"ep=4 does not divide moe_experts=6.*use ep in "
                                         r"\[1, 2, 3, 6\]"):
        expert_parallel(m.experts, em)
    for n, p in m.named_parameters():                # still plain, still the same numbers
        assert type(p) is torch.nn.Parameter and torch.equal(p, before[n]), n
    assert m.token_dispatcher is None
    torch.testing.assert_close(m(x), m(x))           # and it still runs


# ---- the planner and the dry run ------------------------------------------------------------

@pytest.mark.parametrize("k,cf,lay", [(2, 1.25, dict(dp=2, ep=2, global_batch=2)),
                                      (1, 2.0, dict(dp=4, ep=2, global_batch=4)),
                                      (2, 0.5, dict(dp=4, ep=4, global_batch=4, zero=1))])
def test_planner_all_to_all_bytes_and_activations_are_the_dry_runs_with_a_capacity(k, cf,
                                                                                   lay):
    """With a capacity factor c > 1 the planner padded every expert to c k T / E rows
    (``moe_pad_expert_input_to_capacity``, off by default in Megatron-Core); the runtime
    sends and computes the rows that kept a slot, k T under balanced routing: the
    estimate's all-to-all bytes were 1.25x the dry run's at c = 1.25 (10,485,760 against
    8,388,608 per layer) and 2x at c = 2 (activations 0.94x and 0.82x of it)."""
    from workbench.plan import Cluster, Layout, dry_run, estimate
    from workbench.plan.ep_cp import layer_detail
    cfg = get_config("llama2-7b", n_layer=2, d_model=1024, n_head=16, n_kv_head=4,
                     d_ff=2816, seq_len=1024, moe_experts=8, moe_topk=k,
                     moe_capacity_factor=cf)
    lay = Layout(**lay)
    cl = Cluster("a100", lay.world)
    dr = dry_run(cfg, lay, cl)
    est = estimate(cfg, lay.replace(framework="workbench"), cl, attention="flash")
    sent = sum(sum(b for j, b in enumerate(ev.args["send_bytes"][0]) if j)
               for ev in dr.trace.events
               if (ev.label or "").startswith(("EP dispatch", "EP combine")) and 0 in ev.ranks)
    # and the forward's per-expert counts, priced since task moetp (tests/test_moetp.py)
    sent += sum(ev.bytes for ev in dr.trace.events
                if ev.label == "EP counts (forward)" and 0 in ev.ranks)
    planned = layer_detail(cfg, lay.replace(framework="workbench"), cl.profile, "flash")
    assert planned["a2a_count"] == 5                  # dispatch, combine; fwd, bwd; counts
    assert sent == cfg.n_layer * planned["a2a_bytes"]
    # activations: the planner's count (the un-permute's extra R h buffer, R = min(c, 1)
    # k T rows, was added here until moeclk8: ExpertParallel._unpermute by index_put),
    # plus, with c < 1, the dropped (token, choice) slots the un-permute's k T rows keep
    # as zeros where the planner counts the R kept (measured at c = 0.5: 1.0205x alone)
    T = cfg.seq_len * lay.micro_batch
    extra = 2 * (1 - min(cf, 1.0)) * k * T * cfg.d_model * cfg.n_layer
    assert dr.memory["activations"] == pytest.approx(est.memory["activations"] + extra,
                                                     rel=0.01)
    assert dr.step_time == pytest.approx(est.step_time, rel=0.10)
    # the experts' states per rank (E / ep experts, ZeRO-1 over the expert-data-parallel
    # ranks) beside the dense ones: exactly the planner's
    for key in ("params", "grads", "optimizer"):
        assert dr.memory[key] == est.memory[key], key


@pytest.mark.parametrize("chunks", [3, 4])
def test_chunked_exchange_sends_every_routed_row_once(chunks):
    """With ``chunks`` n the clock's pieces were each matrix entry's bytes // n and each
    rank's rows // n: rows the router kept went missing from the trace when n did not
    divide them (and the pieces carried fractions of a row).  The pieces now split each
    entry's rows as evenly as whole rows go, and add up to what was routed; the experts'
    FLOPs likewise."""
    c = dict(arch="llama", E=4, k=2, gating="softmax", cf=None, norm=True, alpha=0.0,
             shared=0, B=2, S=7)
    m, x, gy = _layer(c, 11)
    _, _, _, _, routes = _reference_grads(m, c, x, gy)
    mesh = wb.Mesh.grid((2, 1), ["dp", "tp"])
    m.token_dispatcher = expert_parallel(m.experts, expert_mesh(mesh, 2), chunks)
    parallelize(m, mesh, {})
    with wb.trace() as tr:
        y = m(wb.shard_tensor(x, mesh, [Sh(0), R]).requires_grad_())
        (y * wb.shard_tensor(gy, mesh, [Sh(0), R])).sum().backward()
    sent = [[0, 0], [0, 0]]                       # rows sequence b's rank sends each rank
    for b, _, _, e, kept in routes:
        sent[b][e // 2] += kept
    assert any(n % chunks for row in sent for n in row)          # the case at stake
    per_expert = 3 * 8 * 12                                       # SwiGLU: 3 h d_ff
    for phase, mult in (("forward", 1), ("backward", 2)):
        for label, want in (("dispatch", sent), ("combine", [list(r) for r in zip(*sent)])):
            evs = [ev for ev in tr.events if ev.label == f"EP {label} ({phase})"]
            assert len(evs) == chunks
            total = [[sum(ev.args["send_bytes"][i][j] for ev in evs) for j in range(2)]
                     for i in range(2)]
            assert total == [[8 * 8 * n for n in row] for row in want], (phase, label)
            for ev in evs:                         # whole rows in every piece
                assert all(b % 64 == 0 for row in ev.args["send_bytes"] for b in row)
        flops = sum(ev.flops for ev in tr.events if ev.name == f"experts {phase}")
        assert flops == mult * 2 * per_expert * c["B"] * c["S"] * c["k"]
