"""Run under torchrun (gloo, 4 processes, 2 x 2 dp x tp): habits15's reads of
``DistributedDataParallel`` over tensor parallelism (``wb.parallelize_module`` then
``wb.DistributedDataParallel(model, mesh, dim="dp")``): each parameter's and gradient's
``numel`` / ``shape`` / ``dim`` / reductions after one step's backward, against one
device (a list over the parameters), as on simulated ranks (habits13, habits14); rank 0
prints one JSON line per read (an error's text where a read raises), then the totals
(``clip_grad_norm_``), a view of a parameter (what it raises) and a user's loop
(``loop``: zero_grad, clip, AdamW, state_dict round trip)."""
import json
import math
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import workbench as wb  # noqa: E402
from workbench.sim_mesh import backends  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from habits13_check import start  # noqa: E402  (the job, its rank and batch)

PLAN = {"0": wb.ColwiseParallel(), "2": wb.RowwiseParallel()}


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 6), nn.GELU(), nn.Linear(6, 3))     # 45 parameters


def value(v):
    if isinstance(v, torch.Tensor):
        with torch._C.DisableTorchFunctionSubclass():
            v = v.detach().clone()
        return v.tolist() if v.dim() else float(v)
    return list(v) if isinstance(v, torch.Size) else v


READS = {
    "numel": lambda t: t.numel(), "shape": lambda t: t.shape, "dim": lambda t: t.dim(),
    "len": lambda t: len(t), "sum": lambda t: t.sum(), "mean": lambda t: t.mean(),
    "abs_max": lambda t: t.abs().max(), "min": lambda t: t.min(), "std": lambda t: t.std(),
    "sum_dim0": lambda t: t.sum(0), "norm": lambda t: t.norm(),
    "norm_inf": lambda t: torch.linalg.vector_norm(t, math.inf),
    "data_sum": lambda t: t.data.sum(), "clone_mean": lambda t: t.clone().mean(),
    "detach_norm": lambda t: t.detach().norm(),
}


def safe(f, t):
    try:
        with torch.no_grad():
            return value(f(t))
    except Exception as e:     # noqa: BLE001  (what raised, for the test to read)
        return f"{type(e).__name__}: {e}"


def reads(ps):
    out = {f"p_{k}": [safe(f, p) for p in ps] for k, f in READS.items()}
    out.update({f"g_{k}": [safe(f, p.grad) for p in ps] for k, f in READS.items()})
    out["clip"] = safe(lambda ps: nn.utils.clip_grad_norm_(ps, 1e9), ps)
    out["p_row"] = safe(lambda p: p[0], ps[0])
    out["g_row"] = safe(lambda g: g[0], ps[0].grad)
    return out


def loop(w, mesh, m):
    """A user's loop: zero_grad(set_to_none=False), torch's clip_grad_norm_ (its total
    norms), two AdamW steps, then the state dict loaded into a fresh model: the weights'
    sums (a list: clip norms, then each parameter's sum after the round trip)."""
    ps = list(w.parameters())
    opt = torch.optim.AdamW(ps, lr=1e-2)
    g = torch.Generator().manual_seed(2)
    out = []
    for _ in range(2):
        x, y = torch.randn(8, 3, generator=g), torch.randn(8, 3, generator=g)
        opt.zero_grad(set_to_none=False)
        if mesh is None:
            pred = w(x)
        else:
            pred = w(wb.shard_tensor(x, mesh, [wb.Shard(0), wb.Replicate()])).full()
        ((pred - y) ** 2).mean().backward()
        out.append(float(nn.utils.clip_grad_norm_(ps, 0.1)))
        opt.step()
    sd = w.state_dict()
    fresh = mlp()
    if mesh is not None:
        torch.manual_seed(5)
        fresh = nn.Sequential(nn.Linear(3, 6), nn.GELU(), nn.Linear(6, 3))
        wb.parallelize_module(fresh, mesh, PLAN)
        wb.parallelize(fresh, mesh)
        fresh = wb.DistributedDataParallel(fresh, mesh, dim="dp")
    fresh.load_state_dict(sd)
    with torch.no_grad():
        out += [float(p.sum()) for p in fresh.parameters()]
    return out


def main():
    rank, x, y = start()
    ref = mlp()
    ((ref(x) - y) ** 2).mean().backward()
    one = reads(list(ref.parameters()))
    mesh = wb.distributed.mesh((2, 2), ["dp", "tp"])
    m = mlp()
    wb.parallelize_module(m, mesh, PLAN)
    wb.parallelize(m, mesh)
    ddp = wb.DistributedDataParallel(m, mesh, dim="dp")
    pl = [wb.Shard(0), wb.Replicate()]
    out = ddp(wb.shard_tensor(x, mesh, pl))
    ((out.full() - y) ** 2).mean().backward()
    mine = reads(list(ddp.parameters()))
    one["loop"], mine["loop"] = loop(ref, None, None), loop(ddp, mesh, m)
    if rank == 0:
        for c in one:
            print(json.dumps({"case": c, "one": one[c], "wb": mine[c]}))
    dist.barrier()
    backends.shutdown()     # (several.py: its own, which keeps the group for the next part)


if __name__ == "__main__":
    main()
