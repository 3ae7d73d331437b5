"""Running a torchrun job from a test, the same way in every test file."""
import subprocess

# A gloo worker thread that still holds finished async work when the interpreter tears
# down can abort the process ("terminate called without an active exception": the race
# pytorch/pytorch#179291 describes). It is rare (about 1 run in 8 of a 2-process job on a
# loaded 2-core machine, after every row was printed); a job that ends that way is run
# once more, never twice.
TEARDOWN_ABORT = "terminate called without an active exception"


def run_job(cmd, **kwargs):
    """``subprocess.run(cmd, capture_output=True, text=True, **kwargs)``, rerun once when
    the job ends in the teardown abort above."""
    out = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if out.returncode != 0 and TEARDOWN_ABORT in out.stderr:
        out = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    return out
