"""Bucket small gradient all-reduces: one collective for many gradients.

Each parameter replicated over a mesh dim where its op's outputs diverge needs its
gradient all-reduced over that dim (data parallelism).  One collective per gradient pays
the link latency and a launch each time; PyTorch's DDP packs gradients into buckets of
``bucket_cap_mb=25`` MiB (``torch.nn.parallel.DistributedDataParallel``'s default) and
reduces each bucket once.  Here consecutive gradient all-reduces of the backward on the
same mesh dim join one bucket until it holds ``cap`` bytes; the bucket is reduced where
its last gradient is ready.
"""
from __future__ import annotations

from .schedule_log import log_pass

__all__ = ["bucket", "BUCKET_BYTES"]

BUCKET_BYTES = 25 * 2 ** 20          # DDP's bucket_cap_mb default


def bucket(prog, sched, cap: int = BUCKET_BYTES):
    new = sched.copy()
    out, open_ = [], {}              # mesh dim -> the bucket item being filled
    merged = 0
    for it in new.items:
        if it.kind == "comm" and it.grad and it.coll == "all_reduce":
            b = open_.get(it.mesh_dim)
            if b is not None and b.nbytes + it.nbytes <= cap:
                # the bucket moves to where its newest gradient is ready
                out.remove(b)
                b.nbytes += it.nbytes
                b.members = b.members + it.members
                b.after = it.after
                b.name = f"bucket({b.tag.count('+') + 2})"
                b.tag += "+"
                out.append(b)
                merged += 1
                continue
            it.tag = "bucket"
            open_[it.mesh_dim] = it
            out.append(it)
            continue
        out.append(it)
    for it in out:
        if it.kind == "comm" and it.grad:
            it.tag = "bucketed" if "+" in it.tag else ""
    new.items = out
    return log_pass(prog, "bucket", sched, new,
                    f"{merged} gradient all-reduce(s) merged into buckets of <= {cap:,d} B")
