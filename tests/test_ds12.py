"""DeepSpeed's pipeline engine holds a micro-batch's restored output and gradients through
its backward (``plan.deepspeed_pipe_memory.backward_held_bytes``).

Source: microsoft/DeepSpeed 56c522386 ``runtime/pipe/engine.py`` ``_exec_backward_pass``
(lines 700-765; v0.5.4 bc7778ea5b lines 640-685): on every stage but the last the whole
output is restored (``part_output.full()``) and the received gradient rebuilt
(``part_grad.full()``), ``torch.autograd.backward`` runs with both, then (bf16)
``update_hp_grads``, and only then are both freed; a stage after the first also holds its
input's gradient (a leaf's ``.grad``) until ``_exec_send_grads`` at the next step.  Each is
one 16-bit [s, b, h] tensor: 2 s b h bytes.
"""
from __future__ import annotations

import pytest

from workbench.plan import bf16_optimizer as BF
from workbench.plan import deepspeed_pipe_memory as DPM
from workbench.plan import memory as MEM
from tests.test_bloom3 import _ds_layout


def _ds(**kw):
    """bloom3's DeepSpeed pipeline layout (GPT 8 layers, dp 2 tp 4 pp 4, ZeRO-1)."""
    return _ds_layout(**kw)


def test_backward_held_bytes_per_stage():
    """Stage 0: restored output + rebuilt gradient (2 x 2 s b h) at both instants; middle
    stages: + the input's gradient (2 s b h) at update_hp_grads; the last: the input's
    gradient alone, at update_hp_grads."""
    cfg, lay = _ds()                              # vocabulary 50,257 (GPT-3's)
    sbh2 = 2 * 512 * 2 * 1024                     # one 16-bit [s, b, h]: 2,097,152 bytes
    assert sbh2 == 2 ** 21
    want = {0: (2 * sbh2, 2 * sbh2), 1: (2 * sbh2, 3 * sbh2), 2: (2 * sbh2, 3 * sbh2)}
    for stage, (bwd, upd) in want.items():
        got = DPM.backward_held_bytes(cfg, lay, stage)
        assert got == {"loss": 0.0, "backward": bwd, "update": upd}, stage
    # the last stage: its 2 buffers' fp32 logits (4 s b V / t each; m = 8)
    logits = 4 * 512 * 2 * cfg.vocab_size / 4
    assert DPM.backward_held_bytes(cfg, lay, 3) == {
        "loss": 2 * logits, "backward": 2 * logits, "update": 2 * logits + sbh2}
    # one micro-batch a step: no earlier logits in the buffers
    _, one = _ds(global_batch=4)
    assert DPM.backward_held_bytes(cfg, one, 3) == {
        "loss": 0.0, "backward": logits, "update": logits + sbh2}
    # tp = 1 (not partitioned): the output is one the engine keeps whole and the gradient
    # lands in the persistent grad_layer, both counted there; the input's gradient stays
    _, lay1 = _ds(tp=1)
    assert DPM.backward_held_bytes(cfg, lay1, 1) == {"loss": 0.0, "backward": 0.0,
                                                     "update": sbh2}


def test_backward_held_bytes_only_in_deepspeeds_pipeline():
    cfg, _ = _ds()
    for kw in (dict(framework="megatron"), dict(pp=1, dp=8)):
        _, lay = _ds(**kw)
        assert DPM.backward_held_bytes(cfg, lay, 0) == {"loss": 0.0, "backward": 0.0,
                                                        "update": 0.0}, kw
    _, lay = _ds()
    for bad in (-1, 4, True, "0", None):
        with pytest.raises(ValueError, match="stage="):
            DPM.backward_held_bytes(cfg, lay, bad)


def test_layers_backward_counts_the_engines_tensors(monkeypatch):
    """The layers' backward instant of ``memory.workspace_terms`` holds the term, and
    differs from the same terms without it by exactly that many bytes."""
    cfg, lay = _ds()
    with_term = {s: MEM.workspace_terms(cfg, lay, s) for s in range(lay.pp)}
    monkeypatch.setattr(DPM, "backward_held_bytes",
                        lambda c, l, s: {"loss": 0.0, "backward": 0.0, "update": 0.0})
    without = {s: MEM.workspace_terms(cfg, lay, s) for s in range(lay.pp)}
    logits = 4 * 512 * 2 * cfg.vocab_size / 4
    for s in range(lay.pp):
        term = with_term[s]["engine's output and gradient"]
        assert term == (2 * logits if s == lay.pp - 1 else 2 * 2 ** 21), s
        assert without[s]["engine's output and gradient"] == 0.0
        assert with_term[s]["layers' backward"] - without[s]["layers' backward"] == term, s
        kept = with_term[s]["engine's kept logits"]
        assert kept == (2 * logits if s == lay.pp - 1 else 0.0), s
        assert with_term[s]["loss"] - without[s]["loss"] == kept, s


