"""Under torchrun (2 gloo processes, a 1-d mesh): the gradient of ``P(max)`` / ``P(min)``
parts reduced to ``Replicate`` when the upstream gradient holds inf and NaN
(tests/test_sweep17.py holds it to the simulator's and torch's).  Each process prints one
JSON row per op: its part's gradient (``str`` of each float: inf / nan kept)."""
import json

import torch
import torch.distributed as dist

import workbench as wb

PARTS = {0: [1.0, 3.0, 2.0, 5.0, float("nan")], 1: [2.0, 3.0, 1.0, -1.0, 0.0]}
G = [float("inf"), float("nan"), -float("inf"), float("inf"), 2.0]


def main():
    wb.distributed.init(timeout_s=60)
    rank = dist.get_rank()
    mesh = wb.distributed.mesh((2,), ["a"])
    for op in ("max", "min"):
        x = torch.tensor(PARTS[rank], dtype=torch.float64, requires_grad=True)
        d = wb.DistTensor.from_local(x, mesh, [wb.Partial(op)])
        full = d.redistribute(mesh, [wb.Replicate()])
        full.to_local().backward(torch.tensor(G, dtype=torch.float64))
        print(json.dumps({"rank": rank, "case": op, "grad": [str(v) for v in x.grad.tolist()],
                          "value": [str(v) for v in full.to_local().tolist()]}), flush=True)
    wb.distributed.shutdown()


if __name__ == "__main__":
    main()
