"""Command line: ``python -m workbench doctor | train | course | plan | serve``.

    python -m workbench doctor                 what devices and backends were found, and why
    python -m workbench course student --out student/
                                               student notebooks with the solutions removed
    python -m workbench plan --model gpt3-175b --devices 1024 --profile a100 --global-batch 1536
                                               the fastest layouts that fit, and why
    python -m workbench course workcopy --out work/
                                               copy the notebooks a learner opens (make course)
    python -m workbench serve --checkpoint ckpt --tp 2 --prompt "The fox" --max-new-tokens 40
                                               generate text from a checkpoint, on any layout
"""
from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _doctor(args) -> int:
    from .npu.doctor import main_doctor
    return main_doctor()


def _course(args) -> int:
    import os
    if not os.path.isdir(args.notebooks):
        print(f"error: --notebooks {args.notebooks}: no such folder; give the folder of "
              "instructor notebooks (notebooks/ in the repository)", file=sys.stderr)
        return 2
    if args.what == "student":
        from .exercises.student import make_student_versions
        out = make_student_versions(args.notebooks, args.out or "student")
        for p in out:
            print(p)
        return 0
    if args.what == "workcopy":
        from .exercises.student import make_work_copy
        for path, new in make_work_copy(args.notebooks, args.out or "work"):
            print(f"{'copied' if new else 'kept  '} {path}")
        return 0
    print(f"unknown course command {args.what!r}: use 'student' or 'workcopy'", file=sys.stderr)
    return 2


def _train(args) -> int:
    from .train import main_train
    return main_train(args)


def _serve(args) -> int:
    from .serve.cli import main_serve
    return main_serve(args)


# The largest sizes ``plan`` takes.  The search enumerates layouts over the devices and
# the batch's divisors: 131,072 devices took 0.4 s, 2**20 sequences 3.3 s (gpt3-175b, on
# this project's 2-core machine); 10**12 of either ran for minutes.  Published runs stay
# far below: 16,384 GPUs for Llama 3 405B (Meta 2024, Table 4), 1,536 sequences per step
# for GPT-3 175B (Brown et al. 2020, Table 2.1: 3.2M tokens of 2,048).
PLAN_MAX = {"devices": 2 ** 17, "global_batch": 2 ** 20}


def _plan_sizes(args) -> str | None:
    """The first plan flag outside its range, as an error message (None if all fit)."""
    why = {"devices": "the search enumerates layouts over the devices' divisors, and the "
                      "largest published run used 16,384 GPUs (Llama 3 405B)",
           "global_batch": "the search enumerates the batch's divisors, and GPT-3 175B "
                           "trained on 1,536 sequences per step",
           "max_micro_batch": "a micro-batch is a part of the global batch"}
    for flag in ("devices", "global_batch", "top", "max_micro_batch"):
        v, name = getattr(args, flag), "--" + flag.replace("_", "-")
        most = PLAN_MAX.get(flag, PLAN_MAX["global_batch"] if flag in why else None)
        if v < 1 or (most is not None and v > most):
            if most is None:
                return f"{name} {v}: give an int >= 1"
            return f"{name} {v}: give an int in [1, {most:,}] ({why[flag]})"
    return None


def _plan(args) -> int:
    from .plan import Cluster, search
    from .plan.presets import get_config       # the course's presets, Mixtral, 128K Llamas
    bad = _plan_sizes(args)
    if bad:
        print(f"error: {bad}", file=sys.stderr)
        return 2
    try:
        cfg = get_config(args.model)
        if cfg.dtype not in ("bfloat16", "float16"):    # the course's small float32 presets
            raise ValueError(f"--model {args.model} is a {cfg.dtype} preset; the planner "
                             f"models 16-bit mixed-precision training: plan a 16-bit "
                             f"preset (gpt3-175b, llama2-7b, llama3-8b, mixtral-8x7b...)")
        ranking = search(cfg, Cluster(profile=args.profile, devices=args.devices),
                         global_batch=args.global_batch, top=args.top,
                         max_micro_batch=args.max_micro_batch, overlap=not args.no_overlap,
                         framework=args.framework)
    except ValueError as e:
        from .plan.cli_flags import PLAN_FLAGS, as_flags     # global_batch= as --global-batch
        print(f"error: {as_flags(str(e), PLAN_FLAGS)}", file=sys.stderr)
        return 2
    print(f"{args.model} ({cfg.n_layer} layers, h={cfg.d_model}, {cfg.n_head} heads, "
          f"s={cfg.seq_len}), global batch {args.global_batch}")
    print(ranking)
    from .plan.ranges import ranking_ranges
    print(ranking_ranges(ranking, cfg, overlap=not args.no_overlap))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m workbench",
                                description="the distributed-training workbench")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("doctor", help="report devices, torch_npu, CUDA and the distributed backend")
    d.set_defaults(fn=_doctor)
    c = sub.add_parser("course", help="course tools")
    c.add_argument("what", choices=["student", "workcopy"],
                   help="student: write student versions; workcopy: copy the notebooks a "
                        "learner opens, never overwriting a copy already there")
    c.add_argument("--notebooks", default="notebooks", help="folder of instructor notebooks")
    c.add_argument("--out", default=None,
                   help="folder to write to (default: student/ or work/)")
    c.set_defaults(fn=_course)
    from .train import add_train_arguments
    t = sub.add_parser("train", help="train the course's Llama; one JSON line per step")
    add_train_arguments(t)
    t.set_defaults(fn=_train)
    pl = sub.add_parser("plan", help="the fastest layouts of a model on a cluster (analytic)")
    pl.add_argument("--model", default="gpt3-175b", help="a preset: models.config's (gpt3-175b, llama3-8b...) "
                    "or plan.presets' (mixtral-8x7b, llama3-8b-128k, llama3-70b-128k)")
    pl.add_argument("--devices", type=int, default=1024, help="devices in the cluster")
    pl.add_argument("--profile", default="a100", help="hardware profile (list_profiles())")
    pl.add_argument("--global-batch", type=int, default=1536, help="sequences per step")
    pl.add_argument("--top", type=int, default=5, help="layouts to print")
    pl.add_argument("--max-micro-batch", type=int, default=16, help="largest micro-batch tried")
    pl.add_argument("--no-overlap", action="store_true",
                    help="ZeRO-2/3 collectives do not overlap compute")
    from .plan.frameworks import FRAMEWORKS
    pl.add_argument("--framework", default=None, choices=FRAMEWORKS,
                    help="only the layouts this framework runs, priced as it runs them "
                         "(fsdp: FSDP2's ZeRO-3 as torchtitan; default: Megatron-LM for "
                         "ZeRO 0-1, DeepSpeed for ZeRO 2-3)")
    pl.set_defaults(fn=_plan)
    from .serve.cli import add_serve_arguments
    sv = sub.add_parser("serve", help="generate text from a checkpoint on any layout")
    add_serve_arguments(sv)
    sv.set_defaults(fn=_serve)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
