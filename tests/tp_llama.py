"""A tiny Llama with torchtitan's module names and torchtitan's tensor-parallel plan
(``apply_tp`` in torchtitan/models/llama3/infra/parallelize.py), written once for
``tests/test_tp_styles.py`` and its torchrun check (``tests/dist_scripts/tp_styles_check.py``)."""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

import workbench as wb

R, S = wb.Replicate, wb.Shard
V, D, NH, HID, L, B, SEQ = 32, 16, 4, 32, 2, 2, 8     # vocab, width, heads, ffn, layers, batch, seq


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.head_dim = D // NH
        self.wq, self.wk = nn.Linear(D, D, bias=False), nn.Linear(D, D, bias=False)
        self.wv, self.wo = nn.Linear(D, D, bias=False), nn.Linear(D, D, bias=False)

    def forward(self, x, pos):
        b, s, _ = x.shape                                                   # (B, S, D)
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)       # (B, nh, S, hd)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q + pos, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3 = nn.Linear(D, HID, bias=False), nn.Linear(D, HID, bias=False)
        self.w2 = nn.Linear(HID, D, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.attention = nn.RMSNorm(D), Attention()
        self.ffn_norm, self.feed_forward = nn.RMSNorm(D), FeedForward()

    def forward(self, x, pos):
        h = x + self.attention(self.attention_norm(x), pos)
        return h + self.feed_forward(self.ffn_norm(h))


class TinyLlama(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(V, D)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(L)})
        self.norm, self.output = nn.RMSNorm(D), nn.Linear(D, V, bias=False)
        self.register_buffer("pos", torch.randn(SEQ, D // NH) * 0.1)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.pos)
        return self.output(self.norm(h))


def make():
    torch.manual_seed(0)
    m = TinyLlama()
    with torch.no_grad():                     # norms not all ones: their gradients differ
        for n, p in m.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    tokens, labels = torch.randint(0, V, (B, SEQ)), torch.randint(0, V, (B, SEQ))
    return m, tokens, labels


OURS = SimpleNamespace(Col=wb.ColwiseParallel, Row=wb.RowwiseParallel, SP=wb.SequenceParallel,
                       In=wb.PrepareModuleInput, R=R, S=S, apply=wb.parallelize_module)


def torch_ns():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor import parallel as tp
    return SimpleNamespace(Col=tp.ColwiseParallel, Row=tp.RowwiseParallel,
                           SP=tp.SequenceParallel, In=tp.PrepareModuleInput, R=Replicate,
                           S=Shard, apply=tp.parallelize_module)


def apply_plan(ns, model, mesh, sp=True, **kw):
    """torchtitan's apply_tp (sp=True, with loss parallel); sp=False: PyTorch's tutorial
    plan without sequence parallelism (replicated activations, replicated logits)."""
    if sp:
        top = {"tok_embeddings": ns.Row(input_layouts=ns.R(), output_layouts=ns.S(1)),
               "norm": ns.SP(),
               "output": ns.Col(input_layouts=ns.S(1), output_layouts=ns.S(-1),
                                use_local_output=False)}
        block = {"attention_norm": ns.SP(),
                 "attention": ns.In(input_layouts=(ns.S(1), None),
                                    desired_input_layouts=(ns.R(), None)),
                 "attention.wq": ns.Col(), "attention.wk": ns.Col(), "attention.wv": ns.Col(),
                 "attention.wo": ns.Row(output_layouts=ns.S(1)),
                 "ffn_norm": ns.SP(),
                 "feed_forward": ns.In(input_layouts=(ns.S(1),),
                                       desired_input_layouts=(ns.R(),)),
                 "feed_forward.w1": ns.Col(), "feed_forward.w3": ns.Col(),
                 "feed_forward.w2": ns.Row(output_layouts=ns.S(1))}
    else:
        top = {"tok_embeddings": ns.Row(input_layouts=ns.R()),
               "output": ns.Col(output_layouts=ns.R())}
        block = {"attention.w[qkv]": ns.Col(), "attention.wo": ns.Row(),
                 "feed_forward.w[13]": ns.Col(), "feed_forward.w2": ns.Row()}
    ns.apply(model, mesh, top, **kw)
    for layer in model.layers.values():
        ns.apply(layer, mesh, block, **kw)
