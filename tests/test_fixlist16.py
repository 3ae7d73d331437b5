"""Defects fixed by helper fixlist16: the tied head's gradient under sequence parallelism
with one pipeline stage; MoE with expert parallelism under wb.compile; a read only some
torchrun processes make."""
import pytest
import torch

import workbench as wb
from tests.test_fixlist13 import assert_one_devices_step, one_adamw_step
from tests.test_fixlist14 import assert_compiled_as_eager


# ---- 1. the TIED head's tp-partial gradient under SP with ONE pipeline stage -----------------

@pytest.mark.parametrize("m,dp", [(1, 1), (2, 1), (2, 2)])
def test_one_stage_sp_sums_the_tied_embeddings_gradient_with_the_norms(m, dp):
    """gpt-tiny (tied embeddings; vocabulary 75, which tp 2 does not divide: the word
    embedding is replicated over tp, and the head reads it after the final norm's sequence
    shards), Hybrid(tp=2, sp=True) with one pipeline stage. Was: the tied weight's partial
    gradient (19,200 B) all-reduced over tp by autograd's replica sum, apart from the norms'
    once-per-step all-reduce (fixlist15 joined only the untied head). Megatron-LM sums sequence-parallel gradients once per step
    (finalize_model_grads). Now one all-reduce per step and tp group holding the embedding
    and the norms; its gradient one device's, and so the parameters after the step."""
    from workbench.models.config import get_config
    from workbench.recipes.hybrid import Hybrid
    cfg = get_config("gpt-tiny")
    ref, x, y = one_adamw_step(cfg, 8)
    torch.manual_seed(0)
    want = build_ref_grad(cfg, x, y)
    s = Hybrid(dp=dp, tp=2, sp=True, microbatches=m)
    s.check(cfg, 8)
    model = s.build_model(cfg, 0)
    opts = s.build_optimizer(model, 1e-2, 0.1)
    with wb.trace("a100") as tr:
        s.forward_backward(model, x, y)
        opts[0].finish_gradient_synchronization()        # what step() does first
    grads = [(e.label, e.args["buffer_bytes"], tuple(e.ranks)) for e in tr.events
             if e.name == "all_reduce" and e.label in (
                 "sequence-parallel norm grads", "grad of a replicated input P(sum)->R on tp")]
    emb = cfg.vocab_size * cfg.d_model * 4
    norms = (2 * cfg.n_layer + 1) * 2 * cfg.d_model * 4     # LayerNorms: weight and bias
    tp_groups = [(0, 1), (2, 3)][:dp]
    assert grads == [("sequence-parallel norm grads", emb + norms, g) for g in tp_groups], grads
    w = model.tok_emb.weight
    assert model.lm_head.weight is w                           # still tied
    torch.testing.assert_close(w.grad.full(), want, rtol=1e-5, atol=1e-7)
    s.optimizer_step(opts)
    assert_one_devices_step(ref, model)
    torch.testing.assert_close(w.full(), ref.tok_emb.weight.detach(), rtol=2e-5, atol=5e-6)


def build_ref_grad(cfg, x, y):
    """The tied weight's gradient on one device (the model of one_adamw_step, before it)."""
    from workbench.models.config import build_model
    ref = build_model(cfg, seed=0).train()
    ref(x, y)[1].backward()
    return ref.tok_emb.weight.grad



# ---- 2. MoE with expert parallelism under wb.compile -------------------------------------

