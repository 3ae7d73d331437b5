"""Megatron-LM's GPT (Shoeybi et al. 2019; Radford et al. 2019), two ways.

:class:`GPTLayer` is the transformer layer of Korthikanti et al. 2022 ("Reducing
Activation Recomputation in Large Transformer Models"), written so that what autograd
saves is what their Table 2 counts: LayerNorm, a QKV projection, attention with a
materialized softmax and its dropout, the output projection, a GeLU MLP of 4h, and
dropouts on both residual branches.  Used to hold the activation-memory formulas to a
measurement.  x (s, b, h) -> y (s, b, h) (the paper's sequence-first layout).

:class:`GPT` is the whole model for ``ModelConfig(arch="gpt")``, with the call
signature of :class:`~workbench.models.llama.Llama` (``model(idx, targets) ->
(logits, loss)``, with ``cache``, ``position_ids`` and ``logits_to_keep`` as
:mod:`.positions` says; ``generate``, ``set_recompute``) so a trainer and the serving
engine take either.  Per block (pre-norm, Megatron's GPT):

    x = x + drop(o(attn(q, k, v of LayerNorm(x))))     q, k, v, o: linears with bias
    x = x + drop(fc2(gelu(fc1(LayerNorm(x)))))         fc1: h -> d_ff (4h), fc2: back

with learned position embeddings, a final LayerNorm and an lm head tied to the token
embedding.  q, k and v are three linears rather than Megatron's one fused QKV matrix
(the same parameters and FLOPs): sharded "colwise" each gives a rank whole heads, as in
Llama's :data:`~workbench.models.llama.TP_PLAN`.  Attention goes through
``wb.ops.flash_attention`` (causal), like the Llama's.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..sim_mesh import rng
from .config import ModelConfig
from .llama import attention_core, dropout
from .moe import MoE
from .positions import check_logits_to_keep, check_position_ids
from .split import Splittable

__all__ = ["GPTLayer", "TP_PLAN", "GPT", "GPT_TP_PLAN"]

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


# ---- the whole model ------------------------------------------------------------------------

# Megatron's tensor parallelism for ``wb.parallelize(gpt, mesh, GPT_TP_PLAN)``
GPT_TP_PLAN = {
    "layers.*.attn.wq": "colwise", "layers.*.attn.wk": "colwise",
    "layers.*.attn.wv": "colwise", "layers.*.attn.wo": "rowwise",
    "layers.*.mlp.fc1": "colwise", "layers.*.mlp.fc2": "rowwise",
}


class GPTAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, dt = cfg.d_model, cfg.torch_dtype
        self.n_head, self.head_dim, self.dropout = cfg.n_head, cfg.head_dim, cfg.dropout
        self.index = 0                  # the block's number (GPT sets it): its KV-cache layer
        self.wq = nn.Linear(h, h, dtype=dt)
        self.wk = nn.Linear(h, h, dtype=dt)
        self.wv = nn.Linear(h, h, dtype=dt)
        self.wo = nn.Linear(h, h, dtype=dt)

    def forward(self, x, recompute_core: bool = False, cache=None):
        B, S, _ = x.shape                                                   # (B, S, h)
        q, k, v = (w(x).view(B, S, self.n_head, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))                    # (B, a, S, hd)
        p = self.dropout if self.training else 0.0
        # keyed dropout (train's masks, the same on every layout): call numbers as Llama's
        site, ctx = 1 + 3 * self.index, rng.context()
        if cache is not None:           # generation: keys/values appended, attends to all
            y = cache.attend(self.index, q, k, v)                           # (B, a, S, hd)
        elif recompute_core and torch.is_grad_enabled():
            y = checkpoint(attention_core, q, k, v, p, site, ctx, use_reentrant=False)
        else:
            y = attention_core(q, k, v, p, site, ctx)                       # (B, a, S, hd)
        y = y.transpose(1, 2).reshape(B, S, self.n_head * self.head_dim)   # (B, S, h)
        return self.wo(y)                      # its dropout: in GPTBlock, after TP's g


class GPTMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, f, dt = cfg.d_model, cfg.d_ff, cfg.torch_dtype
        self.dropout = cfg.dropout
        self.fc1 = nn.Linear(h, f, dtype=dt)
        self.fc2 = nn.Linear(f, h, dtype=dt)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))   # its dropout: in GPTBlock, after TP's g


class GPTBlock(nn.Module):
    """Pre-norm GPT block; ``recompute`` is "none", "full" or "selective"."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.recompute = cfg.recompute
        self.ln1 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, dtype=cfg.torch_dtype)
        self.attn = GPTAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, dtype=cfg.torch_dtype)
        self.mlp = MoE(cfg) if cfg.moe_experts else GPTMLP(cfg)  # models/moe.py

    def forward(self, x, cache=None):
        if self.recompute == "full" and torch.is_grad_enabled() and cache is None:
            return checkpoint(self._forward, x, None, rng.context(), use_reentrant=False)
        return self._forward(x, cache)

    def _forward(self, x, cache=None, ctx=None):
        if ctx is not None:             # recomputed in backward: the forward's dropout keys
            with rng.restore(ctx):
                return self._forward(x)
        # the residual branches' dropouts outside attn and mlp, so that with tensor (and
        # sequence) parallelism they run after the row-parallel sum, as Megatron's
        # bias-dropout-add does (on s/t tokens with sequence parallelism)
        p, site = (self.attn.dropout if self.training else 0.0), 2 + 3 * self.attn.index
        x = x + dropout(self.attn(self.ln1(x), recompute_core=self.recompute == "selective",
                                  cache=cache), p, self.training, site)
        return x + dropout(self.mlp(self.ln2(x)), p, self.training, site + 1)   # (B, S, h)


