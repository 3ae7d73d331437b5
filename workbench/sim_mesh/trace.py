"""The trace: every collective and every op that runs records one event.

Events are plain data (:class:`Event`); a :class:`Trace` keeps them together
with a modeled clock per rank and stream ("compute" and "comm").  The one
documented piece of global state in the library is the *current trace*::

    with workbench.trace(profile="a100") as tr:
        y = reshard(x, mesh, [Replicate()])
    print(tr.summary())
    tr.to_chrome_trace("step.json")   # open in chrome://tracing or Perfetto

Outside a ``with trace()`` block nothing is recorded (and nothing is slowed).

Clock semantics (the modeled clock, in seconds on the chosen profile):

* a compute op on rank r starts at r's compute clock;
* each group of ranks has its own comm stream on each of its ranks, as each process
  group of PyTorch's ``ProcessGroupNCCL`` runs its collectives on its own NCCL
  stream (a point-to-point pair too): collectives of one group run in order,
  those of different groups (tensor- and data-parallel) side by side; a rank's
  "comm" clock is the latest of its streams;
* a *blocking* collective starts when every rank of its group is free on the
  compute stream and on the group's comm stream, and leaves both at its end (what a
  synchronous NCCL/HCCL call looks like from the host);
* an *async* collective (``overlap=True``) starts when the group's comm stream is
  free and the data is ready (the issuing rank's compute clock); it advances only
  that stream.  :meth:`Trace.wait` makes the compute stream wait for it, which is
  where communication hides behind computation;
* a compute op that runs while async collectives of its rank are in flight progresses
  at ``cost.overlap_rate(profile, ranks)`` of the collective's group (NCCL's kernels hold
  some SMs: on an A100, 24 of 108 for a group inside one node, 16 for one across nodes;
  with several groups in flight, the lowest of their rates: ``cost.finish_beside``), so its
  event lasts longer than the op alone (``args["alone"]``: the seconds it takes alone),
  also when the collective is recorded after the op (an input gradient's, whose data
  was ``ready`` before the wgrad recorded beside it, as ``plan.layer_cost`` prices
  Megatron's async TP backward); blocking collectives stall compute;
* a *deferred* async collective (:meth:`Trace.defer`) is recorded before the next
  event, unless that is an async collective whose data was ready earlier: autograd
  runs a gradient's hook before the node consuming the same backward's input gradient,
  whose collective a device launched first, between the dgrad and the wgrad (Megatron-LM's
  ``LinearWithGradAccumulationAndAsyncCommunication``).
"""
from __future__ import annotations

import contextvars
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from . import trace_export
from .kernel_cost import finish_beside, overlap_rate

__all__ = ["Event", "Trace", "trace", "current_trace"]

STREAMS = ("compute", "comm")
_TAIL = 4          # compute events per rank an async collective can be timed beside later


@dataclass(frozen=True, slots=True)
class Event:
    """One thing that happened on the modeled clock.

    ``ranks`` lists every rank taking part (one for a compute op, the whole group
    for a collective); ``bytes`` is what each rank sends for a collective (or
    reads and writes for an op); ``flops`` is per rank.
    """
    name: str                      # "all_reduce", "matmul", "F", ...
    stream: str                    # "compute" | "comm"
    start: float                   # seconds on the modeled clock
    duration: float                # seconds
    ranks: tuple[int, ...]
    bytes: int = 0
    flops: int = 0
    label: str = ""                # free text, e.g. "reshard S(0)->R on dp"
    args: Mapping = field(default_factory=dict)

    @property
    def end(self) -> float:
        return self.start + self.duration


@dataclass(frozen=True, slots=True)
class Handle:
    """What an async collective returns: wait on it to use its result."""
    ranks: tuple[int, ...]
    end: float


