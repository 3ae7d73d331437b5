"""Hide communication behind computation by decomposing a collective into chunks.

A tensor-parallel matmul is followed (or preceded) by a collective that needs
its whole result.  Split the rows of the matmul in ``k`` chunks and chunk ``i``'s
collective can run on the comm stream while chunk ``i+1`` is computed (Wang et
al. 2022, "Overlap communication with dependent computation via decomposition
in large deep learning models"; Paddle's and Ascend's fused ``matmul_all_reduce``,
``all_gather_matmul``, ``matmul_reduce_scatter``; MindSpore's fine-grained overlap):

    op                       input (per rank)        output (per rank)       collective
    matmul_all_reduce        x[M, K_tp] @ w[K_tp, N]  y[M, N]   replicated    all_reduce(y_i)
    all_gather_matmul        x[M_tp, K] @ w[K, N_tp]  y[M, N_tp]              all_gather(x_i)
    matmul_reduce_scatter    x[M, K_tp] @ w[K_tp, N]  y[M_tp, N]              reduce_scatter(y_i)

Tensors are STACKED (``(*mesh.shape', *local)``, see ``sim_mesh.collectives``).
Each op returns its result, equal to the unsplit op, and an :class:`OverlapReport`
measured on the modeled clock of the current trace (or of a fresh one).

How much can hide?  With per-chunk compute c = C/k and communication m = M/k,
the chunks form a two-stage pipeline whose makespan is c + m + (k-1) max(c, m),
so the exposed communication is m + (k-1) max(0, m - c) and

    hidden share = (k-1) min(c, m) / (k m) = (1 - 1/k) min(1, C/M)

(:func:`expected_hidden_share`).  More chunks hide more, up to the bound C/M;
on a real profile each chunk also pays a launch, the link latency and re-reads the weight,
so past some k the extra cost outweighs what is hidden (``overlap_sweep.py``).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from ...sim_mesh import cost as _cost
from ...sim_mesh.collectives import all_gather, all_reduce, record_collective, reduce_scatter
from ...sim_mesh.profiles import get_profile
from ...sim_mesh.trace import Event, current_trace, trace

__all__ = ["OverlapReport", "exposed_intervals", "expected_hidden_share",
           "matmul_all_reduce", "all_gather_matmul", "matmul_reduce_scatter", "OPS"]

WIDTH = 100         # printed lines at most this wide (JupyterLab wraps at about 100-105)


# ---- measuring overlap on the modeled clock ------------------------------------------

def _merged(intervals) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _length(intervals) -> float:
    return sum(e - s for s, e in intervals)


def exposed_intervals(events: Iterable[Event], rank: int) -> list[tuple[float, float]]:
    """Times when ``rank`` communicates while its compute stream is idle (merged)."""
    events = list(events)
    comm = _merged((e.start, e.end) for e in events if e.stream == "comm" and rank in e.ranks)
    busy = _merged((e.start, e.end) for e in events if e.stream == "compute" and rank in e.ranks)
    out, j = [], 0
    for s, e in comm:
        while j < len(busy) and busy[j][1] <= s:
            j += 1
        t, i = s, j
        while t < e:
            if i < len(busy) and busy[i][0] < e:
                if busy[i][0] > t:
                    out.append((t, busy[i][0]))
                t = max(t, busy[i][1])
                i += 1
            else:
                out.append((t, e))
                t = e
    return out


@dataclass(frozen=True)
class OverlapReport:
    """How much communication an op hid, measured on the modeled clock (plain data).

    Times are seconds on ``profile`` for the reported ``rank`` (the one with the
    most exposed communication; in these lockstep ops every rank is alike).
    """
    kind: str            # "matmul_all_reduce", "multi-copy forward", ...
    k: int               # chunks (or copies)
    total: float         # makespan of the op: first event's start to last event's end
    compute: float       # compute-stream busy time
    comm: float          # comm-stream busy time
    exposed: float       # comm time while the compute stream is idle
    rank: int = 0
    profile: str = ""
    events: tuple = field(default=(), repr=False)   # the Events the op recorded

    @property
    def hidden(self) -> float:
        """Communication time that ran while the compute stream was busy."""
        return self.comm - self.exposed

    @property
    def hidden_share(self) -> float:
        """hidden / comm (0.0 when nothing was communicated)."""
        return self.hidden / self.comm if self.comm > 0 else 0.0

    @classmethod
    def from_events(cls, events: Iterable[Event], kind: str = "", k: int = 1,
                    profile: str = "") -> "OverlapReport":
        """Measure any list of events (e.g. ``Trace.events``)."""
        events = tuple(events)
        if not events:
            return cls(kind, k, 0.0, 0.0, 0.0, 0.0, 0, profile, events)
        ranks = sorted({r for e in events for r in e.ranks})

        def busy(r, stream):
            return _length(_merged((e.start, e.end) for e in events
                                   if e.stream == stream and r in e.ranks))
        stats = {r: (_length(exposed_intervals(events, r)), busy(r, "comm"), busy(r, "compute"))
                 for r in ranks}
        rank = max(ranks, key=lambda r: (stats[r][0], stats[r][1], -r))
        exposed, comm, compute = stats[rank]
        total = max(e.end for e in events) - min(e.start for e in events)
        return cls(kind, k, total, compute, comm, exposed, rank, profile, events)

    def __str__(self) -> str:
        """One line, or two where one would be wider than ``WIDTH`` characters (JupyterLab
        wraps a text output at about 100, mid-word): the op, then its times, indented."""
        head = f"{self.kind} k={self.k} on {self.profile}:"
        body = (f"total {_ms(self.total)}, compute {_ms(self.compute)}, "
                f"comm {_ms(self.comm)}, exposed {_ms(self.exposed)}, "
                f"hidden {self.hidden_share:.1%}")
        one = f"{head} {body}"
        return one if len(one) <= WIDTH else f"{head}\n  {body}"


def _ms(t: float) -> str:
    return f"{t * 1e3:.3f} ms"


def expected_hidden_share(compute: float, comm: float, k: int) -> float:
    """(1 - 1/k) min(1, C/M): the share of M hidden when an op with compute C and
    communication M is cut into k equal chunks that pipeline (module docstring)."""
    if not (isinstance(k, int) and k >= 1):
        raise ValueError(f"k={k!r} must be an int >= 1 (the number of chunks)")
    if comm <= 0:
        return 0.0
    return (1 - 1 / k) * min(1.0, compute / comm)


# ---- recording helpers ----------------------------------------------------------------

@contextlib.contextmanager
def _recording(profile):
    """The current trace, or a fresh one on ``profile`` when none is being recorded."""
    tr = current_trace()
    if tr is None:
        with trace(profile) as tr:
            yield tr
        return
    if profile is not None and get_profile(profile).name != tr.profile.name:
        raise ValueError(f"profile={get_profile(profile).name!r} but the current trace prices "
                         f"on {tr.profile.name!r}; drop profile= or record outside that trace")
    yield tr


def _quiet(fn, *args, **kwargs):
    """Run a library collective for its exact math only: a nested trace block records
    into its own fresh trace, thrown away here; the caller records the async event."""
    with trace(None):
        return fn(*args, **kwargs)


def _local_numel(t: torch.Tensor, nd: int) -> int:
    n = 1
    for s in t.shape[nd:]:
        n *= s
    return n


def _record_matmul(tr, mesh, name, a, b, out, label=""):
    """A per-rank matmul a[m, k] @ b[k, n] on the compute stream: one GEMM kernel,
    priced by the roofline at the profile's matmul efficiency for its shape (or the
    device's measured rate for it) plus one launch."""
    nd, e = mesh.ndim, a.element_size()
    m, kk, n = a.shape[-2], a.shape[-1], b.shape[-1]
    flops = 2 * m * kk * n
    nbytes = (_local_numel(a, nd) + _local_numel(b, nd) + _local_numel(out, nd)) * e
    dur = _cost.compute_time(flops, nbytes, tr.profile, a.dtype, op_class="matmul", launches=1,
                             gemm=(1, m, n))
    tr.record_compute(mesh.ranks, name, dur, flops=flops, bytes=nbytes, label=label,
                      args={"op_class": "matmul", "phase": "forward"})


