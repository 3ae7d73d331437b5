"""Each schedule pass is replayed before and after, and logged with what it saved."""
from __future__ import annotations

__all__ = ["log_pass"]


def log_pass(prog, name, before, after, what):
    from ..schedule import replay
    a, b = replay(before), replay(after)
    saved = (f"{what}; step {a.time * 1e6:.2f} -> {b.time * 1e6:.2f} us, exposed "
             f"communication {a.exposed * 1e6:.2f} -> {b.exposed * 1e6:.2f} us, launches "
             f"{a.launch * 1e6:.2f} -> {b.launch * 1e6:.2f} us")
    prog.log.append((name, str(before), str(after), saved))
    prog.stages.append((name, after, b))
    return after
