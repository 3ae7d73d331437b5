"""Megatron-core's data-parallel buckets (``plan.megatron_buckets``) held to its source
(NVIDIA/Megatron-LM f2e5db402c: ``distributed_data_parallel.py:51-54``, the bucket size
max(40,000,000, 1,000,000 x dp); ``param_and_grad_buffer.py``, buckets formed walking the
parameters in reverse, each closed once it holds that many elements or more), and the
tensor-parallel layer at tp 8 held to a measurement of Transformer Engine's layer on 8
H100s (NVIDIA/Fuser, below)."""
import sys

import pytest

from workbench.plan import Cluster, Layout
from workbench.plan import costs as C
from workbench.plan import megatron_buckets as MB
from workbench.plan import zero_cost as Z
from workbench.plan.edge_cost import edge_times
from workbench.plan.memory import layer_params, stage_params
from workbench.plan.presets import get_config
from workbench.models import ModelConfig

E = sys.modules["workbench.plan.estimate"]

# the README's GPT 32B (Megatron-LM f2e5db402c images/model_table.png): 56 heads, h 7168,
# 48 layers, tp 8, dp 48, vocabulary 131,072, sequence 4096, untied embeddings
GPT32 = ModelConfig(arch="gpt", vocab_size=131072, seq_len=4096, tie_embeddings=False,
                    dropout=0.1, d_model=7168, n_layer=48, n_head=56, dtype="bfloat16")
LAY32 = Layout(dp=48, tp=8, pp=1, sp=True, zero=1, recompute="none", micro_batch=1,
               global_batch=192)


def _blocks(cfg, lay, stage=0, prof="h100"):
    prof = Cluster(prof, lay.dp * lay.tp * lay.pp).profile
    layer = E.layer_for(cfg, lay, prof, "flash")
    head = C.head_cost(cfg, lay.micro_batch, lay.tp, lay.sp, prof)
    edge = edge_times(cfg, lay.micro_batch, lay.tp, lay.sp, prof)
    return Z.stage_blocks(cfg, lay, stage, layer, head, edge), prof


@pytest.mark.parametrize("dp, want", [(1, 40_000_000), (8, 40_000_000), (40, 40_000_000),
                                      (41, 41_000_000), (48, 48_000_000),
                                      (256, 256_000_000)])
def test_bucket_size_is_megatrons_default(dp, want):
    assert MB.bucket_numel(dp) == want


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, None])
def test_bucket_size_refuses_a_bad_dp(bad):
    with pytest.raises(ValueError, match="dp="):
        MB.bucket_numel(bad)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_layer_parameter_list_sums_to_the_layer(tp):
    cfg = get_config("gpt3-175b", d_model=4096, n_head=32)
    got = MB.layer_param_numels(cfg, tp)
    assert len(got) == 12
    assert sum(got) == pytest.approx(layer_params(cfg, tp), rel=1e-12)


def test_hand_counted_buckets():
    """h 1024, d_ff 4096, 2 layers, tp 1, dp 2 (buckets of 40M), vocabulary 51,200,
    sequence 1024, tied (pp 1: the head holds its norm only).  Per layer: LN 1024 + 1024,
    qkv 3,145,728 + 3,072, proj 1,048,576 + 1,024, LN 2,048, fc1 4,194,304 + 4,096, fc2
    4,194,304 + 1,024 = 12,596,224.  Walking back: norm 2,048 + both layers 25,192,448 +
    positions 1,048,576 = 26,243,072 < 40M, + word 52,428,800 = 78,671,872: one bucket."""
    cfg = get_config("gpt3-175b", n_layer=2, d_model=1024, n_head=16, seq_len=1024)
    lay = Layout(dp=2, tp=1, pp=1, global_batch=4, zero=1)
    blocks, _ = _blocks(cfg, lay, prof="a100")
    assert layer_params(cfg, 1) == 12_596_224
    got = MB.buckets(cfg, lay, 0, blocks)
    assert [b.numel for b in got] == [78_671_872]
    assert got[0].fwd == pytest.approx(sum(b.fwd for b in blocks), rel=1e-12)
    assert got[0].bwd == pytest.approx(sum(b.bwd for b in blocks), rel=1e-12)


