"""The planner's ZeRO-2/3 clock (``wb.plan.zero_cost``): one comm stream against the
modules of a micro-batch, held to hand-worked timelines and to the GPT's own terms."""
import dataclasses

import pytest

from workbench.models.config import get_config
from workbench.plan import Cluster, Layout, estimate
from workbench.plan.memory import layer_params, stage_params
from workbench.plan.zero_cost import Block, zero_exposed
from workbench.sim_mesh.cost import overlap_rate, price


def _half(n):          # a collective of n elements takes n / 2 seconds
    return n / 2


# forward order: embedding (4 elements), two layers (1 each), head without parameters
BLOCKS = [Block(4, 1.0, 1.0), Block(1, 2.0, 2.0), Block(1, 2.0, 2.0), Block(0, 3.0, 3.0)]


def test_zero2_exposes_the_gradient_completed_last():
    """Backward: head 0-3; layer 3-5 (its reduce-scatter 5-5.5); layer 5-7 (7-7.5);
    embedding 7-8, whose reduce-scatter 8-10 overlaps nothing: 2 s exposed."""
    assert zero_exposed(BLOCKS, 2, _half, _half) == (0.0, 2.0)


def test_zero3_first_gather_and_prefetch_by_hand():
    """Prefetch 1 element (one module ahead).  Forward: gather emb 0-2, compute 2-3
    (layer 1's gather issued at 2: 2-2.5); layer 1 computes 3-5 (layer 2's gather 3-3.5),
    layer 2 5-7, head 7-10: 2 s past the 8 s of compute.  Backward from 0: the head
    needs nothing, layer 2's gather is prefetched at 0 (0-0.5) and head computes 0-3;
    layer 2 3-5 (prefetches layer 1: 3-3.5; its gradient 5-5.5), layer 1 5-7 (prefetches
    emb: 5.5-7.5; gradient 7.5-8), emb waits for its gather until 7.5, computes 7.5-8.5,
    its gradient 8.5-10.5: 2.5 s past the 8 s of compute."""
    assert zero_exposed(BLOCKS, 3, _half, _half, prefetch_numel=1) == (2.0, 2.5)


def test_compute_beside_a_collective_runs_at_the_rate_left():
    """rate 0.5 (a collective holding half the SMs): backward head 0-3; layer 3-5 (its
    reduce-scatter 5-5.5); layer 1 from 5: half speed until 5.5, then 1.75 s: ends 7.25
    (7.25-7.75); embedding: 0.25 s done by 7.75, ends 8.5; its gradient 8.5-10.5."""
    assert zero_exposed(BLOCKS, 2, _half, _half, rate=0.5) == (0.0, 2.5)
    assert zero_exposed(BLOCKS, 2, _half, _half, rate=1) == (0.0, 2.0)
    with pytest.raises(ValueError, match="rate=0"):
        zero_exposed(BLOCKS, 2, _half, _half, rate=0)


def test_without_compute_every_collective_is_exposed():
    bare = [Block(b.numel, 0.0, 0.0) for b in BLOCKS]
    total = sum(b.numel for b in BLOCKS) / 2
    assert zero_exposed(bare, 2, _half, _half) == (0.0, total)
    assert zero_exposed(bare, 3, _half, _half) == (total, 2 * total)


def test_zero_stage_must_be_2_or_3():
    with pytest.raises(ValueError, match="zero=1"):
        zero_exposed(BLOCKS, 1, _half, _half)


