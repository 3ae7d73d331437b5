"""``python -m workbench train ... --dry-run``: one step of the real code on meta tensors.

    python -m workbench train --preset gpt3-175b --dry-run --dp 8 --tp 8 --pp 16 \\
        --batch-size 1536 --micro-batch 1 --recompute full --profile a100

prints the JSON line a real step prints (``step``, ``loss`` = null: nothing is computed
on meta tensors, ``tokens``, ``lr``, ``modeled_ms``, ``comm_bytes``, ``state_bytes``,
``activation_bytes``, ``ms``: this machine's wall time of the dry run) plus
``peak_bytes_per_rank`` (one entry per pipeline stage: every rank of a stage holds the
same), ``device_memory_bytes`` and ``fits`` on the ``--profile``'s device, and
``dry_run: true``.  Flags map onto ``wb.plan.Layout`` (``--batch-size`` is the global
batch; ``--micro-batch`` the sequences per micro-batch per data-parallel rank, by
default the recipe's choice: 2 pp micro-batches when the batch divides, else pp);
``--ep`` is carved out of the data-parallel ranks as in training (``--dp 2 --ep 2``: a
Layout of dp 4, ep 2), ``--cp`` is ``Layout(cp=)`` (``plan.dryrun_ep_cp``).
"""
from __future__ import annotations

import json
import sys
import time

__all__ = ["layout_from_args", "main_dry_run"]

_SCHEDULES = {"1f1b": "1f1b", "gpipe": "gpipe", "interleaved": "interleaved_1f1b"}


def layout_from_args(args):
    """The ``wb.plan.Layout`` the train flags describe (ValueError naming the flag)."""
    from .layout import Layout
    # --ep is carved out of the data-parallel ranks: --dp 2 --ep 2 is 4 of them (recipes.moe)
    ep, cp = getattr(args, "ep", 1) or 1, getattr(args, "cp", 1) or 1
    dp, tp, pp, batch = args.dp * ep, args.tp, args.pp, args.batch_size
    if args.schedule not in _SCHEDULES:
        raise ValueError(f"--schedule {args.schedule} with --dry-run: the dry run composes "
                         f"the step with {sorted(_SCHEDULES)}; choose one of them")
    mb = getattr(args, "micro_batch", None)
    if mb is None:                       # Hybrid's default micro-batch count
        m = 1 if pp == 1 else (2 * pp if batch % (dp * 2 * pp) == 0 else pp)
        if batch % (dp * m):
            raise ValueError(f"--batch-size {batch} does not divide into dp={dp} x {m} "
                             f"micro-batches; give --micro-batch or another --batch-size")
        mb = batch // (dp * m)
    v = 2 if args.schedule == "interleaved" else 1
    return Layout(dp=dp, tp=tp, pp=pp, sp=bool(args.sp), zero=args.zero,
                  recompute=getattr(args, "recompute", "none") or "none", micro_batch=mb,
                  global_batch=batch, schedule=_SCHEDULES[args.schedule], v=v, ep=ep, cp=cp,
                  cp_comm=getattr(args, "cp_comm", "p2p"))


def main_dry_run(args) -> int:
    """Run the dry run the flags describe and print one JSON line; 2 on bad flags."""
    from ..models.config import get_config
    from .dryrun import dry_run
    from .layout import Cluster
    t0 = time.perf_counter()
    try:
        if getattr(args, "backend", "sim") != "sim":
            raise ValueError("--dry-run simulates every rank in this process; leave "
                             "--backend at sim")
        from ..recipes.moe import moe_overrides
        cfg = get_config(args.preset, **moe_overrides(args))    # --moe-experts E ...
        lay = layout_from_args(args)
        cl = Cluster(profile=getattr(args, "profile", None) or "a100", devices=lay.world)
        dr = dry_run(cfg, lay, cl, seed=args.seed)
    except (ValueError, NotImplementedError) as e:
        from .cli_flags import as_flags, dry_run_flags     # Layout's tp= as --tp
        print(f"error: {as_flags(str(e), dry_run_flags(getattr(args, 'ep', 1) or 1))}",
              file=sys.stderr)
        return 2
    mem = dr.memory
    rec = {"step": 0, "loss": None, "tokens": lay.global_batch * cfg.seq_len, "lr": args.lr,
           "modeled_ms": round(dr.step_time * 1e3, 6), "comm_bytes": dr.comm_bytes,
           "state_bytes": mem["params"] + mem["grads"] + mem["optimizer"],
           "buffer_bytes": mem["buffers"],
           "comm_buffer_bytes": mem["comm_buffers"],          # NCCL / HCCL, modeled
           "activation_bytes": mem["activations"],
           "workspace_bytes": mem["workspace"],
           "peak_bytes_per_rank": [m["total"] for m in dr.per_rank],
           "device_memory_bytes": cl.memory_bytes,
           "usable_memory_bytes": cl.profile.usable_memory(), "fits": dr.fits,
           "profile": cl.profile.name, "dry_run": True,
           "framework": dr.framework,        # this library's recipe (plan.dryrun)
           "ms": round((time.perf_counter() - t0) * 1e3, 3)}
    print(json.dumps(rec), flush=True)
    return 0
