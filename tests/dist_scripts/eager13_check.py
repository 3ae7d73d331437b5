"""Run under torchrun (gloo, 4 processes): tests/test_eager13.py's MLP (column- then
row-parallel linear, the row-parallel one with a replicated bias) on a 2 x 2 ("dp", "tp")
mesh.  Rank 0 prints one JSON line: each input's gradient's largest difference from one
device's, and the backward collectives it recorded."""
import json

import torch
import torch.nn.functional as F

import workbench as wb

R, S = wb.Replicate, wb.Shard
MLP = [((8, 16), [S(0), R()]), ((32, 16), [R(), S(0)]), ((32,), [R(), S(0)]),
       ((16, 32), [R(), S(1)]), ((16,), [R(), R()])]


def _v(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64)


def _mlp(x, w1, b1, w2, b2):
    return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)


def main():
    wb.distributed.init(timeout_s=120)
    mesh = wb.distributed.mesh((2, 2), ["dp", "tp"])
    xs = [wb.shard_tensor(_v(s, k), mesh, ps).requires_grad_() for k, (s, ps) in
          enumerate(MLP)]
    with wb.trace("a100") as tr:
        out = _mlp(*xs)
        n = len(tr.collectives())
        G = wb.shard_tensor(_v(tuple(out.shape), 99), mesh, [R(), R()])
        (out * G).sum().backward()
    bwd = [[e.name, e.args.get("mesh_dim"), e.args.get("buffer_bytes")]
           for e in tr.collectives()[n:]]
    ys = [_v(s, k).requires_grad_() for k, (s, _) in enumerate(MLP)]
    o = _mlp(*ys)
    (o * _v(tuple(o.shape), 99)).sum().backward()
    errs = [float((x.grad.full() - y.grad).abs().max()) for x, y in zip(xs, ys)]
    if wb.distributed.rank() == 0:
        print(json.dumps({"rank": 0, "case": "mlp", "errs": errs, "bwd": bwd}), flush=True)
    torch.distributed.barrier()
    wb.distributed.shutdown()


if __name__ == "__main__":
    main()
