"""Run under torchrun (gloo): torch's own DistributedDataParallel and
wb.DistributedDataParallel(mesh=None) on the same models, step by step.  Rank 0 prints one
JSON line per case: the parameters of each bucket torch all-reduced at each step (a comm
hook), the buckets and traced all-reduces of wb's, and the largest gradient difference."""
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workbench as wb  # noqa: E402
from ddp_buckets_models import (STEPS, batch, cases, dist_tensor_cases, loss,  # noqa: E402
                                make)


def torch_run(name, kw, rank, n, zero_grad=False):
    """torch's DDP on the case's model, a comm hook logging each bucket's parameters;
    ``zero_grad``: a zero_grad(set_to_none=True) before each step (the optimizer loop's
    habit)."""
    m = make(name)
    names = {p: k for k, p in m.named_parameters()}
    ddp = nn.parallel.DistributedDataParallel(m, **kw)
    log = []

    def hook(state, bucket):                     # records, then torch's own all-reduce
        log[-1].append([names[p] for p in bucket.parameters()])
        buf = bucket.buffer().div_(n)
        return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])

    ddp.register_comm_hook(None, hook)
    for step in range(STEPS):
        log.append([])
        if zero_grad:
            ddp.zero_grad(set_to_none=True)
        loss(ddp(batch(name, step).chunk(n)[rank])).backward()
    return log, m


def shared(model, buckets):
    """For each bucket of two or more parameters: do their gradients share one storage
    (gradient_as_bucket_view)?"""
    grads = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    return [len({grads[k].untyped_storage().data_ptr() for k in b if k in grads}) == 1
            for b in buckets if len([k for k in b if k in grads]) > 1]


def wb_run(name, kw, rank, n):
    m = make(name)
    ddp = wb.DistributedDataParallel(m, **kw)
    buckets, events = [], []
    for step in range(STEPS):
        x = batch(name, step).chunk(n)[rank]
        with wb.trace() as tr:
            out = ddp(x)
            buckets.append(ddp.bucket_names)
            loss(out).backward()
        events.append([[e.name, e.label, e.args["buffer_bytes"]] for e in tr.collectives()
                       if e.label.startswith("ddp")])
    return buckets, events, m


def dist_tensor_run(name, kw, n):
    """The same model as DistTensors replicated over a dp mesh (wb.parallelize): DDP's
    DistTensor mode, each step's buckets and the gradients summed over dp."""
    mesh = wb.distributed.mesh(n, ["dp"])
    m = wb.parallelize(make(name), mesh, {})
    ddp = wb.DistributedDataParallel(m, mesh, "dp", **kw)
    buckets = []
    for step in range(STEPS):
        ddp.zero_grad(set_to_none=True)
        out = ddp(wb.shard_tensor(batch(name, step), mesh, [wb.Shard(0)]))
        buckets.append(ddp.bucket_names)
        loss(out).backward()        # summed when backward returns, as torch DDP (habits5)
    # torch DDP's names; the module's gradient (p.shape is the module's: habits15)
    return buckets, {k[len("module."):]: p.grad.full_tensor()
                     for k, p in ddp.named_parameters()}


def main():
    wb.distributed.init(timeout_s=60)
    n, rank = dist.get_world_size(), dist.get_rank()
    for name, kw in cases():
        log, tm = torch_run(name, kw, rank, n)
        buckets, events, wm = wb_run(name, kw, rank, n)
        ref = {k: p.grad for k, p in tm.named_parameters() if p.grad is not None}
        got = {k: p.grad for k, p in wm.named_parameters() if p.grad is not None}
        diff = max((got[k].double() - ref[k].double()).abs().max().item() for k in ref)
        if rank == 0:
            print(json.dumps({"case": [name, kw], "torch": log, "wb_buckets": buckets,
                              "wb_events": events, "grad_keys": [sorted(ref), sorted(got)],
                              "grad_diff": diff, "shared": [shared(tm, log[-1]),
                                                            shared(wm, buckets[-1])]}))
        if (name, kw) in list(dist_tensor_cases()):
            buckets, got = dist_tensor_run(name, kw, n)
            # torch's all steps accumulate (no zero_grad there): compare the last step's
            # buckets only, and the gradients of one step against a fresh torch run
            log, tm = torch_run(name, kw, rank, n, zero_grad=True)
            ref = {k: p.grad for k, p in tm.named_parameters()}
            diff = max((got[k].double() - ref[k].double()).abs().max().item() for k in ref)
            if rank == 0:
                print(json.dumps({"case": [name, kw, "disttensor"], "torch": log,
                                  "wb_buckets": buckets, "grad_diff": diff}))
    wb.distributed.shutdown()


if __name__ == "__main__":
    main()
