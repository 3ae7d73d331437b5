"""Context-parallel training of the course's models: the sequence sharded over "cp" ranks.

    Hybrid recipe's mesh, with a "cp" dim between dp and tp (Megatron-LM's rank order
    tp, cp, dp from fastest to slowest): Mesh.grid((dp, cp, tp), ["dp", "cp", "tp"]),
    the dp and tp dims left out where they have one rank (fewer placements to choose
    from: the rules' first call on a layout is much faster on fewer mesh dims)

What changes against :class:`~workbench.recipes.hybrid.Hybrid` (pp = 1):

* the token ids are laid out on the ring before the embedding
  (:func:`~workbench.parallel.strategies.context_parallel.to_ring_layout`): rank i of cp
  holds chunks i and 2cp-1-i of every sequence (causal load balancing) and embeds those
  tokens only, as Megatron-LM slices each cp rank's batch up front, so every op but
  attention runs on cp-sharded tokens unchanged;
* attention runs as ring attention (``context_parallel(mesh, "cp")`` while forward runs),
  or with ``cp_comm="a2a"`` as DeepSpeed-Ulysses' all-to-all attention (Megatron-LM's
  ``--cp-comm-type a2a``: ``strategies.context_parallel_a2a``; each tp rank's heads
  dividing by cp, split further over cp as Megatron-LM with Transformer Engine does; the
  ring layout stays, each rank reorders the gathered sequence);
* with sequence parallelism (``sp``, tp > 1) each cp rank's tokens are sharded over tp
  as well (Megatron-LM runs SP inside each cp rank): the rules put Megatron SP's
  all-gathers and reduce-scatters on tp around the linears, the ring stays on cp, and
  the norms' partial gradients are summed over tp once per step;
* positions follow the chunks: the GPT looks its learned position embeddings up at the
  ring order's positions, sharded as the ids (so each token keeps its own), the Llama's
  RoPE tables are laid out with ``to_ring_layout`` for the step, their order recorded
  (as PyTorch's ``context_parallel(..., buffers=[freqs_cis])`` shards them; a plain
  table beside the ring-ordered q is refused, ``seq_order.check_op``);
* the targets are put in the same ring order and sharded the same way, so the
  cross-entropy over the cp-sharded logits is the global mean over every token, exactly;
* gradients: the parameters are data-parallel replicas over dp x cp (one copy per
  rank of the pair, each keeping the gradient of its own tokens), summed after backward
  by one all-reduce over the dp x cp group in one buffer, as Megatron-Core reduces
  gradients over its data-parallel group "with context parallel"
  (``parallel_state.get_data_parallel_group(with_context_parallel=True)``, the group of
  its ``DistributedDataParallel``; :mod:`~workbench.parallel.strategies.flat_dims`).
  ZeRO 1/2 shard the optimizer states over that same dp x cp group (cp alone without
  dp): one reduce-scatter of the gradient buffer and one all-gather of the updated
  parameters over dp*cp ranks (:class:`~workbench.parallel.strategies.zero_optimizer_dist.
  ChunkedZeroOptimizer` on the merged group).  Megatron-Core's distributed optimizer
  shards over the same group (NVIDIA/Megatron-LM d98e8a6:
  ``megatron/core/process_groups_config.py:373-378`` takes ``dp_cp_group`` /
  ``intra_dp_cp_group`` from ``get_data_parallel_group(with_context_parallel=True)``,
  ``megatron/core/optimizer/__init__.py:1204`` builds the dense optimizer on it, of
  dp*cp ranks with one optimizer instance, ``parallel_state.py:927-929``); torchtitan
  shards FSDP2 over "fsdp" = dp_shard x cp (pytorch/torchtitan b5bcd76:
  ``torchtitan/distributed/parallel_dims.py:225-228,281``, the mesh
  ``models/llama3/parallelize.py:62-65`` hands ``fully_shard``; older torchtitan named
  it "dp_shard_cp").  ZeRO-3 is that FSDP: :class:`~workbench.recipes.zero3_stage.
  Zero3Stage` over (dp, cp), each rank holding chunk d * cp + c of every parameter, the
  layers' all-gathers and reduce-scatters over the dp*cp ranks (with sequence
  parallelism the norms' tp partial gradients are summed per use, as Hybrid's ZeRO-3).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from ..models.config import build_model as _build
from ..parallel.dist_tensor import shard_tensor
from ..parallel.module import dist_parameters, parallelize
from ..parallel.placement import Replicate, Shard
from ..parallel.strategies.context_parallel import (check_ring, context_parallel,
                                                    slot_positions, to_ring_layout)
from ..parallel.strategies.context_parallel_a2a import CP_COMMS, check_ulysses_heads
from ..parallel.strategies.data_parallel import DataParallel
from ..parallel.reshard import reshard
from ..parallel.seq_order import ring_order_of, set_ring_order
from ..parallel.strategies.tensor_parallel import (megatron_f, sequence_parallel_norms,
                                                   sequence_parallel_params,
                                                   tensor_parallel_region)
from ..sim_mesh.mesh import Mesh
from ..train_checks import check_world
from .hybrid import _FAILED_STEP, ONE_BUFFER, Hybrid
from .moe import keep_sequence_order
from .zero3_stage import Zero3Stage

__all__ = ["ContextParallel", "cp_mesh"]


def cp_mesh(dp: int, cp: int, tp: int) -> Mesh:
    """The (dp, cp, tp) mesh over ranks 0 .. dp*cp*tp - 1, tp fastest; dp and tp only
    where they have more than one rank."""
    dims = [(n, s) for n, s in (("dp", dp), ("cp", cp), ("tp", tp)) if s > 1 or n == "cp"]
    return Mesh.grid(tuple(s for _, s in dims), [n for n, _ in dims])


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class ContextParallel(Hybrid):
    """DP x CP x TP training (see the module docstring); ``balanced``: causal load
    balancing (rank i holds chunks i and 2cp-1-i), else contiguous slots; ``cp_comm``:
    "p2p" (ring attention) or "a2a" (DeepSpeed-Ulysses), Megatron-LM's --cp-comm-type."""

    name = "context_parallel"

    def __init__(self, cp=2, dp=1, tp=1, pp=1, sp=False, zero=0, balanced: bool = True,
                 distributed: bool = False, regather: bool = True, cp_comm: str = "p2p",
                 **unused):
        if not _int(cp) or cp < 1:
            raise ValueError(f"ContextParallel(cp={cp!r}): give an int >= 2, the number of "
                             "ranks the sequence is sharded over")
        if cp == 1:
            # the ring's layout and attention assume a sequence split over the cp dim: at
            # cp = 1 attention refused a query replicated on it (every zero stage), so
            # refuse here, before a model is built, with the recipe that runs this layout
            raise ValueError(f"ContextParallel(cp=1): the sequence is not split, so there is "
                             f"no context parallelism to run; use cp >= 2, or for plain data "
                             f"/ tensor parallelism Hybrid(dp={dp!r}, tp={tp!r}, sp={sp!r}, "
                             f"zero={zero!r}) (workbench.recipes.hybrid)")
        if pp != 1:
            raise NotImplementedError(f"cp={cp} with pp={pp}: context parallelism with "
                                      "pipeline stages is not built yet; use pp=1")
        if sp and tp == 1:
            raise ValueError(f"cp={cp} with sp and tp=1: sequence parallelism shards each cp "
                             "rank's tokens over tp; give tp > 1 or leave sp off")
        if not isinstance(balanced, bool):
            raise TypeError(f"ContextParallel(balanced={balanced!r}): give True or False")
        if cp_comm not in CP_COMMS:
            raise ValueError(f"ContextParallel(cp_comm={cp_comm!r}): give one of {CP_COMMS} "
                             "(Megatron-LM's --cp-comm-type: the ring, or DeepSpeed-Ulysses' "
                             "all-to-all)")
        if unused:
            raise TypeError(f"ContextParallel: unknown arguments {sorted(unused)}")
        check_world(dp * cp, tp, 1, f"dp={dp}, cp={cp}, tp={tp}")
        super().__init__(dp=dp, tp=tp, pp=1, sp=sp, zero=zero, distributed=False,
                         regather=regather)
        self.cp, self.balanced, self.distributed = cp, balanced, distributed
        self.cp_comm = cp_comm
        self.meshes = [cp_mesh(dp, cp, tp)]
        if distributed:                 # one rank per process on torch.distributed
            from ..sim_mesh import backends as _B
            if _B.world_size() != dp * cp * tp:
                raise ValueError(f"{_B.world_size()} processes for dp x cp x tp = "
                                 f"{dp * cp * tp} ranks: launch torchrun --nproc-per-node "
                                 f"{dp * cp * tp}")
            self.meshes = [_B.register(m) for m in self.meshes]

    def check(self, cfg, batch_size: int) -> None:
        super().check(cfg, batch_size)
        check_ring(cfg.seq_len, self.cp, self.balanced, f"cp={self.cp} (seq_len={cfg.seq_len})")
        if self.cp_comm == "a2a":
            check_ulysses_heads(cfg.n_head, getattr(cfg, "n_kv_head", None) or cfg.n_head,
                                self.cp, f"ContextParallel(cp={self.cp}, tp={self.tp})",
                                self.tp)
        if self.sp and (cfg.seq_len // self.cp) % self.tp:
            raise ValueError(f"cp={self.cp} with sp and tp={self.tp}: each cp rank's "
                             f"{cfg.seq_len // self.cp} tokens do not divide by tp; use a "
                             f"seq_len that is a multiple of {2 * self.cp * self.tp}")
        if getattr(cfg, "moe_experts", 0) and self.distributed and \
                batch_size % (self.dp * self.cp):
            raise ValueError(f"cp={self.cp} with a mixture of experts under torch.distributed: "
                             f"each cp rank routes whole sequences of its own, so the batch "
                             f"({batch_size}) must be a multiple of dp x cp = "
                             f"{self.dp * self.cp} (recipes/moe.py: keep_sequence_order)")
        if cfg.dropout > 0:
            # (the fix named "cp=1", which ContextParallel refuses: no context to split)
            raise ValueError(f"cp={self.cp} with dropout={cfg.dropout}: attention dropout on "
                             "the ring is not built; train with dropout 0 "
                             "(cfg.replace(dropout=0.0)), or without context parallelism: "
                             f"Hybrid(dp={self.dp}, tp={self.tp})")

    # ---- the model and its optimizer ------------------------------------------------------
    def build_model(self, cfg, seed: int):
        """The model, tensor-parallel over tp (Megatron's plan, f and g), replicated over
        cp and dp."""
        with self.device:
            model = _build(cfg, seed=seed).train()
        self.cfg = cfg
        self.stages = model.pipeline_stages(1)
        self.stage_layers = [st["layers"] for st in self.stages]
        mesh = self.meshes[0]
        parallelize(model, mesh, model.tp_plan(self.tp), mesh_dim="tp" if self.tp > 1 else "cp")
        if self.tp > 1:
            for name in model.tp_regions(self.stages[0]["layers"]):
                tensor_parallel_region(model.get_submodule(name), mesh, "tp", self.sp,
                                       seq_dim=1, regather=self.regather,
                                       origin=type(self).__name__)
        # SP: the norms' gradients are partial sums over tp, summed once per step (ZeRO-3:
        # per use, as Hybrid's, the gathered copies' reduce-scatter sums them over dp x cp)
        self._sp_norms = {0: sequence_parallel_norms(model, mesh, model.norm_classes())
                          if self.sp and self.zero != 3 else []}
        plan = model.tp_plan(self.tp)
        if self.sp and self.zero != 3 and self.tp > 1 and \
                "lm_head" in self.stages[0]["modules"] and "lm_head" not in plan:
            # SP, an untied head replicated over tp (a vocabulary tp does not divide) after
            # the final norm's sequence shards: its gradient is a partial sum over tp, as a
            # norm's, summed with them once per step (Hybrid's; Megatron-LM's
            # finalize_model_grads). Was a separate all-reduce in backward (fixlist14)
            self._sp_norms[0] += sequence_parallel_params(model.lm_head, mesh)
        if self.sp and self.tp > 1 and "lm_head" in plan:
            # SP, vocabulary-parallel head: Megatron's output layer, a ColumnParallelLinear
            # with sequence_parallel, all-gathers the final norm's sequence shards (within
            # the cp rank's tokens) and leaves the logits vocabulary-sharded for the
            # vocab-parallel cross-entropy; Megatron's f on the head's input, as Hybrid's.
            # Was (fixlist14): the dispatcher's plan gathered the head's weight over tp
            # (and reduce-scattered its gradient) and the loss read whole-vocabulary logits
            ax = mesh.dim("tp")
            model.get_submodule("norm").register_forward_hook(
                lambda mod, args, out, ax=ax: megatron_f(
                    out, ax, True, seq_dim=1, regather=self.regather,
                    origin=type(self).__name__))
        # MoE layers: route in sequence order, hand the ring its layout back (recipes/moe.py)
        keep_sequence_order(model, "cp", self.balanced)
        return model

    def build_optimizer(self, model, lr: float, weight_decay: float):
        """Data parallelism over dp x cp, ZeRO 1/2 sharded over the same dp x cp ranks,
        ZeRO-3 (FullyShardedDataParallel over the DistTensors) too (module docstring)."""
        dims = "cp" if self.dp == 1 else ("dp", "cp")
        self._shards = {}
        if self.zero == 3:
            holder = nn.ModuleList([model.get_submodule(n) for n in self.stages[0]["modules"]])
            opt = Zero3Stage(holder, self.meshes[0], dims, lr=lr, weight_decay=weight_decay)
            self._shards[0] = [e[3] for e in opt.entries]
            return [opt]
        params = [p for _, p in dist_parameters(model)]
        return [DataParallel(params, self.meshes[0], dims,
                             zero=self.zero, bucket_bytes=ONE_BUFFER if self.zero == 0 else None,
                             lr=lr, weight_decay=weight_decay,
                             partial_grads=self._sp_norms[0])]

    # ---- the layouts -----------------------------------------------------------------------
    def _placements(self, **dims):
        mesh = self.meshes[0]
        ps = [Replicate()] * mesh.ndim
        for name, p in dims.items():
            if name in mesh.dim_names:
                ps[mesh.dim(name)] = p
        return ps

    def _batch(self, t: torch.Tensor, mesh):
        return shard_tensor(t, mesh, self._placements(dp=Shard(0)))

    def _layout(self, x):
        """The residual stream after the embeddings, which ran on each cp rank's own
        tokens in ring order (:meth:`_stage`): sharded over cp, each cp rank's tokens
        over tp too with sequence parallelism (as Megatron-LM shards the cp chunk over
        the tp ranks), else replicated on tp as Hybrid._layout pins it: the
        vocab-parallel embedding's output is a Partial on tp, and left so the op table
        would reduce it per use (a reduce-scatter before each norm, more collectives than
        the one all-reduce here).  The sequence stays in the order it came in (the ids'
        ring order): were the op table to have left it whole on cp, the pin slices it
        locally, no traffic."""
        want = self._placements(dp=Shard(0), cp=Shard(1),
                                tp=Shard(1) if self.sp else Replicate())
        return x if tuple(x.placements) == tuple(want) else reshard(x, x.mesh, want)

    def _stage(self, model, s, x):
        """The model's stage with attention on the ring and positions in ring order.

        The token ids are put in ring order and sharded over cp BEFORE the embedding, so
        each cp rank looks up (and in backward accumulates) its own tokens only, as
        Megatron-LM slices the batch per cp rank up front (``get_batch_on_this_cp_rank``,
        megatron/training/utils.py: tokens, labels and position ids alike) and torchtitan
        shards the inputs over cp (``context_parallel(..., buffers=[inputs, labels,
        freqs_cis])``): no traffic, where laying out the embeddings' output (B, S, h)
        after a lookup of every token costs cp times the lookup and an all-gather of its
        gradient over cp in backward.  The GPT's learned positions come in the same ring
        order (sharded alike), the Llama's RoPE tables are laid out
        (:meth:`_ring_positions`)."""
        with context_parallel(self.meshes[0], "cp", balanced=self.balanced,
                              cp_comm=self.cp_comm), \
                self._ring_positions(model, x.shape[1]):
            if s != 0:
                return super()._stage(model, s, x)
            S = x.shape[1]
            ids = to_ring_layout(x, "cp", 1, self.balanced)
            if not hasattr(model, "pos_emb"):          # the Llama: RoPE, no position table
                return super()._stage(model, s, ids)
            perm = slot_positions(S, self.cp, self.balanced)
            # the positions laid out as the ids, in their order (recorded: seq_order.py)
            pos = set_ring_order(self._positions(ids, perm), ring_order_of(ids))
            return model.stage_forward(self.stages[s], ids, True, len(self.stages) == 1,
                                       self._layout, positions=pos)

    def _loss(self, logits, targets):
        """The mean cross-entropy of every token where it lies: the targets laid out on
        the ring as the logits are, and the (B, V, S) form keeps the cp-sharded logits in
        place (flattening (B, S) would move them to rows)."""
        if targets.placements[targets.mesh.dim("cp")].is_replicate():
            targets = to_ring_layout(targets, "cp", 1, self.balanced)
        if logits.dtype != torch.float32:
            logits = logits.float()                 # in float32, as the models' own forward
        return F.cross_entropy(logits.transpose(1, 2), targets)

    @contextlib.contextmanager
    def _ring_positions(self, model, S: int):
        """The Llama's RoPE tables laid out on the ring for the step, DistTensors whose
        order is recorded (the GPT's learned positions are looked up in ring order by
        :meth:`_stage`)."""
        if not hasattr(model, "rope_cos"):
            yield
            return
        cos, sin = model.rope_cos, model.rope_sin
        mesh = self.meshes[0]

        def laid(t):        # the first S rows on the ring, their order recorded (seq_order)
            whole = shard_tensor(t[:S], mesh, [Replicate()] * mesh.ndim)
            return to_ring_layout(whole, "cp", 0, self.balanced)
        # a plain table in ring order would look like one in the sequence's own order, which
        # an op meeting the ring-ordered q refuses (seq_order.check_op); laid out, it is known
        model.rope_cos, model.rope_sin = laid(cos), laid(sin)
        try:
            yield
        finally:
            model.rope_cos, model.rope_sin = cos, sin

    def evaluate(self, model, inputs, targets=None) -> torch.Tensor:
        """The batch's mean loss, forward only; without ``targets`` the logits (B, S, V) in
        the sequences' own order (the ring layout undone, as the loss's targets follow it)."""
        out = super().evaluate(model, inputs, targets)
        if targets is not None:
            return out
        inv = torch.argsort(slot_positions(out.shape[1], self.cp, self.balanced))
        return out.index_select(1, inv.to(out.device))

    def forward_backward(self, model, inputs, targets):
        self._activations = _FAILED_STEP        # until this step's own figure
        self.check(model.cfg, inputs.shape[0])
        mesh = self.meshes[0]
        check_ring(inputs.shape[1], self.cp, self.balanced, f"cp={self.cp}")

        def forward():
            logits = self._stage(model, 0, self._batch(inputs, mesh))
            return self._loss(logits, self._batch(targets, mesh))
        # the activations counted inside strategy.measure_activations() (Hybrid's)
        loss = self._forward_counted(model, mesh, forward)
        with self.backward_context():
            loss.backward()
        return loss.full().detach()

    def backward_context(self):
        """Where a step's backward runs: recomputed blocks (recompute "full" /
        "selective") run their forward again in backward, so attention is on the ring
        there too (the RoPE tables are the checkpoint's arguments, kept from the forward);
        also the dry run's (``plan.meta_run``)."""
        return context_parallel(self.meshes[0], "cp", balanced=self.balanced,
                                cp_comm=self.cp_comm)
