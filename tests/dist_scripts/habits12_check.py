"""Run under torchrun (gloo, 2 processes): habits12's reads of ``fully_shard``'s gradients
against torch's FSDP2 ``fully_shard`` (``p.grad`` a DTensor: the full tensor's numel and
reductions) and one device.  One step's gradients of a model whose weights do not split
evenly (15 elements: chunks 8 and 7, the second padded), each process its half of the
batch; rank 0 prints one JSON line per read: its value for both wrappers and for one
device (a list over the parameters)."""
import json
import math
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
    return nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 3))     # 38 parameters


def value(v):
    if type(v).__name__ == "DTensor":
        v = v.full_tensor()
    if isinstance(v, torch.Tensor):
        return v.tolist() if v.dim() else float(v)
    return v


READS = {
    "numel": lambda g: g.numel(), "nelement": lambda g: g.nelement(),
    "sum": lambda g: g.sum(), "mean": lambda g: g.mean(), "abs_mean": lambda g: g.abs().mean(),
    "pow_sum": lambda g: g.pow(2).sum(), "std": lambda g: g.std(), "max": lambda g: g.max(),
    "min": lambda g: g.min(), "zeros": lambda g: (g == 0).sum(), "sum_dim0": lambda g: g.sum(0),
    "norm": lambda g: g.norm(), "norm_inf": lambda g: torch.linalg.vector_norm(g, math.inf),
    "norm_dim0": lambda g: torch.linalg.vector_norm(g, dim=0),
    # an alias, copy or cast of it: Lightning's grad_norm (p.grad.data.norm()), fairseq's
    # clip (torch.norm(p.grad.detach(), p=2, dtype=torch.float32)), a saved copy
    "data_norm": lambda g: g.data.norm(), "clone_sum": lambda g: g.clone().sum(),
    "detach_norm": lambda g: torch.norm(g.detach(), p=2, dtype=torch.float32),
    "double_mean": lambda g: g.double().mean(), "detach_mean": lambda g: g.detach().mean(),
}
TOTALS = {                              # over all the gradients: torch's clip and total norm
    "clip_2": lambda ps: nn.utils.clip_grad_norm_(ps, 1e9),
    "clip_inf": lambda ps: nn.utils.clip_grad_norm_(ps, 1e9, norm_type=math.inf),
    "clip_1_foreach": lambda ps: nn.utils.clip_grad_norm_(ps, 1e9, norm_type=1.0,
                                                          foreach=True),
    "total_0": lambda ps: nn.utils.get_total_norm([p.grad for p in ps], 0.0),
    "total_-inf": lambda ps: nn.utils.get_total_norm([p.grad for p in ps], -math.inf),
}


def grads(m, x, y):
    ((m(x) - y) ** 2).mean().backward()
    ps = list(m.parameters())
    out = {k: [value(f(p.grad)) for p in ps] for k, f in READS.items()}
    for k, f in TOTALS.items():
        try:
            out[k] = value(f(ps))
        except Exception as e:       # noqa: BLE001  (what raised, for the test to read)
            out[k] = f"{type(e).__name__}: {e}"
    return out


def steps(m, x, y):
    """Two steps of a loop that clips and steps SGD with momentum (torch.optim keeps
    torch.clone(grad) as the buffer: a kept gradient subclass here): the parameters after,
    flattened."""
    opt = torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9)
    for _ in range(2):
        opt.zero_grad()
        ((m(x) - y) ** 2).mean().backward()
        nn.utils.clip_grad_norm_(m.parameters(), 0.1)
        opt.step()
    return [v for p in m.parameters()
            for v in (p.full_tensor() if hasattr(p, "full_tensor") else p).reshape(-1).tolist()]


def main():
    if not dist.is_initialized():       # (tests/dist_scripts/several.py: already up)
        dist.init_process_group("gloo")
    n, k = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4 * n, 3, generator=g), torch.randn(4 * n, 3, generator=g)
    one = grads(model(), x, y)
    mine_x, mine_y = x.chunk(n)[k], y.chunk(n)[k]
    m = model()
    torch_fully_shard(m[0])
    torch_fully_shard(m)
    theirs = grads(m, mine_x, mine_y)
    w = model()
    wb.fully_shard(w[0])
    wb.fully_shard(w)
    mine = grads(w, mine_x, mine_y)
    one["sgd_clip_steps"] = steps(model(), x, y)
    for c, f in ((None, torch_fully_shard), ("wb", wb.fully_shard)):
        m = model()
        f(m[0])
        f(m)
        (mine if c else theirs)["sgd_clip_steps"] = steps(m, mine_x, mine_y)
    if k == 0:
        for c in one:
            print(json.dumps({"case": c, "one": one[c], "torch": theirs[c], "wb": mine[c]}))
    dist.barrier()
    backends.shutdown()     # (several.py: its own, which keeps the group for the next part)


if __name__ == "__main__":
    main()
