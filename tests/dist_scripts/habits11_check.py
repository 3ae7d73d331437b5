"""Run under torchrun (gloo, 2 processes): habits11's reads of ``fully_shard``'s parameters
against torch's FSDP2 ``fully_shard`` (DTensors: the full tensor's numel, dims and
reductions).  Rank 0 prints one JSON line per case: each read's value for both wrappers
and for one device, and what each raised."""
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import workbench as wb  # noqa: E402
from workbench.sim_mesh import backends  # noqa: E402


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))     # 58 parameters


def value(v):
    v = v.full_tensor() if hasattr(v, "full_tensor") and type(v).__name__ == "DTensor" else v
    return float(v) if isinstance(v, torch.Tensor) else v


READS = {
    "numel": lambda ps: sum(p.numel() for p in ps),
    "dims": lambda ps: [p.dim() for p in ps],
    "norm": lambda ps: [value(p.norm()) for p in ps],
    "mean": lambda ps: [value(p.mean()) for p in ps],
    "abs_max": lambda ps: [value(p.abs().max()) for p in ps],
    "total_norm": lambda ps: value(nn.utils.get_total_norm(ps)),
}


def reads(ps):
    out = {}
    for k, f in READS.items():
        with torch.no_grad():
            out[k] = f(ps)
    return out


def raised(f):
    try:
        f()
    except Exception as e:       # noqa: BLE001  (what raised, for the test to read)
        return f"{type(e).__name__}: {e}"
    return None


def main():
    if not dist.is_initialized():       # (tests/dist_scripts/several.py: already up)
        dist.init_process_group("gloo")
    one = reads(list(model().parameters()))
    m = model()
    torch_fully_shard(m[0])
    torch_fully_shard(m)
    theirs = reads(list(m.parameters()))
    w = model()
    wb.fully_shard(w[0])
    wb.fully_shard(w)
    ps = list(w.parameters())
    mine = reads(ps)
    # with autograd recording: a gathered value has no gradient (raises); a view of the
    # whole parameter does not exist here (raises)
    grad_norm = raised(lambda: ps[0].norm())
    p2v = raised(lambda: nn.utils.parameters_to_vector(ps))
    if dist.get_rank() == 0:
        for k in READS:
            print(json.dumps({"case": k, "one": one[k], "torch": theirs[k], "wb": mine[k]}))
        print(json.dumps({"case": "raises", "grad_norm": grad_norm, "p2v": p2v}))
    dist.barrier()
    backends.shutdown()     # (several.py: its own, which keeps the group for the next part)


if __name__ == "__main__":
    main()
