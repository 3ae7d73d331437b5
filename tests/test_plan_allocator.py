"""PyTorch's caching allocator (plan.allocator) held to its source's arithmetic
(pytorch/pytorch v1.11.0 c10/cuda/CUDACachingAllocator.cpp: round_size,
get_allocation_size, malloc's cache-then-new-segment order) and the reserved memory the
estimate reports for DeepSpeed's BF16_Optimizer pipelines (its bf16 gradient copy at the
DP sync, DeepSpeed 56c522386 engine.py allreduce_bucket)."""
import pytest

import workbench as wb
from workbench.plan import allocator as AL
from workbench.plan import bf16_optimizer as BF
from workbench.plan.memory import stage_params

MiB = 2 ** 20


def test_block_and_segment_sizes_are_torch_1_11s():
    # round_size: multiples of kMinBlockSize = 512 B, at least one
    assert AL.round_size(0) == 512 and AL.round_size(1) == 512
    assert AL.round_size(512) == 512 and AL.round_size(513) == 1024
    # get_allocation_size: <= kSmallSize (1 MiB) -> kSmallBuffer 2 MiB; < kMinLargeAlloc
    # (10 MiB) -> kLargeBuffer 20 MiB; else rounded up to kRoundLarge 2 MiB
    assert AL.segment_bytes(1) == 2 * MiB and AL.segment_bytes(MiB) == 2 * MiB
    assert AL.segment_bytes(MiB + 1) == 20 * MiB
    assert AL.segment_bytes(10 * MiB - 512) == 20 * MiB
    assert AL.segment_bytes(10 * MiB) == 10 * MiB
    assert AL.segment_bytes(10 * MiB + 1) == 12 * MiB
    assert AL.segment_bytes(8e9) == -(-8e9 // (2 * MiB)) * 2 * MiB


def test_a_cached_block_serves_what_fits_in_it():
    # get_free_block: the smallest cached block >= the (rounded) request: no new segment
    assert AL.new_segment_bytes(100 * MiB, 100 * MiB) == 0
    assert AL.new_segment_bytes(100 * MiB, 200 * MiB) == 0
    # larger than every cached block: cudaMalloc a segment of its own (alloc_block)
    assert AL.new_segment_bytes(100 * MiB + 1, 100 * MiB) == 102 * MiB


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), True, "8e9", None])
def test_bad_sizes_raise_naming_the_value(bad):
    with pytest.raises(ValueError, match="nbytes"):
        AL.segment_bytes(bad)


def _small(dtype="bfloat16", **kw):
    cfg = wb.models.get_config("gpt3-175b", n_layer=8, d_model=1024, n_head=8, seq_len=512,
                               dtype=dtype, vocab_size=8192)
    lay = wb.plan.Layout(**{**dict(dp=2, tp=2, pp=4, zero=1, recompute="full",
                                   global_batch=16, framework="deepspeed"), **kw})
    return cfg, lay


def test_bf16_optimizer_sync_copy_is_a_segment_of_its_own():
    """A middle stage of a bf16 DeepSpeed pipeline: the bf16 copy of the fp32 gradients
    (2 psi, one tensor) exceeds the largest block freed before it (4 x the largest
    parameter, a layer's activations): the reserved memory grows by its segment."""
    cfg, lay = _small()
    psi = stage_params(cfg, 2, 4, 1, 2)
    largest = 4 * (1024 * 4096 / 2)                  # 4 B x the MLP's h x 4h / t
    assert BF.largest_numel(cfg, 2, 4, 1, 2) * 4 == largest
    assert 2 * psi > AL.largest_freed_bytes(cfg, lay, 1, 2) >= largest
    want = -(-2 * psi // (2 * MiB)) * 2 * MiB
    assert AL.cached_bytes(cfg, lay, 1, psi, 2) == want
    # no BF16_Optimizer: fp16 (DeepSpeed's own ZeRO / FP16 optimizer), Megatron-LM, no
    # pipe: not modelled (None), not "nothing cached"
    for c, l in (_small("float16"), _small(framework="megatron"),
                 _small(pp=1, global_batch=4)):
        assert AL.cached_bytes(c, l, 0, psi, 2) is None
    with pytest.raises(ValueError, match="psi"):
        AL.cached_bytes(cfg, lay, 1, -1.0, 2)


def test_estimate_reports_reserved_memory_and_judges_fits_on_the_live_peak():
    cfg, lay = _small()
    cl = wb.plan.Cluster("a100", lay.world)
    est = wb.plan.estimate(cfg, lay, cl)
    busy = est.details["stages"][{0: "first", 3: "last"}.get(
        est.details["busiest_stage"], "middle")]
    cache = busy["allocator_cache"]
    psi = stage_params(cfg, 2, 4, est.details["busiest_stage"],
                       lay.stage_layers(cfg.n_layer)[est.details["busiest_stage"]])
    assert cache == -(-2 * psi // (2 * MiB)) * 2 * MiB
    # the busiest stage's reserved peak: at least its live peak, at most live + the segment
    # (the sync copy counted once: tests/test_review_revQ.py)
    assert est.details["reserved_memory"] == busy["reserved_memory"]
    assert est.memory["total"] <= est.details["reserved_memory"] <= est.memory["total"] + cache
    assert est.fits == (est.memory["total"] <= cl.profile.usable_memory())
    assert any("caching allocator" in a for a in est.assumptions())
    assert f"reserved {est.details['reserved_memory'] / 1e9:.1f} GB" in est.explain()
    # the live keys are unchanged: the cache is no part of total
    assert est.memory["total"] == pytest.approx(
        sum(v for k, v in est.memory.items() if k != "total"))
    # a Megatron layout: the allocator is not modelled, so no reserved memory is claimed
    meg = wb.plan.estimate(cfg, lay.replace(framework="megatron"), cl)
    assert meg.details["reserved_memory"] is None
    assert not any("caching allocator" in a for a in meg.assumptions())
    assert "reserved" not in meg.explain()