def _check(what, x, w, mesh, axis, chunks, rows):
    for name, t in (("x", x), ("w", w)):
        if not isinstance(t, torch.Tensor) or t.dim() != mesh.ndim + 2:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{what}: {name} must be a stacked tensor of shape "
                             f"(*{mesh.shape}, rows, cols), one leading axis per mesh dim; "
                             f"got {got}")
        for d, (s, n) in enumerate(zip(t.shape[:mesh.ndim], mesh.shape)):
            if s not in (1, n):
                raise ValueError(f"{what}: {name}'s leading axis {d} has size {s}; mesh dim "
                                 f"{mesh.dim_names[d]!r} needs {n} (sharded) or 1 (replicated)")
    ax = mesh.dim(axis)
    if x.shape[-1] != w.shape[-2]:
        raise ValueError(f"{what}: x's local columns ({x.shape[-1]}) must equal w's local "
                         f"rows ({w.shape[-2]})")
    if x.shape[ax] != mesh.shape[ax]:
        raise ValueError(f"{what}: x is replicated along mesh dim {mesh.dim_names[ax]!r} "
                         f"(leading axis {ax} has size 1); it must be sharded there")
    if isinstance(chunks, bool) or not isinstance(chunks, int) or not 1 <= chunks <= rows:
        raise ValueError(f"{what}: chunks={chunks!r} must be an int in [1, {rows}] "
                         f"(each chunk needs at least one row)")
    return ax


