"""What DeepSpeed's pipeline engine keeps beyond the layers' saved activations: a stage's
outputs between its forward and backward, its receive buffers, what it holds through a
backward, the loaded micro-batches and the last stage's logits (``framework="deepspeed"``,
pp > 1).

Source: microsoft/DeepSpeed 56c522386 (2022-04-19, v0.6.2; BLOOM-176B's BF16_Optimizer
commit, ``plan.bf16_optimizer``), ``deepspeed/runtime/pipe/engine.py``:
``self.is_pipe_partitioned = self.is_model_parallel`` (any tp > 1), and in
``_exec_forward_pass`` every stage but the last partitions its output over the tensor-
parallel ("slice") group before sending it: ``part = PartitionedTensor(tensor=
first_output, group=self.grid.get_slice_parallel_group())``, ``first_output.data =
torch.zeros(1)``, ``self.pipe_buffers['outputs'][buffer_id] = (part.to_meta(),
part.data(), ...)``; ``runtime/utils.py`` ``PartitionedTensor._partition_tensor``
takes ``tensor.detach().contiguous().view(-1).narrow(...).clone()``, a 1/t copy of the
output.  ``_exec_backward_pass`` rebuilds the whole output from it (``part_output.full()``)
and only then frees the buffer (``self.pipe_buffers['outputs'][buffer_id] = None``): each
micro-batch in flight on the stage holds s b h / t elements of its output, beyond the
layers' saved activations (``plan.memory``: the next stage's first layer keeps its own,
whole copy).  16-bit values, 2 bytes, as ``plan.memory``'s activations (Korthikanti et
al. 2022's accounting).  The same code in v0.5.4 (bc7778ea5b), the engine
``plan.deepspeed_pipe`` prices.

Without tensor slicing (tp = 1: ``is_pipe_partitioned`` False) the same line stores the
whole output (:func:`partitioned_output_bytes`), and a receiving stage keeps in
``pipe_buffers['inputs']`` the ``recvd = buffer.clone().detach()`` of
``_exec_recv_activations`` (lines 1040-1068) while ``_exec_forward_pass`` runs the layers
on a further ``clone()`` of it (lines 624-627), which their checkpoint saves: a second whole
input per micro-batch in flight (:func:`kept_input_bytes`; with tp > 1 the buffer takes
the rebuilt ``full()`` input the layers run on: one copy).  Both receive buffers are
allocated once, ``num_buffers=1``, and kept (:func:`receive_buffer_bytes`):
``pipe_recv_buf`` (``_recv_tensor_meta``, lines 882-907) on every stage but the first and
``grad_layer`` (``_exec_recv_grads``, lines 1093-1125) on every stage but the last, each
the received tensor: the 1/t slice (and its meta), the whole with tp = 1.

What the engine holds through a micro-batch's backward (:func:`backward_held_bytes`;
56c522386 ``runtime/pipe/engine.py`` lines 700-765, the same in v0.5.4 lines 640-685):
on every stage but the last ``_exec_backward_pass`` first restores the stage's whole
output (``self.pipe_buffers['output_tensors'][buffer_id].data = part_output.full()``,
s b h) and rebuilds the whole received gradient (``grad_tensors = (part_grad.full(),
...)``, s b h; ``is_grad_partitioned = is_model_parallel``; with tp = 1 both are whole
already: the output kept in ``pipe_buffers['outputs']``, the gradient in the persistent
``grad_layer``), runs ``torch.autograd.backward`` with them, then (bf16, 56c522386)
``self.optimizer.update_hp_grads(clear_lp_grads=False)``, and only then frees both
(``output_tensors`` / ``outputs`` set to None, ``grad_tensors = None``): with tp > 1,
2 x 2 s b h bytes live at the layers' backward (the stage's last layer, recomputed first, runs
beside them) and at ``update_hp_grads``' fp32 cast (``plan.bf16_optimizer``).  A stage
after the first also holds then its input's whole gradient (``inputs[0].requires_grad =
True`` after ``full()``: a leaf, so autograd's AccumulateGrad keeps its gradient as
``.grad``, 2 s b h), freed only by ``_exec_send_grads`` (``pipe_buffers['inputs']
[buffer_id] = None``), which ``TrainSchedule`` (``pipe/schedule.py``) issues at the next
step, after the backward; the last stage's backward (``BF16_Optimizer.backward``:
``loss.backward()`` then ``update_hp_grads``) holds that input gradient alone.

The last stage's logits (in :func:`backward_held_bytes` too): Megatron-DeepSpeed's
``GPTModelPipe`` ends in ``float16_to_fp32`` (bigscience-workshop/Megatron-DeepSpeed
b1359ee0 and microsoft/Megatron-DeepSpeed acc3e9b5 ``megatron/model/gpt_model.py``), so
the stage's output, which ``_exec_forward_pass`` stores in ``pipe_buffers['outputs']``,
is the fp32 logits, 4 s b V / t bytes; its loss (``CrossEntropy``:
``vocab_parallel_cross_entropy(output.contiguous().float(), labels)``, both no-ops on a
contiguous fp32 tensor) works on that very tensor in place (``megatron/mpu/
cross_entropy.py``: ``sub_``, ``torch.exp(..., out=)``, ``div_``, saved as the softmax;
its backward turns it into the gradient in place, ``mul_``).  The last stage's
``_exec_backward_pass`` returns after ``super().backward(self.loss)`` without clearing
the buffer (56c522386 lines 705-710; v0.5.4 lines 635-638), so each of its
``num_pipe_buffers()`` = 2 buffers keeps its micro-batch's fp32 logits until the next
forward into it assigns a new output, after computing it: at a micro-batch's loss the
earlier micro-batches' logits, min(2, m - 1) of them, are live beside its own (which
``plan.memory`` counts with the activations); through its backward and
``update_hp_grads`` its own (which the head's backward does not free, as
``memory.workspace_bytes`` would otherwise take) and the other buffer's, min(1, m - 1);
after the pipeline has drained (BF16_Optimizer's DP sync, ``plan.bf16_optimizer``) the
buffers still hold the last min(2, m) micro-batches' logits, every stage its receive
buffers and the first its buffers' loaded inputs (:func:`loaded_input_bytes`):
:func:`after_pipeline_bytes`.

What the first and last stages keep of the loaded micro-batches (:func:`loaded_input_bytes`):
``_exec_load_micro_batch`` (56c522386 lines 775-812) stores a ``clone()`` of each input
tensor in ``pipe_buffers['inputs'][buffer_id]`` on the first stage, and the labels tuple
in ``pipe_buffers['labels'][buffer_id]`` on the last; ``_exec_forward_pass`` runs the
module on clones of the inputs (lines 624-627), and on the first stage nothing frees the
buffer (``_exec_send_grads``, which sets it to None, runs on the other stages only), so
each of the stage's ``TrainSchedule.num_pipe_buffers()`` = max(2, min(pp - stage + 1,
m)) buffers (``pipe/schedule.py`` line 243) keeps its last micro-batch's inputs for the
whole step.  Megatron-DeepSpeed's ``get_batch_pipe`` (bigscience-workshop/Megatron-
DeepSpeed b1359ee0 ``pretrain_gpt.py`` lines 121-156, ``megatron/utils.py``
``get_ltor_masks_and_position_ids`` lines 150-190; the same in microsoft/Megatron-
DeepSpeed acc3e9b5) gives the first stage (tokens, position_ids, attention_mask): int64
[b, s] twice and a bool [1, 1, s, s] causal mask (``--reset-attention-mask`` off, its
default: one mask for the micro-batch), s^2 + 16 s b bytes; the last stage (labels,
loss_mask): int64 and float32 [b, s], 12 s b bytes.
"""
from __future__ import annotations

