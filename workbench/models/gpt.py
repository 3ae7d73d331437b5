"""The transformer layer of Korthikanti et al. 2022 ("Reducing Activation Recomputation
in Large Transformer Models"), written so that what autograd saves is what their
Table 2 counts: LayerNorm, a QKV projection, attention with a materialized softmax and
its dropout, the output projection, a GeLU MLP of 4h, and dropouts on both residual
branches.  Used to hold the activation-memory formulas to a measurement.

    x (s, b, h) -> y (s, b, h)                (the paper's sequence-first layout)
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTLayer", "TP_PLAN"]

# Megatron's split: heads (q, k, v side by side per head) and the MLP's hidden features
TP_PLAN = {"attn.qkv": "colwise", "attn.proj": "rowwise", "mlp.fc1": "colwise",
           "mlp.fc2": "rowwise"}


class Attention(nn.Module):
    """Self-attention with a materialized softmax (what Table 2 counts: 5as^2b)."""

    def __init__(self, h, heads, dropout, dtype, g):
        super().__init__()
        self.a, self.p = heads, dropout
        self.qkv = nn.Linear(h, 3 * h, dtype=dtype)      # per head: q, k, v side by side
        self.proj = nn.Linear(h, h, dtype=dtype)
        _init(g, self.qkv, self.proj)

    def forward(self, x):
        s, b, h = x.shape
        hd = h // self.a
        qkv = self.qkv(x).reshape(s, b, self.a, 3, hd)                     # (s, b, a, 3, hd)
        q, k, v = qkv.permute(3, 1, 2, 0, 4).unbind(0)                    # (b, a, s, hd)
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(hd)     # (b, a, s, s)
        probs = F.dropout(torch.softmax(scores, -1), self.p, self.training)
        y = torch.matmul(probs, v)                                         # (b, a, s, hd)
        return self.proj(y.permute(2, 0, 1, 3).reshape(s, b, h))          # (s, b, h)


class MLP(nn.Module):
    def __init__(self, h, dtype, g):
        super().__init__()
        self.fc1 = nn.Linear(h, 4 * h, dtype=dtype)
        self.fc2 = nn.Linear(4 * h, h, dtype=dtype)
        _init(g, self.fc1, self.fc2)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def _init(g, *linears):
    with torch.no_grad():
        for m in linears:
            m.weight.copy_(torch.randn(m.weight.shape, generator=g) * 0.02)
            m.bias.zero_()


class GPTLayer(nn.Module):
    """One GPT-2/3 layer: x + drop(attn(ln1(x))), then + drop(mlp(ln2(x)))."""

    def __init__(self, h: int, heads: int, dropout: float = 0.1, dtype=torch.bfloat16, seed=0):
        super().__init__()
        if h % heads:
            raise ValueError(f"GPTLayer: heads={heads} must divide h={h}")
        self.p = dropout
        g = torch.Generator().manual_seed(seed)
        self.ln1 = nn.LayerNorm(h, dtype=dtype)
        self.ln2 = nn.LayerNorm(h, dtype=dtype)
        self.attn = Attention(h, heads, dropout, dtype, g)
        self.mlp = MLP(h, dtype, g)

    def forward(self, x):
        x = x + F.dropout(self.attn(self.ln1(x)), self.p, self.training)
        return x + F.dropout(self.mlp(self.ln2(x)), self.p, self.training)
