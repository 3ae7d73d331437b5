"""Run under torchrun (gloo, 4 processes, a (2, 2) dp x tp mesh, init timeout_s=8):
the same seeded programs as tests/test_dist10.py runs on simulated ranks (:data:`PROGRAMS`),
each process printing its rank's result, and reads one process makes alone.  JSON rows:

* one per program of :data:`PROGRAMS` (``case`` its name): the output's placements, this
  process's local shard and the full value (read by every process);
* ``lone_mul``: rank 0 alone multiplies a partial sum by a factor holding inf in some
  processes' shards (``if rank == 0: print((x * f).sum())``): the processes decide
  together whether to reduce it first (dispatch._unsafe_factor), so the lone reader gets
  agree's error naming the fix after timeout_s, no collective begun; the others wait on
  the store meanwhile;
* ``after_lone``: then every process runs the same product: one device's value, the
  simulator's placements (the job went on);
* ``tp_fs`` / ``tp_ddp``: :func:`hybrid`'s training (every process's);
* ``lone_replicated``: rank 0 alone reads a replicated loss (``float``, ``.item()``, a
  format, ``repr``): no collective, so it works; ``loss``: every process's value;
* ``lone_grad_norm`` then ``lone_item`` (last, then every process ends with
  ``os._exit(0)``): rank 0 alone reads ``float(p.grad.norm())`` of a ``fully_shard``
  parameter, then ``x.sum().item()`` of a partial sum: the first's all-reduce waits for
  peers that never come (torch's ``_NormPartial`` and ``full_tensor()`` wait there too)
  and ends in init()'s timeout, which gloo does not survive (the second fails at once):
  errors naming the fix (rank_grads._full, dist_tensor.full -> agreed_reads.reading)."""
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import workbench as wb  # noqa: E402

TIMEOUT_S = 8        # init()'s: each lone read waits this long


def parts():
    """Every dp coordinate's part of x (a partial sum over dp; its sum is :func:`whole`)."""
    return [torch.tensor([1., -2., 3., 4.]), torch.tensor([0.5, 2., -1., 0.25])]


def whole():
    a, b = parts()
    return a + b


def _x(mesh, build, partial_inf=False):
    """x [Partial, Replicate]: rank r holds its dp coordinate's part (the dp 1 part holds
    inf at index 1 where ``partial_inf``)."""
    ps = parts()
    if partial_inf:
        ps[1][1] = math.inf
    return build(lambda r: ps[mesh.coordinate(r)[0]].clone(), [wb.Partial(), wb.Replicate()])


def _f(mesh, values):
    """A factor [Replicate, Shard(0)]: tp column 1's shard holds indices 2 and 3."""
    return wb.distribute_tensor(torch.tensor(values), mesh, [wb.Replicate(), wb.Shard(0)])


# name -> (program(mesh, build) -> DistTensor, its value on one device)
PROGRAMS = {
    # inf only in tp column 1's shard: every process reduces x first (the simulator's)
    "mul_inf_col1": (lambda m, b: _x(m, b) * _f(m, [1., 2., math.inf, -1.]),
                     lambda: whole() * torch.tensor([1., 2., math.inf, -1.])),
    "div_zero_col1": (lambda m, b: _x(m, b) / _f(m, [1., 2., 0., -1.]),
                      lambda: whole() / torch.tensor([1., 2., 0., -1.])),
    # no inf anywhere: the product stays partial on every process
    "mul_finite": (lambda m, b: _x(m, b) * _f(m, [1., 2., 3., -1.]),
                   lambda: whole() * torch.tensor([1., 2., 3., -1.])),
    # the partial sum's own part holds inf on the dp 1 processes only: x * x (vector_norm's)
    "square_partial_inf": (lambda m, b: _x(m, b, True) * _x(m, b, True),
                           lambda: (parts()[0] + torch.tensor([0.5, math.inf, -1., 0.25])) ** 2),
}


