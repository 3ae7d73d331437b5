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

TP_PLAN = {"qkv": "colwise", "proj": "rowwise", "fc1": "colwise", "fc2": "rowwise"}


class GPTLayer(nn.Module):
    """One GPT-2/3 layer: x + drop(proj(attn(ln1(x)))), then + drop(fc2(gelu(fc1(ln2(x)))))."""

    def __init__(self, h: int, heads: int, dropout: float = 0.1, dtype=torch.bfloat16, seed=0):
        super().__init__()
        if h % heads:
            raise ValueError(f"GPTLayer: heads={heads} must divide h={h}")
        self.h, self.a, self.p = h, heads, dropout
        g = torch.Generator().manual_seed(seed)
        self.ln1 = nn.LayerNorm(h, dtype=dtype)
        self.ln2 = nn.LayerNorm(h, dtype=dtype)
        self.qkv = nn.Linear(h, 3 * h, dtype=dtype)
        self.proj = nn.Linear(h, h, dtype=dtype)
        self.fc1 = nn.Linear(h, 4 * h, dtype=dtype)
        self.fc2 = nn.Linear(4 * h, h, dtype=dtype)
        with torch.no_grad():
            for m in (self.qkv, self.proj, self.fc1, self.fc2):
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * 0.02)
                m.bias.zero_()

    def attention(self, x):
        s, b, h = x.shape
        hd = h // self.a
        qkv = self.qkv(x)                                                   # (s, b, 3h)
        q, k, v = qkv.reshape(s, b, 3, self.a, hd).permute(2, 1, 3, 0, 4).unbind(0)
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(hd)     # (b, a, s, s)
        probs = F.dropout(torch.softmax(scores, -1), self.p, self.training)
        y = torch.matmul(probs, v)                                         # (b, a, s, hd)
        return y.permute(2, 0, 1, 3).reshape(s, b, h)                     # (s, b, h)

    def forward(self, x):
        x = x + F.dropout(self.proj(self.attention(self.ln1(x))), self.p, self.training)
        return x + F.dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))), self.p, self.training)