__all__ = ["partitioned_output_bytes", "receive_buffer_bytes", "kept_input_bytes",
           "backward_held_bytes", "loaded_input_bytes", "after_pipeline_bytes",
           "pipe_buffers", "SOURCE", "BACKWARD_SOURCE"]

BACKWARD_SOURCE = ("microsoft/DeepSpeed 56c522386 (2022-04-19) runtime/pipe/engine.py "
                   "_exec_backward_pass (lines 700-765): the restored whole output and the "
                   "rebuilt whole gradient live until after update_hp_grads; the input's "
                   "gradient until _exec_send_grads; the last stage's buffers keep their "
                   "fp32 logits (Megatron-DeepSpeed GPTModelPipe's float16_to_fp32)")
SOURCE = ("microsoft/DeepSpeed 56c522386 (2022-04-19) runtime/pipe/engine.py "
          "_exec_forward_pass: each stage but the last keeps a 1/t clone of its output "
          "(PartitionedTensor) until that micro-batch's backward")


def _check_held(fn: str, held) -> None:
    if isinstance(held, bool) or not isinstance(held, (int, float)) or held < 0:
        raise ValueError(f"{fn}: held={held!r} must be the micro-batches in flight on the "
                         f"stage, a number >= 0")


def partitioned_output_bytes(cfg, lay, stage: int, held: float) -> float:
    """Bytes of the outputs a rank of ``stage`` keeps for the ``held`` micro-batches in
    flight (module docstring): their 1/t partitions, or with tp == 1 (no partitioning:
    ``_exec_forward_pass`` stores the output itself in ``pipe_buffers['outputs']``) the
    whole outputs; 0 where the engine keeps none: another framework, no pipeline, or the
    last stage."""
    _check_held("partitioned_output_bytes", held)
    if lay.engine != "deepspeed" or lay.pp == 1 or stage == lay.pp - 1:
        return 0.0
    return 2.0 * cfg.seq_len * lay.micro_batch * cfg.d_model / lay.tp * held


