"""Run under torchrun (gloo, 2 processes): shard_tensor broadcasts the global tensor
from the first rank (or src_data_rank; None keeps each process's own), and
from_local(..., [Replicate()]) refuses copies that differ, on every process.  Each
rank prints one JSON line of what it saw."""
import json

import torch

import workbench as wb


def error(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def main():
    wb.distributed.init(timeout_s=60)
    rank = wb.distributed.rank()
    mesh = wb.distributed.mesh(2, ["dp"])
    x = torch.full((2, 3), float(rank))               # each process a different "global" x
    x0 = x.clone()
    out = {"rank": rank}
    out["replicate"] = wb.shard_tensor(x, mesh, [wb.Replicate()]).to_local().tolist()
    out["shard"] = wb.shard_tensor(x, mesh, [wb.Shard(0)]).to_local().tolist()
    out["src1"] = wb.shard_tensor(x, mesh, [wb.Replicate()], src_data_rank=1).to_local().tolist()
    out["own"] = wb.shard_tensor(x, mesh, [wb.Replicate()], src_data_rank=None).to_local().tolist()
    out["x_untouched"] = torch.equal(x, x0)
    leaf = x.clone().requires_grad_()
    (wb.shard_tensor(leaf, mesh, [wb.Replicate()]).to_local() * 3).sum().backward()
    out["grad"] = leaf.grad.tolist()                   # the gradient reaches the local x
    out["bad_src"] = error(lambda: wb.shard_tensor(x, mesh, ["R"], src_data_rank=2))
    out["bad_shape"] = error(lambda: wb.shard_tensor(torch.zeros(2 + rank), mesh, ["R"]))
    # from_local: equal replicas pass, differing ones fail on every process
    out["equal_ok"] = wb.from_local(torch.ones(3), mesh, [wb.Replicate()]).to_local().tolist()
    out["differ"] = error(lambda: wb.from_local(x, mesh, [wb.Replicate()]))
    out["differ_shape"] = error(lambda: wb.from_local(torch.zeros(2 + rank), mesh, ["R"]))
    out["unchecked"] = wb.from_local(x, mesh, [wb.Replicate()],
                                     check_replicas=False).to_local().tolist()
    out["partial"] = wb.from_local(x, mesh, [wb.Partial()]).full().tolist()
    out["sharded"] = wb.from_local(x, mesh, [wb.Shard(0)]).full().tolist()
    print(json.dumps(out), flush=True)
    wb.distributed.shutdown()


if __name__ == "__main__":
    main()
