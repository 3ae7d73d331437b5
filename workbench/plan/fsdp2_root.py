"""FSDP2's root unit: what the transformer blocks leave (the token embedding, the final
norm, the output layer) is ONE parameter group, gathered before the model's forward and
reduce-scattered after its whole backward.

torchtitan wraps each block, then the model (``parallelize_llama``: eb6aa6389, April
2024, ``fully_shard(transformer_block, ...)`` per block then ``model = fully_shard(model,
**fsdp_config)``; ``apply_fsdp`` at 9dec370ad2, December 2024, the same with
``reshard_after_forward=not pp_enabled`` for the root), so the root's
``FSDPParamGroup`` holds ``tok_embeddings``, ``norm`` and ``output``.  What PyTorch's FSDP2
does with it (``torch/distributed/fsdp/_fully_shard/``, read in the installed torch 2.13;
the 2024 ``torch/distributed/_composable/fsdp/`` had the same hooks):

- forward: the root's pre-forward hook unshards its group, one all-gather of all of it,
  before the model's forward runs, so the output layer's weight is gathered with the
  embedding's at the step's start, with no compute to hide behind (``zero_cost``'s stream
  model had gathered the head as a unit of its own, prefetched behind the last block);
- the root is not resharded after forward (``FSDPState._lazy_init``: "For the root, do
  not reshard after forward", ``post_forward_mesh_info = None``): gathered once per step
  (``fsdp2_cost``'s ``stay``, unchanged).  In the 2024 FSDP2 the rows ran this is
  unconditional; torch 2.13 does it only when ``reshard_after_forward`` is left to its
  default (``_auto_reshard_after_forward``), and torchtitan 9dec370ad2 passes it
  explicitly (``reshard_after_forward=not pp_enabled``), so on a current torch that
  root is resharded after forward and gathered again for the backward (not priced:
  the rows' torch is 2024's);
- backward: a group's post-backward (the reduce-scatter copy-in, the reduce-scatter) runs
  when autograd has the gradients of the module's forward inputs
  (``FSDPParamGroup._register_post_backward_hook``: ``RegisterPostBackwardFunction`` on
  the inputs that require a gradient, "if not inp_tensors: return ...").  The root's
  input is the token ids (int64, no gradient), so its post-backward runs in
  ``FSDPState._root_post_backward_final_callback`` ("Run post-backward in case forward
  inputs did not require gradient so the autograd backward did not run"), which autograd
  runs after the whole backward (``Variable._execution_engine.queue_callback``): the
  output layer's and the norm's gradients are reduce-scattered with the embedding's, at
  the end, where the stream model had reduced the head's right after its backward, hidden
  behind the blocks' backward.  With pipeline parallelism (each stage's model part its
  own root) the last stage's input needs a gradient, so its root's post-backward runs
  once that gradient is computed: the end of the stage's backward too.

So on each stage the root's parameters (those of the blocks ``zero_cost.stage_blocks``
puts first on the first stage and last on the last) become one unit ahead of the others
in forward order, with no compute of its own but FSDP2's copy kernels of the group (its
all-gather copy-out, at the root's pre-forward; its gradients' reduce-scatter copy-in, in
the final callback: ``fsdp2_cost``'s prices, moved from the embedding's and the head's
units, which keep their compute and hold no parameters).  The extra exposed time is the
head's gather and its reduce-scatter: e.g. Llama 3 8B on 64 A100s, 525M output weights,
about 5.7 ms gathered and 11 ms reduce-scattered in fp32 per step at the a100 profile's
network; nothing is assumed beyond what ``zero_cost`` and ``fsdp2_cost`` already assume.
"""
from __future__ import annotations

from dataclasses import replace

from . import fsdp2_cost as FS
from .zero_cost import Block

__all__ = ["root_unit", "ASSUMPTION"]

# the line ``Estimate.details["assumptions"]`` carries for an FSDP2 layout (sourced, not
# assumed: what is priced, for the reader of ``Estimate.explain``)
ASSUMPTION = ("FSDP2's root unit (plan/fsdp2_root.py): the embedding, the final norm and "
              "the output layer are one parameter group (torchtitan's fully_shard(model)), "
              "all-gathered before the forward and reduce-scattered after the whole "
              "backward (its post-backward runs in FSDP2's final callback: the token ids "
              "need no gradient), both exposed")


def root_unit(blocks, stay, first: bool, last: bool, shards: int, prof):
    """``(blocks, stay)`` for the stream model (``zero_cost.zero_exposed``) with the
    stage's root parameters as one unit at index 0 (module docstring).  ``blocks``:
    ``fsdp2_cost.stage_copies``' blocks of one stage (its copy kernels in their seconds),
    the embedding first if ``first``, the final norm and head last if ``last``;
    ``stay``: the indices it keeps gathered from forward to backward; ``shards``: the
    ranks a unit is sharded over.  A stage with no root parameters (a middle pipeline
    stage) comes back as it was."""
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise ValueError(f"root_unit: shards={shards!r} must be the ranks a unit is "
                         f"sharded over, an int >= 1")
    blocks = list(blocks)
    roots = ([0] if first else []) + ([len(blocks) - 1] if last else [])
    if not roots or len(blocks) < len(set(roots)):
        return blocks, tuple(stay)
    bad = [i for i in roots if i not in stay]
    if bad:
        raise ValueError(f"root_unit: blocks {bad} are the root's (first={first}, "
                         f"last={last}) but not in stay={tuple(stay)}; give "
                         f"fsdp2_cost.stage_copies' blocks and stay")
    out, numel, f_all, g_all = [], 0.0, 0.0, 0.0
    for i, b in enumerate(blocks):
        if i not in roots:
            out.append(b)
            continue
        by = FS.unit_copy_bytes(b.numel, shards)
        f = FS.copy_seconds(by["all_gather_copy_out"], prof, "all_gather_copy_out")
        g = FS.copy_seconds(by["reduce_scatter_copy_in"], prof, "reduce_scatter_copy_in")
        out.append(replace(b, numel=0.0, fwd=b.fwd - f, bwd=b.bwd - g))
        numel, f_all, g_all = numel + b.numel, f_all + f, g_all + g
    return [Block(numel, f_all, g_all)] + out, (0,) + tuple(i + 1 for i in stay)