def test_hand_counted_buckets_that_split_layers():
    """h 2048 (d_ff 8192), 2 layers, tp 1, dp 2: a layer is 50,358,272.  Walking back:
    the final norm (4,096) and layer 1 from its fc2 bias down to its qkv weight (2,048 +
    16,777,216, 8,192 + 16,777,216, 4,096, 2,048 + 4,194,304, 6,144 + 12,582,912) pass
    40M only at that weight: the bucket closes there, holding a layer's worth; layer 1's
    first norm (4,096) opens the next, which closes likewise at layer 0's qkv weight; the
    last holds layer 0's first norm, the positions and the word embedding."""
    cfg = get_config("gpt3-175b", n_layer=2, d_model=2048, n_head=16, seq_len=1024)
    lay = Layout(dp=2, tp=1, pp=1, global_batch=4, zero=1)
    blocks, _ = _blocks(cfg, lay, prof="a100")
    h, layer = 2048, layer_params(cfg, 1)
    assert layer == 50_358_272
    got = [b.numel for b in MB.buckets(cfg, lay, 0, blocks)]
    word, pos = 51200 * h, 1024 * h
    assert got == [2 * h + pos + word, layer, layer]
    assert sum(got) == pytest.approx(stage_params(cfg, 1, 1, 0), rel=1e-12)


def test_the_32b_rows_buckets():
    """The README's GPT 32B: 74 buckets of >= 48M (the last formed, the embedding's end,
    may hold fewer) where the planner had 50 layer blocks; the head's output layer (117M
    on a tp rank) is a bucket of its own, the first reduce-scattered."""
    blocks, _ = _blocks(GPT32, LAY32)
    got = MB.buckets(GPT32, LAY32, 0, blocks)
    assert len(blocks) == 50 and len(got) == 74
    size = MB.bucket_numel(48)
    assert all(b.numel >= size for b in got[1:])
    assert got[-1].numel == 131072 * 7168 / 8
    assert sum(b.numel for b in got) == pytest.approx(sum(b.numel for b in blocks), rel=1e-12)
    for k in ("fwd", "bwd"):
        assert sum(getattr(b, k) for b in got) == pytest.approx(
            sum(getattr(b, k) for b in blocks), rel=1e-12)


def test_estimate_uses_the_buckets_on_the_first_stage_with_zero_1_only():
    """The 32B's DP sync is ``_dp_sync`` over Megatron's buckets; a ZeRO-0 layout
    (torch DDP's or Megatron's all-reduce: not modeled by bucket) keeps the layer blocks;
    and more collectives over 48 nodes expose more (NCCL's ring latency per call)."""
    blocks, prof = _blocks(GPT32, LAY32)
    psi = sum(b.numel for b in blocks)
    cl = Cluster("h100", 384)
    est = E.estimate(GPT32, LAY32, cl, attention="flash", overlap_grad_reduce=True)
    layer = E.layer_for(GPT32, LAY32, cl.profile, "flash")
    head = C.head_cost(GPT32, 1, 8, True, cl.profile)
    edge = edge_times(GPT32, 1, 8, True, cl.profile)
    bl = Z.stage_blocks(GPT32, LAY32, 0, layer, head, edge)
    by_bucket = E._dp_sync(psi, LAY32, cl.profile, 0, MB.buckets(GPT32, LAY32, 0, bl),
                           True, True, 4)
    by_layer = E._dp_sync(psi, LAY32, cl.profile, 0, bl, True, True, 4)
    assert est.details["dp_sync"] == pytest.approx(by_bucket[0], rel=1e-12)
    assert by_bucket[0] > by_layer[0]
    assert by_bucket[1] == by_layer[1]                  # the same bytes
    assert not MB.applies(GPT32, LAY32.replace(zero=0), 0, True)
    assert not MB.applies(GPT32, LAY32, 0, False)
    assert not MB.applies(GPT32, LAY32.replace(pp=2, dp=24), 1, True)
    assert MB.applies(GPT32, LAY32.replace(pp=2, dp=24), 0, True)