def test_bf16_update_instant_holds_them_beside_the_fp32_cast():
    """BLOOM-like stage 0 (vocabulary 250,880: the embedding's fp32 cast in
    update_hp_grads sets the workspace): 4 bytes x V h / t plus the restored output and
    gradient, 2 x 2 s b h."""
    cfg, lay = _ds()
    cfg = cfg.replace(vocab_size=250880)
    nl = lay.stage_layers(cfg.n_layer)[0]
    mem = MEM.stage_memory(cfg, lay, 0)
    largest = BF.largest_numel(cfg, lay.tp, lay.pp, 0, nl)
    assert largest == 250880 * 1024 / 4
    assert mem["workspace"] == 4 * largest + 2 * 2 ** 21
    # the last stage's update instant: the cast beside the input's gradient and the
    # buffers' fp32 logits; its loss instant: the 16-bit logits beside the fp32 ones
    # (2 bytes a logit) and the two earlier micro-batches' fp32 logits (4 + 4)
    last = MEM.stage_memory(cfg, lay, lay.pp - 1)
    terms = MEM.workspace_terms(cfg, lay, lay.pp - 1)
    logit = 512 * 2 * 250880 / 4
    assert terms["loss"] == (2 + 8) * logit
    held = DPM.backward_held_bytes(cfg, lay, lay.pp - 1)
    assert held["update"] == 8 * logit + 2 ** 21
    assert last["workspace"] == max(terms["workspace"], 4 * largest + held["update"],
                                    2 * MEM.stage_params(cfg, 4, 4, 3, nl)
                                    - last["activations"])


def test_reserved_memory_takes_the_same_update_instant():
    """``plan.allocator.reserved_bytes``: the pipeline phase's peak is the live peak's
    workspace where the update instant sets it (no double count, no term dropped)."""
    from workbench.plan import allocator as AL
    cfg, lay = _ds()
    cfg = cfg.replace(vocab_size=250880)
    nl = lay.stage_layers(cfg.n_layer)[0]
    psi = MEM.stage_params(cfg, lay.tp, lay.pp, 0, nl)
    mem = MEM.stage_memory(cfg, lay, 0)
    cache = AL.cached_bytes(cfg, lay, 0, psi, nl)
    got = AL.reserved_bytes(cfg, lay, 0, psi, nl, mem)
    assert got == max(mem["total"], mem["total"] + cache)


def test_loaded_inputs_kept_in_every_pipe_buffer():
    """TrainSchedule.num_pipe_buffers = max(2, min(pp - stage + 1, m)); the first stage
    keeps tokens and positions (int64 [b, s]) and the causal mask (bool [1, 1, s, s]) in
    each, the last the labels (int64) and loss mask (float32)."""
    cfg, lay = _ds()                     # pp 4, m = 32 / (2 x 2) = 8
    s, b = 512, 2
    assert [DPM.pipe_buffers(lay, st) for st in range(4)] == [5, 4, 3, 2]
    assert DPM.loaded_input_bytes(cfg, lay, 0) == 5 * (s * s + 2 * 8 * s * b)
    assert DPM.loaded_input_bytes(cfg, lay, 1) == 0.0
    assert DPM.loaded_input_bytes(cfg, lay, 3) == 2 * (8 + 4) * s * b
    _, few = _ds(global_batch=8)         # m = 2: no more buffers than micro-batches
    assert DPM.pipe_buffers(few, 0) == 2 and DPM.pipe_buffers(few, 3) == 2
    for kw in (dict(framework="megatron"), dict(pp=1, dp=8)):
        _, other = _ds(**kw)
        assert DPM.loaded_input_bytes(cfg, other, 0) == 0.0, kw
    with pytest.raises(ValueError, match="stage="):
        DPM.loaded_input_bytes(cfg, lay, 4)


def test_stage_memory_counts_the_loaded_inputs(monkeypatch):
    cfg, lay = _ds()
    with_term = [MEM.stage_memory(cfg, lay, st)["activations"] for st in range(4)]
    monkeypatch.setattr(DPM, "loaded_input_bytes", lambda c, l, st: 0.0)
    MEM._LAST[0] = (None, None, None, None, {})       # drop the cached answers
    without = [MEM.stage_memory(cfg, lay, st)["activations"] for st in range(4)]
    MEM._LAST[0] = (None, None, None, None, {})
    assert [a - b for a, b in zip(with_term, without)] == [
        5 * (512 * 512 + 16 * 512 * 2), 0.0, 0.0, 2 * 12 * 512 * 2]


