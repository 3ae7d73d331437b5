"""The bookkeeping of a paged KV cache: a block allocator over a shared pool, and a
block table per sequence (Kwon et al. 2023, "Efficient Memory Management for Large
Language Model Serving with PagedAttention", sec. 4.1-4.2: vLLM).

The cache memory is one pool of ``num_blocks`` physical blocks of ``block_size``
token slots.  A sequence's keys and values fill logical blocks 0, 1, 2, ... in order;
its block table says which physical block holds each logical one, so a sequence takes
blocks only as it grows (at most one partly filled block each), never a contiguous
stretch of its maximum length.

    alloc = BlockAllocator(num_blocks=64)
    tables = BlockTables(alloc, block_size=16)
    tables.add("a")
    slots = tables.reserve("a", 20)     # 20 token slots: logical blocks 0, 1 -> 2 blocks
    tables.table(["a"])                 # (1, 2) int32 physical block ids
    tables.free("a")                    # its blocks go back to the pool

:func:`paged_memory` is the comparison as plain data: the bytes a server reserves by
giving every sequence its maximum length up front, against the bytes of the blocks in
use, and the slots those blocks hold but no token fills (internal fragmentation; vLLM
measures 20-38% of a contiguous reservation actually used by tokens in earlier systems,
Kwon et al. 2023, Fig. 2).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["OutOfBlocks", "BlockAllocator", "BlockTables", "PagedMemory", "paged_memory"]


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than a request needs (nothing was allocated)."""


def _count(name: str, v, least: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < least:
        raise ValueError(f"{name}={v!r}: give an int >= {least}")
    return v


class BlockAllocator:
    """Hands out physical block ids 0 .. num_blocks - 1, the lowest free first."""

    def __init__(self, num_blocks: int):
        self.num_blocks = _count("num_blocks", num_blocks)
        self._free = list(range(num_blocks - 1, -1, -1))     # a stack: pop() gives the lowest
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def allocate(self, n: int = 1) -> list[int]:
        """``n`` free blocks, all or none (:class:`OutOfBlocks` when fewer are free)."""
        _count("n", n, 0)
        if n > len(self._free):
            raise OutOfBlocks(f"allocate({n}): only {len(self._free)} of {self.num_blocks} "
                              "blocks are free; free finished sequences' blocks, or build the "
                              "pool with more num_blocks")
        got = [self._free.pop() for _ in range(n)]
        self._used.update(got)
        return got

    def free(self, blocks) -> None:
        """Return ``blocks`` to the pool; every one must be in use (checked before any is
        freed, so a bad call changes nothing)."""
        blocks = list(blocks)
        bad = [b for b in blocks if b not in self._used]
        if bad or len(set(blocks)) != len(blocks):
            raise ValueError(f"free({blocks}): block {bad[0] if bad else blocks} is not "
                             "allocated (freed twice, or never handed out)")
        for b in blocks:
            self._used.remove(b)
        self._free.extend(sorted(blocks, reverse=True))
        self._free.sort(reverse=True)

    def __repr__(self) -> str:
        return f"BlockAllocator({self.num_used} of {self.num_blocks} blocks in use)"


class BlockTables:
    """Per sequence id: its physical blocks in logical order and its length in tokens."""

    def __init__(self, allocator: BlockAllocator, block_size: int):
        self.allocator = allocator
        self.block_size = _count("block_size", block_size)
        self.blocks: dict = {}
        self.lengths: dict = {}

    def add(self, seq) -> None:
        if seq in self.blocks:
            raise ValueError(f"sequence {seq!r} is in the table already")
        self.blocks[seq], self.lengths[seq] = [], 0

    def _need(self, seq, n: int) -> int:
        have = len(self.blocks[seq]) * self.block_size
        return max(0, -(-(self.lengths[seq] + n - have) // self.block_size))

    def _known(self, seq) -> None:
        if seq not in self.blocks:
            raise KeyError(f"sequence {seq!r} is not in the table; add it first "
                           f"(tables.add({seq!r})); it holds {list(self.blocks)}")

    def reserve(self, seq, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots for ``seq``'s next ``n`` tokens, allocating blocks as it crosses into new
        ones: (physical block, offset in it), two (n,) int64 tensors.  All or nothing."""
        self._known(seq)
        _count("n", n, 0)
        self.blocks[seq] += self.allocator.allocate(self._need(seq, n))
        pos = torch.arange(self.lengths[seq], self.lengths[seq] + n)
        self.lengths[seq] += n
        table = torch.tensor(self.blocks[seq], dtype=torch.int64)
        return table[pos // self.block_size], pos % self.block_size

    def free(self, seq) -> None:
        """Drop ``seq`` and give its blocks back."""
        self._known(seq)
        self.allocator.free(self.blocks.pop(seq))
        del self.lengths[seq]

    def table(self, seqs) -> torch.Tensor:
        """(B, max blocks) int32 block table of ``seqs``, padded with 0 (slots past a
        sequence's length are never read)."""
        seqs = list(seqs)
        for s in seqs:
            self._known(s)
        rows = [self.blocks[s] for s in seqs]
        width = max([1] + [len(r) for r in rows])
        return torch.tensor([r + [0] * (width - len(r)) for r in rows],
                            dtype=torch.int32).reshape(len(rows), width)

    def seq_lens(self, seqs) -> torch.Tensor:
        seqs = list(seqs)
        for s in seqs:
            self._known(s)
        return torch.tensor([self.lengths[s] for s in seqs], dtype=torch.int64)


@dataclass(frozen=True)
class PagedMemory:
    """KV-cache memory of some sequences, paged against contiguous (plain data)."""
    tokens: int                     # tokens held, all sequences
    sequences: int
    block_size: int
    blocks_in_use: int
    bytes_per_token: int            # 2 * n_layer * n_kv_head * head_dim * dtype bytes
    bytes_tokens: int               # what the tokens themselves need
    bytes_paged: int                # the blocks in use (tokens + their last blocks' slack)
    bytes_contiguous: int           # every sequence given max_len slots up front
    fragmentation: float            # share of paged bytes no token fills (< 1 block/sequence)

    @property
    def saved(self) -> float:
        """Share of the contiguous reservation paging does not need."""
        return 1 - self.bytes_paged / self.bytes_contiguous if self.bytes_contiguous else 0.0


def paged_memory(lengths, block_size: int, max_len: int, bytes_per_token: int) -> PagedMemory:
    """The memory of sequences of ``lengths`` tokens: paged in blocks of ``block_size``,
    or contiguous at ``max_len`` each (bytes per token from
    ``workbench.serve.kv_bytes_per_token``)."""
    _count("block_size", block_size)
    _count("max_len", max_len)
    _count("bytes_per_token", bytes_per_token)
    lengths = [n.item() if isinstance(n, torch.Tensor) else n for n in lengths]
    if any(isinstance(n, bool) or int(n) != n for n in lengths):
        raise ValueError(f"lengths {lengths}: give whole numbers of tokens")
    lengths = [int(n) for n in lengths]
    if any(n < 0 or n > max_len for n in lengths):
        raise ValueError(f"lengths {lengths}: each must be in [0, max_len={max_len}]")
    blocks = sum(-(-n // block_size) for n in lengths)
    tokens = sum(lengths)
    paged = blocks * block_size * bytes_per_token
    return PagedMemory(tokens, len(lengths), block_size, blocks, bytes_per_token,
                       tokens * bytes_per_token, paged, len(lengths) * max_len * bytes_per_token,
                       1 - tokens * bytes_per_token / paged if paged else 0.0)
