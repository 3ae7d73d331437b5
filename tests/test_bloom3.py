"""Jean Zay's network as NCCL's log of the cluster's own benchmark shows it (bloom3).

bigscience-workshop/bigscience (9e64edec2a) experiments/bandwidth/all_reduce_bench-a100-n4.txt:
NCCL 2.10.3 built 2 ring channels for 32 ranks on 4 A100 nodes, both entering each node
at GPU 0 through NET/IB/1 and leaving from GPU 7 through NET/IB/3: one Omni-Path adapter
per direction carried the measured 40.54 Gbps bus bandwidth (``topology.ring_nics = 1``,
``inter_node.efficiency = 0.405`` of one 12.5 GB/s adapter).  The same script and NCCL on
4 V100 nodes (all_reduce_bench-32gb-n4.txt) reached 84.59 Gbps with every ring channel
entering a node through one adapter: the range's fast end, 0.846.
"""
import dataclasses

import pytest

from workbench.plan.ranges import BOUNDS
from workbench.sim_mesh import topology as T
from workbench.sim_mesh.cost import price
from workbench.sim_mesh.profiles import Profile, Topology, get_profile

JZ = get_profile("a100-jeanzay")
A100_BUSBW_GBPS = 40.54      # all_reduce_bench-a100-n4.txt, median of 160 lines
V100_BUSBW_GBPS = 84.59      # all_reduce_bench-32gb-n4.txt, median of 80 lines
ADAPTER = 100e9 / 8          # Intel OPA 100 Series: 100 Gb/s per port


def _busbw(kind, n, ranks, profile=JZ):
    p = len(ranks)
    t = price(kind, n, list(ranks), profile)
    return n / t * {"all_reduce": 2 * (p - 1) / p}.get(kind, 1.0) * 8 / 1e9


def test_efficiency_is_one_adapters_share_of_the_benchmark():
    assert JZ.inter_node.efficiency == pytest.approx(A100_BUSBW_GBPS / 100, abs=5e-4)
    assert JZ.topology.ring_nics == 1 and JZ.topology.nics_per_node == 4
    assert "NET/IB/1" in JZ.citations["topology.ring_nics"]
    assert "NET/IB/3" in JZ.citations["inter_node.efficiency"]


def test_benchmark_case_is_capped_at_one_adapter():
    """32 ranks, 8 per node: without the cap the ring would drive 8 ranks' shares of the
    node's 4 adapters (4 x the measured rate); with it, the measured 40.5 Gbps."""
    assert _busbw("all_reduce", 4e9, range(32)) == pytest.approx(A100_BUSBW_GBPS, rel=0.01)
    free = dataclasses.replace(JZ, topology=dataclasses.replace(JZ.topology, ring_nics=None))
    assert _busbw("all_reduce", 4e9, range(32), free) == pytest.approx(
        4 * A100_BUSBW_GBPS, rel=0.01)


def test_dp_group_of_two_ranks_per_node_gets_one_adapter():
    """BLOOM's DP group (tp 4: ranks t + 4 d, 2 per node on 4 nodes) drives 2 ranks'
    shares = one adapter: the benchmark's per-adapter rate, bounded by the cap too."""
    ranks = [4 * d for d in range(8)]
    assert T.group_of(ranks, JZ).per_node == (2, 2, 2, 2)
    assert T._flat_link(JZ, T.group_of(ranks, JZ)).bandwidth == pytest.approx(
        ADAPTER * 0.405, rel=1e-12)
    assert _busbw("all_reduce", 8e9, ranks) == pytest.approx(A100_BUSBW_GBPS, rel=0.01)


def test_pipeline_send_gets_half_an_adapter():
    """A stage boundary: each of a node's 8 GPUs sends to its peer 4 nodes on; 2 GPUs
    share each of the 4 adapters."""
    n = 29.36e6
    t = price("send_recv", n, [0, 32], JZ)
    assert n / t == pytest.approx(ADAPTER * 0.405 / 2, rel=0.01)


def test_profiles_without_the_cap_are_unchanged():
    a100 = get_profile("a100")
    assert a100.topology.ring_nics is None
    g = T.group_of(range(32), a100)          # 8 ranks on each of 4 nodes, 8 NICs each
    nic = a100.inter_node.effective_bandwidth
    assert T._flat_link(a100, g).bandwidth == pytest.approx(
        min(a100.intra_node.effective_bandwidth, 8 * nic), rel=1e-12)


def test_range_spans_the_two_adapter_measurements():
    (field, slow, fast, kind, why), = [b for b in BOUNDS["a100-jeanzay"]
                                       if b[0] == "inter_node.efficiency"]
    assert (slow, kind) == (JZ.inter_node.efficiency, "value")
    assert fast == pytest.approx(V100_BUSBW_GBPS / 100, abs=5e-4)
    assert "all_reduce_bench-32gb-n4.txt" in why


