"""Under torchrun (2 gloo processes, a 1-d mesh): the MAX / MIN all-reduces and
reduce-scatters of workbench keep a NaN as one device and the simulator do, and complex
conj / real / imag / angle of a partial value (tests/test_sweep18.py holds each row to
the simulator's or one device's answer).  Each process prints one JSON row per case
(``str`` of each float: inf / nan kept)."""
import json
import math

import torch
import torch.distributed as dist
from torch import nn

import workbench as wb

NAN = float("nan")
# a P(max) / P(min) value's parts: NaN at element 0 on rank 0, at element 1 on rank 1
PARTS = {0: [NAN, 1.0, 2.0, 3.0, 4.0], 1: [0.0, NAN, 5.0, -1.0, 2.0]}


def _s(t):
    return [str(v) for v in torch.as_tensor(t).reshape(-1).tolist()]


def _row(rank, case, **kw):
    print(json.dumps({"rank": rank, "case": case, **kw}), flush=True)


def reduce_scatters(rank, mesh):
    """P(max) / P(min) -> S(0): a reduce-scatter (4 elements: even; 5: uneven, padded)."""
    for op in ("max", "min"):
        for n in (4, 5):
            x = torch.tensor(PARTS[rank][:n], dtype=torch.float64)
            d = wb.DistTensor.from_local(x, mesh, [wb.Partial(op)])
            s = d.redistribute(mesh, [wb.Shard(0)])
            _row(rank, f"rs_{op}_{n}", value=_s(s.full()))


def clip_inf(rank, mesh):
    """clip_grad_norm_(norm_type=inf) of a DistTensor parameter sharded S(0) whose gradient
    holds NaN in one rank's shard only (row ``bad``): one device's total is NaN."""
    for bad in (0, 3):
        w = wb.distribute_tensor(torch.ones(4, 3, dtype=torch.float64), mesh, [wb.Shard(0)])
        w.requires_grad_(True)
        c = torch.ones(4, 3, dtype=torch.float64)
        c[bad, 1] = NAN
        (w * c).sum().backward()
        total = torch.nn.utils.clip_grad_norm_([w], 1.0, norm_type=math.inf)
        _row(rank, f"clip_inf_{bad}", total=_s(total))


def fully_shard_inf(rank, mesh):
    """torch's clip_grad_norm_(inf) over fully_shard's gradient shards (partial norms),
    NaN in one rank's shard only (output row ``bad`` of the weight)."""
    for bad in (0, 3):
        torch.manual_seed(0)
        m = nn.Linear(3, 4).double()
        wb.fully_shard(m, mesh=mesh)
        c = torch.ones(2, 4, dtype=torch.float64)
        c[:, bad] = NAN
        (m(torch.ones(2, 3, dtype=torch.float64)) * c).sum().backward()
        total = torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0, norm_type=math.inf)
        _row(rank, f"fully_shard_inf_{bad}", total=_s(total))


def ddp_replicas(rank, mesh):
    """DDP.check_replicas: a weight that turned NaN on one rank only differs; the same NaN
    on both ranks does not."""
    for case, on in (("one", (1,)), ("both", (0, 1))):
        torch.manual_seed(0)
        ddp = wb.DistributedDataParallel(nn.Linear(3, 2), mesh)
        if rank in on:
            with torch.no_grad():
                ddp.module.weight[0, 1] = NAN
        try:
            ddp.check_replicas()
            _row(rank, f"ddp_nan_{case}", raised="")
        except RuntimeError as e:
            _row(rank, f"ddp_nan_{case}", raised=type(e).__name__)


def complex_partials(rank, mesh):
    """conj / real / imag / angle / abs of a complex P(sum) (parts differ per rank), then
    gathered: one device's answer on the summed value."""
    g = torch.Generator().manual_seed(10 + rank)
    z = torch.complex(torch.randn(3, 2, generator=g, dtype=torch.float64),
                      torch.randn(3, 2, generator=g, dtype=torch.float64))
    d = wb.DistTensor.from_local(z, mesh, [wb.Partial("sum")])
    fs = {"conj": lambda t: t.conj(), "real": lambda t: t.real, "imag": lambda t: t.imag,
          "angle": lambda t: t.angle(), "abs": lambda t: t.abs(),
          "conj_physical": lambda t: torch.conj_physical(t)}
    for name, f in fs.items():
        out = f(d)
        full = out.full().resolve_conj()
        if full.is_complex():
            full = torch.view_as_real(full)
        _row(rank, f"complex_{name}", value=_s(full), placements=[str(p) for p in out.placements])
    whole = d.full()
    _row(rank, "complex_whole", value=_s(torch.view_as_real(whole)))
    # a conjugate view (the lazy bit on the local) gathered, sliced and all-to-all'd: the
    # collectives read the conjugated values, not the memory behind the bit
    s = wb.distribute_tensor(whole.detach(), mesh, [wb.Shard(0)])
    for name, f in {"gather": lambda t: t.conj().full(),
                    "slice": lambda t: t.redistribute(mesh, [wb.Replicate()]).conj()
                    .redistribute(mesh, [wb.Shard(1)]).full(),
                    "all_to_all": lambda t: t.conj().redistribute(mesh, [wb.Shard(1)]).full(),
                    "imag": lambda t: t.conj().imag.full()}.items():
        out = f(s).resolve_neg().resolve_conj()
        _row(rank, f"conj_{name}", value=_s(torch.view_as_real(out) if out.is_complex() else out))


def main():
    wb.distributed.init(timeout_s=60)
    rank = dist.get_rank()
    mesh = wb.distributed.mesh((2,), ["dp"])
    for part in (reduce_scatters, clip_inf, fully_shard_inf, ddp_replicas, complex_partials):
        try:
            part(rank, mesh)
        except Exception as e:          # noqa: BLE001  (reported as a row, not hidden)
            _row(rank, part.__name__, raised=f"{type(e).__name__}: {e}"[:300])
    wb.distributed.shutdown()


if __name__ == "__main__":
    main()
