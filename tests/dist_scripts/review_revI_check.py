"""Run under torchrun (gloo, 2 processes): torch's own DistributedDataParallel and
wb.DistributedDataParallel(mesh=None) on the programs of tests/test_review_revI.py.  Each
rank prints one JSON line per case: every parameter's gradient after the case's steps, or
the error the wrapper raised."""
import dataclasses
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import workbench as wb


@dataclasses.dataclass
class Out:                                  # a forward's output as Transformers gives it
    logits: torch.Tensor


class Net(nn.Module):
    """a, b, c; ``mode`` picks what forward returns and which layers it uses."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = (nn.Linear(4, 4).double(), nn.Linear(4, 4).double(),
                                  nn.Linear(4, 2).double())

    def forward(self, x, mode="all"):
        y = torch.tanh(self.a(x))
        if mode == "skip_b":
            return self.c(y)
        if mode == "aux":                   # b feeds the loss outside the output
            self.aux = torch.tanh(self.b(y)).mean()
            return self.c(y)
        out = self.c(torch.tanh(self.b(y)))
        return Out(out) if mode == "dataclass" else out


def batch(step, rank, n):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 4, generator=g, dtype=torch.float64).chunk(n)[rank]


# case: (DDP keyword arguments, each step's forward mode ("rank0:" + mode: only rank 0
# runs that mode, the others run "skip_b"))
CASES = {
    "dataclass_output": ({"find_unused_parameters": True}, ["dataclass", "dataclass"]),
    "unused_keeps_stale_grad": ({"find_unused_parameters": True}, ["all", "skip_b"]),
    "loss_outside_output": ({"find_unused_parameters": True}, ["aux"]),
    "graph_changes_under_static_graph": ({"static_graph": True}, ["skip_b", "all"]),
    "used_on_one_rank": ({}, ["rank0:all"]),
}


def run(wrap, kw, modes, rank, n):
    m = Net()
    ddp = wrap(m, **kw)
    for step, mode in enumerate(modes):
        if mode.startswith("rank0:"):
            mode = mode[6:] if rank == 0 else "skip_b"
        out = ddp(batch(step, rank, n), mode)
        loss = (out.logits if isinstance(out, Out) else out).mean()
        (loss + m.aux if mode == "aux" else loss).backward()
    return {k: None if p.grad is None else p.grad.flatten().tolist()
            for k, p in m.named_parameters()}


def torch_buckets_after_no_sync(rank, n):
    """torch DDP's buckets (a comm hook's bucket.parameters()) at the second synchronized
    step of: a no_sync step skipping b, then two steps using everything."""
    m = Net()
    names = {p: k for k, p in m.named_parameters()}
    ddp = nn.parallel.DistributedDataParallel(m)
    log = []

    def hook(state, bucket):
        log.append([names[p] for p in bucket.parameters()])
        buf = bucket.buffer().div_(n)
        return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])

    ddp.register_comm_hook(None, hook)
    with ddp.no_sync():
        ddp(batch(0, rank, n), "skip_b").mean().backward()
    for step in (1, 2):
        log.clear()
        ddp(batch(step, rank, n)).mean().backward()
    return log


def disttensor_used_on_one_rank(rank, n, kw):
    """DDP's DistTensor mode (wb.parallelize over a dp mesh), b used on rank 0 only:
    each rank's gradients, or its error."""
    mesh = wb.distributed.mesh(n, ["dp"])
    ddp = wb.DistributedDataParallel(wb.parallelize(Net(), mesh, {}), mesh, "dp", **kw)
    x = wb.shard_tensor(torch.cat([batch(0, r, n) for r in range(n)]), mesh, [wb.Shard(0)])
    try:
        ddp(x, "all" if rank == 0 else "skip_b").mean().backward()
        ddp.finish_gradient_synchronization()
    except RuntimeError as e:
        return "RuntimeError: " + str(e).splitlines()[0][:300]
    return {k[len("module."):]: None if p.grad is None else p.grad.flatten().tolist()
            for k, p in ddp.named_parameters()}             # torch DDP's names: "module."


def main():
    wb.distributed.init(timeout_s=60)
    n, rank = dist.get_world_size(), dist.get_rank()
    for name in sys.argv[1:]:
        if name.startswith("disttensor_used_on_one_rank"):
            kw = {"bucket_bytes": 1} if name.endswith("bucket_bytes") else {}
            print(json.dumps({"case": name, "rank": rank,
                              "wb": disttensor_used_on_one_rank(rank, n, kw)}), flush=True)
            continue
        if name == "buckets_after_no_sync":
            print(json.dumps({"case": name, "rank": rank,
                              "torch": torch_buckets_after_no_sync(rank, n)}), flush=True)
            continue
        kw, modes = CASES[name]
        row = {"case": name, "rank": rank}
        for who, wrap in (("torch", nn.parallel.DistributedDataParallel),
                          ("wb", wb.DistributedDataParallel)):
            if who == "torch" and name == "used_on_one_rank":
                continue                    # torch's reducer waits forever for rank 1
            try:
                row[who] = run(wrap, kw, modes, rank, n)
            except RuntimeError as e:
                row[who] = "RuntimeError: " + str(e).splitlines()[0][:300]
            if name != "used_on_one_rank":
                dist.barrier()
        print(json.dumps(row), flush=True)
    sys.stdout.flush()
    # used_on_one_rank leaves rank 0 with no error and rank 1 with one: end without the
    # group's teardown
    os._exit(0)


if __name__ == "__main__":
    main()
