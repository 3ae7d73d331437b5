"""Run several torchrun entry points in one launch (one process per rank, as torchrun
started it), one after another, on one process group: a test file that launched the same
world several times pays torchrun's start-up once.  Each process's start-up (``import
torch``, torch._dynamo, which ``torch.optim.Optimizer`` imports on first use, and the
workbench) was most of each launch's CPU time: 2.5-3 s a process, against well under a
second of the entry points' own work (measured: task testspeed4).

    torchrun --nproc-per-node N several.py PART [PART ...]

A PART is a script path with its arguments, or ``-m module args``, as one string split on
spaces (``"-m workbench train --preset tiny --dp 2"``, ``"tests/dist_scripts/x.py OUT"``).
Each part runs as ``__main__`` with its own ``sys.argv``, as it would in its own launch;
its ``sys.exit(0)`` ends the part, any other exit code or exception ends the job with it.
After each part every rank meets at a barrier and rank 0 prints ``{"part_done": k}``, so
the rows printed before it (every rank's, flushed before the barrier) are part k's:
``tests.torchrun_support.split_parts`` cuts the output there.

The process group stays up from the first part's ``wb.distributed.init()`` to the end:
a part's ``wb.distributed.shutdown()`` forgets its meshes and their groups, as shutdown
does, but ends the group only after the last part (a
second ``init_process_group`` after ``destroy_process_group`` in the same torchrun job
rendezvouses on the store keys of the first and connects to the old group's closed
ports: gloo's connectFullMesh fails).  A later part's ``init()`` finds the group
initialized and returns, as ``wb.distributed.init`` does when called twice.
"""
import json
import runpy
import sys


def _run(part: str) -> None:
    args = part.split()
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        run = lambda: runpy.run_module(args[1], run_name="__main__", alter_sys=True)  # noqa: E731
    else:
        sys.argv = args
        run = lambda: runpy.run_path(args[0], run_name="__main__")  # noqa: E731
    try:
        run()
    except SystemExit as e:
        if e.code not in (0, None):
            raise


def main(parts: list[str]) -> None:
    import torch.distributed as dist

    from workbench.sim_mesh import backends
    shutdown = backends.shutdown

    def between_parts():
        # what shutdown() forgets besides the group: the meshes registered as distributed
        # (a later part's simulated Mesh.grid equal to one by value would read as
        # distributed) and their groups
        backends._GROUPS.clear()
        backends._MESHES.clear()

    backends.shutdown = between_parts
    try:
        for k, part in enumerate(parts):
            _run(part)
            dist.barrier()
            if dist.get_rank() == 0:
                print(json.dumps({"part_done": k}), flush=True)
            dist.barrier()
    finally:
        backends.shutdown = shutdown
    shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
