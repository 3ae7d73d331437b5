"""Run under torchrun (gloo, 4 processes, 2 x 2 dp x tp): habits13's reads of
``fully_shard``'s gradients (and parameters) over a tensor-parallel MLP, against torch's
own ``parallelize_module`` + FSDP2 ``fully_shard`` (``p.grad`` a DTensor: its full
tensor's numel and reductions) and one device.  One step's gradients of a model whose
tensor-parallel shards do not split evenly over dp (a (3, 3) local weight: chunks 5 and 4,
the second padded); rank 0 prints one JSON line per read: its value for both and for one
device (a list over the parameters)."""
import json
import math
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import workbench as wb  # noqa: E402
from workbench.sim_mesh import backends  # noqa: E402

PLAN = {"0": "colwise", "2": "rowwise"}


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 6), nn.GELU(), nn.Linear(6, 3))     # 45 parameters


def start():
    """The job up (unless several.py already brought it up), this process's rank, and the
    8 x 3 batch and targets every script of this family trains on."""
    if not dist.is_initialized():       # (tests/dist_scripts/several.py: already up)
        wb.distributed.init(timeout_s=120)
    g = torch.Generator().manual_seed(1)
    return dist.get_rank(), torch.randn(8, 3, generator=g), torch.randn(8, 3, generator=g)


def value(v):
    if type(v).__name__ == "DTensor":
        v = v.full_tensor()
    if isinstance(v, torch.Tensor):
        return v.tolist() if v.dim() else float(v)
    return v


READS = {
    "numel": lambda g: g.numel(), "sum": lambda g: g.sum(), "mean": lambda g: g.mean(),
    "abs_mean": lambda g: g.abs().mean(), "std": lambda g: g.std(), "max": lambda g: g.max(),
    "min": lambda g: g.min(), "zeros": lambda g: (g == 0).sum(),
    "sum_dim0": lambda g: g.sum(0), "norm": lambda g: g.norm(),
    "norm_inf": lambda g: torch.linalg.vector_norm(g, math.inf),
    "norm_dim0": lambda g: torch.linalg.vector_norm(g, dim=0),
    "data_norm": lambda g: g.data.norm(), "clone_sum": lambda g: g.clone().sum(),
    "detach_mean": lambda g: g.detach().mean(),
}
PARAM_READS = {"p_numel": lambda p: p.numel(), "p_mean": lambda p: p.mean(),
               "p_shape": lambda p: list(p.shape), "p_dim": lambda p: p.dim()}
TOTALS = {"clip_2": lambda ps: nn.utils.clip_grad_norm_(ps, 1e9),
          "total_0": lambda ps: nn.utils.get_total_norm([p.grad for p in ps], 0.0)}


def reads(m, run):
    run()
    ps = list(m.parameters())
    out = {k: [value(f(p.grad)) for p in ps] for k, f in READS.items()}
    with torch.no_grad():
        out.update({k: [value(f(p)) for p in ps] for k, f in PARAM_READS.items()})
    for k, f in TOTALS.items():
        try:
            out[k] = value(f(ps))
        except Exception as e:       # noqa: BLE001  (what raised, for the test to read)
            out[k] = f"{type(e).__name__}: {e}"
    return out


def main():
    rank, x, y = start()
    ref = mlp()
    one = reads(ref, lambda: ((ref(x) - y) ** 2).mean().backward())
    # torch: its TP then FSDP2 over dp (torchtitan's order), each dp rank its half
    tmesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    m = parallelize_module(mlp(), tmesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    torch_fully_shard(m, mesh=tmesh["dp"])
    half = tmesh["dp"].get_local_rank()
    xs, ys = x.chunk(2)[half], y.chunk(2)[half]
    theirs = reads(m, lambda: ((m(xs) - ys) ** 2).mean().backward())
    # workbench: the same program
    mesh = wb.distributed.mesh((2, 2), ["dp", "tp"])
    model = wb.parallelize(mlp(), mesh, PLAN, mesh_dim="tp")
    w = wb.fully_shard(model, mesh=mesh["dp"])
    pl = [wb.Shard(0), wb.Replicate()]

    def run():
        ((w(wb.shard_tensor(x, mesh, pl)) - wb.shard_tensor(y, mesh, pl)) ** 2).mean().backward()
    mine = reads(w, run)
    if rank == 0:
        for c in one:
            print(json.dumps({"case": c, "one": one[c], "torch": theirs[c], "wb": mine[c]}))
    dist.barrier()
    backends.shutdown()     # (several.py: its own, which keeps the group for the next part)


if __name__ == "__main__":
    main()