@pytest.mark.parametrize("level", ["O0", "O2"])
def test_tiny_moe_with_ep_compiles_and_runs_as_eager(level):
    """tiny with moe_experts=4, moe_topk=2, its experts over ep 2 of dp 2 (ExpertParallel
    dispatchers, as tests/test_audit_moe2.py wires them). Was: capture ran the dispatcher on
    plain meta tensors, which it refuses, so the whole program ran eagerly (one break,
    test_fixlist15). Now the dispatcher is one op of the table (``expert_parallel``, its
    exchanges and clock its own) and the program compiles by tracing: loss and every
    gradient eager's (O0 bit for bit; O2 within fixlist14's MoE tolerance, measured 0 and
    3.7e-9), the same EP all-to-alls on the trace, the same last_stats."""
    import collections
    from workbench.models import build_model, get_config
    from workbench.models.moe import moe_layers
    from workbench.parallel.strategies.expert_parallel import expert_mesh, expert_parallel
    mesh = wb.Mesh.grid((2,), ("dp",))
    cfg = get_config("tiny", moe_experts=4, moe_topk=2)
    g = torch.Generator().manual_seed(0)
    ids, targets = (torch.randint(0, cfg.vocab_size, (4, 32), generator=g) for _ in range(2))
    xi, yi = (wb.shard_tensor(t, mesh, [wb.Shard(0)]) for t in (ids, targets))

    def moe():
        m = build_model(cfg, seed=0)
        em = expert_mesh(mesh, 2)
        for layer in moe_layers(m):
            layer.token_dispatcher = expert_parallel(layer.experts, em)
        return wb.parallelize(m, mesh, {})
    eager, m = moe(), moe()
    prog = wb.compile(m, xi, yi, level=level, profile="a100")
    assert not prog.breaks, prog.breaks
    assert [n.op for n in prog.graph.nodes].count("expert_parallel") == cfg.n_layer
    assert any("priced on the trace as they run" in n for n in prog.graph.notes)
    with wb.trace("a100") as te:
        _, want = eager(xi, yi)
        want.backward()
    with wb.trace("a100") as tc:
        _, loss = prog(xi, yi)
        loss.backward()
    assert_compiled_as_eager(level, loss, want, m, eager)

    def ep(tr):
        return collections.Counter((e.name, e.label, e.args.get("buffer_bytes")) for e in
                                   tr.events if e.label.startswith("EP "))
    assert ep(tc) == ep(te) and len(ep(te)) >= 5
    for a, b in zip(moe_layers(m), moe_layers(eager)):
        sa, sb = a.last_stats, b.last_stats
        assert torch.equal(sa.pop("tokens_per_expert"), sb.pop("tokens_per_expert"))
        assert sa == sb

# ---- 3. a read only some processes make (torchrun): an error naming the fix, never a hang ---

@pytest.mark.slow
def test_a_read_on_rank_0_only_ends_in_an_error_naming_the_fix_and_the_job_goes_on(
        tmp_path_factory):
    """tests/dist_scripts/fixlist16_check.py (init timeout_s=5; in one launch with
    test_readsync's check, torchrun_support.LONE_READS), DDP over
    tp 2 on 2 gloo processes. Was: rank 0's lone ``p.norm()`` (the logging habit ``if rank
    == 0: print(p.norm())``) waited in the tp gather until gloo's timeout, then the job
    died ('Application timeout caused pair closure'); two processes reading two
    parameters of one shard shape (0.weight, 2.weight: 3 x 3 each) paired their gathers
    and both got 1.1638 (one device: 1.2387 and 1.0687), silently. torch keeps
    ``DTensor.norm()`` local (a Partial DTensor) and hangs as we did on its value's read
    (``.item()``); here the read is the value, so each process first agrees to make it
    (workbench/sim_mesh/agreed_reads.py): the lone reader gets an error naming the fix
    after timeout_s, with no gather begun, and the job goes on; different reads raise at
    once on both. ``wb.fully_shard``'s reads under torchrun (the chunks gathered) the
    same."""
    from tests.torchrun_support import lone_reads
    rows = lone_reads(tmp_path_factory, "fixlist16_check.py")
    lone = rows[(0, "lone")]
    assert "process(es) [1] did not make this read within init()'s timeout_s=5 s" in lone["out"]
    assert "'0.weight' (6, 3)" in lone["out"] and "if rank == 0: print(p.norm())" in lone["out"]
    assert 4.5 <= lone["s"] < 60
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(3, 6), torch.nn.GELU(), torch.nn.Linear(6, 3))
    want = [float(p.detach().norm()) for p in ref.parameters()]
    for rank in (0, 1):
        assert rows[(rank, "step")]["out"] == pytest.approx(want, rel=1e-6)
        assert rows[(rank, "after")]["out"] == pytest.approx(want[0], rel=1e-6)
        mixed = rows[(rank, "mixed")]["out"]
        assert isinstance(mixed, str) and f"process {1 - rank} made another read" in mixed
        assert rows[(rank, "fs_both")]["out"] == pytest.approx(want, rel=1e-6)
    fs = rows[(0, "fs_lone")]
    assert "of shape (6, 3)" in fs["out"] and "process(es) [1] did not make" in fs["out"]
    assert 4.5 <= fs["s"] < 60