def receive_buffer_bytes(cfg, lay, stage: int) -> float:
    """Bytes of the engine's two receive buffers on a rank of ``stage``, allocated once
    (``_allocate_buffer(..., num_buffers=1)``) and kept all run (module docstring):
    ``pipe_recv_buf`` on every stage but the first, ``grad_layer`` on every stage but
    the last, each the 1/t slice of an [s, b, h] 16-bit tensor (the whole tensor with
    tp == 1; the slice's int64 meta, a few dozen bytes, not counted); 0 where the engine
    does not run."""
    if lay.engine != "deepspeed" or lay.pp == 1:
        return 0.0
    part = 2.0 * cfg.seq_len * lay.micro_batch * cfg.d_model / lay.tp
    return part * ((stage > 0) + (stage < lay.pp - 1))


def kept_input_bytes(cfg, lay, stage: int, held: float) -> float:
    """With tp == 1, bytes of the received inputs a rank of ``stage`` (not the first)
    keeps for the ``held`` micro-batches in flight beside the clone its layers run on and
    save (module docstring): whole, 2 s b h each; 0 with tp > 1 (the rebuilt ``full()``
    input is stored in the buffer and is the one the layers save)."""
    _check_held("kept_input_bytes", held)
    if lay.engine != "deepspeed" or lay.pp == 1 or lay.tp > 1 or stage == 0:
        return 0.0
    return 2.0 * cfg.seq_len * lay.micro_batch * cfg.d_model * held


