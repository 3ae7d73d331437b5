"""Checks for the exercises of notebook 09 (fused operators).

As in :mod:`.checks`: a right answer prints one "Correct: ..." line; a wrong one raises
:class:`~.feedback.CheckError` with a hint, the expected value only after repeated tries.
The expected values are derived here, not by the code under test: the online-softmax
update is held to a plain ``torch.softmax`` over all the scores at once, and tile counts
to a count by hand over the tile grid, element by element.
"""
from __future__ import annotations

import math
import numbers

import torch

from ..text_width import wrap
from .feedback import CheckError, exercise

__all__ = ["check_online_softmax", "check_window_tiles"]


def _ok(msg: str) -> None:
    print(wrap("Correct: " + msg))          # within text_width.WIDTH, continuations indented


def _cases():
    """(scores (rows, n), values (n, d), tile widths): random, one tile raising the max
    late, one with a -inf (masked) column, a fully masked tile after finite ones, and a
    fully masked FIRST tile (m is still -inf after it: exp(-inf - (-inf)) is nan), and
    large scores, whose exp() overflows unless the running max is subtracted first."""
    g = torch.Generator().manual_seed(0)
    s = torch.randn(3, 12, generator=g, dtype=torch.float64)
    v = torch.randn(12, 5, generator=g, dtype=torch.float64)
    yield s, v, 4
    late = s.clone()
    late[:, 10] += 30.0                   # the max arrives in the last tile: rescale needed
    yield late, v, 4
    masked = s.clone()
    masked[:, 5] = -math.inf              # a masked key inside a tile
    yield masked, v, 3
    empty = s.clone()
    empty[:, 8:] = -math.inf              # a whole tile masked after finite ones
    yield empty, v, 4
    first = s.clone()
    first[:, :4] = -math.inf              # a whole tile masked before any finite score
    yield first, v, 4
    yield s + 1000.0, v, 4                # exp(1000) overflows even float64: needs the max


_FIRST_MASKED, _LARGE = 4, 5                # indices in _cases(): a masked first tile, large scores


def _run(update, scores, values, width):
    """Stream the tiles through ``update``; also say whether it ever changed its state."""
    rows, d = scores.shape[0], values.shape[1]
    m = torch.full((rows, 1), -math.inf, dtype=scores.dtype)
    l = torch.zeros(rows, 1, dtype=scores.dtype)
    acc = torch.zeros(rows, d, dtype=scores.dtype)
    changed = False
    for j in range(0, scores.shape[1], width):
        before = (m.clone(), l.clone(), acc.clone())     # an update may work in place
        out = update(m, l, acc, scores[:, j:j + width].clone(), values[j:j + width].clone())
        if out is None:
            raise CheckError("your update returned None: end it with return m, l, acc (the new "
                             "values)")
        if not (isinstance(out, tuple) and len(out) == 3):
            n = (f" of {len(out)} value{'s' * (len(out) != 1)}"
                 if isinstance(out, (tuple, list)) else "")   # "got tuple" read as right
            raise CheckError(f"update must return the tuple (m, l, acc), got a "
                             f"{type(out).__name__}{n}")
        m, l, acc = out
        if (isinstance(l, torch.Tensor) and isinstance(acc, torch.Tensor) and d != 1
                and tuple(l.shape) == (rows, d) and tuple(acc.shape) == (rows, 1)):
            raise CheckError(f"your update returned l of shape {tuple(l.shape)} and acc of "
                             f"shape {tuple(acc.shape)}: l and acc swapped? Return them in "
                             "the order (m, l, acc)")
        for name, t, shape in (("m", m, (rows, 1)), ("l", l, (rows, 1)), ("acc", acc, (rows, d))):
            if not isinstance(t, torch.Tensor):
                raise CheckError(f"your update returned {name} as {type(t).__module__}."
                                 f"{type(t).__name__}: return torch tensors, as it is given")
            if t.dtype != scores.dtype:
                raise CheckError(f"your update returned {name} in {t.dtype}, given "
                                 f"{scores.dtype}: keep the inputs' dtype (a tensor you make "
                                 "takes dtype=s.dtype, or torch.zeros_like / torch.full_like)")
            if tuple(t.shape) != shape:
                raise CheckError(f"your update returned {name} of shape "
                                 f"{tuple(getattr(t, 'shape', ()))}; it keeps the shape "
                                 f"{shape} (one value per query row)")
        changed = changed or not all(torch.equal(a, b) for a, b in zip(before, (m, l, acc)))
    return m, l, acc, changed


