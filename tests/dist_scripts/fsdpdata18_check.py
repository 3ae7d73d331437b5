"""Run under torchrun (gloo, 2 processes): FullyShardedDataParallel / fully_shard with the
root kept gathered (tests/test_fsdpdata18.py's Mix: weights saved as views and as
themselves), a ``.data`` write or ``p.data = t`` between forward and backward; each rank
prints one JSON row per case: the largest difference of its gradient chunks from one
device's, the kept-check all-reduces recorded (count and buffer bytes), the kept weights
checked and the root's re-gathers recorded."""
import json

import torch
import torch.distributed as dist

import workbench as wb
from tests.dist_scripts.fsdpdata17_check import chunk_diff
from tests.test_fsdpdata18 import _mix, _new, _xy


def _written(m, case):
    if case == "write-two":             # two kept weights written: one re-gather of both
        m.lin2.weight.data.mul_(2)
        m.w.data.add_(0.5)
    elif case in ("assign", "fully_shard-assign-own"):
        m.w.data = _new("w")            # saved itself (h @ w): the new values
        m.lin2.weight.data = _new("lin2.weight")     # F.linear's view: the old ones


def _one_device(case, x, y):
    ref = _mix()
    loss = ((ref(x) - y) ** 2).mean()
    if case == "retain":
        loss.backward(retain_graph=True)
        ref.lin2.weight.data.mul_(3)
        ref.w.data.mul_(3)
        ref.zero_grad()
    _written(ref, case)
    loss.backward()
    return ref


def main():
    wb.distributed.init(timeout_s=60)
    n, k = dist.get_world_size(), dist.get_rank()
    x, y = _xy()
    for case in ("none", "write-two", "assign", "retain", "fully_shard-assign-own"):
        ref = _one_device(case, x, y)
        m = _mix()
        f = wb.fully_shard(m) if case.startswith("fully_shard") else \
            wb.FullyShardedDataParallel(m)
        with wb.trace() as tr:
            out = f(x.chunk(n)[k])
            loss = ((out - y.chunk(n)[k]) ** 2).mean()
            if case == "retain":
                loss.backward(retain_graph=True)
                m.lin2.weight.data.mul_(3)
                m.w.data.mul_(3)
                f.zero_grad()
            _written(m, case)
            loss.backward()
        diff = chunk_diff(f, ref, n, k)
        checks = [e for e in tr.collectives() if e.label == "fsdp kept-check root"]
        inner = f._wb_fully_shard.wrapper if case.startswith("fully_shard") else f
        kept = sum(len(c.kept.get(k, {})) for c in inner._calls.values())
        regather = sum(e.label == "fsdp re-gather root" for e in tr.collectives())
        print(json.dumps({"rank": k, "case": case, "diff": diff, "checks": len(checks),
                          "check_bytes": [e.args["buffer_bytes"] for e in checks],
                          "kept": kept, "regather": regather}), flush=True)
    wb.distributed.shutdown()


if __name__ == "__main__":
    main()
