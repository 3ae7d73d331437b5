"""Run under torchrun (gloo, 2 processes): torch.optim's state_dict() over
wb.DistributedDataParallel / wb.FullyShardedDataParallel / wb.fully_shard of a
tensor-parallel model (tp_optim_model.py) on a (1, 2) and a (2, 1) ("dp", "tp") mesh.
After 2 AdamW steps rank 0 saves the optimizer's state_dict() and the full model state
dict (torch.save), and every rank wb.checkpoint.get_state_dict's dicts
(wb.checkpoint.save); tests/test_tpoptstate.py loads them into one device and the
simulated ranks. Here: each state's shape, the run's 2 more steps, one device's 2-step
checkpoint loaded into each wrapper (torch's load_state_dict) and each wb.checkpoint one
into another wrapper on the other mesh (wb.checkpoint.load + set_state_dict), 2 more
steps, all against one device's 4. Every rank prints one JSON line per case."""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workbench as wb  # noqa: E402
from workbench.checkpoint import get_state_dict, set_model_state_dict, set_state_dict  # noqa: E402
from tp_optim_model import full_weights, make, max_err, one_device, steps, wrapped  # noqa: E402

CASES = [("ddp", (1, 2)), ("ddp", (2, 1)), ("fsdp", (1, 2)), ("fsdp", (2, 1)),
         ("fully_shard", (1, 2)), ("fully_shard", (2, 1))]


def name_of(kind, shape):
    return f"{kind}_{shape[0]}x{shape[1]}"


def main(root):
    wb.distributed.init(timeout_s=120)
    k = torch.distributed.get_rank()
    want = full_weights(one_device(4)[0])
    shapes = [list(q.shape) for q in make().parameters()]
    for kind, shape in CASES:
        name, mesh = name_of(kind, shape), wb.distributed.mesh(shape, ["dp", "tp"])
        row = {"rank": k, "case": name}
        w, o = wrapped(kind, mesh)
        steps(w, o, mesh, range(2))
        osd = o.state_dict()
        row["shapes"] = [list(st["exp_avg"].shape) for st in osd["state"].values()]
        row["shapes_ok"] = row["shapes"] == shapes
        msd = full_weights(w)                   # a collective: every rank
        if k == 0:
            torch.save({"model": msd, "optim": osd}, f"{root}/{name}.pt")
        wb.checkpoint.save(f"{root}/wb_{name}", dict(zip(("model", "optim"),
                                                         get_state_dict(w, o))))
        steps(w, o, mesh, range(2, 4))
        row["uninterrupted"] = max_err(full_weights(w), want)
        # one device's 2-step checkpoint into this wrapper (torch's own load_state_dict)
        p, po = one_device(2)
        w, o = wrapped(kind, mesh)
        set_model_state_dict(w, p.state_dict())
        o.load_state_dict(po.state_dict())
        steps(w, o, mesh, range(2, 4))
        row["from_one_device"] = max_err(full_weights(w), want)
        print(json.dumps(row), flush=True)
    torch.distributed.barrier()
    # each wb.checkpoint into another wrapper on the other mesh (ddp 1x2 -> fully_shard 2x1 ...)
    for (kind, shape), (other, oshape) in zip(CASES, CASES[::-1]):
        omesh = wb.distributed.mesh(oshape, ["dp", "tp"])
        w, o = wrapped(other, omesh)
        tm, to = get_state_dict(w, o)
        wb.checkpoint.load(f"{root}/wb_{name_of(kind, shape)}", {"model": tm, "optim": to})
        set_state_dict(w, o, model_state_dict=tm, optim_state_dict=to)
        steps(w, o, omesh, range(2, 4))
        print(json.dumps({"rank": k, "across": [name_of(kind, shape), name_of(other, oshape)],
                          "err": max_err(full_weights(w), want)}), flush=True)
    torch.distributed.barrier()
    wb.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
