"""A partial sum times a factor that holds inf on some processes only (divided by one that
holds 0), on torch.distributed (torchrun, gloo, 4 processes, a (2, 2) mesh): x is
[Partial, Replicate], the factor [Replicate, Shard(0)], so the product keeps x partial on
dp and the inf sits in the tp-column-1 processes' shard.  The dispatcher reduces a partial
sum before such a factor (dispatch._unsafe_factor); the processes must agree on it (they
read their own shards): else the column-1 processes hold a replicated product and the
others a partial one, and the next read's collectives do not pair."""
import json
import math

import torch

import workbench as wb


def main():
    wb.distributed.init(timeout_s=20)
    k = torch.distributed.get_rank()
    mesh = wb.distributed.mesh((2, 2), ["dp", "tp"])
    dp = mesh.coordinate(k)[0]
    parts = [torch.tensor([1., -2., 3., 4.]), torch.tensor([0.5, 2., -1., 0.25])]
    whole = parts[0] + parts[1]
    for case, op, f in (("mul", torch.mul, torch.tensor([1., 2., math.inf, -1.])),
                        ("div", torch.div, torch.tensor([1., 2., 0., -1.]))):
        x = wb.DistTensor.from_local(parts[dp].clone(), mesh, [wb.Partial(), wb.Replicate()])
        fd = wb.distribute_tensor(f, mesh, [wb.Replicate(), wb.Shard(0)])
        try:
            y = op(x, fd)
            got = y.full()
            ok, err = bool(torch.equal(got, op(whole, f))), ""
            placements = str(y.placements)
        except Exception as e:  # noqa: BLE001 (reported to the test)
            ok, err, placements = False, f"{type(e).__name__}: {e}"[:300], ""
        print(json.dumps({"rank": k, "case": case, "ok": ok, "err": err,
                          "placements": placements}), flush=True)
    wb.distributed.shutdown()


if __name__ == "__main__":
    main()
