"""Run under torchrun (gloo, 2 processes): habits6's habits on the process group.

* ``ZeroRedundancyOptimizer.add_param_group`` mid-training over ``DistributedDataParallel``,
  against torch's own DDP + ZeroRedundancyOptimizer doing the same (parameters, and the
  groups' keys);
* a forward under ``torch.inference_mode()`` between FSDP steps, and a second backward
  through a retained graph, against one device;
* ``optimizer.zero_grad()`` after an FSDP ``no_sync()`` backward drops the held gradients
  (FSDP1's), against one device.
Every rank prints one JSON line per case."""
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from torch.nn.parallel import DistributedDataParallel as TorchDDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workbench as wb  # noqa: E402


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6))


def batches(k):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g))
            for _ in range(k)]


def mine(t):
    """This process's rows of a global batch."""
    return t.chunk(dist.get_world_size())[dist.get_rank()]


def mse(out, y):
    return ((out - y) ** 2).mean()


def zero_add_param_group():
    runs = {}
    for who, DDP, Zero in (("wb", wb.DistributedDataParallel, wb.ZeroRedundancyOptimizer),
                           ("torch", TorchDDP, TorchZero)):
        w = DDP(mlp())
        ps = {k.removeprefix("module."): p for k, p in w.named_parameters()}
        opt = Zero([ps["2.weight"], ps["2.bias"]], torch.optim.SGD, lr=0.1, momentum=0.9)
        for i, (x, y) in enumerate(batches(4)):
            if i == 2:
                opt.add_param_group({"params": [ps["0.weight"], ps["0.bias"]], "lr": 0.3})
            opt.zero_grad()
            mse(w(mine(x)), mine(y)).backward()
            opt.step()
        runs[who] = ({k: v.detach().clone() for k, v in w.module.state_dict().items()},
                     [sorted(g) for g in opt.param_groups])
    (a, ka), (b, kb) = runs["wb"], runs["torch"]
    return {"case": "zero_add_param_group",
            "params": max((a[k] - b[k]).abs().max().item() for k in b),
            "keys_equal": ka == kb}


def fsdp_inference_and_retain():
    ref = mlp()
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    f = wb.FullyShardedDataParallel(mlp(), None, units={nn.Linear})
    opt = torch.optim.SGD(f.parameters(), lr=0.1, momentum=0.9)
    outs = 0.0
    for x, y in batches(3):
        for o in (ropt, opt):
            o.zero_grad()
        loss = mse(ref(x), y)
        loss.backward(retain_graph=True)
        loss.backward()
        ropt.step()
        loss = mse(f(mine(x)), mine(y))
        loss.backward(retain_graph=True)
        loss.backward()
        opt.step()
        with torch.inference_mode():
            got, want = f(mine(x)), ref(mine(x))
        outs = max(outs, (got - want).abs().max().item())
    full = f.full_state_dict()
    return {"case": "fsdp_inference_and_retain", "outputs": outs,
            "params": max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())}


def fsdp_zero_grad_after_no_sync():
    ref = mlp()
    f = wb.FullyShardedDataParallel(mlp(), None, units={nn.Linear})
    opt = torch.optim.SGD(f.parameters(), lr=1.0)
    (x0, y0), (x1, y1) = batches(2)
    with f.no_sync():
        mse(f(mine(x0)), mine(y0)).backward()
    opt.zero_grad()                     # drops the held gradients, as FSDP1's
    mse(f(mine(x1)), mine(y1)).backward()
    opt.step()
    mse(ref(x1), y1).backward()
    torch.optim.SGD(ref.parameters(), lr=1.0).step()
    full = f.full_state_dict()
    return {"case": "fsdp_zero_grad_after_no_sync",
            "params": max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())}


def main():
    wb.distributed.init(timeout_s=120)
    rank = dist.get_rank()
    for case in (zero_add_param_group, fsdp_inference_and_retain,
                 fsdp_zero_grad_after_no_sync):
        try:
            row = case()
        except Exception as e:          # noqa: BLE001  (reported, not hidden)
            row = {"case": case.__name__, "raised": f"{type(e).__name__}: {e}"[:300]}
        print(json.dumps({"rank": rank, **row}), flush=True)
    wb.distributed.shutdown()


if __name__ == "__main__":
    main()
