"""This library's GPT hands the fused attention's output to its output projection as a
view: ``wb.ops.flash_attention`` runs PyTorch's ``scaled_dot_product_attention``, whose
flash (and memory-efficient) kernel writes the output as [b, s, a, d] and returns its
[b, a, s, d] transpose (aten's ``_scaled_dot_product_flash_attention_cuda``:
``attention.view({batch, seq, heads, dim}).transpose(1, 2)``), so the model's
``transpose(1, 2).reshape(b, s, h)`` copies nothing.  The dry run records no kernel for
it; the estimate's GPT layer (``split_qkv``) priced a context permute forward and
backward (Megatron-LM's [s, b] layout needs one), now none: as the Llama's layer."""
from __future__ import annotations

import pytest
import torch

import workbench as wb
from workbench.plan.layer_cost import layer_ops


def _names(**kw):
    return [o.name for o in layer_ops(1024, 16, 1024, 1, 2, attention="flash",
                                      dropout=False, **kw)]


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_the_library_gpt_layer_prices_no_context_permute(recompute):
    assert not [n for n in _names(split_qkv=True, main_grad=False, recompute=recompute)
                if "context_permute" in n]
    # Megatron-LM's layer ([s, b, h] activations) keeps its copy, forward and backward
    megatron = _names(recompute=recompute)
    assert "context_permute" in megatron and "context_permute_grad" in megatron


def test_the_runtime_records_no_copy_for_the_reshape():
    """The trace of the model's own lines: the attention, then the view, no other event."""
    mesh = wb.Mesh.grid(2, ["tp"])
    q = wb.shard_tensor(torch.randn(2, 4, 8, 16), mesh, [wb.Shard(1)])
    with wb.trace("a100") as tr:
        y = wb.ops.flash_attention(q, q, q, causal=True)
        y.transpose(1, 2).reshape(2, 8, 64)
    assert [e.name for e in tr.events] == ["flash_attention"]