def _without_rescale(scores, values, width, *, rescale_l=False, rescale_acc=False):
    """The common mistakes, for the hint: each tile's terms taken against the new max,
    but the earlier sums never rescaled (or only ``l``, or only ``acc``)."""
    m = torch.full((scores.shape[0], 1), -math.inf, dtype=scores.dtype)
    l = torch.zeros_like(m)
    acc = torch.zeros(scores.shape[0], values.shape[1], dtype=scores.dtype)
    for j in range(0, scores.shape[1], width):
        s, v = scores[:, j:j + width], values[j:j + width]
        m_new = torch.maximum(m, s.max(dim=-1, keepdim=True).values)
        safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        r, p = torch.exp(m - safe), torch.exp(s - safe)
        l = (l * r if rescale_l else l) + p.sum(-1, keepdim=True)
        acc = (acc * r if rescale_acc else acc) + p @ v
        m = m_new
    return acc / l


def _short(t: torch.Tensor) -> str:
    """A column of per-row values, short: [0.43, 1.2, 0.87]."""
    return "[" + ", ".join(f"{x:.3g}" for x in t.flatten().tolist()) + "]"


def _rescale_grows(update) -> bool:
    """Whether ``update`` multiplies the earlier sums by exp(m_new - m_old), which grows
    them, instead of exp(m_old - m_new): one probe where the max rises from 0 to 1 with
    l = 2, so l becomes 2 e^-1 + 1 when right and 2 e + 1 with the sign flipped (and
    2 + e for exp(s - m_old) without a rescale: l = 1 could not tell that one apart)."""
    one = torch.ones(1, 1, dtype=torch.float64)
    try:
        out = update(0 * one, 2 * one, one, one, 0 * one)  # m, l, acc; a tile s = 1, v = 0
        return abs(float(out[1]) - (2 * math.e + 1)) < 1e-9
    except Exception:                                      # the cases already said what
        return False


_SIGN_HINT = ("your update grows the earlier terms when the max rises: the rescale factor is "
              "exp(m_old - m_new), at most 1 (the old terms were taken against a smaller max), "
              "not exp(m_new - m_old)")


