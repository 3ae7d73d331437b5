"""A small Llama-style decoder-only transformer, built from ``workbench.ops``.

    from workbench.models import Llama, get_config
    model = Llama(get_config("tiny"), seed=0)
    logits, loss = model(idx, targets)           # idx, targets: (B, S) token ids
    logits, _ = model(idx, position_ids=pos, logits_to_keep=1)   # pos (B, S): positions.py

Per block (pre-norm, residual stream of width h = d_model):

    x = x + Attention(RMSNorm(x))      q, k, v, o: four bias-free linears; RoPE on q, k;
                                       causal attention through wb.ops.flash_attention
    x = x + MLP(RMSNorm(x))            SwiGLU: w2(silu(w1 x) * w3 x)

Written to run unchanged on DistTensors under tensor parallelism: q, k, v and
gate/up are separate ``nn.Linear`` layers, so sharding each "colwise" splits the
heads / the hidden features cleanly, and o, down "rowwise" produce partial sums
(Megatron-LM's f/g pattern; :data:`TP_PLAN`).  Only ops with SPMD rules appear
here: linear, embedding, view/reshape/transpose, element-wise ops, silu,
dropout, cross_entropy and the wb.ops kernels.  Shapes use B batch, S sequence,
h d_model, nh query heads, nkv key/value heads, hd head dim, V vocabulary.

``recompute`` (per block, :attr:`Block.recompute`):
  "none"      keep every activation for backward;
  "full"      checkpoint the whole block: keep its input only (2 sbh bytes in
              16 bit), recompute the block in backward (Chen et al. 2016);
  "selective" checkpoint only the attention core, softmax(q k^T) v with its
              dropout, the part with the most activation per FLOP (Korthikanti
              et al. 2022, sec. 4.2).  With a fused FlashAttention kernel that core
              keeps only O(S) statistics anyway, so the saving shows most on the
              "unfused" ops backend;
  "op"        torchtitan's op-level selective checkpointing (:mod:`.op_sac`): the
              block is one checkpoint region in which PyTorch's selective
              checkpointing keeps the outputs of q, v, w1, w2 (every second GEMM
              re-run: k, o, w3) and of the attention kernel, and re-runs the rest.

References: Touvron et al. 2023 (Llama); Su et al. 2021 (RoPE); Zhang & Sennrich
2019 (RMSNorm); Shazeer 2020 (SwiGLU); Ainslie et al. 2023 (GQA); Shoeybi et
al. 2019 (Megatron-LM tensor parallelism); Karpathy, nanoGPT (structure).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..ops import flash_attention, rms_norm, rope_cos_sin, rotary_embedding
from ..sim_mesh import rng
from .config import ModelConfig
from . import op_sac
from .moe import MoE
from .positions import check_logits_to_keep, check_position_ids
from .split import Splittable

__all__ = ["Llama", "Block", "Attention", "MLP", "RMSNorm", "TP_PLAN"]

# Megatron-style tensor parallelism for ``wb.parallelize(model, mesh, TP_PLAN)``:
# column-parallel q, k, v and gate/up (each rank owns whole heads / hidden features),
# row-parallel o and down (partial sums, reduced once per sublayer).
TP_PLAN = {
    "layers.*.attn.wq": "colwise", "layers.*.attn.wk": "colwise",
    "layers.*.attn.wv": "colwise", "layers.*.attn.wo": "rowwise",
    "layers.*.mlp.w1": "colwise", "layers.*.mlp.w3": "colwise",
    "layers.*.mlp.w2": "rowwise",
}


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, no bias, no re-centring (Zhang & Sennrich 2019)."""

    def __init__(self, dim: int, eps: float, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


def dropout(x, p: float, training: bool, site: int):
    """``F.dropout``; under keyed masks (:mod:`workbench.sim_mesh.rng`, as ``train`` runs
    it) the mask of call number ``site``, the same whatever the layout."""
    if not training or p == 0 or not rng.is_keyed():
        return F.dropout(x, p, training)
    with rng.site(site):
        if isinstance(x, torch.Tensor):          # one device: the mask the rule would draw
            # drawn by the CPU generator whatever the device (a CUDA or NPU run keeps the
            # CPU run's masks, so its losses match), then moved to the tensor's device
            return x * rng.draw_mask(tuple(x.shape), p, x.dtype).to(x.device)
        return F.dropout(x, p, training)         # a DistTensor: the rule draws and slices


def attention_core(q, k, v, dropout_p: float = 0.0, site: int = 0, ctx=None):
    """softmax(q k^T / sqrt(hd)) v, causal: the part "selective" recompute recomputes.

    With attention dropout under keyed masks (``ctx``: :func:`rng.context` when the
    forward ran) the weights are computed explicitly, so their dropout is an op of
    its own whose mask every layout slices from one device's; otherwise the fused
    kernel."""
    if dropout_p == 0 or ctx is None or ctx[0] is None:
        return flash_attention(q, k, v, causal=True, dropout_p=dropout_p)   # (B, nh, S, hd)
    with rng.restore(ctx):
        B, nh, S, hd = q.shape
        nkv = k.shape[1]
        q5 = q.view(B, nkv, nh // nkv, S, hd)                               # (B, nkv, G, S, hd)
        s = (q5 @ k.unsqueeze(2).transpose(-2, -1)) * hd ** -0.5            # (B, nkv, G, S, S)
        s = s + torch.full((S, S), float("-inf"), dtype=q.dtype, device=q.device).triu(1)
        w = dropout(torch.softmax(s, -1), dropout_p, True, site)
        return (w @ v.unsqueeze(2)).reshape(B, nh, S, hd)                   # (B, nh, S, hd)


class Attention(nn.Module):
    """Causal self-attention with rotary positions and grouped-query heads."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, hd, dt = cfg.d_model, cfg.head_dim, cfg.torch_dtype
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, hd
        self.dropout = cfg.dropout
        self.index = 0                  # the block's number (Llama sets it): dropout sites
        self.wq = nn.Linear(h, cfg.n_head * hd, bias=False, dtype=dt)
        self.wk = nn.Linear(h, cfg.n_kv_head * hd, bias=False, dtype=dt)
        self.wv = nn.Linear(h, cfg.n_kv_head * hd, bias=False, dtype=dt)
        self.wo = nn.Linear(cfg.n_head * hd, h, bias=False, dtype=dt)

    def forward(self, x, cos, sin, recompute_core: bool = False, cache=None):
        B, S, _ = x.shape                                                   # (B, S, h)
        q = self.wq(x).view(B, S, self.n_head, self.head_dim).transpose(1, 2)     # (B, nh, S, hd)
        k = self.wk(x).view(B, S, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, nkv, S, hd)
        v = self.wv(x).view(B, S, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, nkv, S, hd)
        q = rotary_embedding(q, cos, sin)                                   # cos, sin: (S, hd)
        k = rotary_embedding(k, cos, sin)
        p = self.dropout if self.training else 0.0
        site, ctx = 1 + 3 * self.index, rng.context()   # keyed dropout: call numbers
        if cache is not None:           # generation: keys/values appended, attends to all
            y = cache.attend(self.index, q, k, v)                           # (B, nh, S, hd)
        elif recompute_core and torch.is_grad_enabled():
            y = checkpoint(attention_core, q, k, v, p, site, ctx,
                           use_reentrant=False)                             # (B, nh, S, hd)
        else:
            with op_sac.attention_core():       # its GEMMs are not the block's linears'
                y = attention_core(q, k, v, p, site, ctx)                   # (B, nh, S, hd)
        y = y.transpose(1, 2).reshape(B, S, self.n_head * self.head_dim)   # (B, S, h)
        return dropout(self.wo(y), p, self.training, site + 1)              # (B, S, h)


class MLP(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020): w2(silu(w1 x) * w3 x), d_ff hidden features."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, f, dt = cfg.d_model, cfg.d_ff, cfg.torch_dtype
        self.dropout = cfg.dropout
        self.index = 0                  # the block's number (Llama sets it): dropout sites
        self.w1 = nn.Linear(h, f, bias=False, dtype=dt)    # gate
        self.w3 = nn.Linear(h, f, bias=False, dtype=dt)    # up
        self.w2 = nn.Linear(f, h, bias=False, dtype=dt)    # down

    def forward(self, x):
        # Two separate linears, not wb.ops.swiglu on one concatenated (gate | up) output:
        # under column-parallel sharding a rank would hold a slice of the concatenation,
        # not matching halves of gate and up; separate linears keep them on one rank.
        hidden = F.silu(self.w1(x)) * self.w3(x)                            # (B, S, d_ff)
        return dropout(self.w2(hidden), self.dropout, self.training,
                       3 + 3 * self.index)                                  # (B, S, h)


class Block(nn.Module):
    """Pre-norm transformer block; ``recompute`` is "none", "full", "selective" or "op"."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.recompute = cfg.recompute
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.torch_dtype)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.torch_dtype)
        self.mlp = MoE(cfg) if cfg.moe_experts else MLP(cfg)     # models/moe.py

    def forward(self, x, cos, sin, cache=None):
        if self.recompute == "full" and torch.is_grad_enabled() and cache is None:
            return checkpoint(self._forward, x, cos, sin, rng.context(), use_reentrant=False)
        if self.recompute == "op" and torch.is_grad_enabled() and cache is None:
            if isinstance(self.mlp, MoE):
                raise ValueError("Block: recompute='op' is built for the dense Llama block "
                                 "(models/op_sac.py), not a mixture of experts; use 'none', "
                                 "'selective' or 'full'")
            return checkpoint(self._forward, x, cos, sin, rng.context(), use_reentrant=False,
                              context_fn=op_sac.context_fn)
        return self._forward(x, cos, sin, cache=cache)

    def _forward(self, x, cos, sin, ctx=None, cache=None):
        if ctx is not None:             # recomputed in backward: the forward's dropout keys
            with rng.restore(ctx):
                return self._forward(x, cos, sin)
        x = x + self.attn(self.attn_norm(x), cos, sin,                      # (B, S, h)
                          recompute_core=self.recompute == "selective", cache=cache)
        h = self.mlp(self.mlp_norm(x))                                      # (B, S, h)
        if isinstance(self.mlp, MoE):                  # the dense MLP drops out inside
            h = dropout(h, self.mlp.dropout, self.training, 3 + 3 * self.mlp.index)
        return x + h


