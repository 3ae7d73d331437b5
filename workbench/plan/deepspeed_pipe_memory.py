"""What DeepSpeed's pipeline engine keeps of a stage's outputs between its forward and
backward (``framework="deepspeed"``, pp > 1, tp > 1).

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
"""
from __future__ import annotations

__all__ = ["partitioned_output_bytes", "SOURCE"]

SOURCE = ("microsoft/DeepSpeed 56c522386 (2022-04-19) runtime/pipe/engine.py "
          "_exec_forward_pass: each stage but the last keeps a 1/t clone of its output "
          "(PartitionedTensor) until that micro-batch's backward")


def partitioned_output_bytes(cfg, lay, stage: int, held: float) -> float:
    """Bytes of the 1/t output partitions a rank of ``stage`` keeps for the ``held``
    micro-batches in flight (module docstring); 0 where the engine keeps none: another
    framework, no pipeline, tp == 1 (no partitioning), or the last stage."""
    if isinstance(held, bool) or not isinstance(held, (int, float)) or held < 0:
        raise ValueError(f"partitioned_output_bytes: held={held!r} must be the micro-batches "
                         f"in flight on the stage, a number >= 0")
    if lay.engine != "deepspeed" or lay.pp == 1 or lay.tp == 1 or stage == lay.pp - 1:
        return 0.0
    return 2.0 * cfg.seq_len * lay.micro_batch * cfg.d_model / lay.tp * held
