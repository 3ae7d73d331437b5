"""Run under torchrun (gloo, 4 processes, 2 x 2 dp x tp): wb.FullyShardedDataParallel over
tp_optim_model.py's program; after one step, ``model.<p>.data.mul_(2)`` through the
module's parameter (named_parameters) and through its attribute after a forward, as
one device does, and requires_grad_(False) on the attribute after a step; rank 0 prints one JSON line per way: what happened (raised, or the
parameters that differ from one device's after one more step)."""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workbench as wb  # noqa: E402
from tp_optim_model import adamw, full_weights, make, steps, wrapped  # noqa: E402


def main():
    wb.distributed.init(timeout_s=120)
    mesh = wb.distributed.mesh((2, 2), ["dp", "tp"])
    for how in ("named", "attribute", "freeze attribute"):
        ref = make()
        ropt = adamw(ref.parameters())
        steps(ref, ropt, None, range(1))
        with torch.no_grad():
            if how == "freeze attribute":
                ref.blocks[0].up.weight.requires_grad_(False)
            else:
                ref.blocks[0].up.weight.data.mul_(2)
        steps(ref, ropt, None, range(1, 2))
        want = full_weights(ref)
        w, opt = wrapped("fsdp", mesh)
        steps(w, opt, mesh, range(1))
        m = w.module
        p = dict(m.named_parameters())["blocks.0.up.weight"] if how == "named" \
            else m.blocks[0].up.weight
        try:
            with torch.no_grad():
                if how == "freeze attribute":
                    m.blocks[0].up.weight.requires_grad_(False)
                else:
                    p.data.mul_(2)
            steps(w, opt, mesh, range(1, 2))
            got = full_weights(w)
            res = {k: float((got[k] - v).abs().max()) for k, v in want.items()}
            res = {k: e for k, e in res.items() if e > 1e-6}
        except RuntimeError as e:
            res = "raised: " + str(e)[:200]
        if wb.distributed.rank() == 0:
            print(json.dumps({"how": how, "result": res}), flush=True)
    torch.distributed.barrier()
    wb.distributed.shutdown()


if __name__ == "__main__":
    main()
