"""Run under torchrun (gloo, 4 processes): one SGD step of tp_optim_model.py's program on a
2 x 2 ("dp", "tp") mesh under wb.DistributedDataParallel / wb.FullyShardedDataParallel /
wb.fully_shard, against one device's step (SGD: a gradient off by a factor shows; AdamW
hides it, its update being nearly scale-free).  Rank 0 prints one JSON line per wrapper:
the parameters whose weights differ by more than 1e-6, with the difference."""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workbench as wb  # noqa: E402
from tp_optim_model import full_weights, make, steps, wrapped  # noqa: E402


def main():
    wb.distributed.init(timeout_s=120)
    mesh = wb.distributed.mesh((2, 2), ["dp", "tp"])
    m = make()
    steps(m, torch.optim.SGD(m.parameters(), lr=0.5), None, range(1))
    want = full_weights(m)
    for kind in ("ddp", "fsdp", "fully_shard"):
        w, _ = wrapped(kind, mesh)
        steps(w, torch.optim.SGD(w.parameters(), lr=0.5), mesh, range(1))
        got = full_weights(w)
        errs = {k: float((got[k] - v).abs().max()) for k, v in want.items()}
        if wb.distributed.rank() == 0:
            print(json.dumps({"kind": kind, "off": {k: e for k, e in errs.items() if e > 1e-6}}),
                  flush=True)
    torch.distributed.barrier()
    wb.distributed.shutdown()


if __name__ == "__main__":
    main()
