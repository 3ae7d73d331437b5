"""Move collectives early and split them, so that they run beside compute.

Three moves, each checked on the clock (kept only where the replayed step is shorter):

* a parameter's gradient all-reduce (or its bucket) is issued asynchronously when the
  gradient is ready and waited for at the end of the backward: the rest of the backward
  runs beside it (DDP's overlap of gradient reduction with backward computation);
* a collective whose consumer is not the next kernel is issued right after the kernel
  that made its data, asynchronously, and waited for just before its consumer (the
  scheduling MindSpore's and XLA's latency-hiding schedulers do);
* a collective right after the matmul that makes its data (nothing to hide it behind) is
  split with that matmul into ``k`` chunks: chunk ``i``'s collective runs while chunk
  ``i + 1`` is computed (Wang et al. 2022, "Overlap communication with dependent
  computation via decomposition"; ``parallel/strategies/overlap.py`` teaches it op by op).
"""
from __future__ import annotations

import copy

from .schedule_log import log_pass

__all__ = ["overlap"]


def _pos(items):
    return {it.uid: k for k, it in enumerate(items) if it.kind == "compute"}


def _better(a, b) -> bool:
    from ..schedule import replay
    return replay(b).time < replay(a).time * (1 - 1e-12)


def overlap(prog, sched, chunks: int = 4):
    cur = sched.copy()
    moved = asyncd = split = 0
    # 1. gradient reductions: async, waited at the end
    trial = cur.copy()
    n = 0
    for it in trial.items:
        if it.kind == "comm" and it.grad:
            it.async_, it.before, it.tag = True, None, (it.tag + " async").strip()
            n += 1
    if n and _better(cur, trial):
        cur, asyncd = trial, n
    # 2. collectives issued early
    for uid in [it.uid for it in cur.items if it.kind == "comm" and not it.grad]:
        trial = cur.copy()
        items = trial.items
        k = next(i for i, it in enumerate(items) if it.uid == uid)
        it = items[k]
        pos = _pos(items)
        if it.before is None or it.before not in pos:
            continue
        start = pos.get(it.after, -1) + 1
        between = [x for x in items[start:pos[it.before]] if x.kind == "compute"]
        if not between:
            continue
        items.pop(k)
        pos = _pos(items)
        ins = pos.get(it.after, -1) + 1
        it.async_, it.tag = True, "moved early"
        items.insert(ins, it)
        if _better(cur, trial):
            cur, moved = trial, moved + 1
    # 3. split with the matmul that makes the data
    for uid in [it.uid for it in cur.items if it.kind == "comm" and not it.grad
                and not it.async_ and it.coll in ("all_reduce", "reduce_scatter")
                and not it.ranks and not it.sent]:   # (a round trip's recorded event,
        #                                          uneven pieces: not split)
        trial = cur.copy()
        items = trial.items
        k = next(i for i, it in enumerate(items) if it.uid == uid)
        it = items[k]
        pos = _pos(items)
        p = pos.get(it.after)
        if p is None or items[p].op_class != "matmul" or \
                any(x.kind == "compute" for x in items[p + 1:k]):
            continue
        prod = items[p]
        nxt = trial.next_uid()
        pieces = []
        for c in range(chunks):
            ck = copy.copy(prod)
            ck.kernel, ck.uid, ck.tag = prod.kernel / chunks, prod.uid if c == chunks - 1 \
                else nxt + 2 * c, f"chunk {c + 1}/{chunks}"
            ck.kernels = 1
            cm = copy.copy(it)
            cm.nbytes, cm.uid, cm.async_ = max(1, it.nbytes // chunks), nxt + 2 * c + 1, True
            cm.after, cm.tag = ck.uid, f"split {c + 1}/{chunks}"
            pieces += [ck, cm]
        items.pop(k)
        items[p:p + 1] = pieces
        if _better(cur, trial):
            cur, split = trial, split + 1
    return log_pass(prog, "overlap", sched, cur,
                    f"{asyncd} gradient reduction(s) made async, {moved} collective(s) moved "
                    f"early, {split} split with their matmul in {chunks} chunks")