def backward_held_bytes(cfg, lay, stage: int) -> dict:
    """Bytes DeepSpeed's pipeline engine holds on a rank of ``stage`` at three instants
    beyond what ``plan.memory`` counts there (module docstring): ``"backward"`` at the
    layers' backward (every stage but the last: the restored output and the rebuilt
    received gradient, 2 s b h bytes each; the last: its buffers' fp32 logits, the
    micro-batch's own and min(1, m - 1) earlier, 4 s b V / t each), ``"update"`` at
    BF16_Optimizer's ``update_hp_grads`` after it (the same, plus the input's gradient,
    2 s b h, on every stage but the first) and ``"loss"`` at the last stage's loss (the
    earlier micro-batches' fp32 logits its buffers keep, min(2, m - 1)).  Zeros where
    the engine does not run: another framework, or no pipeline."""
    if not isinstance(stage, int) or isinstance(stage, bool) or not 0 <= stage < lay.pp:
        raise ValueError(f"backward_held_bytes: stage={stage!r} must be a pipeline stage "
                         f"in 0 .. pp - 1 = {lay.pp - 1}")
    if lay.engine != "deepspeed" or lay.pp == 1:
        return {"loss": 0.0, "backward": 0.0, "update": 0.0}
    whole = 2.0 * cfg.seq_len * lay.micro_batch * cfg.d_model    # one s b h, 16-bit
    input_grad = 0.0 if stage == 0 else whole
    if stage < lay.pp - 1:
        # with tp == 1 the output is one of those partitioned_output_bytes keeps and the
        # gradient is received into grad_layer (receive_buffer_bytes): counted there
        rebuilt = 2 * whole if lay.tp > 1 else 0.0
        return {"loss": 0.0, "backward": rebuilt, "update": rebuilt + input_grad}
    logits = 4.0 * cfg.seq_len * lay.micro_batch * cfg.vocab_size / lay.tp   # fp32
    nbuf = pipe_buffers(lay, stage)
    earlier = min(nbuf, lay.m - 1)               # at the loss: the buffers' older logits
    own = logits * (1 + min(nbuf - 1, lay.m - 1))     # through the backward
    return {"loss": earlier * logits, "backward": own, "update": own + input_grad}


def pipe_buffers(lay, stage: int) -> int:
    """``TrainSchedule.num_pipe_buffers()`` of ``stage`` (module docstring)."""
    return max(2, min(lay.pp - stage + 1, lay.m))


def loaded_input_bytes(cfg, lay, stage: int) -> float:
    """Bytes of loaded micro-batches a rank of ``stage`` keeps in the engine's buffers
    all step (module docstring): on the first stage each pipe buffer's clone of the
    tokens, positions and causal mask (s^2 + 16 s b), on the last each one's labels and
    loss mask (12 s b); 0 on a middle stage or where the engine does not run."""
    if not isinstance(stage, int) or isinstance(stage, bool) or not 0 <= stage < lay.pp:
        raise ValueError(f"loaded_input_bytes: stage={stage!r} must be a pipeline stage "
                         f"in 0 .. pp - 1 = {lay.pp - 1}")
    if lay.engine != "deepspeed" or lay.pp == 1:
        return 0.0
    s, b = cfg.seq_len, lay.micro_batch
    per = (s * s + 16.0 * s * b if stage == 0 else 0.0) + \
        (12.0 * s * b if stage == lay.pp - 1 else 0.0)
    return pipe_buffers(lay, stage) * per


def after_pipeline_bytes(cfg, lay, stage: int) -> float:
    """Bytes the engine's buffers still hold on a rank of ``stage`` once its pipeline has
    drained (module docstring): the loaded inputs (:func:`loaded_input_bytes`), the
    receive buffers (:func:`receive_buffer_bytes`) and, on
    the last stage, the fp32 logits of its last min(2, m) micro-batches (4 s b V / t
    each); 0 where the engine does not run."""
    out = loaded_input_bytes(cfg, lay, stage) + receive_buffer_bytes(cfg, lay, stage)
    if lay.engine == "deepspeed" and lay.pp > 1 and stage == lay.pp - 1:
        logits = 4.0 * cfg.seq_len * lay.micro_batch * cfg.vocab_size / lay.tp
        out += min(pipe_buffers(lay, stage), lay.m) * logits
    return out