# ---- the decomposed ops -----------------------------------------------------------------

def matmul_all_reduce(x, w, mesh, axis, chunks: int = 1, *, profile=None):
    """Row-parallel matmul then all-reduce, in ``chunks`` row chunks.

    x: (*lead, M, K/p) sharded along ``axis``; w: (*lead, K/p, N).  Returns
    ``(y, report)`` with y = all_reduce(x @ w) of shape (*lead', M, N), replicated
    along ``axis``.  Chunk i's all-reduce starts when its matmul ends and runs
    while chunk i+1 is computed (Megatron's row-parallel linear, decomposed)."""
    ax = _check("matmul_all_reduce", x, w, mesh, axis, chunks, x.shape[-2])
    nd = mesh.ndim
    with _recording(profile) as tr:
        n0, outs, handles = len(tr.events), [], []
        for i, xi in enumerate(x.tensor_split(chunks, dim=nd)):   # (*lead, M_i, K/p)
            yi = xi @ w                                            # (*lead, M_i, N) partial
            _record_matmul(tr, mesh, "matmul", xi, w, yi, label=f"chunk {i}")
            outs.append(_quiet(all_reduce, yi, mesh, ax))          # (*lead', M_i, N)
            handles += record_collective("all_reduce", mesh, ax, _local_numel(yi, nd)
                                         * yi.element_size(), f"chunk {i}", overlap=True)
        for h in handles:
            tr.wait(h)
        rep = OverlapReport.from_events(tr.events[n0:], "matmul_all_reduce", chunks,
                                        tr.profile.name)
    return torch.cat(outs, nd), rep


