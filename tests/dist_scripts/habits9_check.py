"""Run under torchrun (gloo, 2 processes): habits9's checks against torch's own wrappers.
Rank 0 prints one JSON line per case.

* ``grad_sync_<how>``: ``set_requires_gradient_sync(False)``, a backward, then True, a
  ``zero_grad`` (``how``: none, the model's, the optimizer's, ``set_to_none=False``), a
  backward and a step: ``wb.fully_shard`` against torch's FSDP2 ``fully_shard`` (the
  parameters' largest difference), and each against one device with both batches'
  gradients (FSDP2 keeps the held gradients on its unsharded parameters, which no
  ``zero_grad`` reaches);
* ``tie_<wrapper>``: ``head.weight = wte.weight`` after wrapping: what torch's DDP and
  FSDP2 do (raise, or train as one device's tied model) and what wb's do;
* ``opt_before_<wrapper>``: the optimizer built before wrapping (nanoGPT's order), two
  AdamW steps: the parameters' largest difference to one device's (torch's DDP keeps the
  parameters; torch's FSDP2 replaces them and trains nothing, 0.020 off);
* ``grad_sync_flag``: nanoGPT's ``model.require_backward_grad_sync = (micro == 2)`` over
  three micro-batches, two AdamW steps: wb's DDP against torch's (parameters, and wb's
  all-reduces against no_sync()'s);
* ``ema``: ``AveragedModel`` (torch's EMA, ``_foreach_lerp_``) of the plain model updated
  from the wrapped one: wb's FSDP / fully_shard against torch's DDP (largest difference).
"""
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.nn.parallel import DistributedDataParallel as TorchDDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import workbench as wb  # noqa: E402
from workbench.sim_mesh import backends  # noqa: E402
from tests.test_habits6 import batches, mlp, mse  # noqa: E402
from tests.test_habits9 import LM, lm_batches, lm_loss  # noqa: E402


def mine(t):
    return t.chunk(dist.get_world_size())[dist.get_rank()]


def full(v):
    if isinstance(v, wb.DistTensor):
        return v.full()
    return v.full_tensor() if hasattr(v, "full_tensor") else v


def diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in b)


def grad_sync(fs, how):
    m = mlp()
    fs(m[0])
    fs(m)
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    (x0, y0), (x1, y1) = batches(2)
    m.set_requires_gradient_sync(False)
    mse(m(mine(x0)), mine(y0)).backward()
    m.set_requires_gradient_sync(True)
    if how == "model":
        m.zero_grad()
    elif how == "optimizer":
        opt.zero_grad()
    elif how == "set_to_none_false":
        opt.zero_grad(set_to_none=False)
    mse(m(mine(x1)), mine(y1)).backward()
    opt.step()
    return {k: full(v).detach().clone() for k, v in m.state_dict().items()}


def one_device_both():
    m = mlp()
    for x, y in batches(2):
        mse(m(x), y).backward()
    torch.optim.SGD(m.parameters(), lr=1.0).step()
    return m.state_dict()


def tie(wrapper):
    m = LM()
    if wrapper in ("torch_ddp", "wb_ddp"):
        w = TorchDDP(m) if wrapper == "torch_ddp" else wb.DistributedDataParallel(m)
    else:
        fs = torch_fully_shard if wrapper == "torch_fsdp2" else wb.fully_shard
        fs(m.mid)
        w = fs(m)
    m.head.weight = m.wte.weight
    opt = torch.optim.SGD(w.parameters(), lr=0.5)
    try:
        for ids, y in lm_batches(3):
            opt.zero_grad()
            lm_loss(w(mine(ids)), mine(y)).backward()
            opt.step()
    except RuntimeError as e:
        return {"raised": str(e)[:120]}
    ref = LM()
    ref.head.weight = ref.wte.weight
    ropt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for ids, y in lm_batches(3):
        ropt.zero_grad()
        lm_loss(ref(ids), y).backward()
        ropt.step()
    got = {k: full(v).detach() for k, v in m.state_dict().items()}
    return {"one_device": diff(got, ref.state_dict()), "tied": m.head.weight is m.wte.weight}


