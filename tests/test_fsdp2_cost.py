"""FSDP2's copy kernels and SDPA's attention kernel in the planner (``plan.fsdp2_cost``):
each copy's bytes by hand, its seconds at the profile's memory rate, where the estimate
puts them (compute stream, or in series with a collective), the FlashAttention-2 switch
for ``framework="fsdp"``, and the other frameworks untouched."""
import dataclasses

import pytest

import workbench.plan as P
from workbench.models.config import get_config
from workbench.plan import fsdp2_cost as FS
from workbench.plan.zero_cost import Block
from workbench.sim_mesh.profiles import get_profile

H100 = get_profile("h100")
RATE = 3.35e12 * 0.901          # h100.json: memory_bandwidth x memory_efficiency
LAUNCH = 1e-6                   # h100.json: launch_overhead
CFG = get_config("llama3-8b", n_layer=4, seq_len=2048)
# each kernel's GB/s on the H100 over the plain copy's 2,998 (benchmarks/fsdp2_copies_h100.json)
SHARE = {"all_gather_cast": 2271 / 2998, "all_gather_copy_in": 1880 / 2998,
         "all_gather_copy_out": 2708 / 2998, "reduce_scatter_copy_in": 1836 / 2998,
         "grad_accumulate": 2940 / 2998}


def t(nbytes, kernel):
    """A copy kernel's seconds by hand: bytes at its share of the memory rate + launch."""
    return nbytes / (RATE * SHARE[kernel]) + LAUNCH


def test_copy_bytes_by_hand():
    """8,000 parameters in 8 shards of 1,000: copy-in casts the fp32 shard to bf16 (4 + 2
    bytes) and copies it into the gather buffer (2 + 2); copy-out splits the gathered
    bf16 buffer (2 + 2 per unsharded element); the reduce-scatter copy-in chunk-cats
    bf16 gradients into fp32 (2 + 4); the accumulation reads two fp32 shards and writes
    one (4 + 4 + 4)."""
    got = FS.unit_copy_bytes(8000, 8)
    assert got == {"all_gather_cast": 1000 * 6, "all_gather_copy_in": 1000 * 4,
                   "all_gather_copy_out": 8000 * 4,
                   "reduce_scatter_copy_in": 8000 * 6,
                   "grad_accumulate": 1000 * 12}
    for kw, match in ((dict(numel=-1, shards=8), "numel=-1"),
                      (dict(numel=10, shards=0), "shards=0"),
                      (dict(numel=10, shards=2.0), "shards=2.0")):
        with pytest.raises(ValueError, match=match):
            FS.unit_copy_bytes(**kw)


def test_copy_seconds_at_the_measured_share_of_the_memory_rate():
    """The H100 profile's memory rate is its plain copy's (0.901 x 3.35 TB/s = 3,018
    GB/s; 2,998 measured again beside the kernels): each kernel at the share of it
    measured, e.g. the chunk-cat's 1,836 GB/s."""
    for k in SHARE:
        assert FS.copy_seconds(3e9, H100, k) == pytest.approx(t(3e9, k), rel=1e-12)
    assert 3e9 / (FS.copy_seconds(3e9, H100, "reduce_scatter_copy_in") - LAUNCH) == \
        pytest.approx(1836e9 * RATE / 2998e9, rel=1e-12)
    assert FS.copy_seconds(0.0, H100, "grad_accumulate") == 0.0
    with pytest.raises(ValueError, match="kernel='memcpy'"):
        FS.copy_seconds(1.0, H100, "memcpy")


