"""The processes of a torch.distributed job that share this host, and what to do with
a frozen one.

Why: a rank stopped by SIGSTOP (state ``T`` in /proc) outlives its job.  Its peers'
collectives time out and one of them exits; torchrun then sends SIGTERM to every
worker and SIGKILL only after its shutdown grace period (``--shutdown-timeout``,
default 30 s, torch/distributed/run.py and launcher/api.py in torch 2.13): a stopped
process cannot act on SIGTERM, so the job ends 30 s late.  torch.distributed.elastic
watches only workers in uninterruptible sleep (``D``,
``TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT``, agent/server/local_elastic_agent.py),
not stopped ones.

What: at :func:`start`, each rank writes ``host rank pid start-time`` into the job's
store and reads those of the ranks on its host (the host is named by its hostname and
kernel boot id; the start time is field 22 of /proc/<pid>/stat, proc(5), so a pid
reused by another process is never taken for a peer).  A peer counts as *frozen*
once it has been stopped for ``timeout_s``, the collectives' own timeout.  A frozen
peer is sent SIGTERM then SIGCONT: it resumes only to receive SIGTERM, so it ends as
any other worker does (its own SIGTERM handler, if any, runs).  Who sends:

- a daemon thread in each rank (the lowest running rank of the host acts), so the
  job ends even when no collective is pending;
- the exit of a rank by an uncaught exception (a collective's timeout error, say):
  it ends the host's stopped peers at once, since the job is ending anyway;
- a normal exit waits until each stopped peer resumes or counts as frozen.

Only ``T`` counts: a process stopped by a debugger is in state ``t`` and is left alone.
Limits: only peers on this host can be signalled, so a host whose every worker is
stopped is out of reach.  NCCL's default ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3`` tears a
timed-out process down from its own watchdog thread (PyTorch's "ProcessGroupNCCL
Environment Variables" page): no exit hook runs, and the thread of the other ranks acts
only if it reaches ``timeout_s`` before torchrun ends them; ``TORCH_NCCL_BLOCKING_WAIT=1``
raises the timeout in Python instead (documented there; not tried here: no multi-GPU
machine).
"""
from __future__ import annotations

import atexit
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import NamedTuple

log = logging.getLogger("workbench.distributed")

__all__ = ["Peer", "proc_stat", "host_id", "start", "stop", "watch", "end_frozen"]


class Peer(NamedTuple):
    rank: int
    pid: int
    start: int              # start time, clock ticks after boot (/proc/<pid>/stat field 22)


def proc_stat(pid: int):
    """(state letter, start time) of process ``pid`` from /proc/<pid>/stat (fields 3
    and 22, proc(5)); None when there is no such process (a zombie counts as none)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
    except OSError:                               # no such process (or not ours to see)
        return None
    fields = s[s.rindex(")") + 2:].split()        # field 2, the command, may hold spaces
    return (None if fields[0] in "ZX" else fields[0]), int(fields[19])


def host_id() -> str:
    """This host as its processes see it: hostname and the kernel's boot id."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f"{socket.gethostname()}/{f.read().strip()}"


def _same(peer: Peer):
    """The state letter of ``peer`` if it is still the process that published itself."""
    st = proc_stat(peer.pid)
    return st[0] if st is not None and st[1] == peer.start else None


def end_frozen(peer: Peer, why: str) -> bool:
    """Send SIGTERM then SIGCONT to ``peer`` if it is still the same process (checked
    through a pidfd, so a pid reused in between cannot be hit).  True if sent."""
    try:
        fd = os.pidfd_open(peer.pid)
    except ProcessLookupError:
        return False
    try:
        if _same(peer) is None:                   # the pid now names another process
            return False
        log.error("workbench.distributed: rank %d (pid %d on %s) %s: sending it SIGTERM "
                  "and SIGCONT so the job ends", peer.rank, peer.pid, socket.gethostname(), why)
        for sig in (signal.SIGTERM, signal.SIGCONT):
            signal.pidfd_send_signal(fd, sig)
        return True
    except ProcessLookupError:
        return False
    finally:
        os.close(fd)


