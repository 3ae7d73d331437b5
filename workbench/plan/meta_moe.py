"""Expert parallelism on the meta device: the dry run's token routing.

On meta tensors a router computes no scores, so which expert a token picks is unknown:
the expert-parallel dispatcher (``parallel.strategies.expert_parallel.ExpertParallel``)
needs, per source rank, how many (token, choice) rows go to each expert (its
``_permute``'s ``torch.nonzero`` and ``bincount`` have no meta implementation).  The
dry run supplies them (:class:`MetaExpertParallel`, its ``_permute`` only: the exchange,
the experts' grouped GEMMs, the combine, the clock and autograd are the recipe's own):

- ``routing="balanced"`` (the default): each rank's T k rows spread evenly over the E
  experts (T k / E each, the remainder one row each to the first experts), capacity
  applied as the router applies it (at most C per expert per sequence).  This is what
  the planner assumes (``plan.moe_cost``: "routing perfectly balanced", the
  load-balancing loss's aim), so the dry run is held to it like with like;
- ``routing=counts``: a list of per-expert row counts per data-parallel rank (one list
  of E ints per rank, or one list for every rank), e.g. measured from a real forward
  (:func:`measured_routing`: a randomly initialised router is uneven, and the ep rank
  that receives most rows is the straggler the combine waits for).

Every MoE layer takes the same counts (the dry run runs one micro-batch per stage).
"""
from __future__ import annotations

import torch

from ..models.moe import moe_layers
from ..ops.moe import capacity
from ..parallel.strategies.expert_parallel import ExpertParallel

__all__ = ["MetaExpertParallel", "balanced_counts", "use_meta_routing", "measured_routing"]


def balanced_counts(sequences: int, seq_len: int, experts: int, k: int,
                    capacity_factor) -> list[int]:
    """Rows per expert of one rank's ``sequences`` x ``seq_len`` tokens, k choices each,
    spread evenly (module docstring), after capacity."""
    per_seq = [seq_len * k // experts + (1 if e < seq_len * k % experts else 0)
               for e in range(experts)]
    cap = capacity(seq_len, experts, k, capacity_factor)
    return [sequences * min(n, cap) for n in per_seq]


class MetaExpertParallel(ExpertParallel):
    """``ExpertParallel`` whose permutation takes its row counts from ``counts(rank)``
    when the tokens are meta tensors (module docstring)."""

    def __init__(self, emesh, chunks, counts):
        super().__init__(emesh, chunks)
        self.counts = counts          # callable: data-parallel rank -> E row counts
        self._next = 0

    def _simulated(self, x, w, e, s, module, params, E):
        self._next = 0                # _permute is called once per source rank, in order
        return super()._simulated(x, w, e, s, module, params, E)

    def _permute(self, x, e, s, E):
        if not x.is_meta:
            return super()._permute(x, e, s, E)
        per_expert = list(self.counts(self._next))
        self._next += 1
        if len(per_expert) != E:
            raise ValueError(f"dry_run(routing=...): {len(per_expert)} counts for a layer "
                             f"of {E} experts; give E row counts per rank")
        rows = sum(per_expert)
        k = e.shape[-1]
        if rows > x.shape[0] * k:
            raise ValueError(f"dry_run(routing=...): {rows} rows from {x.shape[0]} tokens of "
                             f"k={k} choices each (at most {x.shape[0] * k}); lower the counts")
        # which (token, choice) pairs: unknown on meta, only how many (module docstring)
        assign = torch.empty(rows, dtype=torch.long, device="meta")
        per_dest = [sum(per_expert[r * (E // self.ep):(r + 1) * (E // self.ep)])
                    for r in range(self.ep)]
        return x[assign // k], assign, per_dest, per_expert


def use_meta_routing(model, cfg, micro_batch: int, routing="balanced") -> None:
    """Give every expert-parallel MoE layer of ``model`` the meta routing (module
    docstring); ``micro_batch``: sequences per data-parallel rank."""
    E, k = cfg.moe_experts, cfg.moe_topk
    if isinstance(routing, str):
        if routing != "balanced":
            raise ValueError(f"dry_run(routing={routing!r}): give 'balanced' or per-rank "
                             f"lists of {E} row counts")
        one = balanced_counts(micro_batch, cfg.seq_len, E, k, cfg.moe_capacity_factor)

        def counts(r):
            return one
    else:
        table = [list(map(int, row)) for row in routing]
        if table and not isinstance(routing[0], (list, tuple)):
            table = [list(map(int, routing))]

        def counts(r):
            return table[r % len(table)]
    for layer in moe_layers(model):
        d = layer.token_dispatcher
        if isinstance(d, ExpertParallel):
            layer.token_dispatcher = MetaExpertParallel(d.mesh, d.chunks, counts)


class _Routed(Exception):
    """Ends :func:`measured_routing`'s forward once the first MoE layer has routed."""


def measured_routing(cfg, micro_batch: int, ranks: int, seed: int = 0) -> list[list[int]]:
    """Per data-parallel rank, the rows each expert receives from ``micro_batch`` random
    sequences through the model's FIRST MoE layer at its random initialisation (a real
    forward on the CPU: small models only), to feed ``dry_run(routing=...)``."""
    from ..models.config import build_model
    torch.manual_seed(seed)
    model = build_model(cfg, seed=seed).eval()
    idx = torch.randint(0, cfg.vocab_size, (ranks * micro_batch, cfg.seq_len))
    layer = moe_layers(model)[0]
    # the forward stops once that layer has recorded its routing (``MoE.record_stats``,
    # called after its router, before its experts): what would follow (its experts, the
    # later blocks, the vocabulary projection: ~2/3 of a forward of test_dryrun_ep_cp's
    # MoE, measured 4.5 -> 1.8 s of CPU) changes no count here
    record = layer.record_stats

    def record_and_stop(*args):
        record(*args)
        raise _Routed

    layer.record_stats = record_and_stop
    try:
        with torch.no_grad():
            model(idx)
    except _Routed:
        pass
    finally:
        del layer.record_stats              # the class's method again
    e, slot, _, _ = layer._last[0]          # one forward: one part (models/moe.py)
    out = []
    for r in range(ranks):
        er = e[r * micro_batch:(r + 1) * micro_batch]
        keep = slot[r * micro_batch:(r + 1) * micro_batch] >= 0
        out.append(torch.bincount(er[keep], minlength=cfg.moe_experts).tolist())
    return out