@exercise
def check_online_softmax(update) -> None:
    """``update(m, l, acc, s, v) -> (m, l, acc)``: one step of the online softmax
    (Milakov & Gimelshein 2018; FlashAttention-2, Dao 2023, Algorithm 1) over a tile of
    scores ``s`` (rows, t) and values ``v`` (t, d); acc / l after the last tile must equal
    softmax(all scores) @ V."""
    if not callable(update):
        raise CheckError(f"pass your function update(m, l, acc, s, v), got {update!r}")
    for k, (s, v, width) in enumerate(_cases()):
        want = torch.softmax(s, dim=-1) @ v                  # all scores at once
        try:
            m, l, acc, changed = _run(update, s, v, width)
        except CheckError:
            raise
        except Exception as e:                               # the student's code
            raise CheckError(f"your update raised {type(e).__name__}: {e} (the check calls "
                             "update(m, l, acc, s, v) with m and l of shape (rows, 1), acc "
                             "(rows, d), s (rows, t) and v (t, d), and unpacks the tuple "
                             "(m, l, acc) it returns)") from None
        if not changed:
            raise CheckError("your update returns m, l and acc unchanged: after the last tile "
                             "m is still -inf and l still 0. Fold each tile in: the new max "
                             "max(m, rowmax(s)), then l and acc rescaled by exp(m - m_new) "
                             "plus the tile's exp(s - m_new) terms")
        got = acc / l
        if not torch.isfinite(got).all() and k == _LARGE:
            raise CheckError("your output has nan or inf for large scores (all near 1000): "
                             "exp(1000) overflows; subtract the running max before exp, "
                             "exp(s - m_new), which is what m is for")
        if not torch.isfinite(got).all() and _rescale_grows(update):
            raise CheckError(_SIGN_HINT)
        if not torch.isfinite(got).all() and k != _FIRST_MASKED:
            raise CheckError("your output has nan or inf where the scores are finite or only "
                             "some keys masked (exp(-inf - m) = 0 is fine; nan comes from "
                             "-inf - (-inf), inf - inf or 0 / 0): print m, l and acc after "
                             "each tile to see where it starts")
        if not torch.isfinite(got).all():
            raise CheckError("your output has nan or inf: while every score of a row so far "
                             "is masked (a masked first tile), m_new is still -inf and "
                             "exp(-inf - (-inf)) is nan. Where m_new is -inf, subtract 0 instead "
                             "(torch.where(torch.isfinite(m_new), m_new, 0.0)): then "
                             "exp(m_old - 0) and exp(s - 0) are 0 for that row, as they "
                             "should be")
        row_max = s.max(dim=-1, keepdim=True).values
        if not torch.equal(m, row_max):
            if torch.equal(m, torch.full_like(m, s.max().item())) and len(set(row_max.flatten(
                    ).tolist())) > 1:
                hint = ("m holds one max per query row: a max taken over other rows' scores "
                        "can lie far above this row's, and exp(s - m) of this row then "
                        "underflows to 0 (l = 0, acc / l nan)")
            else:
                hint = ("m is the running max, max(m_old, rowmax(s)): the largest score of "
                        "its row so far. A tile's own max can be lower than an earlier "
                        "tile's, or -inf for a masked tile: the earlier terms, rescaled by "
                        "exp(m_old - m_new), then blow up or are lost")
            raise CheckError(f"after the last tile m is not each row's largest score "
                             f"({_short(m)} where the rows' maxima are {_short(row_max)}): "
                             f"{hint}")
        err = (got - want).abs().max().item()
        if err > 1e-9:
            if torch.allclose(got, _without_rescale(s, v, width), atol=1e-9, equal_nan=True):
                hint = ("the max rose in a later tile and your earlier terms were not "
                        "rescaled: multiply l and acc by exp(m_old - m_new) before adding the "
                        "new tile's terms")
            elif torch.allclose(got, _without_rescale(s, v, width, rescale_l=True),
                                atol=1e-9, equal_nan=True):
                hint = ("you rescale l but not acc: when the max rises, acc's earlier terms "
                        "exp(s - m_old) v must become exp(s - m_new) v too: multiply acc by "
                        "exp(m_old - m_new) as well")
            elif torch.allclose(got, _without_rescale(s, v, width, rescale_acc=True),
                                atol=1e-9, equal_nan=True):
                hint = ("you rescale acc but not l: when the max rises, l's earlier terms "
                        "exp(s - m_old) must become exp(s - m_new) too: multiply l by "
                        "exp(m_old - m_new) as well")
            elif _rescale_grows(update):
                hint = _SIGN_HINT
            elif torch.allclose(acc, want, atol=1e-9):
                hint = ("acc must stay unnormalised (a sum of exp(s - m) v); divide by l only "
                        "once, at the end (FlashAttention-2's change to the first version)")
            elif err < 1e-5:
                hint = ("close, but not to float64's precision: does a step go through float32 "
                        "(a tensor made without dtype=s.dtype, a .float())?")
            else:
                hint = ("the new max is max(m_old, rowmax(s)); then l = l exp(m_old - m_new) + "
                        "rowsum(exp(s - m_new)), acc = acc exp(m_old - m_new) + exp(s - m_new) v")
            raise CheckError(f"after the last tile acc / l differs from softmax(S) V by up to "
                             f"{err:.3g}: {hint}", expected="acc / l == torch.softmax(S, -1) @ V")
    _ok("acc / l equals softmax(S) V on all six cases (a late max, masked keys, masked "
        "tiles, first and later, scores too large for exp), without ever holding a whole "
        "row of scores")