def test_after_the_pipeline_the_buffers_keep_inputs_and_logits():
    """Once drained, stage 0 keeps its buffers' loaded inputs and the last stage its two
    buffers' fp32 logits (4 s b V / t each): both beside BF16_Optimizer's bf16 sync copy
    (2 psi), the instant that sets the live peak of a stage with few activations."""
    cfg, lay = _ds(global_batch=64)              # m = 16
    cfg = cfg.replace(vocab_size=250880)
    logits = 4 * 512 * 2 * 250880 / 4
    recv = 2 * 512 * 2 * 1024 / 4                # a receive buffer: the 1/t slice
    assert DPM.after_pipeline_bytes(cfg, lay, 3) == 2 * logits + 2 * 12 * 512 * 2 + recv
    assert DPM.after_pipeline_bytes(cfg, lay, 1) == 2 * recv
    assert DPM.after_pipeline_bytes(cfg, lay, 0) == DPM.loaded_input_bytes(cfg, lay, 0) \
        + recv
    _, one = _ds(global_batch=4)                 # m = 1: one buffer ever written
    assert DPM.after_pipeline_bytes(cfg, one, 3) == logits + 2 * 12 * 512 * 2 + recv
    nl = lay.stage_layers(cfg.n_layer)[3]
    mem = MEM.stage_memory(cfg, lay, 3)
    sync = 2 * MEM.stage_params(cfg, 4, 4, 3, nl)
    assert mem["workspace"] >= sync + DPM.after_pipeline_bytes(cfg, lay, 3) \
        - mem["activations"]
    states = mem["params"] + mem["grads"] + mem["optimizer"] + mem["buffers"] \
        + mem.get("comm_buffers", 0.0)
    assert mem["total"] >= states + sync + 2 * logits


def test_receive_buffers_and_tp1_copies():
    """pipe_recv_buf (stages after the first) and grad_layer (stages before the last):
    one buffer each of the received tensor, the 1/t slice or (tp = 1) the whole; with
    tp = 1 a receiving stage keeps its received input beside the clone its layers save,
    and its whole outputs."""
    cfg, lay = _ds()
    sbh2 = 2 * 512 * 2 * 1024
    assert [DPM.receive_buffer_bytes(cfg, lay, st) for st in range(4)] == [
        sbh2 / 4, 2 * sbh2 / 4, 2 * sbh2 / 4, sbh2 / 4]
    assert DPM.kept_input_bytes(cfg, lay, 2, 2) == 0.0           # tp 4: one copy
    _, lay1 = _ds(tp=1, dp=8)
    assert [DPM.receive_buffer_bytes(cfg, lay1, st) for st in range(4)] == [
        sbh2, 2 * sbh2, 2 * sbh2, sbh2]
    assert [DPM.kept_input_bytes(cfg, lay1, st, 3) for st in range(4)] == [
        0.0, 3 * sbh2, 3 * sbh2, 3 * sbh2]
    assert DPM.partitioned_output_bytes(cfg, lay1, 1, 3) == 3 * sbh2
    assert DPM.partitioned_output_bytes(cfg, lay1, 3, 1) == 0.0
    for bad in (-1, True, None):
        with pytest.raises(ValueError, match="held"):
            DPM.kept_input_bytes(cfg, lay1, 1, bad)
    _, meg = _ds(framework="megatron")
    assert DPM.receive_buffer_bytes(cfg, meg, 1) == 0.0
    assert DPM.kept_input_bytes(cfg, meg, 1, 2) == 0.0


def test_tp1_stage_memory_counts_the_whole_copies(monkeypatch):
    """A middle stage at tp = 1: its activations hold, beyond the layers' and the states,
    the kept whole outputs and received inputs of the micro-batches in flight and the two
    whole receive buffers."""
    cfg, lay = _ds(tp=1, dp=8, global_batch=64)              # m = 4
    sbh2 = 2 * 512 * 2 * 1024
    held = MEM.in_flight(lay.schedule, lay.pp, lay.m, lay.v, 1)
    with_term = MEM.stage_memory(cfg, lay, 1)["activations"]
    for name in ("partitioned_output_bytes", "kept_input_bytes"):
        monkeypatch.setattr(DPM, name, lambda c, l, st, h: 0.0)
    monkeypatch.setattr(DPM, "receive_buffer_bytes", lambda c, l, st: 0.0)
    MEM._LAST[0] = (None, None, None, None, {})
    without = MEM.stage_memory(cfg, lay, 1)["activations"]
    MEM._LAST[0] = (None, None, None, None, {})
    assert held == 3
    assert with_term - without == 2 * held * sbh2 + 2 * sbh2
