"""Run under torchrun (gloo): an ordinary training loop's habits on the wrappers over
the process group.  Every rank prints one JSON line per case: torch's own
clip_grad_norm_ then an optimizer step against one device (the norms and the
parameters), state dict round trips, and a summed loss against the simulation."""
import json
import math
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workbench as wb  # noqa: E402
from wrappers_model import data, loss_fn, make  # noqa: E402


def wrap(kind, m, mesh):
    if kind == "fsdp":
        return wb.FullyShardedDataParallel(m, mesh)
    if kind == "fsdp_units":
        return wb.FullyShardedDataParallel(m, mesh, units={nn.Linear}, prefetch=True)
    # the toy's unused parameter: torch DDP trains it only with find_unused_parameters
    return wb.DistributedDataParallel(m, mesh, find_unused_parameters=True)


def clipped_training(kind, norm_type, n, k):
    """Three steps of loss, backward, torch's clip_grad_norm_, AdamW (ZeroRedundancy-
    Optimizer for "zero"), on the process group and on one device."""
    w, ref = wrap(kind, make(), None), make()
    if kind == "zero":
        opt = wb.ZeroRedundancyOptimizer(w.parameters(), torch.optim.AdamW, None, lr=1e-2)
    else:
        opt = torch.optim.AdamW(w.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    norms = []
    for ids, y in data(3):
        opt.zero_grad()
        ropt.zero_grad()
        loss_fn(w(ids.chunk(n)[k]), y.chunk(n)[k]).backward()
        loss_fn(ref(ids), y).backward()
        got = torch.nn.utils.clip_grad_norm_(w.parameters(), 0.05, norm_type)
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type)
        norms.append([got.item(), want.item()])
        opt.step()
        ropt.step()
    if kind == "zero":                  # the optimizer's states, consolidated on rank 0
        opt.consolidate_state_dict(0)
        if k == 0:
            a, b = opt.state_dict(), ropt.state_dict()
            ropt.opt_state = max((a["state"][i][nm] - b["state"][i][nm]).abs().max().item()
                                 for i in b["state"] for nm in b["state"][i])
    full = w.full_state_dict()
    ref.opt_state = getattr(ropt, "opt_state", None)
    return w, ref, norms, max((full[n_] - v).abs().max().item()
                              for n_, v in ref.state_dict().items())


def state_dicts(w, ref):
    """The wrapper's state_dict round trip, a plain model's loaded, a bad key refused."""
    sd = w.state_dict()
    out = {"keys": sorted(sd)[:2], "dist": isinstance(next(iter(sd.values())), wb.DistTensor)}
    full = {k: v.full() if isinstance(v, wb.DistTensor) else v for k, v in sd.items()}
    prefix = "module." if isinstance(w, wb.DistributedDataParallel) else ""
    ref_full = {prefix + k: v for k, v in ref.state_dict().items()}
    w.load_state_dict(sd)
    other = make(seed=7)
    w.load_state_dict({prefix + k: v for k, v in other.state_dict().items()})
    out["plain_loaded"] = all(torch.equal(w.full_state_dict()[k], v)
                              for k, v in other.state_dict().items())
    out["round_trip"] = all(k in full for k in ref_full)
    try:
        w.load_state_dict({})
        out["strict"] = None
    except RuntimeError as e:
        out["strict"] = "Missing key(s)" in str(e)
    return out


class SumLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = make()

    def forward(self, ids, y):
        return F.cross_entropy(self.net(ids).reshape(-1, 12), y.reshape(-1), reduction="sum")


def sum_loss_grads(mesh, n, k):
    from workbench.parallel.strategies.laid_out_whole import storage
    torch.manual_seed(0)
    w = wb.DistributedDataParallel(SumLoss(), mesh)
    ids, y = data(1)[0]
    if mesh is None:
        w(ids.chunk(n)[k], y.chunk(n)[k]).backward()
        return {nm: p.grad for nm, p in w.named_parameters() if p.grad is not None}
    w(wb.shard_tensor(ids, mesh, ["S(0)"]), wb.shard_tensor(y, mesh, ["S(0)"])).backward()
    # rank k's row of the rows (a user's p.grad[k] is the module's row: habits13)
    return {nm: storage(p.grad)[k] for nm, p in w.named_parameters() if p.grad is not None}


