"""Run under torchrun (gloo, 2 processes): wb.checkpoint's get_state_dict / set_state_dict
on the wrappers over the process group and on torch's own DDP.  Two AdamW steps on one
wrapper, a sharded checkpoint of get_state_dict's dicts, loaded in place into another
wrapper's and set, three more steps: the final weights against one device's five steps.
Every rank prints one JSON line."""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workbench as wb  # noqa: E402
from workbench.checkpoint import (StateDictOptions, get_model_state_dict,  # noqa: E402
                                  get_state_dict, set_state_dict)
from wrappers_model import data, loss_fn, make, one_device, optimizer  # noqa: E402


def build(kind):
    m = make()
    if kind == "torch_ddp":
        w = torch.nn.parallel.DistributedDataParallel(m, find_unused_parameters=True)
    elif kind == "fsdp":
        w = wb.FullyShardedDataParallel(m, None)
    else:
        # the toy's unused parameter: torch DDP trains it only with find_unused_parameters
        w = wb.DistributedDataParallel(m, None, find_unused_parameters=True)
    return w, optimizer("adamw", w.parameters())


def steps(w, opt, batches, n, k):
    for ids, y in batches:
        opt.zero_grad()
        loss_fn(w(ids.chunk(n)[k]), y.chunk(n)[k]).backward()
        opt.step()


def main(root):
    wb.distributed.init(timeout_s=120)
    n, k = torch.distributed.get_world_size(), torch.distributed.get_rank()
    want = one_device("adamw", steps=5)
    batches = data(5)
    full = StateDictOptions(full_state_dict=True)
    row = {"rank": k, "cases": {}}
    for a, b in [("ddp", "fsdp"), ("fsdp", "ddp"), ("torch_ddp", "fsdp"), ("fsdp", "torch_ddp")]:
        w, opt = build(a)
        steps(w, opt, batches[:2], n, k)
        msd, osd = get_state_dict(w, opt)
        path = f"{root}/{a}_{b}"
        wb.checkpoint.save(path, {"model": msd, "optim": osd})
        w2, opt2 = build(b)
        tm, to = get_state_dict(w2, opt2)
        # strict=False: the fresh optimizer's states include the parameter no step
        # reached ("unused"), which the checkpoint has none of (torch's DCP alike)
        wb.checkpoint.load(path, {"model": tm, "optim": to}, strict=False)
        set_state_dict(w2, opt2, model_state_dict=tm, optim_state_dict=to)
        steps(w2, opt2, batches[2:], n, k)
        got = get_model_state_dict(w2, options=full)
        row["cases"][f"{a}->{b}"] = {
            "keys": list(got) == list(want),
            "err": max(float((got[key] - v).abs().max()) for key, v in want.items())}
    # torch's own helpers on torch's DDP give the same dicts as these
    w, opt = build("torch_ddp")
    steps(w, opt, batches[:1], n, k)
    import torch.distributed.checkpoint.state_dict as tsd
    tm, to = tsd.get_state_dict(w, opt)
    mm, mo = get_state_dict(w, opt)
    row["torch_ddp_same"] = (list(tm) == list(mm) and all(torch.equal(tm[x], mm[x]) for x in tm)
                             and to["param_groups"] == mo["param_groups"]
                             and list(to["state"]) == list(mo["state"]))
    # full_state_dict + cpu_offload: rank 0 alone keeps it, as torch's
    f, _ = build("fsdp")
    off = get_model_state_dict(f, options=StateDictOptions(full_state_dict=True,
                                                           cpu_offload=True))
    row["offloaded_keys"] = len(off)
    print(json.dumps(row), flush=True)
    torch.distributed.barrier()
    wb.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
