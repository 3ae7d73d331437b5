"""Activation memory counted from what autograd saves, held to Korthikanti et al. 2022
Table 2 (no parallelism: sbh(34 + 5as/h) bytes per layer in 16-bit)."""
import pytest
import torch

from workbench.models.gpt import GPTLayer
from workbench.parallel.strategies.memory import saved_activation_bytes
from workbench.sim_mesh.estimates import activation_bytes_per_layer


@pytest.mark.parametrize("s,b,h,a", [(64, 2, 64, 4), (32, 3, 96, 6)])
def test_counted_equals_table_2_plus_the_explained_difference(s, b, h, a):
    layer = GPTLayer(h, a)
    x = torch.randn(s, b, h, dtype=torch.bfloat16, requires_grad=True)
    _, rep = saved_activation_bytes(layer, x, params=list(layer.parameters()))
    formula = activation_bytes_per_layer(s, b, h, a, case="none")
    # where the formula's assumptions do not hold on this CPU build:
    # * dropout keeps its scaled 16-bit noise (2 bytes an element), not a 1-byte mask:
    #   one more byte per element of the attention mask (a s^2 b) and the two residual
    #   masks (2 s b h);
    # * each LayerNorm also keeps its mean and 1/std (2 x s b values in 16 bit), which
    #   the paper leaves out as small.
    masks = a * s * s * b + 2 * s * b * h
    norm_stats = 2 * (2 * s * b * 2)
    assert rep.bytes == formula + masks + norm_stats


def test_full_recompute_keeps_only_the_layer_input():
    from torch.utils.checkpoint import checkpoint
    s, b, h, a = 32, 2, 64, 4
    layer = GPTLayer(h, a)
    x = torch.randn(s, b, h, dtype=torch.bfloat16, requires_grad=True)
    _, rep = saved_activation_bytes(lambda t: checkpoint(layer, t, use_reentrant=False), x,
                                    params=list(layer.parameters()))
    assert rep.bytes == activation_bytes_per_layer(s, b, h, a, case="full")   # 2 sbh
