"""A dead (SIGKILL) or frozen (SIGSTOP) rank ends a torchrun job non-zero: the
subgroups carry init()'s timeout (new_group's own default is 30 minutes), and no
process is left behind."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 10
# torchrun sends SIGTERM to the remaining workers and SIGKILL 30 s later: a stopped
# process only dies by the SIGKILL (torch.distributed.elastic's shutdown grace period)
TORCHRUN_GRACE_S = 30


def _alive(pid) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "zombie" not in f.read()
    except FileNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("sig,limit", [(signal.SIGKILL, TIMEOUT_S),
                                       (signal.SIGSTOP, TIMEOUT_S + TORCHRUN_GRACE_S + 10)])
def test_a_dead_or_frozen_rank_ends_the_job(sig, limit):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node=4",
                          os.path.join(ROOT, "tests", "dist_scripts", "fault_check.py"),
                          str(TIMEOUT_S)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                         text=True, env=env, cwd=ROOT, start_new_session=True)
    try:
        pids = {}
        while len(pids) < 4:
            line = p.stdout.readline()
            assert line, "the job ended before every rank was ready"
            # four processes share the pipe: lines may interleave
            for r, pid in re.findall(r"ready (\d+) (\d+)", line):
                pids[int(r)] = int(pid)
        t0 = time.monotonic()
        os.kill(pids[3], sig)
        rc = p.wait(timeout=limit + 60)
        elapsed = time.monotonic() - t0
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert rc != 0
    assert elapsed < limit, f"the job took {elapsed:.1f} s to end (limit {limit} s)"
    time.sleep(0.5)
    assert not [pid for pid in pids.values() if _alive(pid)]
