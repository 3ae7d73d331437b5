"""A user's read that gathers over processes: every process of the gather first agrees to
make it, within init()'s timeout, or the reader gets an error naming the fix.

Under torch.distributed a read of a tensor-parallel parameter that gives the module's
value (``p.norm()`` of ``wb.DistributedDataParallel``'s parameter over tensor parallelism,
habits15: one device's answer, not this process's shard's) is a gather over the
processes holding the other shards, a collective each of them must join.  A common
logging habit makes it on one process only::

    if dist.get_rank() == 0:
        print(p.norm())          # rank 1 never joins the gather

torch keeps that read local (fixlist16, torch 2.13): ``DTensor.sum()`` / ``norm()`` give
a Partial DTensor without communicating and ``DTensor.__repr__`` prints the local tensor
(torch/distributed/tensor/_api.py ``__repr__``); only the value's read communicates
(``.item()``: ``aten._local_scalar_dense``'s strategy is replicate-only,
_ops/_tensor_ops.py ``replica_only_strategy``; ``full_tensor()``), and torch hangs there
as here when one process makes it.  torch's DDP over TP (``_pre_dp_module_transform``,
tensor/parallel/ddp.py) holds plain local shards, whose reads are the shard's.  Here the
read is the value, so it communicates; before this, a lone reader waited in the gather
while its peers went on to their next collective, both ending only in gloo's timeout
(measured: "Timed out waiting 20000ms for send operation", init(timeout_s=20)), and two
processes gathering different parameters of one shape would have paired their gathers,
each reading a mix.

:func:`agree` runs before such a gather: each process writes what it reads, numbered per
group, in the job's store (no collective, so nothing is left half-paired on a process
group) and waits for its peers' entries for at most init()'s ``timeout_s``; a peer that
never makes the read, or makes another, is an error naming the fix, on the reader, with
no gather begun (a read that timed out is taken back: the processes' next reads pair up
again, and a caught error leaves the job able to go on).
"""
from __future__ import annotations

import contextlib
import os

import torch.distributed as dist

from . import backends as _B

__all__ = ["agree", "agree_any", "timed_out", "timeout_message", "reading"]

_COUNT: dict = {}           # ranks of a group -> reads made over them (this process)


def agree(ranks, what: str, how: str = "gathered from the shards of") -> None:
    """Before a user's read gathered over processes ``ranks`` (this one among them):
    every one of them makes the same read (``what``: which tensor, named for the error;
    ``how``: what the collective does with the processes' parts, for the error), or raise
    RuntimeError naming the fix (module docstring)."""
    _exchange(ranks, what, how, "")


def agree_any(ranks, what: str, flag: bool, how: str = "decided together by") -> bool:
    """As :func:`agree`, and each process also gives a fact only it can see (``flag``: a
    value read from its own shards): True if any of ``ranks`` gave True.  The processes
    decide one thing from it together, through the store (no collective: a step made
    inside a read one process makes alone ends in the error naming the fix, as agree's,
    instead of pairing with a peer's next collective; dispatch._unsafe_factor)."""
    return any(v == "1" for v in _exchange(ranks, what, how, "1" if flag else "0")) or flag


def _exchange(ranks, what: str, how: str, mine: str) -> list:
    """agree's protocol; each process's entry is ``what`` and ``mine`` (one line each):
    the peers' ``mine``s, once their ``what`` is this one's."""
    ranks = tuple(sorted(ranks))
    me = dist.get_rank()
    if len(ranks) < 2:
        return []
    n = _COUNT[ranks] = _COUNT.get(ranks, 0) + 1
    store = dist.distributed_c10d._get_default_store()
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    base = f"workbench/reads/{restart}/{'-'.join(map(str, ranks))}/"
    store.set(f"{base}{n}/{me}", f"{what}\n{mine}")
    others = [r for r in ranks if r != me]
    timeout = _B._TIMEOUT[0]
    try:
        store.wait([f"{base}{n}/{r}" for r in others], timeout)
    except RuntimeError:                # torch's DistStoreError: the wait timed out
        missing = [r for r in others if not store.check([f"{base}{n}/{r}"])]
        # undone: the peers' next read of this group pairs with this process's next
        store.delete_key(f"{base}{n}/{me}")
        _COUNT[ranks] = n - 1
        raise RuntimeError(
            f"a read of {what}: its value is {how} processes "
            f"{list(ranks)}, a collective each of them must join, and process(es) "
            f"{missing} did not make this read within init()'s timeout_s="
            f"{timeout.total_seconds():g} s.  A read made on some processes only (`if "
            "rank == 0: print(p.norm())`) would hang: make the same reads on every "
            "process, in the same order, and print on one (`v = p.norm()` everywhere, "
            "then `if rank == 0: print(v)`)") from None
    values = []
    for r in others:
        theirs, _, value = store.get(f"{base}{n}/{r}").decode().rpartition("\n")
        values.append(value)
        if theirs != what:
            raise RuntimeError(
                f"a read of {what}: its value is {how} processes "
                f"{list(ranks)}, and process {r} made another read at this point (of "
                f"{theirs}); their gathers would pair up and each read a mix of two "
                "tensors.  Make the same reads on every process, in the same order")
    if n > 1:
        # every peer wrote read n, so each finished read n - 1 (reading this process's
        # entry): it is not needed again (the store would grow a key per read)
        store.delete_key(f"{base}{n - 1}/{me}")
    return values


def timed_out(err: RuntimeError) -> bool:
    """True if ``err`` is a collective's that ended in init()'s timeout (gloo: "Timed out
    waiting 8000ms for recv operation", then "Application timeout caused pair closure" on
    every later call of the process group)."""
    text = str(err)
    return "Timed out waiting" in text or "timeout caused pair closure" in text


def timeout_message(what: str, err: RuntimeError) -> str:
    """The error of a gather (``full()``, ``.item()``, ``float()``, ``full_tensor()``)
    whose collective timed out: a read one process made alone, most likely, as torch's
    ``DTensor.full_tensor()`` on one rank only (it waits there too, and ends in the same
    timeout).  Unlike :func:`agree`'s reads, these are not agreed first (a store round
    trip measured 3.5 ms on 4 gloo processes, against 0.65 ms for the gather of a
    4-element tensor: every gather would pay it), so the process group is lost."""
    first = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
    timeout = _B._TIMEOUT[0]
    secs = f"={timeout.total_seconds():g} s" if timeout is not None else ""
    return (f"a read of {what}: its value is gathered from the processes' shards, and "
            f"the collective did not complete within init()'s timeout_s{secs} ({first}).  "
            "A read made on some processes only (`if rank == 0: print(t.full())`, "
            "`.item()`, `float(t)`, `t.full_tensor()`) waits for peers that never come: "
            "make the same reads on every process, in the same order, and print on one "
            "(`v = t.full()` everywhere, then `if rank == 0: print(v)`).  torch.distributed's "
            "process group does not recover from a timed-out collective: restart the job")



@contextlib.contextmanager
def reading(what: str):
    """Around a read's collectives (under torch.distributed): one that ended in init()'s
    timeout raises :func:`timeout_message`'s error naming the fix (``what``: the read);
    any other error passes unchanged."""
    try:
        yield
    except RuntimeError as e:
        if timed_out(e):
            raise RuntimeError(timeout_message(what, e)) from e
        raise