def test_gpt_zero2_tail_is_the_tied_embedding_once_per_micro_batch():
    """The dry run's GPT shape: layers' reduce-scatters hide behind the backward, the
    tied word embedding's is the exposed tail of every micro-batch (DeepSpeed waits for
    the reduction stream at the end of each backward; the recipe reduce-scatters each
    parameter as its gradient is produced, ``zero_cost.recipe_blocks``: the positions'
    runs beside the word embedding's backward); then the updated weights are gathered
    once."""
    cfg = get_config("gpt3-175b", n_layer=2, d_model=1024, n_head=16, seq_len=1024)
    lay = Layout(dp=2, tp=1, pp=1, global_batch=4, zero=2, framework="workbench")
    cl = Cluster("a100", 2)
    est = estimate(cfg, lay, cl, attention="flash")
    h, V, s = cfg.d_model, cfg.vocab_size, cfg.seq_len
    ranks = lay.dp_ranks()
    tail = price("reduce_scatter", 2 * V * h, ranks, "a100")
    pos = price("reduce_scatter", 2 * s * h, ranks, "a100")
    gather = price("all_gather", 2 * stage_params(cfg, 1, 1, 0), ranks, "a100")
    assert lay.m == 2
    # the layers' reduce-scatters hide behind the backward, which runs at 84/108 speed
    # beside them (NCCL's 24 SMs: the dp group is inside one node): at most (1 - r) / r
    # of each more compute
    r = overlap_rate("a100", ranks)
    assert r == pytest.approx(84 / 108)
    f = cfg.d_ff                  # one reduce-scatter per parameter (models.gpt)
    params = [h, h, h * h, h, h * h, h, h * h, h, h * h, h, h, h, h * f, f, f * h, h]
    assert sum(params) == layer_params(cfg, 1)
    hidden = sum(price("reduce_scatter", 2 * n, ranks, "a100")
                 for n in params * cfg.n_layer + [h, h])
    assert lay.m * tail + gather < est.details["dp_sync"] \
        <= lay.m * (tail + pos + (1 - r) / r * hidden) + gather + 1e-12
    no_sms = dataclasses.replace(cl.profile, topology=dataclasses.replace(
        cl.profile.topology, collective_sms=0, collective_sms_intra=0))
    est1 = estimate(cfg, lay, Cluster(no_sms, 2), attention="flash")
    assert est1.details["dp_sync"] == pytest.approx(lay.m * tail + gather, rel=1e-12)


@pytest.mark.parametrize("zero, kind", [(0, "all_reduce"), (1, "reduce_scatter")])
def test_overlap_grad_reduce_leaves_the_embedding_tail(zero, kind):
    """Megatron's --overlap-grad-reduce (ZeRO-0/1): the gradients reduced module by module
    during the last micro-batch's backward; the layers' reductions hide behind the
    backward, the tied embedding's (completed last) shows once per step, not per
    micro-batch (after what is left of the first layer's, issued just before it).  ZeRO-1's
    updated weights are gathered beside the next forward (--overlap-param-gather): the
    embedding's, needed first, shows.  With the SMs NCCL takes, a little more.  Layers
    of 50M parameters: one Megatron-core bucket each at ZeRO-1 (max(40M, 1M x dp),
    plan.megatron_buckets), the embedding and positions the last."""
    cfg = get_config("gpt3-175b", n_layer=2, d_model=2048, n_head=16, seq_len=1024)
    lay = Layout(dp=2, tp=1, pp=1, global_batch=4, zero=zero)
    a100 = Cluster("a100", 2).profile
    bare = dataclasses.replace(a100, topology=dataclasses.replace(
        a100.topology, collective_sms=0, collective_sms_intra=0))
    h, V, s = cfg.d_model, cfg.vocab_size, cfg.seq_len
    ranks = lay.dp_ranks()
    # Megatron-LM reduces the bf16 model's gradients in fp32 (4 bytes), gathers 16-bit
    tail = price(kind, 4 * (V * h + s * h), ranks, "a100")
    if zero == 1:
        tail += price("all_gather", 2 * (V * h + s * h), ranks, "a100")
    layer = price(kind, 4 * layer_params(cfg, 1), ranks, "a100")
    if zero == 1:   # the embedding's forward is too short to hide the first layer's gather
        layer += price("all_gather", 2 * layer_params(cfg, 1), ranks, "a100")
    got = {}
    for name, prof in (("bare", bare), ("a100", a100)):
        cl = Cluster(prof, 2)
        plain = estimate(cfg, lay, cl, attention="flash")
        over = estimate(cfg, lay, cl, attention="flash", overlap_grad_reduce=True)
        got[name] = over.details["dp_sync"]
        assert got[name] < plain.details["dp_sync"]
        assert over.memory == plain.memory and over.comm_bytes == plain.comm_bytes
    assert tail <= got["bare"] <= tail + layer
    assert got["bare"] < got["a100"] < 1.2 * got["bare"]


def test_overlap_grad_reduce_is_a_bool_and_leaves_zero_2_and_3_alone():
    cfg = get_config("gpt3-175b", n_layer=2, d_model=1024, n_head=16, seq_len=1024)
    cl = Cluster("a100", 2)
    for zero in (2, 3):
        lay = Layout(dp=2, tp=1, pp=1, global_batch=4, zero=zero)
        assert estimate(cfg, lay, cl, overlap_grad_reduce=True).step_time == \
            estimate(cfg, lay, cl).step_time
    with pytest.raises(ValueError, match="overlap_grad_reduce='yes'"):
        estimate(cfg, Layout(dp=2, tp=1, pp=1, global_batch=4), cl, overlap_grad_reduce="yes")


