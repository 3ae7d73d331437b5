"""Run under torchrun (gloo): the data-dependent ops (ops_table/datadep.py) on the process
group, each rank holding its own shard: values and gradients against one device. Every
rank prints one JSON line."""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workbench as wb  # noqa: E402


def main():
    wb.distributed.init(timeout_s=60)
    n, k = torch.distributed.get_world_size(), torch.distributed.get_rank()
    mesh = wb.distributed.mesh(n, ["dp"])
    g = torch.Generator().manual_seed(0)
    X = torch.randn(4 * n, 3, generator=g)
    M = X > 0
    ok = {}
    x = wb.shard_tensor(X, mesh, ["S(0)"]).requires_grad_()
    xr = X.clone().requires_grad_()
    m = wb.shard_tensor(M, mesh, ["S(1)"] if 3 % n == 0 else ["S(0)"])
    y, yr = torch.masked_select(x, m), torch.masked_select(xr, M)
    ok["masked_select"] = torch.equal(y.full(), yr.detach())
    (y * 2).sum().backward()
    (yr * 2).sum().backward()
    ok["masked_select_grad"] = torch.equal(x.grad.full(), xr.grad)
    ok["getitem"] = torch.equal(x[m].full(), X[M])
    ok["nonzero"] = torch.equal(torch.nonzero(m).full(), torch.nonzero(M))
    ids = (X * 2).round().long()
    u = torch.unique(wb.shard_tensor(ids, mesh, ["S(0)"]), return_inverse=True,
                     return_counts=True, dim=0)
    ok["unique"] = all(torch.equal(a.full(), b)
                       for a, b in zip(u, torch.unique(ids, return_inverse=True,
                                                        return_counts=True, dim=0)))
    print(json.dumps({"rank": k, **ok}), flush=True)
    wb.distributed.shutdown()


if __name__ == "__main__":
    main()
