"""A mixture-of-experts feed-forward layer, for the Llama and the GPT by config.

    cfg = get_config("tiny", moe_experts=4, moe_topk=2)     # every block's MLP is a MoE
    model = build_model(cfg)
    logits, loss = model(idx, targets)                     # loss: the LM loss (see below)
    model.layers[0].mlp.last_stats                         # per-expert load, drops, aux

Per block (``ModelConfig`` fields ``moe_*``), on x (B, S, h):

    logits = router(x)                                      (B, S, E)   bias-free linear
    w, e, slot, aux = router_topk(logits, k, gating, C)     top-k experts per token
    y = combine(experts(dispatch(x, e, slot)), w, e, slot)  (B, S, h)
    y = y + shared(x)                                       optional shared experts

* experts: E MLPs of width d_ff stacked on a leading expert dim (one grouped matmul, as
  Megatron-LM's GroupedMLP): SwiGLU w2(silu(x w1) * x w3) for the Llama (Mixtral, Jiang
  et al. 2024), GeLU fc2(gelu(x fc1 + b1)) + b2 for the GPT (Switch / GShard's FFN);
* router: softmax (Mixtral, GShard) or sigmoid with the DeepSeek-V3 normalisation
  (``workbench.ops.moe``), the k gates renormalised to sum 1, or with
  ``moe_norm_topk=False`` the router's own probabilities (Switch's top-1 gate p_i);
  each sequence is a routing group: capacity per expert
  C = ceil(capacity_factor S k / E) slots per sequence (GShard's group capacity), the
  overflow dropped (the token then passes through the residual only);
  ``moe_capacity_factor=None`` drops nothing;
* shared experts (DeepSeek-V3, Liu et al. 2024, eq. 12; DeepSeekMoE, Dai et al. 2024):
  ``moe_shared_experts`` n_s always-on experts, run as one dense MLP of n_s d_ff.

**The auxiliary load-balancing loss** (Switch, Fedus et al. 2021, eq. 4; with k > 1 every
choice counted in f_i, as Megatron-LM's, not GShard's first choices only), per sequence,
averaged over the batch: alpha E sum_i f_i P_i with alpha = ``moe_aux_loss_coef``.  It
is part of the training objective through its gradient: each layer attaches alpha x (mean of its sequences' aux) to its gate weights with
``wb.ops.attach_aux_loss`` (Megatron-LM's ``MoEAuxLossAutoScaler``), so that
``loss.backward()`` trains on ``lm loss + sum over MoE layers of alpha aux`` whatever runs
the loss (one device, every parallel recipe, every pipeline schedule), while the
returned loss stays the language-model loss, as Megatron-LM reports "lm loss" and
"load_balancing_loss" apart (in training mode only; ``eval()`` attaches nothing).  The
aux value of the last forward: ``last_stats["aux_loss"]`` per layer, :func:`aux_loss` over
a model, and ``moe_aux_loss`` / ``moe_dropped`` in ``train``'s step records.  A recipe that splits a batch into m
micro-batches whose losses it averages sets :attr:`MoE.aux_loss_scale` to 1/m (as
Megatron's ``MoEAuxLossAutoScaler.set_loss_scale``).

Without expert parallelism the experts run as one batched matmul over the (B, E, C, h)
buffers, empty slots included, as GShard's dispatch einsum computes them: with
``moe_capacity_factor=None`` (C = S) the buffers hold E / k times the routed tokens, and the
clock prices that work as done.  Expert parallelism computes the routed rows only.

Expert parallelism plugs in as :attr:`MoE.token_dispatcher` (a callable
``(x, weights, experts, slots, experts_module) -> y``, e.g.
``workbench.parallel.strategies.expert_parallel.ExpertParallel``): it replaces
dispatch, experts and combine; the module and its experts know nothing of meshes.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.moe import (attach_aux_loss, batch_token, capacity, moe_combine, moe_dispatch,
                       router_topk, stats_layers)
from .config import ModelConfig

__all__ = ["MoE", "Experts", "SharedMLP", "aux_loss", "moe_layers"]


class Experts(nn.Module):
    """E expert MLPs, every parameter with the experts on dim 0 (grouped matmuls).

    Llama: ``w1``, ``w3`` (E, h, d_ff), ``w2`` (E, d_ff, h): SwiGLU.
    GPT: ``fc1_weight`` (E, h, d_ff), ``fc1_bias`` (E, d_ff), ``fc2_weight`` (E, d_ff, h),
    ``fc2_bias`` (E, h): GeLU."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, h, f, dt = cfg.moe_experts, cfg.d_model, cfg.d_ff, cfg.torch_dtype
        self.arch, self.num_experts = cfg.arch, E
        shapes = {"w1": (E, h, f), "w3": (E, h, f), "w2": (E, f, h)} if cfg.arch == "llama" \
            else {"fc1_weight": (E, h, f), "fc1_bias": (E, f), "fc2_weight": (E, f, h),
                  "fc2_bias": (E, h)}
        for name, shape in shapes.items():
            self.register_parameter(name, nn.Parameter(torch.empty(shape, dtype=dt)))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Each expert as ``nn.Linear`` initializes itself: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
        for weights and biases (its kaiming_uniform_ with a = sqrt(5)), so that a layer
        built on its own computes with numbers, not uninitialized memory (the models
        replace this with their own init, drawn from their seed)."""
        for name, p in self._parameters.items():
            if p.is_meta:
                continue                                    # shape-only: nothing to fill
            fan_in = self._parameters[name.replace("bias", "weight")].shape[-2]
            bound = 1 / math.sqrt(fan_in)
            nn.init.uniform_(p, -bound, bound)

    def expert_forward(self, x, params: dict):
        """One expert (``params``: its tensors, the expert dim removed) on tokens x (n, h),
        or every expert at once on buffers (G, E, C, h) (``params`` with the expert dim,
        biases shaped (E, 1, n) to broadcast)."""
        if self.arch == "llama":
            return (F.silu(x @ params["w1"]) * (x @ params["w3"])) @ params["w2"]
        hidden = F.gelu(x @ params["fc1_weight"] + params["fc1_bias"])
        return hidden @ params["fc2_weight"] + params["fc2_bias"]

    def forward(self, buf):
        """(G, E, C, h) dispatched tokens -> (G, E, C, h) every expert's outputs."""
        # read as attributes, not from _parameters: a wrapper that swaps in the gathered
        # weights (ZeRO-3 / FSDP's pre-forward hook sets the attribute) is then seen
        params = {n: getattr(self, n) for n in self._parameters}
        params = {n: p.unsqueeze(-2) if n.endswith("bias") else p for n, p in params.items()}
        return self.expert_forward(buf, params)


