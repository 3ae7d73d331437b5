"""Run under torchrun (gloo): CNN ops (ops_table/conv.py, pool.py, batch_norm.py,
group_norm.py) on the process group, each rank holding its shard of the batch or of the
channels: values, gradients and batch norm's running statistics against one device. Every
rank prints one JSON line."""
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workbench as wb  # noqa: E402


def close(a, b):
    return bool(torch.allclose(a, b, rtol=1e-5, atol=1e-6))


def main():
    wb.distributed.init(timeout_s=60)
    n, k = torch.distributed.get_world_size(), torch.distributed.get_rank()
    mesh = wb.distributed.mesh(n, ["dp"])
    g = torch.Generator().manual_seed(0)
    X = torch.randn(2 * n, 2 * n, 6, 6, generator=g, dtype=torch.float64)
    W = torch.randn(4, 2 * n, 3, 3, generator=g, dtype=torch.float64)
    ok = {}

    def net(x, w, rm, rv):
        y = F.conv2d(x, w, padding=1)
        y = F.batch_norm(y, rm, rv, training=True, momentum=0.3)
        y = F.max_pool2d(F.relu(y), 2)
        return F.adaptive_avg_pool2d(F.group_norm(y, 2), 1)

    for name, ps in (("batch", ["S(0)"]), ("channels", ["S(1)"])):
        rm0, rv0, rm1, rv1 = (f(4, dtype=torch.float64) for f in (torch.zeros, torch.ones) * 2)
        xr, wr = X.clone().requires_grad_(), W.clone().requires_grad_()
        ref = net(xr, wr, rm0, rv0)
        x = wb.shard_tensor(X, mesh, ps).requires_grad_()
        w = W.clone().requires_grad_()
        out = net(x, w, rm1, rv1)
        ok[name] = close(out.full(), ref.detach())
        (ref * ref).sum().backward()
        (out * out).sum().backward()
        ok[name + "_grads"] = close(x.grad.full(), xr.grad) and close(w.grad, wr.grad)
        ok[name + "_running"] = close(rm1, rm0) and close(rv1, rv0)
    print(json.dumps({"rank": k, **ok}), flush=True)
    wb.distributed.shutdown()


if __name__ == "__main__":
    main()