def tensor_parallel(n, k):
    """A parallelized MLP on a 2-process tp mesh: wb.clip_grad_norm_ against one device,
    its state dict round trip, a plain model's loaded, .double()."""
    mesh = wb.distributed.mesh(n, ["tp"])

    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6))
    m, ref = wb.parallelize(mlp(), mesh, {"0": "colwise", "2": "rowwise"}), mlp()
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(1))
    m(wb.shard_tensor(x, mesh, ["R"])).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    got = wb.clip_grad_norm_(m.parameters(), 0.5).item()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5).item()
    grads = max((p.grad.full() - q.grad).abs().max().item()
                for p, q in zip(m.parameters(), ref.parameters()))
    sd = m.state_dict()
    other = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6))
    m.load_state_dict(other.state_dict())
    loaded = all(torch.equal(m.state_dict()[nm].full(), v)
                 for nm, v in other.state_dict().items())
    m.load_state_dict(sd)
    m.double()
    y = m(wb.shard_tensor(x.double(), mesh, ["R"])).full()
    return {"rank": k, "tp_norm": [got, want], "tp_grads": grads, "tp_loaded": loaded,
            "tp_double": (y - other.double()(x.double())).abs().max().item()}


def ddp_names_against_torchs(n, k):
    """torch's own DDP and wb's on the process group (and wb's on simulated ranks): the
    names of named_parameters / named_buffers / named_modules / state_dict, and each
    one's state_dict loaded into the other (values equal)."""
    def bn():
        torch.manual_seed(k)                # different per rank: DDP broadcasts rank 0's
        return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
    td, wd = nn.parallel.DistributedDataParallel(bn()), wb.DistributedDataParallel(bn(), None)
    sim = wb.DistributedDataParallel(bn(), wb.Mesh.grid(n, ["dp"]))

    def names(m):
        return [[x for x, _ in m.named_parameters()], [x for x, _ in m.named_buffers()],
                [x for x, _ in m.named_modules()], list(m.state_dict())]
    torch.manual_seed(99)
    other = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
    td.load_state_dict({"module." + x: v for x, v in other.state_dict().items()})
    wd.load_state_dict(td.state_dict())                     # torch DDP's checkpoint into ours
    into_ours = all(torch.equal(wd.state_dict()[x], v) for x, v in td.state_dict().items())
    td2 = nn.parallel.DistributedDataParallel(bn())
    td2.load_state_dict(wd.state_dict())                    # ours into torch DDP
    into_torch = all(torch.equal(td2.state_dict()[x], v) for x, v in wd.state_dict().items())
    return {"rank": k, "names_torch": names(td), "names_wb": names(wd),
            "names_sim": names(sim), "into_ours": into_ours, "into_torch": into_torch}


def main():
    wb.distributed.init(timeout_s=60)
    n, k = torch.distributed.get_world_size(), torch.distributed.get_rank()
    for kind in ("ddp", "zero", "fsdp", "fsdp_units"):
        for norm_type in (2.0, math.inf):
            w, ref, norms, diff = clipped_training(kind, norm_type, n, k)
            row = {"rank": k, "case": [kind, norm_type], "norms": norms, "params": diff,
                   "opt_state": ref.opt_state}
            if norm_type == 2.0 and kind != "zero":
                row.update(state_dicts(w, ref))
            print(json.dumps(row), flush=True)
    got = sum_loss_grads(None, n, k)
    sim = sum_loss_grads(wb.Mesh.grid(n, ["dp"]), n, k)
    print(json.dumps({"rank": k, "sum_loss": max((got[nm] - sim[nm]).abs().max().item()
                                                 for nm in sim)}), flush=True)
    print(json.dumps(tensor_parallel(n, k)), flush=True)
    print(json.dumps(ddp_names_against_torchs(n, k)), flush=True)
    wb.distributed.shutdown()


if __name__ == "__main__":
    main()
