"""Review revQ of the merges after dde142e (z3scale, bloommem, gemmrate, nbr0506, nbr0813,
nbr1416): regression tests, each failed before its fix."""
import pytest
import torch

import workbench as wb
from workbench.plan import allocator as AL
from workbench.plan import bf16_optimizer as BF
from workbench.plan.ep_cp import token_cfg
from workbench.plan.memory import stage_params, workspace_bytes

MiB = 2 ** 20


def _pipe(recompute):
    cfg = wb.models.get_config("gpt3-175b", n_layer=8, d_model=1024, n_head=8, seq_len=512,
                               dtype="bfloat16", vocab_size=8192)
    lay = wb.plan.Layout(dp=2, tp=2, pp=4, zero=1, recompute=recompute, global_batch=16,
                         framework="deepspeed")
    return cfg, lay, wb.plan.estimate(cfg, lay, wb.plan.Cluster("a100", lay.world))


@pytest.mark.parametrize("recompute", ["full", "none"])
def test_reserved_memory_counts_the_sync_copy_once(recompute):
    """BF16_Optimizer's bf16 copy of the fp32 gradients (2 psi) lives in the segment the
    caching allocator adds at the DP sync.  Where that copy sets a stage's live peak
    (few activations in flight: memory's workspace is ``sync - activations``), the live
    peak already holds it: the reserved peak is the pipeline phase's live peak (its
    segments stay cached) plus the new segment, not the live peak plus the segment.
    Before: details["reserved_memory"] was memory["total"] + allocator_cache, the copy
    counted twice (2.5777 GB where the pipeline phase + segment is 2.5724 GB here)."""
    cfg, lay, est = _pipe(recompute)
    for d in est.details["stages"].values():
        s, mem = d["stage"], d["memory"]
        layers = lay.stage_layers(cfg.n_layer)[s]
        psi = stage_params(cfg, lay.tp, lay.pp, s, layers)
        sync = 2 * psi                                         # the bf16 copy, one block
        segment = -(-sync // (2 * MiB)) * 2 * MiB              # kRoundLarge
        assert d["allocator_cache"] == segment
        # the pipeline phase: every live term but the sync copy (the loss's or a
        # recompute's workspace, update_hp_grads' fp32 cast of the largest parameter
        # beside the engine's restored output and gradients: ds12's backward_held_bytes)
        from workbench.plan.deepspeed_pipe_memory import backward_held_bytes
        pipe_ws = max(workspace_bytes(token_cfg(cfg, lay), lay, s, "materialized"),
                      4 * BF.largest_numel(cfg, lay.tp, lay.pp, s, layers)
                      + backward_held_bytes(token_cfg(cfg, lay), lay, s)["update"])
        pipeline = mem["total"] - mem["workspace"] + pipe_ws
        # ds12: what the engine's buffers still hold after the pipeline stays beside it
        from workbench.plan.deepspeed_pipe_memory import after_pipeline_bytes
        after = after_pipeline_bytes(token_cfg(cfg, lay), lay, s)
        sync_sets_peak = mem["workspace"] == pytest.approx(sync + after - mem["activations"])
        assert d["reserved_memory"] == pytest.approx(max(mem["total"], pipeline + segment))
        if sync_sets_peak:
            assert d["reserved_memory"] < mem["total"] + segment
        else:
            assert d["reserved_memory"] == pytest.approx(mem["total"] + segment)
    busy = next(d for d in est.details["stages"].values()
                if d["stage"] == est.details["busiest_stage"])
    assert est.details["reserved_memory"] == busy["reserved_memory"]
    if recompute == "full":          # the case that was wrong: the sync sets stage 0's peak
        # (stage 0, which was the busiest until ds12 counted the fp32 logits DeepSpeed's
        # last stage keeps in its output buffers: deepspeed_pipe_memory)
        first = est.details["stages"]["first"]
        m = first["memory"]
        after = after_pipeline_bytes(token_cfg(cfg, lay), lay, 0)
        assert m["workspace"] == pytest.approx(2 * first["psi"] + after - m["activations"])
        assert first["reserved_memory"] < m["total"] + first["allocator_cache"]
    # fits stays on the live peak
    assert est.fits == (est.memory["total"] <= wb.plan.Cluster("a100", 16).profile
                        .usable_memory())


def test_a_bool_mask_is_no_list_of_ranks():
    """check_load_reads took each element with operator.index, which reads a torch bool
    as 0 or 1: a WRONG mask of saved ranks (rank 0 of 4 loaded reads saved ranks 0 and 1;
    this mask marks 0 and 2) became ranks {0, 1} and printed "Correct".  Its docstring
    and check_tp_group's refuse bools; a bool array or tensor is refused alike now."""
    from workbench.exercises.checks import check_tp_group
    from workbench.exercises.checks_serve import check_load_reads
    from workbench.exercises.feedback import CheckError
    np = pytest.importorskip("numpy")
    wrong = [True, False, True, False, False, False, False, False]
    for mask in (torch.tensor(wrong), np.array(wrong)):
        with pytest.raises(CheckError, match="rank numbers"):
            check_load_reads(mask, rank=0, loaded=4)
    with pytest.raises(CheckError, match="ints"):
        check_tp_group(torch.tensor([True] * 4), rank=1)
    # integers of any kind still pass (the right answer: saved ranks 0 and 1)
    for ok in ([0, 1], np.array([0, 1]), torch.tensor([0, 1]), range(2)):
        check_load_reads(ok, rank=0, loaded=4)
    check_tp_group(torch.arange(4, 8))
