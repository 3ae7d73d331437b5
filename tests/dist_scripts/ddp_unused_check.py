"""Run under torchrun (gloo, 2 processes) by tests/test_fixlist2.py and
tests/test_review_revI.py: fixlist2_check.py's cases, then review_revI_check.py's, in one
launch (each had a launch of its own, most of whose time was the start-up: torchrun and
two processes importing torch and the workbench; task speed17).  Each prints its JSON
rows (keyed by case and rank; the two scripts' case names differ) as in its own launch.

fixlist2_check's ``main`` ends with ``os._exit(0)`` (no teardown of the process group);
here it is given another end, and review_revI_check's ``main``, which ends that way,
runs next on the same group (its ``init`` finds the group up: fixlist2's timeout_s=30
holds for both).

    torchrun --nproc-per-node 2 ddp_unused_check.py FIXLIST2_CASE ... -- REVI_CASE ..."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fixlist2_check  # noqa: E402
import review_revI_check  # noqa: E402


def _ended(code):
    if code != 0:
        raise SystemExit(code)


def main(argv):
    if "--" not in argv:
        raise SystemExit("usage: ddp_unused_check.py FIXLIST2_CASE ... -- REVI_CASE ...")
    k = argv.index("--")
    sys.argv = ["fixlist2_check.py", *argv[:k]]
    fixlist2_check.main(end=_ended)         # its end(0): the process goes on
    sys.argv = ["review_revI_check.py", *argv[k + 1:]]
    review_revI_check.main()                # ends the process: os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
