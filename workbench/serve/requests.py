"""Serving traces and what a schedule did with them, as plain data.

    trace = poisson_trace(200, rate=8.0, prompt=(32, 512), output=(16, 512), seed=0)
    trace = read_trace("requests.jsonl")        # {"arrival": s, "prompt": n, "output": n}
    print(latency_table([result_a, result_b]))

:class:`Request` (when it arrives, how long its prompt and output are), :class:`Step` (one
forward of the engine: the timeline) and :class:`Result` (one schedule's run of a trace:
throughput, time to first token, time per output token, p50 / p99), made by the
schedulers of :mod:`workbench.serve.batching`.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

__all__ = ["Request", "Step", "Result", "percentile", "poisson_trace", "read_trace",
           "latency_table"]


@dataclass(frozen=True)
class Request:
    id: int
    arrival: float          # seconds
    prompt: int             # tokens
    output: int             # tokens to generate (>= 1)


@dataclass(frozen=True)
class Step:
    """One forward of the engine: when, how long, and what it held."""
    start: float
    seconds: float
    prefill_tokens: int
    decode_tokens: int
    requests: tuple         # ids of the requests in the step


@dataclass
class Result:
    """One schedule's run of a trace (plain data; times in seconds)."""
    name: str
    steps: list
    first_token: dict       # request id -> time of its first output token
    finish: dict            # request id -> time of its last output token
    requests: list = field(repr=False, default_factory=list)

    @property
    def makespan(self) -> float:
        return max(self.finish.values()) - min(r.arrival for r in self.requests)

    @property
    def throughput(self) -> float:
        """Output tokens per second over the whole run."""
        return sum(r.output for r in self.requests) / self.makespan

    def ttft(self) -> list:
        return [self.first_token[r.id] - r.arrival for r in self.requests]

    def tpot(self) -> list:
        return [(self.finish[r.id] - self.first_token[r.id]) / (r.output - 1)
                for r in self.requests if r.output > 1]

    @property
    def ttft_p50(self):
        return percentile(self.ttft(), 50)

    @property
    def ttft_p99(self):
        return percentile(self.ttft(), 99)

    @property
    def tpot_p50(self):
        """nan when no request made a second token (time per output token is undefined)."""
        return percentile(self.tpot(), 50) if self.tpot() else math.nan

    @property
    def tpot_p99(self):
        return percentile(self.tpot(), 99) if self.tpot() else math.nan

    @property
    def useful_decode_share(self) -> float:
        """Decode tokens a request needed over decode tokens the steps computed (static
        batching computes the padded slots of requests already finished)."""
        slots = sum(s.decode_tokens for s in self.steps)
        return sum(r.output - 1 for r in self.requests) / slots if slots else 1.0

    def summary(self) -> dict:
        """The figures as a dict (tokens/s, milliseconds)."""
        return {"schedule": self.name, "throughput_tok_s": round(self.throughput, 1),
                "ttft_p50_ms": round(self.ttft_p50 * 1e3, 1),
                "ttft_p99_ms": round(self.ttft_p99 * 1e3, 1),
                "tpot_p50_ms": round(self.tpot_p50 * 1e3, 2),
                "tpot_p99_ms": round(self.tpot_p99 * 1e3, 2),
                "useful_decode": round(self.useful_decode_share, 3),
                "steps": len(self.steps), "makespan_s": round(self.makespan, 3)}


def percentile(values, q: float) -> float:
    """The ``q``-th percentile with linear interpolation between ranks (numpy's default)."""
    xs = sorted(values)
    if not xs:
        raise ValueError("percentile of no values")
    if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0 <= q <= 100:
        raise ValueError(f"percentile(q={q!r}): give a percentile in [0, 100] (as numpy's)")
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def poisson_trace(n: int, rate: float, prompt=(32, 512), output=(16, 512),
                  seed: int = 0) -> list:
    """``n`` requests arriving as a Poisson process of ``rate`` per second (exponential
    gaps), prompt and output lengths drawn uniformly from the inclusive ranges, seeded."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"poisson_trace(n={n!r}): give the number of requests, an int >= 1")
    if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not 0 < rate < math.inf:
        raise ValueError(f"poisson_trace(rate={rate!r}): give requests per second, > 0")
    for name, (lo, hi), least in (("prompt", prompt, 1), ("output", output, 1)):
        if not (isinstance(lo, int) and isinstance(hi, int) and least <= lo <= hi):
            raise ValueError(f"poisson_trace({name}={(lo, hi)!r}): give (low, high) token "
                             f"counts, {least} <= low <= high")
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        out.append(Request(i, t, rng.randint(*prompt), rng.randint(*output)))
    return out


def _whole(v, name: str) -> int:
    """A count from JSON: an int, or a float holding a whole number (1.0); 3.7 tokens is
    an error, not 3."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
            or v != int(v):
        raise ValueError(f"{name}={v!r} is not a whole number")
    return int(v)


def read_trace(path) -> list:
    """Requests from a JSON-lines file, one ``{"arrival": s, "prompt": tokens, "output":
    tokens}`` per line (``id`` optional: the line number); a bad line is an error naming
    it."""
    import json
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                req = Request(_whole(row.get("id", len(out)), "id"), float(row["arrival"]),
                              _whole(row["prompt"], "prompt"), _whole(row["output"], "output"))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise ValueError(f"{path}:{n}: {line.strip()[:60]!r} is not a request "
                                 '{"arrival": seconds, "prompt": tokens, "output": tokens} '
                                 f"({e})") from None
            if not (0 <= req.arrival < math.inf and req.prompt >= 1 and req.output >= 1):
                raise ValueError(f"{path}:{n}: arrival must be >= 0 and prompt, output >= 1")
            if any(r.id == req.id for r in out):
                raise ValueError(f"{path}:{n}: id {req.id} is taken by an earlier request; "
                                 "give every request its own id (or none: the line's position)")
            out.append(req)
    if not out:
        raise ValueError(f"{path}: no requests")
    return out


def latency_table(results) -> str:
    """The schedules' figures as a text table (one row per :class:`Result`)."""
    cols = ["throughput_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms",
            "useful_decode", "steps"]
    lines = [f"{'schedule':<12}" + "".join(f"{c:>18}" for c in cols)]
    for r in results:
        row = r.summary()
        lines.append(f"{row['schedule']:<12}" + "".join(f"{row[c]:>18}" for c in cols))
    return "\n".join(lines)
