"""``explain(fn, *args)``: run a function on DistTensors and say, op by op, what the
SPMD rules decided, which collectives were inserted, what they cost, and why.

    >>> table = wb.explain(lambda a, b: torch.relu(a @ b), a, b)
    >>> print(table)
    op      inputs          required        output   inserted          bytes   time  why
    matmul  [R], [S(0)]     [S(1)], [S(0)]  [P(sum)] -                     0   ...
    relu    [P(sum)]        [S(0)]          [S(0)]   reduce_scatter      144   ...

The rows are plain data (:class:`ExplainRow`); the table prints as text and shows
as HTML in a notebook.
"""
from __future__ import annotations

import html
from dataclasses import dataclass

from ..sim_mesh.trace import current_trace, trace
from ..text_width import wrap
from .dispatch import explain_hooks
from .ops_table.table import TABLE
from .placement import fmt_placements

__all__ = ["explain", "Explanation", "ExplainRow"]


@dataclass(frozen=True)
class ExplainRow:
    op: str
    inputs: tuple           # input placements as they came (None for non-tensors)
    required: tuple         # what the rule required
    outputs: tuple          # output placements
    collectives: tuple      # inserted collectives, in order (kind, mesh dim)
    bytes: int              # bytes each rank sent for them
    time: float             # modeled seconds of that communication
    reason: str
    candidates: int         # how many valid strategies the rule weighed
    op_class: str = ""      # the op table's class of the op ("matmul", "elementwise", ...)
    flops: int = 0          # forward FLOPs on the busiest rank (the op table's cost)
    backward_flops: int = 0


class Explanation:
    """The rows of :func:`explain`, the function's result, and the trace."""

    def __init__(self, rows, result, trace_):
        self.rows = list(rows)
        self.result = result
        self.trace = trace_

    @property
    def total_bytes(self) -> int:
        return sum(r.bytes for r in self.rows)

    @property
    def total_time(self) -> float:
        return sum(r.time for r in self.rows)

    def _cells(self):
        out = []
        for r in self.rows:
            fmt = lambda ps: ", ".join("-" if p is None else fmt_placements(p) for p in ps)  # noqa: E731
            out.append((r.op, fmt(r.inputs), fmt(r.required), fmt(r.outputs),
                        ", ".join(f"{k} on {d}" if d else k for k, d in r.collectives) or "-",
                        f"{r.bytes:,d}", f"{r.time * 1e6:.2f}"))
        return out

    HEAD = ("op", "inputs", "required", "output", "inserted", "bytes/rank", "us")

    def __str__(self) -> str:
        cells = self._cells()
        widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h)
                  for i, h in enumerate(self.HEAD)]
        line = lambda c: "  ".join(x.ljust(w) for x, w in zip(c, widths)).rstrip()  # noqa: E731
        rows = [line(self.HEAD)] + [line(c) for c in cells]
        rows.append(f"total: {self.total_bytes:,d} bytes sent per rank, "
                    f"{self.total_time * 1e6:.2f} us of communication")
        return "\n".join(rows)

    def reasons(self) -> str:
        """Each op's reason, one per op, within ``text_width.WIDTH`` characters a line."""
        return wrap("\n".join(f"{r.op}: {r.reason}" for r in self.rows))

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{h}</th>" for h in self.HEAD + ("why",))
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(x)}</td>" for x in c) +
            f"<td>{html.escape(r.reason)}</td></tr>" for c, r in zip(self._cells(), self.rows))
        total = (f"<p>total: {self.total_bytes:,d} bytes sent per rank, "
                 f"{self.total_time * 1e6:.2f} us of communication</p>")
        return f"<table><tr>{head}</tr>{body}</table>{total}"

    def __repr__(self) -> str:
        return str(self)


def _op_class(op: str) -> str:
    e = TABLE.get(op)
    return (e.op_class or "") if e is not None else ""


def explain(fn, *args, profile=None, **kwargs) -> Explanation:
    """Run ``fn(*args, **kwargs)`` and explain every SPMD decision it made.

    Runs inside the current trace if one is open, else in a fresh one on
    ``profile``."""
    rows = []
    outer = current_trace()
    ctx = trace(profile) if outer is None else None
    tr = ctx.__enter__() if ctx is not None else outer
    mark = [len(tr.events)]

    def hook(dec, specs, outputs, cost=None):
        evs = [e for e in tr.events[mark[0]:] if e.stream == "comm"]
        seen, colls, nbytes, t = set(), [], 0, 0.0
        for e in evs:              # one event per group: count each collective once
            key = (e.name, e.args.get("mesh_dim", ""), e.label, e.start)
            if key in seen:
                continue
            seen.add(key)
            colls.append((e.name, e.args.get("mesh_dim", "")))
            nbytes += e.bytes
            t += e.duration
        mark[0] = len(tr.events)
        rows.append(ExplainRow(
            dec.op, tuple(None if s is None else tuple(s.placements) for s in specs),
            dec.inputs, dec.outputs, tuple(colls), nbytes, t, dec.reason,
            len(dec.candidates), _op_class(dec.op), 0 if cost is None else cost.flops,
            0 if cost is None else cost.backward_flops))
    try:
        with explain_hooks(hook):
            result = fn(*args, **kwargs)
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
    return Explanation(rows, result, tr)