def test_stage_copies_by_hand():
    """Embedding, two blocks, head (root = embedding + head), 4 shards, 4 micro-batches:
    forward copies out every unit; backward copies out the first block only (the root
    and the last block stay gathered) and chunk-cats every unit's gradients."""
    blocks = [Block(100.0, 1.0, 2.0), Block(800.0, 3.0, 6.0), Block(800.0, 3.0, 6.0),
              Block(200.0, 0.5, 1.0)]
    got = FS.stage_copies(blocks, 2, True, True, 4, 4, H100)
    o = [t(4 * n, "all_gather_copy_out") for n in (100, 800, 800, 200)]      # copy-out
    c = [t(6 * n, "reduce_scatter_copy_in") for n in (100, 800, 800, 200)]   # chunk-cat
    assert got["forward"] == pytest.approx(sum(o), rel=1e-12)
    assert got["backward"] == pytest.approx(o[1] + sum(c), rel=1e-12)
    assert [b.fwd for b in got["blocks"]] == pytest.approx(
        [1.0 + o[0], 3.0 + o[1], 3.0 + o[2], 0.5 + o[3]], rel=1e-12)
    assert [b.bwd for b in got["blocks"]] == pytest.approx(
        [2.0 + c[0], 6.0 + o[1] + c[1], 6.0 + c[2], 1.0 + c[3]], rel=1e-12)
    assert [b.numel for b in got["blocks"]] == [100.0, 800.0, 800.0, 200.0]
    # side streams: copy-in before a gather of n, accumulation after a reduce of n on
    # 3 of the 4 micro-batches
    assert got["gather_extra"](800) == pytest.approx(
        t(200 * 6, "all_gather_cast") + t(200 * 4, "all_gather_copy_in"), rel=1e-12)
    assert got["reduce_extra"](800) == pytest.approx(0.75 * t(200 * 12, "grad_accumulate"),
                                                     rel=1e-12)
    assert got["stay"] == (0, 2, 3)
    assert got["bytes"] == pytest.approx({
        "all_gather_cast": 6 * (1900 + 800) / 4, "all_gather_copy_in": 4 * (1900 + 800) / 4,
        "all_gather_copy_out": 4 * 2700,
        "reduce_scatter_copy_in": 6 * 1900, "grad_accumulate": 0.75 * 12 * 1900 / 4})
    with pytest.raises(ValueError, match="4 blocks for 3 layers"):
        FS.stage_copies(blocks, 3, True, True, 4, 4, H100)


def test_blocks_that_stay_gathered_are_not_gathered_for_backward():
    """``zero_exposed(..., stay=...)`` by hand, no compute to hide behind (a collective
    of n elements n / 2 seconds): forward gathers 2 + 4 + 6 elements; backward
    gathers only block 1 (blocks 0 and 2 stay) and reduce-scatters all three."""
    from workbench.plan.zero_cost import zero_exposed
    blocks = [Block(2.0, 0.0, 0.0), Block(4.0, 0.0, 0.0), Block(6.0, 0.0, 0.0)]
    half = lambda n: n / 2        # noqa: E731
    assert zero_exposed(blocks, 3, half, half, prefetch_numel=1) == (6.0, 12.0)
    assert zero_exposed(blocks, 3, half, half, prefetch_numel=1, stay=(0, 2)) == (6.0, 8.0)


def _est(framework="fsdp", profile="h100", **kw):
    zero = 3 if framework in ("fsdp", "deepspeed") else 1
    lay = P.Layout(dp=8, zero=zero, framework=framework, micro_batch=1, global_batch=16,
                   **kw)
    return P.estimate(CFG, lay, P.Cluster(profile, 8))


def test_copies_on_the_compute_stream_of_every_micro_batch(monkeypatch):
    """The estimate's compute is larger by exactly m x the compute-stream copies, and
    its DP sync, with no overlap, by exactly m x the side-stream copies in series with
    each gather (forward: every unit; backward: the blocks but the last, the root and
    the last block staying gathered) and each reduce-scatter."""
    from workbench.plan import memory as M
    est = _est()
    lay, m = est.layout, est.layout.m
    c = est.details["fsdp2_copies"]
    zero = {k: 0.0 for k in FS.unit_copy_bytes(1, 1)}
    monkeypatch.setattr(FS, "unit_copy_bytes", lambda n, s: dict(zero))
    bare = P.estimate(CFG, lay, P.Cluster("h100", 8))
    assert est.breakdown["compute"] - bare.breakdown["compute"] == pytest.approx(
        m * (c["forward"] + c["backward"]), rel=1e-9)
    monkeypatch.undo()
    # the forward copy-out by hand: every unit's parameters, 4 bytes each
    h, V = CFG.d_model, CFG.vocab_size
    units = [V * h] + [M.layer_params(CFG, 1)] * CFG.n_layer + [h + V * h]
    assert c["forward"] == pytest.approx(sum(t(4 * n, "all_gather_copy_out") for n in units),
                                         rel=1e-12)
    assert c["bytes"]["all_gather_copy_out"] == pytest.approx(
        4 * (sum(units) + (CFG.n_layer - 1) * units[1]), rel=1e-12)
    # without overlap the side copies add in full to the exposed collectives
    on = P.estimate(CFG, lay, P.Cluster("h100", 8), overlap=False)
    monkeypatch.setattr(FS, "unit_copy_bytes", lambda n, s: dict(zero))
    off = P.estimate(CFG, lay, P.Cluster("h100", 8), overlap=False)
    monkeypatch.undo()

    def gather(n):               # the cast and the copy-in of a shard of n / 8
        return t(6 * n / 8, "all_gather_cast") + t(4 * n / 8, "all_gather_copy_in")
    again = units[1:-2]          # the blocks but the last: the root and it stay gathered
    # the root's parameters (embedding, final norm, head) one group: one gather, one
    # reduce-scatter and their side copies (plan.fsdp2_root)
    groups = [units[0] + units[-1]] + units[1:-1]
    side = sum(gather(n) + (m - 1) / m * t(12 * n / 8, "grad_accumulate") for n in groups) \
        + sum(gather(n) for n in again)
    assert on.details["dp_sync"] - off.details["dp_sync"] == pytest.approx(m * side,
                                                                           rel=1e-9)
    assert any("FSDP2's copy kernels" in a for a in est.assumptions())