def test_reduce_scatter_buckets_wait_for_enough_gradient():
    """DeepSpeed's reduce_bucket_size (``bucket``, here 3 elements): backward head 0-3,
    layers 3-5 and 5-7 (2 elements pending, under the bucket), embedding 7-8: the six
    elements reduce-scattered together 8-11: 3 s exposed (one per block: 2 s)."""
    assert zero_exposed(BLOCKS, 2, _half, _half, bucket=3) == (0.0, 3.0)
    assert zero_exposed(BLOCKS, 2, _half, _half, bucket=1) == (0.0, 2.0)


def test_deepspeed_zero3_gathers_module_by_module():
    """DeepSpeed ZeRO-3 (the default framework for zero=3): each layer's four weight
    matrices gathered on their own (biases and norms under stage3_param_persistence_
    threshold never), gradients reduce-scattered in buckets of 5e8 elements; without
    overlap every collective shows: m x (two gathers per module + the buckets)."""
    from workbench.plan import costs as C
    from workbench.plan.edge_cost import edge_times
    from workbench.plan.zero_cost import PERSISTENCE_NUMEL, REDUCE_BUCKET_NUMEL, stage_blocks
    cfg = get_config("gpt3-175b")
    cl = Cluster("a100", 1024)
    lay = Layout(dp=256, tp=4, sp=True, zero=3, recompute="selective", micro_batch=3,
                 global_batch=1536)
    assert lay.engine == "deepspeed"
    layer = C.layer_cost(cfg, 3, 4, True, "selective", cl.profile)
    head = C.head_cost(cfg, 3, 4, True, cl.profile)
    edge = edge_times(cfg, 3, 4, True, cl.profile)
    blocks = stage_blocks(cfg, lay, 0, layer, head, edge, per_module=True)
    h, f = cfg.d_model, cfg.d_ff
    assert [b.numel for b in blocks[1:5]] == [3 * h * h / 4, h * h / 4, h * f / 4, f * h / 4]
    assert len(blocks) == 2 + 4 * cfg.n_layer and PERSISTENCE_NUMEL == 1e5
    assert sum(b.fwd for b in blocks[1:5]) == pytest.approx(layer.fwd_compute)
    ranks = lay.dp_ranks()
    whole, pending = 0.0, 0.0
    for b in blocks[::-1]:
        whole += 2 * price("all_gather", 2 * b.numel, ranks, "a100")
        pending += b.numel
        if pending >= REDUCE_BUCKET_NUMEL:
            whole += price("reduce_scatter", 2 * pending, ranks, "a100")
            pending = 0.0
    whole += price("reduce_scatter", 2 * pending, ranks, "a100") if pending else 0.0
    est = estimate(cfg, lay, cl, overlap=False)
    assert est.details["dp_sync"] == pytest.approx(lay.m * whole, rel=1e-9)
    # this library's recipe gathers the same modules and also the norms and biases
    # DeepSpeed keeps whole (no persistence threshold), and reduce-scatters each
    # parameter where DeepSpeed fills 5e8-element buckets (zero_cost.recipe_blocks): more
    # latency-bound collectives over 256 ranks, more exposed
    # latency-bound collectives over 256 ranks, more exposed (at one SM share for both:
    # the profile's all-ranks 16, nccl_version unset; at NCCL 2.12.7's 4 for this group's
    # 2 ranks per node, sim_mesh.nccl_channels, compute beside runs faster and the two
    # come within 3%)
    p16 = dataclasses.replace(cl.profile, topology=dataclasses.replace(
        cl.profile.topology, nccl_version=""))
    c16 = Cluster(p16, 1024)
    ours = estimate(cfg, lay.replace(framework="workbench"), c16)
    assert ours.details["dp_sync"] > estimate(cfg, lay, c16).details["dp_sync"]


def test_loss_waits_behind_the_backward_prefetch():
    """This library's recipe with an untied head: the backward's prefetch is issued at the
    end of the forward and the loss's dp all-reduce queues behind it, so no gather of it
    hides behind backward compute (``zero_exposed(loss_waits=True)``); otherwise only the
    first module's gather shows."""
    from workbench.plan.zero_cost import Block, zero_exposed
    blocks = [Block(10, 1.0, 2.0)] * 3
    ag, rs = (lambda n: 0.1 * n), (lambda n: 0.0)
    f0, b0 = zero_exposed(blocks, 3, ag, rs, prefetch_numel=float("inf"))
    f1, b1 = zero_exposed(blocks, 3, ag, rs, prefetch_numel=float("inf"), loss_waits=True)
    assert f1 == f0 and b0 == 1.0 and b1 == 3.0
