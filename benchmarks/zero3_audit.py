"""Every phase of a DeepSpeed v0.3.13 ZeRO-3 step, what the planner charges for it, and
the figure it rests on: an audit of Narayanan et al.'s GPT 530B rows against the GPT 175B
rows at the same micro-batch.

    PYTHONPATH=$PWD python benchmarks/zero3_audit.py        # ~3 s

READING: filled in below the table once the script has run (module docstring, end).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import published as P  # noqa: E402
from workbench.plan import zero3_2021 as Z  # noqa: E402
from workbench.plan.edge_cost import edge_times  # noqa: E402
from workbench.plan.estimate import EC  # noqa: E402

# (175B GPUs, 530B GPUs) at micro-batch 4, 2, 1 (published.py's narayanan_zero3 rows)
PAIRS = ((384, 640), (768, 1120), (1536, 2240))

# the simulation's work kinds (zero3_2021.simulate), in the step's order, with what runs
# them and the figure each is priced from
WORK = (
    ("fill", "gather buffer: torch.zeros of the whole parameter (pp:607-609)",
     "2 B/elem at HBM"),
    ("sync", "torch.cuda.synchronize after it, _synchronize_communication (pp:611, "
     "s3:483-493)", "SYNC_S 9.6 us, meas."),
    ("ag_loop", "DeepSpeed's all-gather loop: narrow, get_rank, append, per rank "
     "(pp:620-625)", "AG_LOOP_S 6.9 us, meas."),
    ("rs_loop", "DeepSpeed's reduce-scatter loop per rank (pp:738-763)",
     "RS_LOOP_S 7.5 us, meas."),
    ("record_copy", "c10d's recordStream + copy_ per chunk (host, ProcessGroupNCCL)",
     "RECORD_COPY_S 6.1 us, meas."),
    ("chunk_copy", "c10d's chunk copies on the GPU (out of / into its flat buffer)",
     "4 B/elem at HBM"),
    ("nccl_ag", "NCCL all-gather, one per parameter (list of p chunks)",
     "NCCL 2.8.3 tuning model"),
    ("nccl_rs", "NCCL reduce-scatter, one per gradient (s3:1689-1716)",
     "NCCL 2.8.3 tuning model"),
    ("predivide", "average_tensor's div_ of the ipg buffer + large grads (s3:1496-1505)",
     "4 B/elem at HBM"),
    ("release", "release: torch.ones(1).half().to(device), blocking (pp:532)",
     "RELEASE_S 21 us, meas."),
    ("norm", "v0.3.15+ debug-print norm + .item() per fetch (not in v0.3.13)",
     "0 at v0.3.13"),
    ("checkpoint_copies", "partition_activations at mp 1: clone; zeros, copy, 1-rank "
     "all-gather (ck:446-455, :284-309)", "4 + 14 B/elem, copy rate"),
)
# the step's host terms outside the hooks (zero3_2021.step_host_seconds)
HOST = (
    ("waits", "host waits: .item() / float() per gradient partition (overflow, norm), "
     "timers, loss f-string", "SYNC_S each"),
    ("h2d", "blocking one-element host-to-device copies (ByteTensor, FloatTensor, "
     "zeros(1).cuda(), batch sizes)", "RELEASE_S each"),
    ("loops", "per-tensor host loops: averaged_gradients narrow, unflatten narrow + view",
     "NARROW_S, meas."),
    ("all_reduces", "scalar all-reduces: overflow flag, norm (dp), reduce_losses (world)",
     "NCCL 2.8.3 tuning model"),
)


def audit(name: str, devices: int) -> dict:
    """Seconds per step of each phase of the ``narayanan_zero3`` row ``name`` on
    ``devices`` GPUs on the planner's clock; ``listed`` (their sum) equals the estimate's
    step."""
    row = next(r for r in P.ROWS if r["source"] == "narayanan_zero3"
               and r["name"] == name and r["devices"] == devices)
    cfg, lay, cl = P.build(row)
    res = P.predict(row)
    est, prof = res["estimate"], cl.profile
    if lay.engine != Z.FRAMEWORK:
        raise ValueError(f"zero3_audit: row {name!r} does not run {Z.FRAMEWORK!r}")
    tcfg = EC.token_cfg(cfg, lay)
    edge = edge_times(tcfg, lay.micro_batch, lay.tp, lay.sp, prof)
    d = Z.dp_sync_parts(cfg, lay, prof, est.details["layer"], est.details["head"], edge)
    first, rest, m = d["first"], d["rest"], lay.m
    stage = next(iter(est.details["stages"].values()))
    phases = {"compute: layers fwd, recompute, bwd; embedding, head, loss":
              m * first["compute"],
              "compute: the estimate's rest (gradient accumulation)":
              m * stage["compute"] - m * first["compute"]}
    work = {k: first["work"][k] + (m - 1) * rest["work"][k] for k, _, _ in WORK}
    for k, label, _ in WORK:
        phases[label] = work[k]
    micro = first["seconds"] + (m - 1) * rest["seconds"] - m * first["compute"]
    phases["hidden: work run beside other work (negative), compute slowed beside NCCL"] = \
        micro - sum(work.values())
    phases["_post_step: persistent parameters gathered, reassembled (s3:2339-2349)"] = \
        d["post"]
    for k, label, _ in HOST:
        phases[label] = d["host"][k]
    phases["optimizer passes: overflow check, norm, flatten, unscale, Adam, copy"] = \
        est.details["optimizer"]
    rest_step = est.step_time - sum(phases.values())
    phases["the estimate's other terms"] = rest_step
    return dict(name=f"{name} / {devices}", mb=lay.micro_batch, m=m, p=lay.dp,
                ratio=res["ratio"], predicted=est.step_time,
                published=est.step_time * res["ratio"], phases=phases,
                listed=sum(phases.values()), work=work,
                exposed=micro, compute=m * first["compute"],
                gathers=first["gathers"], prefetches=first["prefetches"],
                reduce_scatters=first["reduce_scatters"])


def needs(a: dict) -> dict:
    """What the row would need for the published step, one term at a time (held-out
    figures read, not an input of the planner): the NCCL seconds scaled by ``nccl``,
    the compute by ``compute``, or each host wait (``sync`` + ``release`` events) costing
    ``per_wait`` seconds more."""
    gap = a["published"] - a["predicted"]
    nccl = a["work"]["nccl_ag"] + a["work"]["nccl_rs"]
    waits = a["work"]["sync"] / Z.SYNC_S + a["work"]["release"] / Z.RELEASE_S
    return {"gap": gap, "nccl": (nccl + gap) / nccl, "compute": (a["compute"] + gap)
            / a["compute"], "per_wait": gap / waits, "waits": waits}


def main():
    out = [audit(n, k) for pair in PAIRS for n, k in zip(("GPT 175B", "GPT 530B"), pair)]
    print("A DeepSpeed v0.3.13 ZeRO-3 step, phase by phase, as the planner prices it: "
          "seconds per step (benchmarks/zero3_audit.py; pp = partition_parameters.py, "
          "s3 = stage3.py at v0.3.13 12a53b4383)")
    w = 78
    print(f"  {'':<{w}}" + "".join(f"{x['name']:>17}" for x in out))
    print(f"  {'micro-batch size, micro-batches':<{w}}"
          + "".join(f"{str(x['mb']) + ' x ' + str(x['m']):>17}" for x in out))
    for k in out[0]["phases"]:
        print(f"  {k[:w]:<{w}}" + "".join(f"{x['phases'][k]:>17.2f}" for x in out))
    for label, key in (("sum of the above", "listed"), ("estimate's step", "predicted"),
                       ("published step", "published")):
        print(f"  {label:<{w}}" + "".join(f"{x[key]:>17.2f}" for x in out))
    print(f"  {'ratio predicted / published':<{w}}" + "".join(f"{x['ratio']:>17.3f}"
                                                             for x in out))
    label = "all-gathers (prefetched) / reduce-scatters a micro-batch"
    print(f"  {label:<{w}}" + "".join(
        f" {x['gathers']:>5}({x['prefetches']:>3}) /{x['reduce_scatters']:>5}" for x in out))
    print("  figures: " + "; ".join(f"{lab.split(':')[0].split(' (')[0]}: {fig}"
                                   for _, lab, fig in WORK + HOST))
    print("  what the published step needs, one term at a time (held out, not an input):")
    for label, key, fmt in (("published - predicted, s", "gap", "{:>17.1f}"),
                            ("NCCL seconds x", "nccl", "{:>17.2f}"),
                            ("compute x", "compute", "{:>17.2f}"),
                            ("host waits (sync + release) in the step", "waits", "{:>17.0f}"),
                            ("each host wait longer by, ms", "per_wait", "{:>17.2f}")):
        vals = [needs(x)[key] * (1e3 if key == "per_wait" else 1) for x in out]
        print(f"    {label:<{w - 2}}" + "".join(fmt.format(v) for v in vals))
    return out


if __name__ == "__main__":
    main()
