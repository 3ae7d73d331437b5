"""Attention masks as rules on positions, and the tile plan they give FlashAttention.

Convention (PyTorch's ``scaled_dot_product_attention``): a mask is True where a
query MAY attend to a key.  torch_npu's ``atten_mask`` is the opposite (True =
masked out); the NPU path inverts at that boundary and nowhere else.

A :class:`MaskPattern` is a rule on (query, key) positions: causal, a sliding
window (Beltagy et al. 2020; Mistral), block-diagonal for packed documents.
A rule can be asked about one tile at a time, so the tiled kernel learns that
a whole tile is empty and skips it without ever building the S x S mask: this
is how block-sparse FlashAttention (Dao et al. 2022, section 3.3) turns
sparsity into skipped work.  :func:`attention_tiles` draws the plan.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from ._checks import broadcasts

__all__ = ["MaskPattern", "Causal", "SlidingWindow", "BlockDiagonal", "TilePlan",
           "attention_tiles"]

SKIP, PARTIAL, FULL = "skip", "partial", "full"


class MaskPattern:
    """A mask given by a rule on positions; subclasses define :meth:`keep`."""

    def keep(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """(Tq,) query positions, (Tk,) key positions -> (Tq, Tk) bool, True = attend."""
        raise NotImplementedError

    def check(self, q_len: int, k_len: int) -> None:
        """Raise a clear error when the pattern does not fit these lengths."""

    def dense(self, q_len: int, k_len: int, device=None) -> torch.Tensor:
        """The whole (q_len, k_len) mask; for the paths that cannot take a rule."""
        return self.keep(torch.arange(q_len, device=device), torch.arange(k_len, device=device))


@dataclass(frozen=True)
class Causal(MaskPattern):
    """Query i sees keys j <= i (top-left aligned, as ``is_causal`` in PyTorch)."""

    def keep(self, rows, cols):
        return rows[:, None] >= cols[None, :]


@dataclass(frozen=True)
class SlidingWindow(MaskPattern):
    """Query i sees the ``window`` keys i-window+1 .. i (both sides if not causal)."""
    window: int
    causal: bool = True

    def __post_init__(self):
        if not isinstance(self.window, int) or isinstance(self.window, bool) or self.window < 1:
            raise ValueError(f"SlidingWindow(window={self.window!r}): window must be an int >= 1")

    def keep(self, rows, cols):
        d = rows[:, None] - cols[None, :]                  # (Tq, Tk) query minus key position
        if self.causal:
            return (d >= 0) & (d < self.window)
        return d.abs() < self.window


@dataclass(frozen=True)
class BlockDiagonal(MaskPattern):
    """Documents packed into one sequence: a query sees only keys of its own document."""
    lengths: tuple[int, ...]

    def __post_init__(self):
        given = tuple(self.lengths)
        # int() would truncate 2.5 to 2 and parse "2": each length must already be an integer
        # (a Python or numpy int, or an integer tensor element)
        try:
            if any(isinstance(n, bool) for n in given):
                raise TypeError
            lengths = tuple(operator.index(n) for n in given)
        except TypeError:
            raise TypeError(f"BlockDiagonal(lengths={given}): give one int token count per "
                            "packed document, e.g. (3, 5); a float or str is not one") from None
        object.__setattr__(self, "lengths", lengths)
        if not self.lengths or min(self.lengths) < 1:
            raise ValueError(f"BlockDiagonal(lengths={self.lengths}): give one length >= 1 "
                             "per packed document")

    def check(self, q_len, k_len):
        total = sum(self.lengths)
        if not q_len == k_len == total:
            raise ValueError(f"BlockDiagonal(lengths summing to {total}) needs q and k of that "
                             f"length, got q_len={q_len}, k_len={k_len}")

    def keep(self, rows, cols):
        doc = torch.repeat_interleave(torch.arange(len(self.lengths), device=rows.device),
                                      torch.tensor(self.lengths, device=rows.device))
        return doc[rows][:, None] == doc[cols][None, :]


class AttentionMask:
    """Causal flag, patterns and a dense bool tensor, ANDed: what the kernels consume.

    ``dense`` is 4-d (b, h, Sq, Sk) with b in {1, B} and h in {1, Hq}; the tiled
    kernel sees it as (b, Hkv or 1, G or 1, Sq, Sk) to match its GQA layout.
    """

    def __init__(self, patterns: tuple[MaskPattern, ...], dense: torch.Tensor | None,
                 kv_heads: int = 1, groups: int = 1):
        self.patterns, self.dense = patterns, dense
        self._dense5 = None
        if dense is not None:
            h = dense.shape[1]
            self._dense5 = (dense.unflatten(1, (kv_heads, groups)) if h > 1 and groups > 1
                            else dense.unsqueeze(2))          # (b, Hkv|1, G|1, Sq, Sk)

    @property
    def causal_only(self) -> bool:
        return self.dense is None and self.patterns == (Causal(),)

    def tile(self, r0: int, r1: int, c0: int, c1: int, device) -> torch.Tensor | None:
        """Keep-mask of rows [r0, r1) x cols [c0, c1), broadcastable to (B, Hkv, G, Tq, Tk)."""
        keep = None
        if self.patterns:
            rows = torch.arange(r0, r1, device=device)
            cols = torch.arange(c0, c1, device=device)
            for p in self.patterns:
                k = p.keep(rows, cols)                      # (Tq, Tk)
                keep = k if keep is None else keep & k
        if self._dense5 is not None:
            d = self._dense5[..., r0:r1, c0:c1]             # (b, Hkv|1, G|1, Tq, Tk)
            keep = d if keep is None else keep & d
        return keep

    def dense4(self, q_len: int, k_len: int, device) -> torch.Tensor:
        """The whole mask as one bool tensor (b, h, Sq, Sk) for the non-tiled paths."""
        keep = self.dense
        for p in self.patterns:
            k = p.dense(q_len, k_len, device)               # (Sq, Sk)
            keep = k if keep is None else keep & k
        return keep.reshape((1,) * (4 - keep.dim()) + tuple(keep.shape))


def build_mask(q_len: int, k_len: int, q_heads: int, kv_heads: int, batch: int,
               causal: bool, mask, device=None) -> AttentionMask | None:
    """Check ``causal`` and ``mask`` (a bool tensor or a :class:`MaskPattern`) and combine them."""
    patterns: list[MaskPattern] = [Causal()] if causal else []
    dense = None
    if isinstance(mask, MaskPattern):
        mask.check(q_len, k_len)
        patterns.append(mask)
    elif isinstance(mask, torch.Tensor):
        if mask.dtype != torch.bool:
            raise TypeError(f"flash_attention: mask.dtype is {mask.dtype}; give a bool mask "
                            "(True = may attend), e.g. mask > 0, or add a float bias to the "
                            "scores yourself")
        full = (batch, q_heads, q_len, k_len)
        if mask.dim() > 4 or not broadcasts(tuple(mask.shape), full):
            raise ValueError(f"flash_attention: mask.shape={tuple(mask.shape)} does not "
                             f"broadcast to (batch, heads, q_len, k_len)={full}")
        if device is not None and mask.device != device:
            raise ValueError(f"flash_attention: mask is on {mask.device} but q is on {device}; "
                             "move it with mask.to(q.device)")
        m4 = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
        dense = m4.expand(m4.shape[0], m4.shape[1], q_len, k_len)
    elif mask is not None:
        raise TypeError(f"flash_attention: mask must be None, a bool tensor or a MaskPattern "
                        f"(SlidingWindow, BlockDiagonal), got {type(mask).__name__}")
    if not patterns and dense is None:
        return None
    return AttentionMask(tuple(patterns), dense, kv_heads, q_heads // kv_heads)


@dataclass(frozen=True)
class TilePlan:
    """Which (query tile, key tile) pairs a tiled attention computes.

    ``kinds[i][j]`` is ``"full"`` (no masking needed), ``"partial"`` (the
    element-wise mask is applied) or ``"skip"`` (empty: never computed).
    """
    rows: tuple[tuple[int, int], ...]      # [start, stop) of each query tile
    cols: tuple[tuple[int, int], ...]      # [start, stop) of each key tile
    kinds: tuple[tuple[str, ...], ...]     # (query tiles, key tiles)

    def count(self, kind: str) -> int:
        return sum(row.count(kind) for row in self.kinds)

    @property
    def computed(self) -> int:
        return self.count(FULL) + self.count(PARTIAL)

    @property
    def skipped(self) -> int:
        return self.count(SKIP)

    def __str__(self) -> str:
        glyph = {FULL: "#", PARTIAL: "+", SKIP: "."}
        grid = "\n".join("".join(glyph[k] for k in row) for row in self.kinds)
        return (f"{len(self.rows)} x {len(self.cols)} tiles: {self.computed} computed "
                f"({self.count(PARTIAL)} partial '+'), {self.skipped} skipped '.'\n{grid}")


def _spans(n: int, size: int) -> tuple[tuple[int, int], ...]:
    return tuple((s, min(s + size, n)) for s in range(0, n, size))


def plan_tiles(mask: AttentionMask | None, q_len: int, k_len: int, tile_q: int, tile_k: int,
               device=None) -> TilePlan:
    """Classify every tile from the mask itself (exact: a tile is skipped only if empty)."""
    rows, cols = _spans(q_len, tile_q), _spans(k_len, tile_k)
    kinds = []
    for r0, r1 in rows:
        row = []
        for c0, c1 in cols:
            keep = None if mask is None else mask.tile(r0, r1, c0, c1, device)
            row.append(FULL if keep is None or bool(keep.all()) else
                       PARTIAL if bool(keep.any()) else SKIP)
        kinds.append(tuple(row))
    return TilePlan(rows, cols, tuple(kinds))


def attention_tiles(q_len: int, k_len: int | None = None, *, causal: bool = False, mask=None,
                    tile_q: int = 128, tile_k: int = 128) -> TilePlan:
    """The tile plan the reference kernel follows, without running it (for the course).

    >>> print(wb.ops.attention_tiles(1024, causal=True, tile_q=256, tile_k=256))
    4 x 4 tiles: 10 computed (4 partial '+'), 6 skipped '.'
    """
    k_len = q_len if k_len is None else k_len
    heads = mask.shape[-3] if isinstance(mask, torch.Tensor) and mask.dim() >= 3 else 1
    batch = mask.shape[0] if isinstance(mask, torch.Tensor) and mask.dim() == 4 else 1
    device = mask.device if isinstance(mask, torch.Tensor) else None
    built = build_mask(q_len, k_len, heads, heads, batch, causal, mask, device)
    return plan_tiles(built, q_len, k_len, tile_q, tile_k, device)
