"""loss8 on torch.distributed (torchrun, gloo, 2 processes): loss_parallel cross-entropy
and log_softmax + nll_loss on a vocabulary that tp does not divide (7 classes: 4, 3),
against one device; a random nn.init of DDP-over-tp replicas raises at once."""
import json

import torch
import torch.nn.functional as F
from torch import nn

import workbench as wb

S, R = wb.Shard, wb.Replicate


def main():
    wb.distributed.init(timeout_s=60)
    n, k = torch.distributed.get_world_size(), torch.distributed.get_rank()
    mesh = wb.distributed.mesh(n, ["tp"])
    torch.manual_seed(0)
    x, t = torch.randn(6, 7, dtype=torch.float64), torch.randint(0, 7, (6,))
    t[1] = -100
    w = torch.rand(7, dtype=torch.float64)
    for case, kw in (("plain", {}), ("smooth+weight", {"label_smoothing": 0.2, "weight": w}),
                     ("none", {"reduction": "none"})):
        xr = x.clone().requires_grad_()
        want = F.cross_entropy(xr, t, **kw)
        want.sum().backward()
        xd = wb.distribute_tensor(x, mesh, [S(1)]).requires_grad_()
        with wb.loss_parallel():
            got = F.cross_entropy(xd, t, **kw)
        got.sum().backward()
        print(json.dumps({"rank": k, "case": case,
                          "loss": (got.full() - want).abs().max().item(),
                          "grad": (xd.grad.full() - xr.grad).abs().max().item()}), flush=True)
    xr = x.clone().requires_grad_()
    want = F.nll_loss(F.log_softmax(xr, -1), t)
    want.backward()
    xd = wb.distribute_tensor(x, mesh, [S(1)]).requires_grad_()
    with wb.loss_parallel():
        lp = F.log_softmax(xd, -1)
        got = F.nll_loss(lp, t)
    got.backward()
    print(json.dumps({"rank": k, "case": "nll", "placements": str(lp.placements),
                      "loss": (got.full() - want).abs().item(),
                      "grad": (xd.grad.full() - xr.grad).abs().max().item()}), flush=True)
    mesh2 = wb.distributed.mesh((1, n), ["dp", "tp"])
    m = wb.parallelize_module(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)),
                              mesh2, {"0": wb.ColwiseParallel(), "2": wb.RowwiseParallel()})
    ddp = wb.DistributedDataParallel(m, mesh2, "dp")
    try:
        nn.init.normal_(next(iter(ddp.parameters())))
        raised = ""
    except RuntimeError as e:
        raised = str(e)
    print(json.dumps({"rank": k, "case": "init", "raised": raised[:600]}), flush=True)
    wb.distributed.shutdown()


if __name__ == "__main__":
    main()