class _Watch:
    """The host's peers, since when each has been seen stopped, and which were ended."""

    def __init__(self, me: Peer, peers: list, timeout_s: float):
        self.me, self.peers, self.timeout_s = me, peers, timeout_s
        self.poll_s = min(0.5, timeout_s / 10)     # how often /proc is read
        self.since: dict = {}                     # rank -> monotonic time first seen stopped
        self.ended: set = set()
        self.done = threading.Event()             # the thread stops
        self.lock = threading.Lock()              # the thread and the exit hook share state

    def step(self, wait_s: float, why: str, act=lambda states: True) -> list:
        """Read the peers' states; end those stopped for ``wait_s`` (if ``act(states)``).
        Returns the peers still stopped and not ended."""
        with self.lock:
            now, states = time.monotonic(), {}
            for p in self.peers:
                states[p.rank] = s = _same(p)
                if s == "T":
                    self.since.setdefault(p.rank, now)
                else:
                    self.since.pop(p.rank, None)
            stopped = [p for p in self.peers if p.rank in self.since and p.rank not in self.ended]
            if act(states):
                for p in stopped:
                    if now - self.since[p.rank] >= wait_s:
                        self.ended.add(p.rank)
                        end_frozen(p, why)
            return [p for p in stopped if p.rank not in self.ended]

    def _lowest_running(self, states) -> bool:
        return all(self.me.rank < p.rank for p in self.peers if states[p.rank] not in (None, "T"))

    def run(self):
        while not self.done.wait(self.poll_s):
            self.step(self.timeout_s, f"has been stopped for over timeout_s={self.timeout_s:g} s",
                      self._lowest_running)

    def at_exit(self):
        self.done.set()
        if getattr(sys, "last_value", None) is not None:     # an uncaught exception
            self.step(0.0, f"is stopped while rank {self.me.rank} fails")
            return
        # a normal exit: wait until each stopped peer resumes or counts as frozen
        while self.step(self.timeout_s, f"has been stopped for over timeout_s="
                        f"{self.timeout_s:g} s, and rank {self.me.rank} has finished"):
            time.sleep(self.poll_s)


_WATCH: list = [None]


def start(store, rank: int, world_size: int, timeout_s: float) -> bool:
    """Publish this process in ``store`` (the job's), learn its peers on this host,
    and watch them (see the module docstring).  False where there is no /proc or
    pidfd (not Linux): nothing is watched."""
    if not (os.path.exists("/proc/self/stat") and hasattr(os, "pidfd_open")):
        return False
    host, pid = host_id(), os.getpid()
    me = Peer(rank, pid, proc_stat(pid)[1])
    if "LOCAL_RANK" in os.environ and "LOCAL_WORLD_SIZE" in os.environ:  # set by torchrun
        slot, n, scope = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"]), host
    else:
        slot, n, scope = rank, world_size, "all"
    prefix = f"workbench/peers/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{scope}/"
    store.set(prefix + str(slot), f"{host} {rank} {pid} {me.start}")
    keys = [prefix + str(i) for i in range(n)]
    store.wait(keys)                              # the store's timeout: init()'s
    peers = []
    for k in keys:
        h, r, p, s = store.get(k).decode().split()
        if h == host and int(r) != rank:
            peers.append(Peer(int(r), int(p), int(s)))
    watch(_Watch(me, peers, timeout_s))
    return True


def watch(w: _Watch) -> None:
    """Make ``w`` the process's watch: its thread runs, its exit hook is registered."""
    old, _WATCH[0] = _WATCH[0], w
    if old is not None:
        old.done.set()
        atexit.unregister(old.at_exit)
    atexit.register(w.at_exit)
    threading.Thread(target=w.run, name="workbench-peers", daemon=True).start()


def stop() -> None:
    """Stop the watching thread (at shutdown).  The exit hook stays: a job that fails
    after shutdown() (``finally: shutdown()``) still ends its stopped peers."""
    if _WATCH[0] is not None:
        _WATCH[0].done.set()