def test_ring_nics_validated():
    for bad in (0, -1, True, 1.5, "1"):
        with pytest.raises(ValueError, match="ring_nics"):
            Topology(ring_nics=bad)
    with pytest.raises(ValueError, match=r"ring_nics=5 exceeds the node's 4 NICs"):
        dataclasses.replace(JZ, topology=dataclasses.replace(JZ.topology, ring_nics=5))


def test_ring_nics_round_trips():
    data = JZ.to_dict()
    assert data["topology"]["ring_nics"] == 1
    back = Profile.from_dict(data)
    assert back.topology.ring_nics == 1 and back == JZ
    assert "ring_nics" not in get_profile("a100").to_dict()["topology"]


# ---- DeepSpeed's pipeline keeps each in-flight output as a 1/t partition -------------

def _ds_layout(**kw):
    import workbench as wb
    cfg = wb.models.get_config("gpt3-175b", n_layer=8, d_model=1024, n_head=8, seq_len=512,
                               dtype="bfloat16")
    lay = wb.plan.Layout(**{**dict(dp=2, tp=4, pp=4, zero=1, recompute="full",
                                   global_batch=32, micro_batch=2, framework="deepspeed"),
                            **kw})
    return cfg, lay


def test_partitioned_outputs_counted_on_every_stage_but_the_last():
    """DeepSpeed 56c522386 _exec_forward_pass: PartitionedTensor(...).clone() of 1/t of
    the output, held until the micro-batch's backward: 2 s b h / t per micro-batch."""
    from workbench.plan import deepspeed_pipe_memory as DPM
    from workbench.plan import memory as MEM
    cfg, lay = _ds_layout()
    s, b, h, t = cfg.seq_len, 2, cfg.d_model, 4
    for stage in range(lay.pp):
        held = MEM.in_flight(lay.schedule, lay.pp, lay.m, lay.v, stage)
        got = DPM.partitioned_output_bytes(cfg, lay, stage, held)
        want = 0.0 if stage == lay.pp - 1 else held * 2 * s * b * h / t
        assert got == want, stage
        nl = lay.stage_layers(cfg.n_layer)[stage]
        per = MEM.layer_activation_bytes(cfg, b, t, False, "full")
        edge = MEM._edge_activation_bytes(cfg, b, t, False, stage, lay.pp, held, 1)
        act = MEM.stage_memory(cfg, lay, stage)["activations"]
        # ds12: the buffers' loaded inputs, the receive buffers (1/t slices)
        loaded = DPM.loaded_input_bytes(cfg, lay, stage) + DPM.receive_buffer_bytes(
            cfg, lay, stage)
        assert act == pytest.approx(per * nl * held + edge + want + loaded, rel=1e-12), stage
    assert DPM.partitioned_output_bytes(cfg, lay, 0, 4) == 4 * 2 * s * b * h / t


def test_partitioned_outputs_only_where_the_engine_partitions():
    from workbench.plan import deepspeed_pipe_memory as DPM
    cfg, _ = _ds_layout()
    for kw in (dict(framework="megatron"), dict(pp=1, dp=8)):
        _, lay = _ds_layout(**kw)
        assert DPM.partitioned_output_bytes(cfg, lay, 0, 4) == 0.0, kw
    # tp = 1 (ds12): not partitioned, the engine keeps the whole outputs
    _, lay = _ds_layout(tp=1)
    assert DPM.partitioned_output_bytes(cfg, lay, 0, 4) == 4 * 2 * 512 * 2 * 1024
    _, lay = _ds_layout()
    for bad in (-1, True, "2", None):
        with pytest.raises(ValueError, match="held"):
            DPM.partitioned_output_bytes(cfg, lay, 0, bad)


# ---- BLOOM's LayerNorm on the embeddings (ModelConfig.embed_norm) --------------------
# bigscience-workshop/Megatron-DeepSpeed b1359ee0 (2021-11-18) "add layernorm in
# Embedding (#191)": --embed-layernorm gives VocabParallelEmbedding on the first stage a
# MixedFusedLayerNorm after the all-reduce, before the embedding dropout; its autograd
# function (megatron/model/fused_layer_norm.py) saves its input: 2 s b h bytes a
# micro-batch.  tr11-176B-ml.slurm sets --embed-layernorm.

def _gpt(**kw):
    import workbench as wb
    return wb.models.get_config("tiny").replace(
        **{**dict(arch="gpt", embed_norm=True, dropout=0.0, tie_embeddings=False), **kw})


def test_embed_norm_is_validated():
    with pytest.raises(ValueError, match="embed_norm=1 must be True or False"):
        _gpt(embed_norm=1)
    with pytest.raises(ValueError, match="arch='llama' has none"):
        _gpt(arch="llama")


