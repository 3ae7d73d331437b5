"""The planner against the dry run, swept: presets x profiles x layouts (issue 21's check
"the Llama planner against the dry run of the course's Llama (memory within 5%, step
within 10%), uneven stages included", held over every architecture and profile).

    PYTHONPATH=. python benchmarks/plan_dryrun_sweep.py            # the whole sweep
    PYTHONPATH=. python benchmarks/plan_dryrun_sweep.py --quick    # one profile

Each row is ``wb.plan.agree.compare(cfg, layout, cluster)``: the dry run of the library's
own recipe on meta tensors against ``wb.plan.estimate`` of the same layout with
``framework="workbench"`` (the recipe the dry run runs) and the attention kernel the
models run (flash), memory per pipeline stage and step time.  Presets keep their widths
and sequence lengths; their depth is cut to a few layers per stage so that one row
costs about a second.  Columns: dry run / estimate of the step, of the busiest rank's
memory, the worst of every stage's total and saved activations; "default fw": what the
layout's default framework (Megatron-LM for ZeRO 0/1, DeepSpeed for 2/3) holds beyond
this recipe on the busiest rank, by design (``plan.agree``'s ``framework_gap``).
"""
from __future__ import annotations

import argparse
import sys
import time

from workbench.plan.agree import compare, sweep_cases


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the a100 profile only")
    ap.add_argument("--profiles", nargs="*", default=None)
    ap.add_argument("--presets", nargs="*", default=None)
    args = ap.parse_args(argv)
    profiles = args.profiles or (["a100"] if args.quick else ["a100", "h100", "ascend-910b"])
    bad, n, t0 = 0, 0, time.perf_counter()
    print(f"{'preset':<14} {'profile':<12} {'layout':<52} {'step':>6} {'mem':>6} "
          f"{'worst stage':>11} {'default fw':>10}")
    for cfg_name, cfg, lay, cl in sweep_cases(profiles, args.presets):
        a = compare(cfg, lay, cl)
        n += 1
        flag = "" if a.agrees else "  <-- " + "; ".join(a.problems())
        bad += not a.agrees
        print(f"{cfg_name:<14} {cl.profile.name:<12} {lay.short():<52} "
              f"{a.step_ratio:6.3f} {a.memory_ratio:6.3f} {a.worst_stage_ratio:11.3f} "
              f"{a.framework_gap.get('total', 0.0) / 1e9:+8.2f}GB{flag}",
              flush=True)
    print(f"{n} rows, {bad} beyond 5% memory / 10% step, "
          f"{time.perf_counter() - t0:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
