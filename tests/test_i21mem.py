"""Issue 21 (i21mem): full recompute in chunks of k layers (``Layout.recompute_num_layers``,
``plan.recompute_chunks``) held to Megatron-LM's / DeepSpeed's chunking and to PyTorch's
reentrant checkpoint measured on the CPU; the 530B ZeRO-3 memory terms against their
DeepSpeed v0.3.13 source figures."""
import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils.checkpoint import checkpoint

import workbench as wb
from workbench.plan import Layout
from workbench.plan import recompute_chunks as RC
from workbench.plan import zero3_2021 as Z
from workbench.plan.memory import layer_activation_bytes, stage_memory, workspace_bytes
from tests.test_zero3_2021 import _gpt, _trace


def _cfg(layers=5, h=256):
    return wb.models.ModelConfig(arch="gpt", vocab_size=512, seq_len=128, tie_embeddings=True,
                                 dropout=0.1, d_model=h, n_layer=layers, n_head=4,
                                 dtype="bfloat16")


# -- the Layout field --------------------------------------------------------------

@pytest.mark.parametrize("kw, words", [
    (dict(recompute="full", recompute_num_layers=0), "int >= 1"),
    (dict(recompute="full", recompute_num_layers=True), "int >= 1"),
    (dict(recompute="full", recompute_num_layers=2.0), "int >= 1"),
    (dict(recompute="selective", recompute_num_layers=2), "recompute='full'"),
    (dict(recompute="none", recompute_num_layers=2), "recompute='full'"),
    (dict(recompute="full", recompute_num_layers=2, framework="workbench"), "one block each"),
    (dict(recompute="full", recompute_num_layers=2, zero=3, framework="fsdp"),
     "TransformerBlock"),
])
def test_layout_refuses_what_no_framework_runs(kw, words):
    with pytest.raises(ValueError, match="recompute_num_layers") as e:
        Layout(**kw)
    assert words in str(e.value)


def test_layout_string_and_chunk_bound():
    assert "chunk" not in Layout(recompute="full").short()
    lay = Layout(dp=2, recompute="full", recompute_num_layers=2)
    assert lay.short().endswith("rc:full chunk2")
    cl = wb.plan.Cluster("a100", 4)
    # Megatron-LM: "between 1 and num_layers_per_pipeline_rank" (5 layers, pp 2: 2)
    cfg = _cfg(layers=4)
    bad = Layout(dp=2, pp=2, recompute="full", recompute_num_layers=3)
    with pytest.raises(ValueError, match="recompute_num_layers=3 exceeds the 2 layers"):
        wb.plan.estimate(cfg, bad, cl)
    wb.plan.estimate(cfg, bad.replace(recompute_num_layers=2), cl)


def test_chunks_as_megatron_steps_them():
    # transformer_block.py uniform: custom(l, min(l + k, n)), l += k
    assert RC.chunk_sizes(105, 2) == [2] * 52 + [1]
    assert RC.chunk_sizes(8, 3) == [3, 3, 2]
    assert RC.saved_inputs(105, 1, 2) == 53      # initialize.py:105-106 num_checkpoints
    assert RC.saved_inputs(8, 2, 3) == 4         # two model chunks of 4 layers: 2 + 2
    assert RC.largest_chunk(8, 2, 3) == 3 and RC.largest_chunk(1, 1, 2) == 1


# -- memory ------------------------------------------------------------------------