def test_fsdp_attention_is_flash_attention_2_on_the_h100():
    """SDPA's priority runs FlashAttention-2 on an H100 in the 2024-2025 releases: an
    FSDP layout's layer is priced at the measured FlashAttention-2 rates (as a DeepSpeed
    layout on the profile switched to them), slower than cuDNN's; the assumption is
    stated; a profile without measured attention (the A100) is left as it is."""
    fsdp, ds = _est("fsdp"), _est("deepspeed")
    flash = dataclasses.replace(H100, measured={**H100.measured, "attention_backend": "flash"})
    ds_flash = P.estimate(CFG, ds.layout, P.Cluster(flash, 8))
    assert fsdp.details["layer"] == ds_flash.details["layer"]
    assert fsdp.details["layer"].fwd_compute > ds.details["layer"].fwd_compute
    assert fsdp.details["layer"].bwd_compute > ds.details["layer"].bwd_compute
    said = " ".join(fsdp.assumptions())
    assert "FlashAttention-2 at the rates measured" in said and "2.5.1-2.8" in said
    assert "cuDNN's fused attention" in " ".join(ds.assumptions())
    assert FS.sdpa_profile(H100).measured["attention_backend"] == "flash"
    assert FS.sdpa_profile(H100).name == "h100"
    a100 = get_profile("a100")
    assert FS.sdpa_profile(a100) is a100
    assert "priority_order" not in " ".join(_est("fsdp", "a100").assumptions())


def test_fsdp_range_spans_flash_to_cudnn():
    """``estimate_range``: the point and the slow end run FlashAttention-2, the fast end
    cuDNN's kernel (the releases that put it first); NCCL's HBM traffic, the other bounded
    figure, pinned at the point's 0 (tests/test_i21c11.py holds it)."""
    r = P.estimate_range(CFG, _est().layout, P.Cluster("h100", 8),
                         pinned={"topology.collective_hbm_factor": 0.0})
    assert r.slow.step_time == pytest.approx(r.estimate.step_time, rel=1e-12)
    assert r.fast.step_time < r.estimate.step_time
    assert r.fast.details["layer"] == _est("deepspeed").details["layer"]


def test_other_frameworks_never_reach_the_fsdp_model(monkeypatch):
    """Megatron-LM and DeepSpeed estimates do not call the FSDP2 model (their numbers
    are as before), and say nothing of it."""
    def boom(*a, **k):
        raise AssertionError("FSDP2 model called")
    before = {fw: _est(fw) for fw in ("megatron", "deepspeed")}
    monkeypatch.setattr(FS, "stage_copies", boom)
    monkeypatch.setattr(FS, "sdpa_profile", boom)
    for fw, est in before.items():
        again = _est(fw)
        assert again.step_time == est.step_time and again.breakdown == est.breakdown
        assert est.details["fsdp2_copies"] is None
        assert not any("FSDP2" in a or "priority_order" in a for a in est.assumptions())
    with pytest.raises(AssertionError, match="FSDP2 model called"):
        _est("fsdp")
