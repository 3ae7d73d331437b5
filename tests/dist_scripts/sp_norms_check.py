"""Run under torchrun (gloo, 4 processes): sp_norms_model.py's program on a dp 2 x tp 2
mesh with sequence parallelism, one process per rank; rank 0 saves what ``run`` returned
(and ``run_no_sync``'s, under "no_sync") to the path given (tests/test_sp_norms_torchrun.py holds it to the simulated ranks' and
one device's)."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sp_norms_model import run, run_no_sync  # noqa: E402
import workbench as wb  # noqa: E402
from workbench.recipes.hybrid import Hybrid  # noqa: E402
from workbench.sim_mesh import backends  # noqa: E402


def main():
    backends.init(timeout_s=120)
    out = run(Hybrid(dp=2, tp=2, sp=True, distributed=True))
    out["no_sync"] = run_no_sync(wb.distributed.mesh((2, 2), ["dp", "tp"]))
    if backends.rank() == 0:
        torch.save(out, sys.argv[1])
    torch.distributed.barrier()
    backends.shutdown()


if __name__ == "__main__":
    main()