class SharedMLP(nn.Module):
    """The shared experts: one dense MLP of ``n_shared x d_ff`` (SwiGLU or GeLU)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, f, dt = cfg.d_model, cfg.d_ff * cfg.moe_shared_experts, cfg.torch_dtype
        self.arch = cfg.arch
        if cfg.arch == "llama":
            self.w1 = nn.Linear(h, f, bias=False, dtype=dt)
            self.w3 = nn.Linear(h, f, bias=False, dtype=dt)
            self.w2 = nn.Linear(f, h, bias=False, dtype=dt)
        else:
            self.fc1 = nn.Linear(h, f, dtype=dt)
            self.fc2 = nn.Linear(f, h, dtype=dt)

    def forward(self, x):
        if self.arch == "llama":
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.fc2(F.gelu(self.fc1(x)))


class MoE(nn.Module):
    """Router, E routed experts, optional shared experts (module docstring)."""

    # what record_stats writes (a compiled program calls it on each run: wb.compile's
    # guards do not hold these as values the program read)
    STATS_WRITES = ("_last", "_batch")

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, h, dt = cfg.moe_experts, cfg.d_model, cfg.torch_dtype
        self.num_experts, self.k = E, cfg.moe_topk
        self.gating, self.capacity_factor = cfg.moe_gating, cfg.moe_capacity_factor
        self.norm_topk = cfg.moe_norm_topk
        self.aux_loss_coef = cfg.moe_aux_loss_coef
        self.aux_loss_scale = 1.0       # 1/m when a recipe averages m micro-batch losses
        self.dropout = cfg.dropout
        self.index = 0                  # the block's number (the Llama numbers dropout sites)
        self.router = nn.Linear(h, E, bias=False, dtype=dt)
        self.experts = Experts(cfg)
        self.shared = SharedMLP(cfg) if cfg.moe_shared_experts else None
        self.token_dispatcher = None    # expert parallelism's (module docstring)
        self._last = None               # [(e, slot, aux, C)]: the last batch's forwards
        self._batch = None              # ops.moe.batch_token() of that batch

    def forward(self, x):
        B, S, h = x.shape                                                   # (B, S, h)
        E, k = self.num_experts, self.k
        C = capacity(S, E, k, self.capacity_factor)
        logits = self.router(x)                                             # (B, S, E)
        w, e, slot, aux = router_topk(logits, k, self.gating,
                                      None if self.capacity_factor is None else C,
                                      normalize=self.norm_topk)
        sink = stats_layers()
        if sink is not None:
            # workbench.compile captures this forward: the compiled program records each
            # call's routing (its router_topk node's) with record_stats, in this order
            sink.append(self)
        elif torch._C._current_graph_task_id() == -1:
            # (not an activation checkpoint's recompute in backward: torch.utils.checkpoint
            # reruns this forward inside the autograd engine, where the graph task id is
            # set, torch 2.13 torch/utils/checkpoint.py reads the same id; it routes the
            # same tokens again, one simulated rank at a time outside one_batch, so it
            # would replace the batch's stats with one rank's rows: the forward's stand)
            self.record_stats(e, slot, aux)
        if self.training and self.aux_loss_coef > 0:
            # alpha * mean over the B sequences: d/d aux_b = alpha / B (x the recipe's 1/m);
            # attached to the gates, which the layer consumes, so that its output is a
            # tensor of its own (a user may change it in place, as any module's output)
            w = attach_aux_loss(w, aux, self.aux_loss_coef * self.aux_loss_scale / max(1, B))
        if self.token_dispatcher is not None:
            y = self.token_dispatcher(x, w, e, slot, self.experts)          # (B, S, h)
        else:
            buf = moe_dispatch(x, e, slot, E, C)                            # (B, E, C, h)
            y = moe_combine(self.experts(buf), w, e, slot)                  # (B, S, h)
        if self.shared is not None:
            y = y + self.shared(x)
        return y

    def record_stats(self, e, slot, aux) -> None:
        """Keep one forward's routing (``router_topk``'s experts, slots and aux) for
        :attr:`last_stats`: another simulated rank's rows of the same batch are added."""
        part, tok = (e, slot, aux.detach(), capacity(e.shape[1], self.num_experts, self.k,
                                                     self.capacity_factor)), batch_token()
        if tok is not None and tok is self._batch:      # another simulated rank's rows
            self._last.append(part)
        else:
            self._last, self._batch = [part], tok

    def add_stats_of(self, other: "MoE") -> None:
        """Add ``other``'s routing of the same batch (a second copy of this layer that ran
        some of the batch's micro-batches: DualPipe's copy fed from the last rank) to this
        layer's :attr:`last_stats`; a routing of another batch is left out."""
        tok = batch_token()
        if tok is None or other._batch is not tok or not other._last:
            return
        if self._batch is tok:
            self._last = self._last + other._last
        else:
            self._last, self._batch = list(other._last), tok

    @property
    def last_stats(self) -> dict:
        """The last forward's routing: ``tokens_per_expert`` (E,) assignments routed to
        each expert (before dropping), ``dropped`` assignments over capacity, ``routed``
        all assignments (B S k), ``capacity`` slots per expert per sequence, ``aux_loss``
        (alpha x the batch mean of the per-sequence loss).  Gathered on request (on
        DistTensors, outside any trace the step records).  Under a simulated data-parallel
        wrapper (``wb.DistributedDataParallel``, ``FullyShardedDataParallel``), which runs
        this layer once per rank on that rank's rows, the whole batch's: every rank's
        counts summed and the aux mean over all its sequences, as one device reports
        (``ops.moe.one_batch``); under torchrun each process's own rows, as torch's."""
        if self._last is None:
            raise RuntimeError("MoE.last_stats: run a forward first")
        parts = [tuple(t.full() if hasattr(t, "full") else t for t in p[:3]) for p in self._last]
        C = self._last[0][3]
        if any(p[3] != C for p in self._last):
            raise RuntimeError(f"MoE.last_stats: the ranks' forwards of one batch had "
                               f"capacities {[p[3] for p in self._last]} (sequence lengths "
                               "differ); read each rank's stats under torchrun instead")
        e = torch.cat([p[0].reshape(-1) for p in parts])
        slot = torch.cat([p[1].reshape(-1) for p in parts])
        aux = torch.cat([p[2].reshape(-1) for p in parts])
        return {"tokens_per_expert": torch.bincount(e, minlength=self.num_experts),
                "dropped": int((slot < 0).sum()), "routed": e.numel(), "capacity": C,
                # the mean in the loss's own precision, at least float32 (a float64
                # model's in float64)
                "aux_loss": float(aux.to(torch.promote_types(aux.dtype, torch.float32))
                                  .mean()) * self.aux_loss_coef if aux.numel() else 0.0}


def moe_layers(model: nn.Module) -> list[MoE]:
    """The model's MoE layers, in module order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def aux_loss(model: nn.Module) -> float:
    """The load-balancing loss of the model's last forward: the sum over its MoE layers of
    alpha x the batch mean of the per-sequence Switch loss (what backward adds)."""
    return sum(m.last_stats["aux_loss"] for m in moe_layers(model))