def test_embed_norm_model_normalises_the_embeddings():
    import torch
    import torch.nn.functional as F
    from workbench.models import build_model, param_count
    cfg = _gpt()
    m, m0 = build_model(cfg, seed=3), build_model(cfg.replace(embed_norm=False), seed=3)
    n, n0 = (sum(p.numel() for p in x.parameters()) for x in (m, m0))
    assert n - n0 == 2 * cfg.d_model
    pc = param_count(cfg)
    assert pc.module == n == sum(pc.terms.values())
    assert pc.megatron + sum(pc.differences.values()) == n
    torch.manual_seed(0)
    idx = torch.randint(0, cfg.vocab_size, (2, 9))
    with torch.no_grad():
        m.emb_norm.weight.uniform_(0.5, 1.5)
        m.emb_norm.bias.uniform_(-0.1, 0.1)
        x = m.tok_emb(idx) + m.pos_emb(torch.arange(9))
        x = F.layer_norm(x, (cfg.d_model,), m.emb_norm.weight, m.emb_norm.bias, cfg.norm_eps)
        for block in m.layers:
            x = block(x)
        want = m.lm_head(m.norm(x))
        got, _ = m(idx)
        torch.testing.assert_close(got, want)
        stages = m.pipeline_stages(2)
        assert "emb_norm" in stages[0]["modules"] and "emb_norm" not in stages[1]["modules"]
        mid = m.stage_forward(stages[0], idx, True, False)
        torch.testing.assert_close(m.stage_forward(stages[1], mid, False, True), got)


def test_embed_norm_priced_on_the_first_stage():
    import workbench as wb
    from workbench.plan import memory as MEM
    from workbench.plan.edge_cost import edge_times
    from workbench.sim_mesh.profiles import get_profile
    cfg = wb.models.get_config("gpt3-175b", n_layer=8, d_model=1024, n_head=8, seq_len=512,
                               dtype="bfloat16", dropout=0.1)
    on = cfg.replace(embed_norm=True)
    lay = wb.plan.Layout(dp=2, tp=4, pp=4, zero=1, recompute="full", global_batch=32,
                         micro_batch=2, framework="deepspeed")
    s, b, h, t = cfg.seq_len, 2, cfg.d_model, 4
    assert MEM.stage_params(on, 4, 4, 0) - MEM.stage_params(cfg, 4, 4, 0) == 2 * h
    assert MEM.stage_params(on, 4, 4, 1) == MEM.stage_params(cfg, 4, 4, 1)
    held = MEM.in_flight(lay.schedule, lay.pp, lay.m, lay.v, 0)
    d0 = MEM.stage_memory(on, lay, 0)["activations"] - MEM.stage_memory(cfg, lay, 0)["activations"]
    assert d0 == pytest.approx(held * 2 * s * b * h, rel=1e-12)       # no SP: whole
    assert MEM.stage_memory(on, lay, 1)["activations"] == MEM.stage_memory(cfg, lay, 1)["activations"]
    prof = get_profile("a100-jeanzay")
    e1, e0 = edge_times(on, b, t, False, prof), edge_times(cfg, b, t, False, prof)
    assert e1["last"] == e0["last"]
    assert all(x1 > x0 for x1, x0 in zip(e1["first"], e0["first"]))


def test_bloom_rows_have_the_embedding_layernorm():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "published_bloom.py"
    spec = importlib.util.spec_from_file_location("pb_bloom3", path)
    B = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(B)
    assert all(r["model"]["embed_norm"] for r in B.ROWS)
    assert [r["model"]["embed_norm"] for r in B.OOM_ROWS] == [
        r["model"]["dtype"] == "bfloat16" for r in B.OOM_ROWS]


def test_embed_norm_plan_and_dry_run_agree():
    """The planner's LayerNorm (params, saved input, kernels) is the model's: the dry run
    of the same layout, which runs the GPT itself on the modeled clock, agrees."""
    from workbench.plan import Cluster, Layout
    from workbench.plan.agree import MEMORY_RTOL, STEP_RTOL, compare
    from workbench.plan.presets import get_config as preset
    cfg = preset("gpt-22b", n_layer=4).replace(dtype="bfloat16", dropout=0.1,
                                               embed_norm=True)
    lay = Layout(dp=2, pp=2, tp=2, micro_batch=1, global_batch=8, recompute="full")
    a = compare(cfg, lay, Cluster("a100", lay.world))
    assert a.agrees, a.problems()
    assert abs(a.step_ratio - 1) <= STEP_RTOL
    for r in a.stage_ratios + a.activation_ratios:
        assert r == pytest.approx(1, abs=MEMORY_RTOL / 5)