def all_gather_matmul(x, w, mesh, axis, chunks: int = 1, *, profile=None):
    """Sequence-parallel input gathered in chunks while computing.

    x: (*lead, M/p, K) sharded by rows along ``axis``; w: (*lead, K, N/p).  Returns
    ``(y, report)`` with y = all_gather(x, rows) @ w of shape (*lead, M, N/p).
    Every rank splits its rows in ``chunks``; gathering chunk i+1 runs while chunk
    i is multiplied.  All gathers are issued up front (they queue on the comm
    stream); chunk i's matmul waits for its own gather only."""
    ax = _check("all_gather_matmul", x, w, mesh, axis, chunks, x.shape[-2])
    nd, p = mesh.ndim, mesh.shape[ax]
    with _recording(profile) as tr:
        n0 = len(tr.events)
        parts = x.tensor_split(chunks, dim=nd)                   # (*lead, c_i, K) per rank
        gathered, handles = [], []
        for i, xi in enumerate(parts):
            gi = _quiet(all_gather, xi, mesh, ax, 0)               # (*lead', p c_i, K)
            gathered.append(gi)
            handles.append(record_collective("all_gather", mesh, ax, _local_numel(gi, nd)
                                             * gi.element_size(), f"chunk {i}", overlap=True))
        outs = []
        for i, (xi, gi) in enumerate(zip(parts, gathered)):
            for h in handles[i]:
                tr.wait(h)
            yi = gi @ w                                            # (*lead, p c_i, N/p)
            _record_matmul(tr, mesh, "matmul", gi, w, yi, label=f"chunk {i}")
            outs.append(yi.unflatten(nd, (p, xi.shape[nd])))       # (*lead, p, c_i, N/p)
        rep = OverlapReport.from_events(tr.events[n0:], "all_gather_matmul", chunks,
                                        tr.profile.name)
    return torch.cat(outs, nd + 1).flatten(nd, nd + 1), rep       # rows back in rank order


def matmul_reduce_scatter(x, w, mesh, axis, chunks: int = 1, *, profile=None):
    """Row-parallel matmul then reduce-scatter of the rows (sequence parallel), chunked.

    x: (*lead, M, K/p) sharded along ``axis``; w: (*lead, K/p, N).  Returns
    ``(y, report)`` with y = reduce_scatter(x @ w, rows) of shape (*lead, M/p, N).
    Chunk i holds the i-th slice of every destination rank's block, so its
    reduce-scatter delivers to each rank the i-th piece of exactly its own rows."""
    ax = _check("matmul_reduce_scatter", x, w, mesh, axis, chunks, x.shape[-2])
    nd, p, M = mesh.ndim, mesh.shape[ax], x.shape[-2]
    if M % p:
        raise ValueError(f"matmul_reduce_scatter: x has {M} rows, not divisible by the "
                         f"{p} ranks of mesh dim {mesh.dim_names[ax]!r}; pad the rows")
    if chunks > M // p:
        raise ValueError(f"matmul_reduce_scatter: chunks={chunks} must be an int in "
                         f"[1, {M // p}] (each rank's block has {M // p} rows)")
    with _recording(profile) as tr:
        n0, outs, handles = len(tr.events), [], []
        blocks = x.unflatten(nd, (p, M // p))                      # (*lead, p_dst, M/p, K/p)
        for i, xi in enumerate(blocks.tensor_split(chunks, dim=nd + 1)):
            xi = xi.flatten(nd, nd + 1)                            # (*lead, p c_i, K/p)
            yi = xi @ w                                            # (*lead, p c_i, N) partial
            _record_matmul(tr, mesh, "matmul", xi, w, yi, label=f"chunk {i}")
            outs.append(_quiet(reduce_scatter, yi, mesh, ax, 0))   # (*lead, c_i, N)
            handles += record_collective("reduce_scatter", mesh, ax, _local_numel(yi, nd)
                                         * yi.element_size(), f"chunk {i}", overlap=True)
        for h in handles:
            tr.wait(h)
        rep = OverlapReport.from_events(tr.events[n0:], "matmul_reduce_scatter", chunks,
                                        tr.profile.name)
    return torch.cat(outs, nd), rep


OPS: dict[str, Callable] = {f.__name__: f for f in
                            (matmul_all_reduce, all_gather_matmul, matmul_reduce_scatter)}