class Trace:
    """Events plus a modeled clock per (rank, stream).

    Args:
        profile: the hardware profile (name or object) used to price events that
            the recording code does not price itself.
    """

    def __init__(self, profile=None):
        from .profiles import get_profile
        self.profile = get_profile(profile)
        self._events: list[Event] = []
        self._clock: dict[tuple[int, str], float] = defaultdict(float)
        self._chan: dict[tuple[int, tuple], float] = defaultdict(float)  # (rank, group)
        self._deferred: list = []      # (ready, record) of deferred async collectives
        self._async: dict[int, list] = defaultdict(list)   # rank -> (start, end, rate)
        self._last: dict[int, int] = {}       # rank -> index of its last compute event
        self._recent: dict[int, list] = defaultdict(list)   # rank -> its last few, in order
        self._rates: dict[tuple, float] = {}  # group -> overlap_rate(profile, group)
        self.notes: list[str] = []            # what the clock leaves out, said once each

    def note(self, text: str) -> None:
        """Say what this trace's clock leaves out (e.g. an optimizer it cannot price)."""
        if text not in self.notes:
            self.notes.append(text)

    @property
    def events(self) -> list[Event]:
        self.flush()
        return self._events

    def defer(self, ready: float, record) -> None:
        """``record()`` records an async collective whose data was ready at ``ready``:
        run before the next event but an async collective ready earlier (module doc)."""
        self._deferred.append((ready, record))

    def flush(self, upto: float = float("inf")) -> None:
        """Record the deferred collectives ready by ``upto``, earliest data first."""
        while any(d[0] <= upto for d in self._deferred):
            first = min(self._deferred, key=lambda d: d[0])
            self._deferred.remove(first)
            first[1]()

    # ---- the clock -------------------------------------------------------------
    def now(self, rank: int, stream: str = "compute") -> float:
        if stream != "compute":         # deferred collectives advance the comm streams
            self.flush()
        return self._clock[(rank, stream)]

    def time(self) -> float:
        """The modeled makespan: the latest clock of any rank and stream."""
        self.flush()
        return max(self._clock.values(), default=0.0)

    def record_compute(self, ranks: Iterable[int], name: str, duration: float,
                       flops: int = 0, bytes: int = 0, label: str = "", args=None) -> Event:
        """An op that each of ``ranks`` runs at once, each on its own compute stream.

        Recorded as one event; its start is the latest compute clock of the ranks
        (simulated ranks run the op in lockstep)."""
        self.flush()
        ranks = tuple(ranks)
        start = max(self._clock[(r, "compute")] for r in ranks)
        end = max(self._beside(r, start, duration) for r in ranks)
        args = dict(args or {})
        if end > start + duration:           # stretched by collectives beside it
            args["alone"] = duration
            duration = end - start
        for r in ranks:
            self._clock[(r, "compute")] = start + duration
            self._last[r] = len(self._events)
            tail = self._recent[r]
            tail.append(len(self._events))
            del tail[:-_TAIL]
        ev = Event(name, "compute", start, duration, ranks, bytes, flops, label, args)
        self._events.append(ev)
        return ev

    def last_compute(self, rank: int) -> "tuple[int, Event] | None":
        """(index, event) of the last compute event of ``rank``, as it stands now."""
        i = self._last.get(rank)
        return None if i is None else (i, self._events[i])

    def _restretch(self, ranks, since: float) -> None:
        """An async collective recorded after the compute ops it runs beside (from
        ``since``, its start): those ops, the last on these ranks (a matmul's weight
        gradient, then its bias's sum), are timed again in order as if the collective
        had come first, each from the end of the one before it on its ranks."""
        chain = sorted({i for r in ranks for i in self._tail(r, since)})
        if not chain:
            return
        held = {r for i in chain for r in self._events[i].ranks}
        if any(self._last.get(r) not in chain
               or self._clock[(r, "compute")] != self._events[self._last[r]].end
               for r in held):
            return                            # something ran or waited after them
        cur: dict[int, float] = {}
        for i in chain:
            ev = self._events[i]
            t = max([ev.start] + [cur[r] for r in ev.ranks if r in cur])
            alone = ev.args.get("alone", ev.duration)
            end = max(self._beside(r, t, alone) for r in ev.ranks)
            if (t, end) != (ev.start, ev.end):
                args = {**ev.args, "alone": alone} if end - t > alone else ev.args
                self._events[i] = Event(ev.name, ev.stream, t, end - t, ev.ranks, ev.bytes,
                                        ev.flops, ev.label, args)
            for r in ev.ranks:
                cur[r] = self._events[i].end       # the event's own end, to the last bit
        for r, t in cur.items():
            self._clock[(r, "compute")] = t

    def _tail(self, rank: int, since: float) -> list:
        """The indices of ``rank``'s last compute events that end after ``since``."""
        out = []
        for i in reversed(self._recent.get(rank, ())):
            if self._events[i].end <= since:
                break
            out.append(i)
        return out

    def _beside(self, rank: int, t: float, work: float) -> float:
        """When ``work`` seconds of compute started at ``t`` on ``rank`` end, at the
        rate of each of the rank's async collectives in flight (module doc)."""
        if rank not in self._async:
            return t + work
        live = self._async[rank] = [iv for iv in self._async[rank] if iv[1] > t]
        return finish_beside(t, work, None, live)

    def _rate(self, group: tuple) -> float:
        """``overlap_rate`` of a collective over ``group`` (sorted ranks) on this profile."""
        r = self._rates.get(group)
        if r is None:
            r = self._rates[group] = overlap_rate(self.profile, group)
        return r

    def record_collective(self, ranks: Sequence[int], name: str, duration: float,
                          bytes: int = 0, label: str = "", args=None,
                          overlap: bool = False, ready: "float | None" = None) -> Handle:
        """A collective over ``ranks``; blocking unless ``overlap=True``.  ``ready``
        (async only): when its data was produced, if before the ranks' compute clock
        (an input gradient whose weight-gradient GEMM was recorded after it)."""
        # deferred ones first, but those whose data came later than this one's after it
        self.flush(ready if overlap and ready is not None else float("inf"))
        ranks = tuple(ranks)
        c, g = self._clock, tuple(sorted(ranks))
        start = max(max(self._chan[(r, g)], c[(r, "compute")] if ready is None or not overlap
                        else ready) for r in ranks)
        end = start + duration
        rate = self._rate(g) if overlap else 1.0
        for r in ranks:
            self._stream_end(r, g, end)
            if not overlap:
                c[(r, "compute")] = end
            elif end > start:
                self._async[r].append((start, end, rate))
        if overlap and ready is not None and rate < 1.0:
            self._restretch(ranks, start)
        self._events.append(Event(name, "comm", start, duration, ranks, bytes, 0, label,
                                  args or {}))
        return Handle(ranks, end)

    def record_send(self, src: int, dst: int, name: str, duration: float, ready: float,
                    bytes: int = 0, label: str = "", args=None) -> Handle:
        """An asynchronous point-to-point send (isend/irecv): it starts once the data is
        ``ready`` and the sender's comm stream is free; the receiver waits on the handle
        before it uses the data.  The sender's compute stream does not wait."""
        self.flush()
        g = tuple(sorted((src, dst)))
        start = max(ready, self._chan[(src, g)])
        end = start + duration
        self._stream_end(src, g, end)
        self._stream_end(dst, g, max(self._chan[(dst, g)], end))
        self._events.append(Event(name, "comm", start, duration, (src, dst), bytes, 0, label,
                                  args or {}))
        return Handle((dst,), end)

    def _stream_end(self, rank: int, group: tuple, end: float) -> None:
        self._chan[(rank, group)] = end
        if self._clock[(rank, "comm")] < end:
            self._clock[(rank, "comm")] = end

    def wait(self, handle: Handle) -> None:
        """Make the compute stream of the handle's ranks wait for the collective."""
        self.flush()
        for r in handle.ranks:
            key = (r, "compute")
            if self._clock[key] < handle.end:
                self._clock[key] = handle.end

    def barrier(self, ranks: Iterable[int]) -> None:
        self.flush()
        ranks = tuple(ranks)
        t = max(max(self._clock[(r, s)] for s in STREAMS) for r in ranks)
        for r in ranks:
            for s in STREAMS:
                self._clock[(r, s)] = t
        for key in self._chan:
            if key[0] in ranks:
                self._chan[key] = t

    # ---- reading ------------------------------------------------------------------
    def collectives(self) -> list[Event]:
        return [e for e in self.events if e.stream == "comm"]

    def counts(self) -> Counter:
        """How many collectives of each kind were recorded."""
        return Counter(e.name for e in self.collectives())

    def total_bytes(self, name: str | None = None) -> int:
        """Bytes sent, summed over every recorded collective event (of ``name``): groups
        that ran at once count once each.  For what one rank sent, see
        :meth:`bytes_per_rank`."""
        return sum(e.bytes for e in self.collectives() if name is None or e.name == name)

    def bytes_per_rank(self, name: str | None = None) -> dict[int, int]:
        """Bytes each rank sent in the recorded collectives (of ``name``).  An uneven
        all-to-all (``all_to_all_v``: its ``send_bytes`` matrix, row i what ``ranks[i]``
        sends each) counts each rank's own off-rank sends, not the busiest rank's
        ``bytes`` (was: every rank charged the busiest sender's, so a router sending all
        its tokens one way counted the dispatch and the combine twice on every rank)."""
        out: dict[int, int] = defaultdict(int)
        for e in self.collectives():
            if name is None or e.name == name:
                if e.name == "send_recv" and "src" in e.args:
                    out[e.args["src"]] += e.bytes
                    continue
                matrix = e.args.get("send_bytes") if e.args else None
                if matrix is not None and len(matrix) == len(e.ranks):
                    for i, (r, row) in enumerate(zip(e.ranks, matrix)):
                        out[r] += sum(row) - row[i]
                    continue
                for r in e.ranks:
                    out[r] += e.bytes
        return dict(out)

    def busy(self, rank: int, stream: str) -> float:
        return sum(e.duration for e in self.events if e.stream == stream and rank in e.ranks)

    def summary(self) -> str:
        """One line per collective kind: events, bytes sent by the busiest rank, and the
        summed duration of the events."""
        return trace_export.summary(self)

    def __repr__(self) -> str:
        return (f"Trace({len(self.events)} events, {trace_export.fmt_s(self.time())}, "
                f"{self.profile.name})")

    def to_chrome_trace(self, path=None) -> dict:
        """Chrome trace-event JSON: one process per rank, one thread per stream.

        Opens in chrome://tracing and https://ui.perfetto.dev.  Returns the dict and
        writes it to ``path`` when given."""
        return trace_export.chrome_trace(self, path)


_current: contextvars.ContextVar[Trace | None] = contextvars.ContextVar("workbench_trace",
                                                                      default=None)


def current_trace() -> Trace | None:
    """The trace being recorded, or None outside ``with workbench.trace()``."""
    return _current.get()


class suspend:
    """``with suspend():`` runs code without recording (the caller records by hand)."""

    def __enter__(self):
        self._token = _current.set(None)

    def __exit__(self, *exc):
        _current.reset(self._token)


class trace:
    """``with workbench.trace(profile="ascend-910b") as tr: ...`` records a Trace.

    Nested blocks record into their own, fresh trace."""

    def __init__(self, profile=None):
        self._profile = profile
        self._token = None
        self.trace: Trace | None = None

    def __enter__(self) -> Trace:
        self.trace = Trace(self._profile)
        self._token = _current.set(self.trace)
        return self.trace

    def __exit__(self, *exc) -> None:
        self.trace.flush()
        _current.reset(self._token)
