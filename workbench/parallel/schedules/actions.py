"""Pipeline schedules as plain data: what each rank runs, in which order.

A schedule lists, for every rank (pipeline device), the ordered actions it runs:

* ``F``  forward of one micro-batch through one model chunk;
* ``B``  backward.  In a schedule with ``split_backward=False`` it is the whole
  backward; with ``split_backward=True`` it is only the input gradient, and
* ``W``  is the weight gradient, split off so it can be deferred (Qi et al. 2024,
  "Zero Bubble Pipeline Parallelism").

Rank ``r`` holds ``v`` model chunks; which layer-stage chunk ``c`` of rank ``r``
holds is the schedule's ``layout`` (:data:`LAYOUTS`):

* ``"interleaved"`` (default): chunk c of rank r is layer-stage ``c * p + r``
  (Megatron's virtual pipeline, Narayanan et al. SC21), so the model runs stage 0,
  1, ..., p*v - 1;
* ``"v"``: two chunks, stage r and stage 2p - 1 - r (the "V" of ZB-V, Qi et al. 2024:
  rank 0 holds the first and the last stage);
* ``"dualpipe"``: two copies of a p-stage model (DeepSeek-V3's DualPipe): chunk 0 of
  rank r is stage r of the copy fed from rank 0, chunk 1 is stage p - 1 - r of the copy
  fed from rank p - 1; micro-batches ``mb < m // 2`` run on chunk 0 only, the rest on
  chunk 1 only (:meth:`Schedule.chunks_of`).  The send/recv between stages is not stored: it is
derived (:func:`transfers`), since F of stage ``s`` always feeds F of ``s + 1`` and
B of ``s`` feeds B of ``s - 1``.

Text form, one row per rank (write ``F3c1`` for micro-batch 3 on chunk 1)::

    >>> s = Schedule.from_text(["F0 F1 B0 B1",
    ...                         "F0 B0 F1 B1"])
    >>> print(s)
    custom: p=2 m=2 v=1
    rank 0: F0 F1 B0 B1
    rank 1: F0 B0 F1 B1
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

__all__ = ["Action", "Schedule", "Transfer", "transfers", "KINDS", "LAYOUTS"]

KINDS = ("F", "B", "W")
LAYOUTS = ("interleaved", "v", "dualpipe")
TEXT_WIDTH = 100      # characters a printed schedule's line may take (Schedule.__str__)
_TOKEN = re.compile(r"^([FBW])(\d+)(?:c(\d+))?$")


@dataclass(frozen=True, slots=True)
class Action:
    """One step of one rank: ``Action("F", 3)`` is the forward of micro-batch 3.

    ``str`` is the compact token used in the text form (``F3``, ``B3c1``)."""
    kind: str          # "F" | "B" | "W"
    mb: int            # micro-batch index, 0 <= mb < m
    chunk: int = 0     # model chunk on this rank, 0 <= chunk < v

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Action kind={self.kind!r}: must be one of 'F' (forward), "
                             f"'B' (backward or input gradient), 'W' (weight gradient)")
        for arg in ("mb", "chunk"):
            val = getattr(self, arg)
            if isinstance(val, bool) or not isinstance(val, int) or val < 0:
                raise ValueError(f"Action {arg}={val!r}: must be an int >= 0")

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}" + (f"c{self.chunk}" if self.chunk else "")

    def __repr__(self) -> str:
        chunk = f", chunk={self.chunk}" if self.chunk else ""
        return f"Action({self.kind!r}, {self.mb}{chunk})"

    @classmethod
    def parse(cls, token) -> "Action":
        """``"F3"``, ``"B2c1"``, an Action, or a tuple ``("F", 3)`` / ``("F", 3, 1)``."""
        if isinstance(token, Action):
            return token
        if isinstance(token, (tuple, list)):
            return cls(*token)
        mt = _TOKEN.match(str(token).strip())
        if not mt:
            raise ValueError(f"action {token!r}: write a kind F, B or W, then the micro-batch, "
                             f"and optionally c<chunk>, e.g. 'F3', 'B0', 'W2c1'")
        return cls(mt.group(1), int(mt.group(2)), int(mt.group(3) or 0))


@dataclass(frozen=True, slots=True)
class Transfer:
    """One point-to-point message between stages, derived from a schedule.

    An ``activation`` goes from F(mb) on stage s to F(mb) on stage s + 1; a
    ``gradient`` goes from B(mb) on stage s to B(mb) on stage s - 1."""
    kind: str          # "activation" | "gradient"
    mb: int
    src: int           # sending rank
    dst: int           # receiving rank
    src_chunk: int
    dst_chunk: int


@dataclass(frozen=True)
class Schedule:
    """Per-rank ordered actions of one training step (one global batch).

    ``actions[r]`` is the order in which rank ``r`` runs its actions.  A schedule
    need not be valid to exist (so that a broken hand-written one can be built
    and shown); :func:`validate` says what is wrong with it.
    """
    p: int                                   # ranks (pipeline devices)
    m: int                                   # micro-batches per step
    v: int                                   # model chunks per rank (1 = no interleaving)
    actions: tuple[tuple[Action, ...], ...]  # actions[rank] in run order
    name: str = "custom"
    split_backward: bool = False             # True: backward is B (input grad) + W (weight grad)
    layout: str = "interleaved"              # which stage each chunk holds (LAYOUTS)
    _index: dict = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        for arg in ("p", "m", "v"):
            val = getattr(self, arg)
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"Schedule {arg}={val!r}: must be an int >= 1")
        _check_rows("Schedule(actions=...)", self.actions)
        rows = tuple(tuple(Action.parse(a) for a in row) for row in self.actions)
        if len(rows) != self.p:
            raise ValueError(f"Schedule p={self.p} but actions has {len(rows)} rows: "
                             f"give one row of actions per rank")
        object.__setattr__(self, "actions", rows)
        if self.layout not in LAYOUTS:
            raise ValueError(f"Schedule layout={self.layout!r}: use one of {list(LAYOUTS)}")
        if self.layout != "interleaved" and self.v != 2:
            raise ValueError(f"Schedule layout={self.layout!r} places two chunks per rank; "
                             f"got v={self.v}: use v=2")
        if self.layout == "dualpipe" and self.m % 2:
            raise ValueError(f"Schedule layout='dualpipe' feeds half the micro-batches from "
                             f"each end; got m={self.m}: use an even m")

    # ---- building by hand ----------------------------------------------------------
    @classmethod
    def from_text(cls, rows, *, m: int | None = None, v: int | None = None,
                  split_backward: bool | None = None, name: str = "custom",
                  layout: str = "interleaved") -> "Schedule":
        """Build a schedule from one row per rank.

        ``rows`` is a list of strings (``"F0 F1 B0 B1"``; a leading ``"rank 0:"``
        is ignored), one multi-line string, or a list of lists of tokens, Actions
        or tuples.  ``m``, ``v`` and ``split_backward`` default to what the actions
        use (the largest micro-batch + 1, the largest chunk + 1, any W present).
        """
        if isinstance(rows, str):
            rows = [ln for ln in rows.strip().splitlines() if ln.strip()]
        _check_rows("Schedule.from_text(rows=...)", rows, text=True)
        parsed = []
        for row in rows:
            if isinstance(row, str):
                row = row.split(":", 1)[1] if ":" in row else row
                row = row.split()
            parsed.append(tuple(Action.parse(t) for t in row))
        if not parsed:
            raise ValueError("Schedule.from_text(rows=[]): give one row of actions per rank")
        every = [a for row in parsed for a in row]
        m = m if m is not None else 1 + max((a.mb for a in every), default=0)
        v = v if v is not None else 1 + max((a.chunk for a in every), default=0)
        if split_backward is None:
            split_backward = any(a.kind == "W" for a in every)
        return cls(len(parsed), m, v, tuple(parsed), name, split_backward, layout)

    # ---- reading -------------------------------------------------------------------
    @property
    def stages(self) -> int:
        """Stages a micro-batch passes through: p * v (p for "dualpipe", whose two chunks
        per rank are two copies of a p-stage model)."""
        return self.p if self.layout == "dualpipe" else self.p * self.v

    def stage(self, rank: int, chunk: int) -> int:
        """The layer-stage that chunk ``chunk`` of rank ``rank`` holds (module docstring)."""
        if self.layout == "interleaved":
            return chunk * self.p + rank
        if self.layout == "v":
            return rank if chunk == 0 else 2 * self.p - 1 - rank
        return rank if chunk == 0 else self.p - 1 - rank

    def placement(self, stage: int, mb: int = 0) -> tuple[int, int]:
        """(rank, chunk) running layer-stage ``stage`` for micro-batch ``mb`` (``mb``
        matters only for "dualpipe", whose micro-batches use one copy or the other)."""
        p = self.p
        if self.layout == "interleaved":
            return stage % p, stage // p
        if self.layout == "v":
            return (stage, 0) if stage < p else (2 * p - 1 - stage, 1)
        return (stage, 0) if mb < self.m // 2 else (p - 1 - stage, 1)

    def chunks_of(self, mb: int) -> tuple[int, ...]:
        """The chunks micro-batch ``mb`` runs on, on every rank."""
        if self.layout == "dualpipe":
            return (0,) if mb < self.m // 2 else (1,)
        return tuple(range(self.v))

    def slot(self, rank: int, chunk: int) -> int:
        """Index of the stage callable (and its parameters) for chunk ``chunk`` of rank
        ``rank``: the layer-stage, or for "dualpipe" chunk * p + stage (copy 0 of stage s
        at s, copy 1 at p + s)."""
        s = self.stage(rank, chunk)
        return chunk * self.p + s if self.layout == "dualpipe" else s

    def position(self, rank: int, action: Action) -> int | None:
        """Index of ``action`` in rank ``rank``'s row (None if absent; first if repeated)."""
        if self._index is None:
            idx = [{} for _ in range(self.p)]
            for r, row in enumerate(self.actions):
                for i, a in enumerate(row):
                    idx[r].setdefault(a, i)
            object.__setattr__(self, "_index", idx)
        return self._index[rank].get(action)

    def __len__(self) -> int:
        return sum(len(row) for row in self.actions)

    def to_text(self) -> list[str]:
        """One line per rank, ``"rank r: F0 F1 B0 ..."``; :meth:`from_text` reads it back."""
        width = len(str(self.p - 1))
        return [f"rank {r:>{width}}: " + " ".join(map(str, row))
                for r, row in enumerate(self.actions)]

    def __str__(self) -> str:
        """The head line and one row per rank; rows longer than TEXT_WIDTH characters are
        cut into parts of the same positions on every rank, one column per position (a
        notebook's output area breaks a longer line anywhere, even inside ``F3c1``)."""
        head = f"{self.name}: p={self.p} m={self.m} v={self.v}"
        if self.split_backward:
            head += " (backward split into B and W)"
        if self.layout != "interleaved":
            head += f" [{self.layout} layout]"
        rows = self.to_text()
        if max(map(len, rows), default=0) <= TEXT_WIDTH:
            return "\n".join([head] + rows)
        tokens = [[str(a) for a in row] for row in self.actions]
        cell = max(len(t) for row in tokens for t in row) + 1
        prefix = len(rows[0]) - len(rows[0].split(": ", 1)[1])       # "rank 0: "
        per = max(1, (TEXT_WIDTH - prefix + 1) // cell)
        n = max(map(len, tokens))
        lines = [head + f"   (rows in {-(-n // per)} parts of {per} actions)"]
        for lo in range(0, n, per):
            lines.append(f"positions {lo}-{min(lo + per, n) - 1}:")
            lines += [rows[r][:prefix] + "".join(t.ljust(cell) for t in row[lo:lo + per]).rstrip()
                      for r, row in enumerate(tokens)]
        return "\n".join(lines)

    def __repr__(self) -> str:
        lay = f", layout={self.layout!r}" if self.layout != "interleaved" else ""
        return (f"Schedule({self.name!r}, p={self.p}, m={self.m}, v={self.v}, "
                f"split_backward={self.split_backward}{lay}, {len(self)} actions)")


def _check_rows(fn: str, rows, text: bool = False) -> None:
    """A clear TypeError unless ``rows`` is a list of rows, each a list of actions
    (or, with ``text``, a string such as ``"F0 F1 B0 B1"``)."""
    ok = isinstance(rows, (list, tuple)) and all(
        isinstance(row, (list, tuple)) or (text and isinstance(row, str)) for row in rows)
    if not ok:
        raise TypeError(f"{fn[:-4]}{rows!r:.60}): give one row per rank, each a list of actions "
                        f"such as ['F0', 'B0'] or (\"F\", 0)" +
                        (", or a string 'F0 F1 B0 B1'" if text else ""))


def transfers(schedule: Schedule) -> list[Transfer]:
    """The send/recv messages a schedule implies, in each sender's run order.

    Derived, not stored: F on stage s sends its activation to stage s + 1, and B
    on stage s sends its input gradient to stage s - 1 (when the two stages sit on
    different ranks, which they always do for p > 1)."""
    last = schedule.stages - 1
    out = []
    for r, row in enumerate(schedule.actions):
        for a in row:
            s = schedule.stage(r, a.chunk)
            if a.kind == "F" and s < last:
                dst, dst_chunk = schedule.placement(s + 1, a.mb)
                if dst != r:
                    out.append(Transfer("activation", a.mb, r, dst, a.chunk, dst_chunk))
            elif a.kind == "B" and s > 0:
                dst, dst_chunk = schedule.placement(s - 1, a.mb)
                if dst != r:
                    out.append(Transfer("gradient", a.mb, r, dst, a.chunk, dst_chunk))
    return out