class GPT(Splittable, nn.Module):
    """Token and position embeddings (then a LayerNorm with ``cfg.embed_norm``, BLOOM),
    ``n_layer`` blocks, final LayerNorm, lm head
    (tied to the token embedding when ``cfg.tie_embeddings``, as Megatron's GPT; no
    bias).  Deterministic init from ``seed`` without touching the global RNG."""

    def __init__(self, cfg: ModelConfig, seed: int = 0):
        super().__init__()
        if cfg.arch != "gpt":
            raise ValueError(f"GPT: cfg.arch={cfg.arch!r}; build it with "
                             f"workbench.models.build_model(cfg), or set arch='gpt'")
        self.cfg = cfg
        dt = cfg.torch_dtype
        with torch.random.fork_rng(devices=[]):
            # _weight given: skip nn.Embedding's own init (see Llama.__init__)
            self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model,
                                        _weight=torch.empty(cfg.vocab_size, cfg.d_model, dtype=dt))
            self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model,
                                        _weight=torch.empty(cfg.seq_len, cfg.d_model, dtype=dt))
            self.layers = nn.ModuleList(GPTBlock(cfg) for _ in range(cfg.n_layer))
            self.norm = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, dtype=dt)
            if cfg.embed_norm:                 # BLOOM: a LayerNorm on the embeddings
                self.emb_norm = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, dtype=dt)
                self.FIRST_MODULES = GPT.FIRST_MODULES + ("emb_norm",)
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False, dtype=dt)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        for i, block in enumerate(self.layers):             # numbers the KV-cache layers
            block.attn.index = i
        self.reset_parameters(seed)

    # ---- how the model splits (models/split.py) --------------------------------------------
    TP_BLOCK_PLAN = GPT_TP_PLAN
    FIRST_MODULES = ("tok_emb", "pos_emb")
    NORM_CLASSES = (nn.LayerNorm,)

    def stage_forward(self, stage: dict, x, first: bool, last: bool, layout=None,
                      positions=None):
        """Run one stage of :meth:`pipeline_stages`: ids (B, S) -> residual stream (B, S,
        h) on the first, (B, S, h) -> logits (B, S, V) on the last.  ``layout`` places
        the residual stream right after the embeddings; ``positions`` (S,) or (B, S): the
        position of each token (default ``arange(S)``; the recipes give (B, S) laid out
        as the ids, as Megatron-LM's position_ids, context parallelism in its ring
        order)."""
        if first:
            S = x.shape[1]
            pos = torch.arange(S, device=self.pos_emb.weight.device) \
                if positions is None else positions
            x = self.tok_emb(x) + self.pos_emb(pos)                         # (B, S, h)
            if layout is not None:
                x = layout(x)
            if self.cfg.embed_norm:
                x = self.emb_norm(x)
            x = dropout(x, self.cfg.dropout, self.training, 0)
        for i in stage["layers"]:
            x = self.layers[i](x)                                           # (B, S, h)
        return self.head(x, stage) if last else x                          # (B, S, V)

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """Megatron's init (Shoeybi et al. 2019, sec. 3): weights N(0, init_std), the
        residual outputs wo and fc2 N(0, init_std / sqrt(2 n_layer)), biases 0,
        LayerNorm weight 1 and bias 0; drawn in float32 on the CPU in
        ``named_parameters`` order."""
        g = torch.Generator().manual_seed(seed)
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if p.is_meta:
                continue
            if p.dim() == 1:
                p.fill_(1.0 if name.endswith("weight") else 0.0)   # LayerNorm weight
                continue
            if name.endswith("_bias"):                  # MoE experts' biases (E, n)
                p.zero_()
                continue
            s = std / math.sqrt(2 * self.cfg.n_layer) \
                if name.endswith(("wo.weight", "fc2.weight", "fc2_weight")) else std
            p.copy_(torch.randn(p.shape, generator=g) * s)

    def forward(self, idx, targets=None, cache=None, position_ids=None, logits_to_keep=0):
        """idx (B, S) token ids -> (logits (B, S, V), loss or None); loss is the mean
        cross-entropy of ``targets`` (B, S), computed in float32.  ``cache`` (generation,
        :class:`workbench.serve.KVCache`): idx are the tokens after the
        ``cache.get_seq_length()`` it holds; their keys and values are appended to it.
        ``position_ids`` (B, S) or (1, S): each token's own position (default: from the
        cache's length on); ``logits_to_keep``: the positions the head runs on, logits
        (B, kept, V) (:mod:`.positions`, Hugging Face's names)."""
        B, S = idx.shape
        if position_ids is None:
            start = 0 if cache is None else cache.get_seq_length()         # tokens before idx
            if start + S > self.cfg.seq_len:
                raise ValueError(f"GPT: sequence of {start + S} tokens is longer than seq_len="
                                 f"{self.cfg.seq_len}; crop it or raise cfg.seq_len")
            pos = torch.arange(start, start + S, device=idx.device)        # (S,)
        else:
            pos = check_position_ids("GPT", position_ids, B, S, self.cfg.seq_len)  # (B, S)
        keep = check_logits_to_keep("GPT", logits_to_keep, S, targets is not None)
        p = self.cfg.dropout if self.training else 0.0
        x = self.tok_emb(idx) + self.pos_emb(pos)                           # (B, S, h)
        if self.cfg.embed_norm:
            x = self.emb_norm(x)
        x = dropout(x, p, self.training, 0)
        for block in self.layers:
            x = block(x, cache=cache)
        if keep is not None:                    # the head on the kept positions only
            x = x[:, keep]                                                  # (B, kept, h)
        logits = self.lm_head(self.norm(x))                                 # (B, S or kept, V)
        if targets is None:
            return logits, None
        flat = logits.reshape(B * S, self.cfg.vocab_size)
        if flat.dtype != torch.float32:
            flat = flat.float()
        return logits, F.cross_entropy(flat, targets.reshape(B * S))
