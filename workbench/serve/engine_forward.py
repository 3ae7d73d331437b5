"""One forward over a ragged batch: the engine's step (``engine.py``) runs every
scheduled sequence's new tokens packed into one row, each token at its own position,
each sequence's keys and values in its own pages.

    cache = RaggedPagedCache(model, num_blocks=16, block_size=4)
    logits = packed_forward(model, cache, [("a", [5, 7, 9]), ("b", [3])])  # (2, V)

The packing is Orca's "selective batching" (Yu et al., OSDI'22, sec. 4.2; vLLM's model
runner flattens a step's tokens the same way): the token-wise layers (embedding, norms,
linears, MLP) run on all T tokens of the step as one (1, T, h) tensor, whatever sequence
each belongs to; only attention needs to know the sequences apart.  So:

    positions      token j of a sequence holding c tokens sits at c + j: the model's
                   ``position_ids`` (1, T) (Hugging Face's name), so it looks the RoPE
                   angles (Llama) or the learned position embedding (GPT) up per token
                   (``models/positions.py``);
    attention      :meth:`RaggedPagedCache.attend` writes each token's k, v into its
                   sequence's next slot, then runs ``paged_attention`` over each
                   sequence's pages (the sequences with as many new tokens in one call:
                   every decode sequence, Sq = 1, together), causal and bottom-right
                   aligned, so a prompt chunk after c cached tokens sees them and itself;
    logits         only of each sequence's last token (the one sampled from): the
                   model's ``logits_to_keep``, so the final norm and the head run on
                   those R tokens only.

The forward IS the model's: ``model(ids, cache=this, position_ids=..., logits_to_keep=...)``,
nothing of an architecture restated here.  Tests hold every token to ``generate``.
"""
from __future__ import annotations

import torch

from ..ops import paged_attention
from ..ops.kv_blocks import BlockAllocator, BlockTables, OutOfBlocks

__all__ = ["RaggedPagedCache", "packed_forward"]