class Llama(Splittable, nn.Module):
    """Token embedding, ``n_layer`` blocks, final RMSNorm, lm head.  Deterministic init
    from ``seed`` (a private generator: the global RNG is neither read nor advanced)."""

    def __init__(self, cfg: ModelConfig, seed: int = 0):
        super().__init__()
        if cfg.arch != "llama":
            raise ValueError(f"Llama: cfg.arch={cfg.arch!r}; build it with "
                             f"workbench.models.build_model(cfg), or set arch='llama'")
        self.cfg = cfg
        dt = cfg.torch_dtype
        with torch.random.fork_rng(devices=[]):    # torch's default init draws; ours replaces it
            # _weight given: skip nn.Embedding's normal_ init, which on "meta" imports
            # torch's compiler stack (seconds); reset_parameters below fills it
            self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model,
                                        _weight=torch.empty(cfg.vocab_size, cfg.d_model, dtype=dt))
            self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
            self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, dt)
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False, dtype=dt)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight       # one (V, h) matrix, used twice
        for i, block in enumerate(self.layers):             # numbers the dropout calls
            block.attn.index = block.mlp.index = i
        # computed on the CPU, then moved: on "meta" the float64 formula would pull in
        # torch's Python decompositions (seconds of import for a shape-only model)
        cos, sin = rope_cos_sin(cfg.seq_len, cfg.head_dim, base=cfg.rope_theta, dtype=dt,
                                device="cpu")
        device = self.tok_emb.weight.device
        cos, sin = cos.to(device), sin.to(device)
        self.register_buffer("rope_cos", cos, persistent=False)             # (seq_len, hd)
        self.register_buffer("rope_sin", sin, persistent=False)             # (seq_len, hd)
        self.reset_parameters(seed)

    # ---- how the model splits (models/split.py) --------------------------------------------
    TP_BLOCK_PLAN = TP_PLAN
    NORM_CLASSES = (RMSNorm,)

    def stage_forward(self, stage: dict, x, first: bool, last: bool, layout=None):
        """Run one stage of :meth:`pipeline_stages`: ids (B, S) -> residual stream (B, S,
        h) on the first, (B, S, h) -> logits (B, S, V) on the last.  ``layout`` (a
        function) places the residual stream right after the embedding."""
        if first:
            x = self.tok_emb(x)                                             # (B, S, h)
            if layout is not None:
                x = layout(x)
            x = dropout(x, self.cfg.dropout, self.training, 0)
        S = x.shape[1]
        cos, sin = self.rope_cos[:S], self.rope_sin[:S]                     # (S, hd)
        for i in stage["layers"]:
            x = self.layers[i](x, cos, sin)                                 # (B, S, h)
        return self.head(x, stage) if last else x                          # (B, S, V)

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """N(0, init_std) for embeddings and linears, init_std / sqrt(2 n_layer) for the
        residual outputs o and w2 (GPT-2), ones for RMSNorm.  Drawn in float32 on the
        CPU in ``named_parameters`` order, so every device and dtype gets the same model."""
        g = torch.Generator().manual_seed(seed)
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if p.is_meta:
                continue                                    # shape-only model: nothing to fill
            if p.dim() == 1:                                # RMSNorm weights
                p.fill_(1.0)
                continue
            s = std / math.sqrt(2 * self.cfg.n_layer) if name.endswith(("wo.weight", "w2.weight", "experts.w2")) \
                else std
            p.copy_(torch.randn(p.shape, generator=g) * s)

    def forward(self, idx, targets=None, cache=None, position_ids=None, logits_to_keep=0):
        """idx (B, S) token ids -> (logits (B, S, V), loss or None); loss is the mean
        cross-entropy of ``targets`` (B, S).  ``cache`` (generation,
        :class:`workbench.serve.KVCache`): idx are the tokens after the
        ``cache.get_seq_length()`` it holds; their keys and values are appended to it.
        ``position_ids`` (B, S) or (1, S): each token's own position (default: from the
        cache's length on); ``logits_to_keep``: the positions the head runs on, logits
        (B, kept, V) (:mod:`.positions`, Hugging Face's names)."""
        B, S = idx.shape
        if position_ids is None:
            pos = 0 if cache is None else cache.get_seq_length()           # tokens before idx
            if pos + S > self.cfg.seq_len:
                raise ValueError(f"Llama: sequence of {pos + S} tokens is longer than seq_len="
                                 f"{self.cfg.seq_len}; crop it or raise cfg.seq_len")
        else:
            check_position_ids("Llama", position_ids, B, S, self.cfg.seq_len)
        keep = check_logits_to_keep("Llama", logits_to_keep, S, targets is not None)
        p = self.cfg.dropout if self.training else 0.0
        x = dropout(self.tok_emb(idx), p, self.training, 0)                 # (B, S, h)
        if position_ids is None:
            cos, sin = self.rope_cos[pos:pos + S], self.rope_sin[pos:pos + S]   # (S, hd)
        else:                           # per token, broadcast over the heads
            cos = self.rope_cos[position_ids].unsqueeze(1)                  # (B, 1, S, hd)
            sin = self.rope_sin[position_ids].unsqueeze(1)
        for block in self.layers:
            x = block(x, cos, sin, cache=cache)                             # (B, S, h)
        if keep is not None:                    # the head on the kept positions only
            x = x[:, keep]                                                  # (B, kept, h)
        logits = self.lm_head(self.norm(x))                                 # (B, S or kept, V)
        if targets is None:
            return logits, None
        flat = logits.reshape(B * S, self.cfg.vocab_size)                   # (B*S, V)
        if flat.dtype != torch.float32:
            flat = flat.float()                                             # loss in fp32
        return logits, F.cross_entropy(flat, targets.reshape(B * S))
