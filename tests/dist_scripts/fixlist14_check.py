"""Run under torchrun (gloo, 4 processes): the programs of tests/test_fixlist14.py on
torch.distributed.  Every rank prints one JSON line per program: the collectives its
trace recorded in backward (kind, bytes, label) and the gradient's largest difference from
plain PyTorch.  The test runs the same programs on simulated ranks (written once, here:
``mesh`` is a simulated Mesh or a distributed one)."""
import json

import torch

import workbench as wb
from workbench.parallel import storage

R, S = wb.Replicate, wb.Shard
PROFILE = "a100"


def _values(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64)


def _run(fn, level, x, *ws):
    """Forward and backward of ``fn`` (eager, or compiled at ``level``): the backward's
    collectives this rank took part in (rank 0 on the simulator), and x's gradient."""
    f = fn if level == "eager" else wb.compile(fn, x, *ws, level=level, profile=PROFILE)
    rank = wb.distributed.rank() if storage.holds_own(x.mesh) else 0
    with wb.trace(PROFILE) as tr:
        out = f(x, *ws)
        n = len(tr.events)
        out.backward()
    return ([[e.name, int(e.args["buffer_bytes"]), e.label] for e in tr.events[n:]
             if e.stream == "comm" and rank in e.ranks], x.grad.full())


def resharded(mesh, level):
    """x [S(0)] on 4 ranks, wb.reshard to [R], read by two matmuls with column-sharded
    weights (every rank its own view: Partial gradients): one reduce-scatter back."""
    def fn(x, w1, w2):
        xr = wb.reshard(x, mesh, [R()])
        return ((xr @ w1) * (xr @ w2)).sum()
    X, W1, W2 = _values((4, 6), 0), _values((6, 8), 1), _values((6, 8), 2)
    x = wb.shard_tensor(X, mesh, [S(0)]).requires_grad_()
    ws = [wb.shard_tensor(W, mesh, [S(1)]) for W in (W1, W2)]
    comm, grad = _run(fn, level, x, *ws)
    xs = X.clone().requires_grad_()
    ((xs @ W1) * (xs @ W2)).sum().backward()
    return comm, float((grad - xs.grad).abs().max())


def sliced_o0(mesh, level):
    """tests/test_tdreshard4.py's case compiled at O0 (each reader's reshard kept, the
    second reading the first copy: compile/lower.execute_program)."""
    def fn(x, w1, w2):
        return ((x @ w1) * (x @ w2)).sum()
    X, W1, W2 = _values((4, 8), 0), _values((8, 32), 1), _values((8, 32), 2)
    x = wb.shard_tensor(X, mesh, [R(), S(0)]).requires_grad_()
    ws = [wb.shard_tensor(W, mesh, [S(0), S(1)]) for W in (W1, W2)]
    comm, grad = _run(fn, level, x, *ws)
    xs = X.clone().requires_grad_()
    ((xs @ W1) * (xs @ W2)).sum().backward()
    return comm, float((grad - xs.grad).abs().max())


# (name, mesh shape, dim names, program, levels)
PROGRAMS = [("resharded", (4,), ("tp",), resharded, ("eager", "O0", "O1")),
            ("sliced_o0", (2, 2), ("dp", "tp"), sliced_o0, ("O0",))]


def main():
    wb.distributed.init(timeout_s=120)
    rank = wb.distributed.rank()
    meshes = {(shape, names): wb.distributed.mesh(shape, names)
              for _, shape, names, _, _ in PROGRAMS}
    for name, shape, names, fn, levels in PROGRAMS:
        for level in levels:
            try:
                comm, diff = fn(meshes[(shape, names)], level)
                row = {"case": name, "level": level, "rank": rank, "comm": comm, "diff": diff}
            except Exception as e:       # noqa: BLE001 (reported, the test fails on it)
                row = {"case": name, "level": level, "rank": rank,
                       "raised": f"{type(e).__name__}: {e}"}
            print(json.dumps(row), flush=True)
    wb.distributed.shutdown()


if __name__ == "__main__":
    main()