def _window_tile_kinds(seq: int, window: int, tile: int) -> tuple[int, int]:
    """(whole, partial): tiles whose every (query i, key j) is kept (j <= i and
    i - j < window), and tiles with some kept and some masked."""
    n = -(-seq // tile)
    whole = partial = 0
    for a in range(n):
        for b in range(n):
            rows = range(a * tile, min((a + 1) * tile, seq))
            cols = range(b * tile, min((b + 1) * tile, seq))
            kept = [0 <= i - j < window for i in rows for j in cols]
            whole += all(kept)
            partial += any(kept) and not all(kept)
    return whole, partial


def _window_tiles_by_hand(seq: int, window: int, tile: int) -> int:
    """Tiles with at least one kept (query i, key j): j <= i and i - j < window."""
    return sum(_window_tile_kinds(seq, window, tile))


@exercise
def check_window_tiles(computed, seq: int = 1024, window: int = 256, tile: int = 128) -> None:
    """How many of the (seq/tile)^2 tiles a tiled attention computes under a causal
    sliding window of ``window`` keys (query i sees keys i-window+1..i)."""
    if isinstance(computed, bool) or not isinstance(computed, numbers.Integral):
        whole = False
        try:                                  # 21.0, torch.tensor(21): the count, not an int
            whole = not isinstance(computed, (bool, str)) and float(computed).is_integer()
        except (TypeError, ValueError, RuntimeError):
            pass
        raise CheckError(f"give a number of tiles (an int), got {computed!r}"
                         + (": give it as an int, int(x)" if whole else ""))
    computed = int(computed)                  # numpy's integers too
    want = _window_tiles_by_hand(seq, window, tile)
    n = -(-seq // tile)
    if computed == want:
        _ok(f"{want} of {n * n} tiles ({want / (n * n):.0%}), causal alone {n * (n + 1) // 2}: "
            f"the work grows with seq x window, not seq^2")
        return
    if computed == n * (n + 1) // 2:
        hint = "that is the causal mask alone; the window also skips the tiles far left"
    elif computed == n * n:
        hint = "that is every tile; a tile is skipped when no (query, key) in it is kept"
    elif computed == sum(n - d for d in range(window // tile)) and window % tile == 0:
        hint = ("you counted the key tiles that a query tile's LAST query reaches; its "
                "first query reaches one key tile further left, partially (query i sees "
                "back to key i - window + 1)")
    elif computed == n * (window // tile):
        hint = ("the window's band is not aligned with the tiles: a query tile reaches one "
                "key tile more than window / tile, partially")
    elif computed == n * (-(-window // tile) + 1):
        hint = (f"you gave every query tile {computed // n} key tiles; the first query tiles "
                "have fewer key tiles to their left (query tile 0 sees only its diagonal tile)")
    elif window > tile and computed == _window_tiles_by_hand(seq, window + tile, tile):
        hint = (f"that is the count for a window of {window + tile} keys (the figure of "
                f"section 3); this window is {window} keys")
    elif computed == n * n - want:
        hint = ("that is the number of tiles SKIPPED; the exercise asks how many are "
                "computed")
    elif computed == _window_tile_kinds(seq, window, tile)[0]:
        hint = ("you counted only the tiles kept whole; a partial tile (on the diagonal, "
                "and at the window's far edge) is computed too, with the element-wise mask")
    elif computed == _window_tile_kinds(seq, window, tile)[1]:
        hint = ("you counted only the partial tiles; the tiles kept whole are computed "
                "too")
    else:
        hint = (f"draw the {n} x {n} grid: in query tile a, which key tiles hold a key j with "
                "0 <= i - j < window for some query i of the tile?")
    raise CheckError(f"your count is {computed}: {hint}", expected=f"{want} tiles")