class RaggedPagedCache:
    """Every layer's key and value pool (num_blocks, n_kv_head, block_size, head_dim),
    one block table per sequence (shared by the layers, as vLLM), and the slots of the
    step in flight (:meth:`begin`)."""

    def __init__(self, model, num_blocks: int, block_size: int):
        cfg = model.cfg
        w = model.tok_emb.weight
        self.n_layer = cfg.n_layer
        self.allocator = BlockAllocator(num_blocks)
        self.tables = BlockTables(self.allocator, block_size)
        self.block_size = self.tables.block_size
        shape = (num_blocks, cfg.n_kv_head, block_size, cfg.head_dim)       # (blocks, Hkv, bs, hd)
        self.k_pools = [self._pool(shape, w) for _ in range(self.n_layer)]
        self.v_pools = [self._pool(shape, w) for _ in range(self.n_layer)]
        self._step = None
        self._undo = None

    def _pool(self, shape, w):
        """One layer's key (or value) pool, (blocks, Hkv, bs, hd) like the weights ``w``
        (``engine_tp.ShardedPagedCache``: sharded over the heads)."""
        return torch.zeros(shape, dtype=w.dtype, device=w.device)

    # ---- bookkeeping -------------------------------------------------------------------------
    def length(self, seq) -> int:
        return self.tables.lengths[seq]

    def blocks_needed(self, seq, n: int) -> int:
        """New blocks ``seq`` (None: a sequence not in the table) takes to hold n more tokens."""
        have = 0 if seq not in self.tables.blocks else self.length(seq)
        held = 0 if seq not in self.tables.blocks else len(self.tables.blocks[seq])
        return max(0, -(-(have + n) // self.block_size) - held)

    def release(self, seq) -> None:
        """Give ``seq``'s blocks back (it finished, or was preempted)."""
        self._undo = None                       # the last step can no longer be undone
        if seq in self.tables.blocks:
            self.tables.free(seq)

    def begin(self, segments) -> None:
        """Reserve the slots of a step's new tokens, ``segments`` [(seq, n)] in packed
        order; all or nothing (:class:`OutOfBlocks`, no table changed)."""
        need = sum(self.blocks_needed(s, n) for s, n in segments)
        if need > self.allocator.num_free:
            raise OutOfBlocks(f"RaggedPagedCache: the step needs {need} blocks, "
                              f"{self.allocator.num_free} are free")
        self._undo = {s: (list(self.tables.blocks[s]), self.tables.lengths[s])
                      if s in self.tables.blocks else None for s, _ in segments}
        for s, _ in segments:
            if s not in self.tables.blocks:
                self.tables.add(s)
        slots = [self.tables.reserve(s, n) for s, n in segments]
        blk = torch.cat([b for b, _ in slots])                              # (T,)
        off = torch.cat([o for _, o in slots])                              # (T,)
        t, groups = 0, {}
        for s, n in segments:                   # sequences with n new tokens: one call
            groups.setdefault(n, []).append((s, t))
            t += n
        device = self.k_pools[0].device
        self._step = (blk.to(device), off.to(device), t, [
            (n, [s for s, _ in g], (torch.tensor([o for _, o in g])[:, None]
                                    + torch.arange(n)[None, :]).to(device))      # (G, n)
            for n, g in groups.items()])

    def rollback(self) -> None:
        """Undo the last :meth:`begin` (the forward failed, or the sampling after it: until
        the next begin or :meth:`release`): the tables and the allocator as before it
        (slots past a sequence's length may hold the failed step's keys: never read)."""
        if self._undo is None:
            return
        for s, old in self._undo.items():
            if old is None:                     # new this step: drop it, blocks and all
                self.tables.free(s)
                continue
            blocks, length = old
            self.allocator.free(self.tables.blocks[s][len(blocks):])
            self.tables.blocks[s], self.tables.lengths[s] = blocks, length
        self._step = self._undo = None

    def end(self) -> None:
        """The step's forward is done (its undo is kept until the next begin or release:
        the engine's sampling may still fail)."""
        self._step = None

    # ---- the models' cache interface ---------------------------------------------------------
    def attend(self, layer: int, q, k, v):
        """q (1, Hq, T, hd), k, v (1, Hkv, T, hd) of the packed step: store k, v in their
        slots, attend each sequence's queries to its pages -> (1, Hq, T, hd)."""
        if self._step is None:
            raise RuntimeError("RaggedPagedCache.attend outside a step: the engine calls "
                               "begin(segments) before the forward (packed_forward)")
        T = self._step[2]
        if q.shape[0] != 1 or q.shape[2] != T:
            raise ValueError(f"RaggedPagedCache.attend: q of shape {tuple(q.shape)}; the step "
                             f"packs {T} tokens as (1, Hq, {T}, hd)")
        return self._attend(self.k_pools[layer], self.v_pools[layer], q, k, v)

    def _attend(self, kp, vp, q, k, v):
        """:meth:`attend` on plain tensors: one device's pools, or one rank's shards."""
        blk, off, T, groups = self._step
        kp[blk, :, off] = k[0].transpose(0, 1).to(kp.dtype)                # (T, Hkv, hd)
        vp[blk, :, off] = v[0].transpose(0, 1).to(vp.dtype)
        y = torch.empty_like(q[0])                                          # (Hq, T, hd)
        for n, seqs, idx in groups:
            qg = q[0][:, idx].permute(1, 0, 2, 3)                           # (G, Hq, n, hd)
            out = paged_attention(qg, kp, vp, self.tables.table(seqs).to(idx.device),
                                  self.tables.seq_lens(seqs).to(idx.device))
            y[:, idx] = out.permute(1, 0, 2, 3)                             # (Hq, G, n, hd)
        return y[None]                                                      # (1, Hq, T, hd)

    def get_seq_length(self, layer: int = 0) -> int:
        raise TypeError("RaggedPagedCache holds sequences of different lengths: no single "
                        "offset; give every token its position (model(idx, cache=..., "
                        "position_ids=...) after begin(), as packed_forward does), or run it "
                        "with workbench.serve.engine")


def packed_forward(model, cache: RaggedPagedCache, segments) -> torch.Tensor:
    """``segments`` [(seq, new token ids)] -> logits (len(segments), V) of each one's last
    token; their keys and values are appended to ``cache`` (module docstring)."""
    dev = model.tok_emb.weight.device
    ids = torch.tensor([t for _, toks in segments for t in toks], device=dev)[None]  # (1, T)
    pos = torch.cat([torch.arange(cache.length(s) if s in cache.tables.blocks else 0,
                                  (cache.length(s) if s in cache.tables.blocks else 0)
                                  + len(toks)) for s, toks in segments]).to(dev)[None]  # (1, T)
    last = torch.tensor(list(_ends(segments)), device=dev)                  # (R,)
    cache.begin([(s, len(toks)) for s, toks in segments])
    try:
        logits, _ = model(ids, cache=cache, position_ids=pos, logits_to_keep=last)  # (1, R, V)
    except BaseException:
        cache.rollback()
        raise
    cache.end()
    return logits[0]                                                        # (R, V)


def _ends(segments):
    t = 0
    for _, toks in segments:
        t += len(toks)
        yield t - 1