def opt_before(wrapper):
    m = mlp()
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    if wrapper in ("torch_ddp", "wb_ddp"):
        w = TorchDDP(m) if wrapper == "torch_ddp" else wb.DistributedDataParallel(m)
    else:
        fs = torch_fully_shard if wrapper == "torch_fsdp2" else wb.fully_shard
        fs(m[0])
        w = fs(m)
    ref = mlp()
    ropt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    for x, y in batches(2):
        opt.zero_grad()
        mse(w(mine(x)), mine(y)).backward()
        opt.step()
        ropt.zero_grad()
        mse(ref(x), y).backward()
        ropt.step()
    got = {k: full(v).detach() for k, v in m.state_dict().items()}
    return {"one_device": diff(got, ref.state_dict())}


def flag_run(wrapper, how):
    import contextlib
    m = mlp()
    w = TorchDDP(m) if wrapper == "torch" else wb.DistributedDataParallel(m)
    opt = torch.optim.AdamW(w.parameters(), lr=0.01)
    data = batches(6)
    with wb.trace() as tr:
        for s in range(2):
            for micro in range(3):
                x, y = data[3 * s + micro]
                ctx = contextlib.nullcontext()
                if how == "flag":
                    w.require_backward_grad_sync = micro == 2
                elif micro < 2:
                    ctx = w.no_sync()
                with ctx:
                    (mse(w(mine(x)), mine(y)) / 3).backward()
            opt.step()
            opt.zero_grad()
    return ({k: v.detach().clone() for k, v in m.state_dict().items()},
            sum(e.name == "all_reduce" for e in tr.collectives()))


def ema(wrapper):
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
    m = mlp()
    avg = AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    if wrapper == "torch_ddp":
        w = TorchDDP(m)
    elif wrapper == "wb_fsdp":
        w = wb.FullyShardedDataParallel(m)
    else:
        wb.fully_shard(m[0])
        w = wb.fully_shard(m)
    opt = torch.optim.SGD(w.parameters(), lr=0.1)
    for x, y in batches(3):
        opt.zero_grad()
        mse(w(mine(x)), mine(y)).backward()
        opt.step()
        avg.update_parameters(w)
    return [p.detach().clone() for p in avg.parameters()]


def main():
    if not dist.is_initialized():       # (tests/dist_scripts/several.py: already up)
        dist.init_process_group("gloo")
    rows = []
    want = one_device_both()
    for how in ("none", "model", "optimizer", "set_to_none_false"):
        a, b = grad_sync(wb.fully_shard, how), grad_sync(torch_fully_shard, how)
        rows.append({"case": f"grad_sync_{how}", "wb_vs_torch": diff(a, b),
                     "wb_one_device_both": diff(a, want), "torch_one_device_both": diff(b, want)})
    for wrapper in ("torch_ddp", "wb_ddp", "torch_fsdp2", "wb_fully_shard"):
        rows.append({"case": f"tie_{wrapper}", **tie(wrapper)})
        rows.append({"case": f"opt_before_{wrapper}", **opt_before(wrapper)})
    (a, na), (b, _), (_, nb) = (flag_run("wb", "flag"), flag_run("torch", "flag"),
                                flag_run("wb", "no_sync"))
    rows.append({"case": "grad_sync_flag", "wb_vs_torch": diff(a, b), "all_reduces": [na, nb]})
    want = ema("torch_ddp")
    rows.append({"case": "ema", **{w: max((a - b).abs().max().item() for a, b in
                                          zip(ema(w), want))
                                   for w in ("wb_fsdp", "wb_fully_shard")}})
    if dist.get_rank() == 0:
        for r in rows:
            print(json.dumps(r), flush=True)
    backends.shutdown()     # (several.py: its own, which keeps the group for the next part)


if __name__ == "__main__":
    main()
