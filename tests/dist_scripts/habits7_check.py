"""Run under torchrun (gloo, 2 processes): habits7's ``ZeroRedundancyOptimizer.step(closure)``
over ``DistributedDataParallel`` against torch's own DDP + ZeroRedundancyOptimizer doing the
same (the parameters, the returned losses, the closure's calls).  Every rank prints one
JSON line."""
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from torch.nn.parallel import DistributedDataParallel as TorchDDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workbench as wb  # noqa: E402
from workbench.sim_mesh import backends  # noqa: E402
from habits6_check import batches, mine, mlp  # noqa: E402  (the same model, data, rows)


def zero_closure():
    runs = {}
    for who, DDP, Zero in (("wb", wb.DistributedDataParallel, wb.ZeroRedundancyOptimizer),
                           ("torch", TorchDDP, TorchZero)):
        w = DDP(mlp())
        opt = Zero(w.parameters(), torch.optim.AdamW, lr=0.01)
        losses, calls = [], [0]
        for x, y in batches(3):
            def closure():
                calls[0] += 1
                opt.zero_grad()
                loss = ((w(mine(x)) - mine(y)) ** 2).mean()
                loss.backward()
                return loss
            losses.append(float(opt.step(closure)))
        runs[who] = ({k: v.detach().clone() for k, v in w.module.state_dict().items()},
                     losses, calls[0])
    (a, la, ca), (b, lb, cb) = runs["wb"], runs["torch"]
    return {"case": "zero_closure", "params": max((a[k] - b[k]).abs().max().item() for k in b),
            "losses_equal": la == lb, "calls": [ca, cb]}


def main():
    if not dist.is_initialized():       # (tests/dist_scripts/several.py: already up)
        dist.init_process_group("gloo")
    try:
        row = zero_closure()
    except Exception as e:       # noqa: BLE001 (reported, the test fails on it)
        row = {"case": "zero_closure", "raised": f"{type(e).__name__}: {e}"}
    print(json.dumps(row), flush=True)
    backends.shutdown()     # (several.py: its own, which keeps the group for the next part)


if __name__ == "__main__":
    main()