def hybrid(kind: str, mesh) -> dict:
    """A user's hybrid training program on the (2, 2) dp x tp mesh, the same on simulated
    ranks and on processes: an MLP with dropout under ColwiseParallel / RowwiseParallel
    on the whole mesh, then ``fully_shard(mesh=mesh["dp"])`` (``kind`` "tp_fs") or
    ``parallelize`` + ``DistributedDataParallel(dim="dp")`` ("tp_ddp"); the global batch
    sharded over dp; three AdamW steps with torch's clip_grad_norm_.  The clip's total
    norms, every parameter's sum after, and the generator's next draw (dropout's draws
    advance it alike)."""
    from torch import nn
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.25), nn.Linear(16, 8))
    wb.parallelize_module(m, mesh, {"0": wb.ColwiseParallel(), "3": wb.RowwiseParallel()})
    if kind == "tp_fs":
        w = wb.fully_shard(m, mesh=mesh["dp"])
    else:
        wb.parallelize(m, mesh)
        w = wb.DistributedDataParallel(m, mesh, dim="dp")
    opt = torch.optim.AdamW(w.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(5)
    norms = []
    for _ in range(3):
        x, y = (wb.shard_tensor(torch.randn(8, 8, generator=g), mesh,
                                [wb.Shard(0), wb.Replicate()]) for _ in range(2))
        opt.zero_grad()
        ((w(x) - y) ** 2).mean().backward()
        if kind == "tp_ddp":
            w.finish_gradient_synchronization()
        norms.append(float(torch.nn.utils.clip_grad_norm_(w.parameters(), 0.5)))
        opt.step()
    with torch.no_grad():
        sums = [float((p.full() if isinstance(p, wb.DistTensor) else p).double().sum())
                for p in m.parameters()]     # (fully_shard's: parameters that read whole)
    return {"norms": norms, "sums": sums, "rng": torch.rand(1).item()}


HYBRID = ("tp_fs", "tp_ddp")


def result(y) -> dict:
    """What a program's output is, on this process (the simulator: on rank ``rank``)."""
    return {"placements": str(y.placements), "full": y.full().tolist()}


def main():
    wb.distributed.init(timeout_s=TIMEOUT_S)
    import torch.distributed as dist
    k = dist.get_rank()
    mesh = wb.distributed.mesh((2, 2), ["dp", "tp"])

    def build(local_of, placements):
        return wb.DistTensor.from_local(local_of(k), mesh, placements)

    rows = []
    for name, (prog, _) in PROGRAMS.items():
        y = prog(mesh, build)
        rows.append({"case": name, "local": y.to_local().tolist(), **result(y)})
    store = dist.distributed_c10d._get_default_store()
    x, f = _x(mesh, build), _f(mesh, [1., 2., math.inf, -1.])
    if k == 0:
        t0 = time.monotonic()
        try:
            out = float((x * f).sum())
        except Exception as e:  # noqa: BLE001  (what raised, for the test to read)
            out = f"{type(e).__name__}: {e}"
        rows.append({"case": "lone_mul", "out": out, "s": round(time.monotonic() - t0, 1)})
        store.set("dist10/lone_mul", "1")
    else:
        from datetime import timedelta
        store.wait(["dist10/lone_mul"], timedelta(seconds=120))
    y = x * f
    rows.append({"case": "after_lone", "local": y.to_local().tolist(), **result(y)})
    for kind in HYBRID:
        rows.append({"case": kind, **hybrid(kind, mesh)})
    # reads that need no collective work on one process alone: a replicated loss
    loss = (x * _f(mesh, [1., 2., 3., -1.])).sum().redistribute(mesh, [wb.Replicate()] * 2)
    if k == 0:
        rows.append({"case": "lone_replicated", "out": [float(loss), loss.item(),
                                                        f"{loss:.4f}", repr(loss)]})
    rows.append({"case": "loss", "out": float(loss)})
    dist.barrier()
    # a fully_shard model's gradients (FSDP2's: a norm of the shards is partial, its value
    # an all-reduce)
    from torch import nn
    torch.manual_seed(0)
    fs = wb.fully_shard(nn.Sequential(nn.Linear(3, 6), nn.GELU(), nn.Linear(6, 3)))
    fs(torch.randn(2, 3)).pow(2).mean().backward()
    grad = next(iter(fs.parameters())).grad
    # last (torch.distributed's process group does not outlive a timed-out collective):
    # rank 0 alone reads a gradient's norm, then a partial sum's value (the collective
    # waits for peers that never come, as torch's does): errors naming the fix, the first
    # after timeout_s, the second at once (gloo closed the pairs)
    s = x.sum()
    for r in rows:
        print(json.dumps({"rank": k, **r}), flush=True)
    if k == 0:
        for case, read in (("lone_grad_norm", lambda: float(grad.norm())),
                           ("lone_item", lambda: s.item())):
            t0 = time.monotonic()
            try:
                out = read()
            except Exception as e:  # noqa: BLE001
                out = f"{type(e).__name__}: {e}"
            print(json.dumps({"rank": k, "case": case, "out": out,
                              "s": round(time.monotonic() - t0, 1)}), flush=True)
        store.set("dist10/lone_item", "1")
    else:
        from datetime import timedelta
        store.wait(["dist10/lone_item"], timedelta(seconds=120))
    sys.stdout.flush()
    os._exit(0)          # no barrier, no destroy_process_group: the group is lost


if __name__ == "__main__":
    main()