@pytest.mark.parametrize("layers, k", [(5, 2), (6, 3), (4, 4)])
def test_memory_keeps_one_input_per_chunk_and_a_chunk_live(layers, k):
    cfg = _cfg(layers)
    s, h, b = cfg.seq_len, cfg.d_model, 2
    one = Layout(dp=1, recompute="full", micro_batch=b, global_batch=b, framework="megatron")
    lay = one.replace(recompute_num_layers=k)
    m1, mk = stage_memory(cfg, one, 0), stage_memory(cfg, lay, 0)
    chunks = -(-layers // k)
    # saved: one 2 s b h input per chunk instead of per layer (Korthikanti's full recompute)
    assert m1["activations"] - mk["activations"] == pytest.approx(
        (layers - chunks) * 2 * s * b * h)
    # backward: the chunk's k layers re-run with autograd on, less its kept input
    none = layer_activation_bytes(cfg, b, 1, False, "none")
    loss = 2 * s * b * cfg.vocab_size            # Megatron's in-place loss, 2 B a logit
    # pp = 1: the head's saved tensors of the micro-batch (final-LN and head inputs, fp32
    # logits) are freed by its backward before the chunk re-runs (tests/test_i21mem3.py)
    head = 4 * s * b * h + 4 * s * b * cfg.vocab_size
    assert workspace_bytes(cfg, lay, 0) == pytest.approx(
        max(k * none - 2 * s * b * h - head, loss))
    assert mk["workspace"] - m1["workspace"] == pytest.approx((k - 1) * none)
    for key in ("params", "grads", "optimizer", "buffers"):
        assert mk[key] == m1[key]


def test_interleaved_chunks_per_model_chunk():
    # each virtual stage is its own TransformerBlock: 8 layers, pp 2, v 2 -> blocks of 2
    cfg = _cfg(layers=8)
    b = 1
    lay = Layout(dp=1, pp=2, recompute="full", micro_batch=b, global_batch=4,
                 schedule="interleaved_1f1b", v=2, framework="megatron")
    with pytest.raises(ValueError, match="exceeds the 2 layers"):
        wb.plan.estimate(cfg, lay.replace(recompute_num_layers=3), wb.plan.Cluster("a100", 2))
    m1 = stage_memory(cfg, lay, 0)
    m2 = stage_memory(cfg, lay.replace(recompute_num_layers=2), 0)
    held = wb.plan.memory.in_flight("interleaved_1f1b", 2, 4, 2, 0)
    assert m1["activations"] - m2["activations"] == pytest.approx(
        2 * 2 * cfg.seq_len * b * cfg.d_model * held)     # 4 saved inputs -> 2


class _Layer(torch.nn.Module):
    def __init__(self, h):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(h, 4 * h), torch.nn.Linear(4 * h, h)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def _measure(k, layers=4, n=64, h=32):
    """(bytes saved after the forward, peak bytes beyond that in the backward) of
    ``layers`` layers checkpointed in chunks of k with the reentrant checkpoint
    (Megatron-LM's and DeepSpeed's CheckpointFunction are reentrant)."""
    torch.manual_seed(0)
    mods = [_Layer(h) for _ in range(layers)]
    x0 = torch.randn(n, h, requires_grad=True)
    mt = MemTracker()
    mt.track_external(*mods, x0)

    def run(lo, hi):
        def f(x):
            for m in mods[lo:hi]:
                x = m(x)
            return x
        return f

    with mt:
        x = x0 * 1.0                    # the first chunk's input, not a leaf
        for lo in range(0, layers, k):
            x = checkpoint(run(lo, min(lo + k, layers)), x, use_reentrant=True)
        loss = x.sum()
        saved = mt.get_tracker_snapshot("current")
        after_fwd = sum(v.get("Activation", 0) for v in saved.values())
        loss.backward()
    peak = mt.get_tracker_snapshot("peak")
    return after_fwd, sum(v.get("Activation", 0) for v in peak.values())


def test_chunked_checkpoint_measured_on_cpu():
    # PyTorch's reentrant checkpoint, measured: the saved inputs fall to one per chunk;
    # the backward's peak grows by about one layer's activations (its input, fc1's
    # output, GeLU's output: the planner's "none" of this layer) per extra layer a chunk
    # re-runs at once.  The measured growth is 1.11-1.22x that: gradient temporaries,
    # which the planner leaves out (memory.workspace_bytes: "Not counted")
    n, h = 64, 32
    inp = n * h * 4                                   # one fp32 layer input
    none = inp * (1 + 4 + 4)
    saved, peak = {}, {}
    for k in (1, 2, 4):
        saved[k], peak[k] = _measure(k, n=n, h=h)
    assert saved[1] - saved[2] == 2 * inp             # 4 inputs -> 2
    assert saved[1] - saved[4] == 3 * inp             # 4 inputs -> 1
    for k in (2, 4):
        grown = (peak[k] - saved[k]) - (peak[1] - saved[1])
        assert 1.0 <= grown / ((k - 1) * none) <= 1.25


def test_dry_run_refuses_chunks():
    cfg = _cfg(layers=4)
    lay = Layout(dp=2, recompute="full", recompute_num_layers=2, micro_batch=1,
                 global_batch=2)
    with pytest.raises(ValueError, match="recompute_num_layers"):
        wb.plan.dry_run(cfg, lay, wb.plan.Cluster("a100", 2))


# -- ZeRO-3 2021's trace -----------------------------------------------------------

def test_trace_recomputes_a_chunk_then_runs_its_backwards():
    cfg = _gpt(4096, layers=5)
    tr1 = _trace(cfg)
    prof = wb.plan.Cluster("a100", 8).profile
    from workbench.plan import costs as C
    from workbench.plan.edge_cost import edge_times
    layer = C.layer_cost(cfg, 1, 1, False, "full", prof, "materialized", False)
    head = C.head_cost(cfg, 1, 1, False, prof)
    tr2 = Z.gpt_trace(cfg, layer, head, edge_times(cfg, 1, 1, False, prof), "full",
                      (1e-3, 3e-3), chunk=2)
    order = [(e.module.split(".")[0], e.phase) for e in tr2 if e.phase in "rb"
             and e.module[0].isdigit()]
    seq = []
    for k, ph in order:
        if not seq or seq[-1] != (k, ph):
            seq.append((k, ph))
    # chunks (0, 1), (2, 3), (4): the last first; recompute in forward order, then back
    assert seq == [("4", "r"), ("4", "b"), ("2", "r"), ("3", "r"), ("3", "b"), ("2", "b"),
                   ("0", "r"), ("1", "r"), ("1", "b"), ("0", "b")]
    # the same modules and compute as one layer a chunk; copies one per chunk
    assert sorted((e.module, e.phase) for e in tr1) == sorted((e.module, e.phase)
                                                              for e in tr2)
    assert sum(e.compute for e in tr2) == pytest.approx(sum(e.compute for e in tr1))
    assert sum(e.copies for e in tr2) == pytest.approx(3 * (1e-3 + 3e-3))


def test_chunk_breaks_the_reuse_of_the_first_layers_fc2():
    # at 530B (h 20,480): with one layer a chunk fc2's recompute is followed at once by
    # its backward (kept); in a chunk of two, layer 2j's fc2 waits for layer 2j+1's
    # recompute and backward (far above 1e9 elements): gathered again
    cfg = _gpt(20480, layers=2)
    prof = wb.plan.Cluster("a100", 8).profile
    from workbench.plan import costs as C
    from workbench.plan.edge_cost import edge_times
    layer = C.layer_cost(cfg, 1, 1, False, "full", prof, "materialized", False)
    head = C.head_cost(cfg, 1, 1, False, prof)
    edge = edge_times(cfg, 1, 1, False, prof)
    one = Z.simulate(Z.gpt_trace(cfg, layer, head, edge, "full"), 64,
                     lambda n: 1e-3, lambda n: 1e-3, 2e12)
    two = Z.simulate(Z.gpt_trace(cfg, layer, head, edge, "full", chunk=2), 64,
                     lambda n: 1e-3, lambda n: 1e-3, 2e12)
    assert two["gathers"] == one["gathers"] + 1


# -- the 530B ZeRO-3 memory audit (benchmarks/zero3_audit.py, memory section) ------

def _audit():
    from tests.test_i21z3530 import _audit_module
    return _audit_module()


def test_memory_audit_terms_against_their_sources():
    A = _audit()
    a = A.memory_audit("GPT 530B", 640)
    t = {k.split(":")[0].split(",")[0]: v for k, v in a["terms"].items()}
    h, f, V, s, b = 20480, 4 * 20480, 51200, 2048, 4
    inp = 2 * s * b * h
    # the planner's side is stage_memory's total, term for term
    assert a["planner"] == pytest.approx(a["total"], rel=1e-12)
    assert a["source"] == pytest.approx(sum(v[1] for v in a["terms"].values()), rel=1e-12)
    # stage3.py:2535-2546: two ipg buffers of reduce_bucket_size fp16 (overlap_comm)
    assert t["reduce bucket (ipg_buffer)"][1] == 2 * 2 * Z.REDUCE_BUCKET_NUMEL
    # the tied embedding held by the root + fc2 (f h) kept from its recompute
    assert t["gathered parameters"][1] == 2 * (V * h + f * h)
    # the previous chunk's qkv weight gradient (3 h^2), freed at fc2's hook (pp:848)
    assert t["the previous extra-large gradient"][1] == 2 * 3 * h * h
    assert t["the head's gradient of the tied embedding"][1] == 2 * V * h
    # initialize.py:105-106: the row's chunks of 1 layer (105 layers: chunks of 2 would
    # assert in v0.3.13, zero3_2021.check_chunks): 105 checkpoints, one layer re-run
    assert t["checkpointed chunk inputs (partition at mp 1 = whole)"][1] == 105 * inp
    cfg = wb.models.ModelConfig(arch="gpt", vocab_size=V, seq_len=s, tie_embeddings=True,
                                dropout=0.1, d_model=h, n_layer=105, n_head=128,
                                dtype="float16")
    none = layer_activation_bytes(cfg, b, 1, False, "none")
    assert t["the chunk's recomputed layers (k x none"][1] == pytest.approx(none - inp)
    assert t["head"][1] == 0.0
    # fc2's bias hook: the previous gradient freed, fc2's input released, c10d's flat
    # copy of fc2's gradient (a whole parameter) live
    assert a["alt"] == pytest.approx(a["source"] - 2 * 3 * h * h + 2 * f * h - 2 * s * b * f)
    # the source's peak fits the usable memory of the capacity CUDA reports (79.25 GiB,
    # a100.json); with the datasheet's 80e9 B it did not (75.22 GB usable)
    # and the planner counts it (zero3_2021.backward_peak_bytes; it counted 73.84 before)
    assert a["usable"] > max(a["source"], a["alt"]) == pytest.approx(a["planner"])
    assert max(a["source"], a["alt"]) > 80e9 * 0.95 - 0.78e9


def test_tied_embedding_gradient_waits_in_autograd_measured():
    # one leaf used by the embedding and the head: autograd holds the head's gradient
    # in the leaf's input buffer until the embedding's backward adds its own, so during
    # the layers' backward V x h more bytes are live than when the head's gradient is
    # reduced and freed as it lands (an untied head under ZeRO-3's hook)
    from tests.test_i21mem3 import _Live          # live bytes of a real autograd

    def live_in_layer_backward(tied, V=512, h=32, n=16):
        torch.manual_seed(0)
        emb = torch.nn.Parameter(torch.randn(V, h))
        head = emb if tied else torch.nn.Parameter(torch.randn(V, h))
        if not tied:
            head.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
        mid = torch.nn.Linear(h, h)
        idx = torch.randint(0, V, (n,))
        seen, mode = {}, _Live(external=set())

        def hook(g):
            seen["bytes"] = mode.live
            return g
        with mode:
            x = emb[idx]
            x.register_hook(hook)          # after the layer's backward
            loss = (mid(x) @ head.t()).logsumexp(-1).sum()
            loss.backward()
        return seen["bytes"]

    assert live_in_layer_backward(True) - live_in_layer_backward(False) == 512 * 32 * 4


def test_zero3_2021_memory_counts_the_sources_terms():
    """stage_memory for framework='deepspeed-0.3' is v0.3.13's backward peak term by term
    (zero3_2021.backward_peak_bytes): before, it counted today's DeepSpeed buffers
    (73.84 GB at 530B / 640 where the source holds 78.34; 41.7 and 24.7 at 1,120 and
    2,240 where fc2's bias hook holds 47.6 and 31.5)."""
    A = _audit()
    for devices in (640, 1120, 2240):
        a = A.memory_audit("GPT 530B", devices)
        assert a["total"] == pytest.approx(max(a["source"], a["alt"]), rel=1e-9)
    h, f, V, s = 20480, 4 * 20480, 51200, 2048
    cfg = wb.models.ModelConfig(arch="gpt", vocab_size=V, seq_len=s, tie_embeddings=True,
                                dropout=0.1, d_model=h, n_layer=105, n_head=128,
                                dtype="float16")
    lay = wb.plan.Layout(dp=640, zero=3, recompute="full", micro_batch=4,
                         global_batch=2560, framework="deepspeed-0.3",
                         recompute_num_layers=2)
    z = Z.backward_peak_bytes(cfg, lay, remat=1.0, head=2.0, loss=3.0)["terms"]
    assert z["reduce buckets"] == 2 * 2 * Z.REDUCE_BUCKET_NUMEL       # s3:2535-2546
    assert z["gathered"] == 2 * (V * h + f * h)      # held wte + fc2; V h > 1e9: no prefetch
    assert z["largest gradient"] == 2 * f * h                          # s3:1452-1453
    assert z["previous gradient"] == 2 * 3 * h * h                     # the qkv above's
    assert z["tied head gradient"] == 2 * V * h                        # autograd's buffer
    assert z["at fc2's weight gradient"] == 1.0 + 2 * 3 * h * h + 2 * V * h
    assert z["at fc2's bias hook"] == 1.0 + 2 * f * h - 2 * s * 4 * f + 2 * V * h
    assert z["head + loss"] == 5.0
    # an untied model holds no external embedding and no autograd-held head gradient
    un = Z.backward_peak_bytes(cfg.replace(tie_embeddings=False), lay, 1.0, 2.0, 3.0)
    assert un["terms"]["tied head gradient"] == 0.0
    # nor does it reach stage3_max_live_parameters: the module after the one running
    # may be prefetched (the ASSUMED upper bound: fc2 and fc1 beside it)
    assert un["terms"]["gathered"] == 2 * (f * h + h * f)