def test_buckets_refuse_blocks_that_are_not_the_gpt_layer():
    blocks, _ = _blocks(GPT32, LAY32)
    with pytest.raises(ValueError, match="blocks for stage 0"):
        MB.buckets(GPT32, LAY32, 0, blocks[:-1])
    bad = list(blocks)
    bad[3] = Z.Block(bad[3].numel + 1e6, bad[3].fwd, bad[3].bwd)
    with pytest.raises(ValueError, match="block 3 of stage 0"):
        MB.buckets(GPT32, LAY32, 0, bad)


# NVIDIA/Fuser (NVIDIA's nvFuser team) timed Transformer Engine's TransformerLayer at
# GPT-3's shape (h 12,288, 96 heads, d_ff 4h, batch 1, sequence 2,048, bf16) with
# tensor parallelism 8 and sequence parallelism, its collectives NCCL's, not overlapped,
# on 8 H100 80GB (tests/python/multidevice/test_transformer_engine.py): forward 2.67 ms
# (median of 5, pull request #3546, 2024-12-09) and 2.5 ms (#5560, 2025-11-20), backward
# 4.58 ms (#5667, 2025-12-11).  Each figure is the wall time of one call between
# torch.cuda.synchronize()s (benchmark_utils.get_benchmark_fn): the kernels, the host's
# launches before the first and the ranks' skew at the first collective; so it bounds the
# layer's device time from above.
FUSER_TE_TP8 = {"forward": (2.5e-3, 2.67e-3), "backward": (4.58e-3, 4.58e-3)}


def test_tp8_te_layer_is_not_priced_above_te_measured():
    """The planner's tp-8 layer (the 32B's layout family) is not overpriced: at the
    measured shape it prices 2.06 ms forward and 3.43 ms backward, under the measured
    2.5-2.67 and 4.58 ms (upper bounds), and not below 0.7 of them."""
    cfg = ModelConfig(arch="gpt", vocab_size=51200, seq_len=2048, dropout=0.1,
                      d_model=12288, n_layer=1, n_head=96, dtype="bfloat16")
    lay = Layout(dp=1, tp=8, pp=1, sp=True, zero=0, recompute="none", micro_batch=1,
                 global_batch=1)
    prof = Cluster("h100", 8).profile
    lc = E.layer_for(cfg, lay, prof, "flash", transformer_engine=True)
    fwd, bwd = lc.fwd_compute + lc.fwd_comm, lc.bwd_compute + lc.bwd_comm
    for got, (lo, hi) in ((fwd, FUSER_TE_TP8["forward"]), (bwd, FUSER_TE_TP8["backward"])):
        assert 0.7 * lo < got <= lo


def test_the_32b_line_rate_floor():
    """benchmarks/tp8_audit.line_rate_floor: the reduce-scatter of the 32B's fp32
    gradients (3.97G parameters on a rank) and the gather of its bf16 weights over a dp
    ring of one GPU per node, each through one 400 Gb/s port at its line rate (DGX H100:
    one NDR port per GPU, 50 GB/s, profiles/h100.json inter_node.bandwidth), no latency:
    4 x psi x 47/48 / 50e9 and 2 x psi x 47/48 / 50e9; bf16 gradients halve the first;
    a micro-batch of 2 doubles the windows (last backward, first forward)."""
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]
                           / "benchmarks"))
    import step_audit as SA
    import tp8_audit as TA
    r = SA.row("megatron_h100", "GPT 32B", 384)
    f = TA.line_rate_floor(r)
    psi = stage_params(GPT32, 8, 1, 0)
    assert f["reduce_scatter"] == pytest.approx(4 * psi * 47 / 48 / 50e9, rel=1e-12)
    assert f["all_gather"] == pytest.approx(2 * psi * 47 / 48 / 50e9, rel=1e-12)
    assert f["floor"] == pytest.approx(
        f["compute"] + f["reduce_scatter"] - f["last_backward"] + f["all_gather"]
        - f["first_forward"], rel=1e-12)
    half = TA.line_rate_floor(r, grad_bytes=2)
    assert half["reduce_scatter"] == pytest.approx(f["reduce_scatter"] / 2, rel=1e-12)
    two = TA.line_rate_floor(r, micro_batch=2)
    assert two["last_backward"] == pytest.approx(2 * f["last_backward"], rel=0.05)
    assert two["first_forward"] == pytest.approx(2 * f["first_forward"], rel=0.05)
