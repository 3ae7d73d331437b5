"""Run under torchrun (gloo, 2 processes): tests/test_fixlist11.py's torchrun case; every
process prints one JSON line per case (with its rank).  Each case is a function of
``distributed``, so the test runs the same program on simulated ranks.

* ``zero3_clip``: tiny, ``Hybrid(dp=2, zero=3)``, one step with
  ``strategy.clip_grad_norm_``: the norm, the parameters' checksum, the modeled step and
  the collectives the step's trace recorded (name, label, ranks; torchrun: this
  process's groups).
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import workbench as wb  # noqa: E402
from workbench.models import get_batch, get_config  # noqa: E402
from workbench.recipes.hybrid import Hybrid  # noqa: E402
from workbench.sim_mesh.trace import trace  # noqa: E402


def zero3_clip(distributed):
    cfg = get_config("tiny")
    h = Hybrid(dp=2, zero=3, distributed=distributed)
    torch.manual_seed(0)
    model = h.build_model(cfg, 0)
    opts = h.build_optimizer(model, 1e-3, 0.0)
    x, y = get_batch(cfg, 8, 0, 0)
    with trace() as tr:
        h.forward_backward(model, x, y)
        norm = h.clip_grad_norm_(opts, 0.01)
        h.optimizer_step(opts)
    params = sum(float(v.full().double().sum()) if isinstance(v, wb.DistTensor) else 0.0
                 for v in model.state_dict().values())
    return {"norm": float(norm), "params": params, "modeled_ms": round(tr.time() * 1e3, 6),
            "collectives": sorted([e.name, e.label, list(e.ranks)] for e in tr.collectives())}


if __name__ == "__main__":
    wb.distributed.init(timeout_s=60)
    rank = wb.distributed.rank()
    rows = [{"case": "zero3_clip", **zero3_clip(True)}]
    for r in rows:
        print(json.dumps({"rank": rank, **r}), flush=True)
    torch.distributed.barrier()
    wb.distributed.shutdown()
