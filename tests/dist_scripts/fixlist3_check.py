"""Run under torchrun (gloo, 4 processes, 2 x 2 dp x tp): wb.FullyShardedDataParallel over
tp_optim_model.py's program, then ``p.detach().zero_()`` (the in-place init idiom) on
``blocks.0.up.weight``: through named_parameters before any forward, through
named_parameters and through the module's attribute after a step.  Under
torch.distributed neither is a view of the shards, so the write must raise; rank 0
prints one JSON line per way: what happened (raised, or the parameters that differ from
one device's, zeroed the same way, after one more step); then what ``.grad`` of the
module's parameter and attribute gives after a step (the shards hold gradients)."""
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
    for how in ("named before a forward", "named", "attribute"):
        first = 0 if how == "named before a forward" else 1
        ref = make()
        ropt = adamw(ref.parameters())
        steps(ref, ropt, None, range(first))
        ref.blocks[0].up.weight.detach().zero_()
        steps(ref, ropt, None, range(first, 2))
        want = full_weights(ref)
        w, opt = wrapped("fsdp", mesh)
        steps(w, opt, mesh, range(first))
        m = w.module
        p = m.blocks[0].up.weight if how == "attribute" \
            else dict(m.named_parameters())["blocks.0.up.weight"]
        try:
            p.detach().zero_()
            steps(w, opt, mesh, range(first, 2))
            got = full_weights(w)
            res = {k: float((got[k] - v).abs().max()) for k, v in want.items()}
            res = {k: e for k, e in res.items() if e > 1e-6}
        except RuntimeError as e:
            res = "raised: " + str(e)[:200]
        if wb.distributed.rank() == 0:
            print(json.dumps({"how": how, "result": res}), flush=True)
    # the module's parameter's .grad after a step (the shards hold gradients): None before
    w, opt = wrapped("fsdp", mesh)
    steps(w, opt, mesh, range(1))
    for how in ("named grad", "attribute grad"):
        p = w.module.blocks[0].up.weight if how == "attribute grad" \
            else dict(w.module.named_parameters())["blocks.0.up.weight"]
        try:
            res = "None" if p.grad is None else "a gradient"
        except RuntimeError as e:
            res = "raised: " + str(e)[:200]
        if wb.distributed.rank() == 0:
            print(json.dumps({"how": how, "result": res}), flush=True)
    torch.distributed.barrier()
    wb.distributed.shutdown()


if __name__ == "__main__":
    main()
