"""torch.optim over a tensor-parallel model's DistTensor parameters on torch.distributed
(torchrun, gloo, one process per tp rank; tests/test_optim8.py reads the rows): AdamW
(foreach None and True) and SGD with momentum train as one device; ``opt.state_dict()``
through ``torch.save`` / ``torch.load`` (weights_only) into a fresh optimizer, a one-device
optimizer's state loaded into the parallel one, and a GradScaler loop (its last step
overflowing: skipped, the scale halved) go on as one device."""
import copy
import io
import json

import torch
from torch import nn

import workbench as wb

R = wb.Replicate
PLAN = {"0": wb.ColwiseParallel(), "2": wb.RowwiseParallel()}


def _mk():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 8))


def _steps(m, ref, opt, ro, mesh, n, seed, scalers=None):
    g = torch.Generator().manual_seed(seed)
    for i in range(n):
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
        if scalers is not None and i == n - 1:
            x = x * 1e30                    # the scaled gradients overflow: a skipped step
        for mod, o, inp, k in ((m, opt, wb.shard_tensor(x, mesh, [R()]), 0), (ref, ro, x, 1)):
            o.zero_grad()
            out = mod(inp)
            loss = ((out.full() if isinstance(out, wb.DistTensor) else out) - y).pow(2).mean()
            if scalers is None:
                loss.backward()
                o.step()
            else:
                scalers[k].scale(loss).backward()
                scalers[k].unscale_(o)
                scalers[k].step(o)
                scalers[k].update()


def _err(m, ref):
    return max((p.full_tensor() - q.detach()).abs().max().item()
               for p, q in zip(m.parameters(), ref.parameters()))


def main():
    wb.distributed.init(timeout_s=60)
    n, k = torch.distributed.get_world_size(), torch.distributed.get_rank()
    mesh = wb.distributed.mesh(n, ["tp"])
    row = {"rank": k}
    makers = {"adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
              "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
              "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True)}
    for name, make in makers.items():
        ref, m = _mk(), _mk()
        wb.parallelize_module(m, mesh, PLAN)
        opt, ro = make(m.parameters()), make(ref.parameters())
        _steps(m, ref, opt, ro, mesh, 3, 1)
        sd = opt.state_dict()
        row[name] = _err(m, ref)
        row[name + "_placed"] = all(
            isinstance(v, wb.DistTensor) and v.placements == p.placements
            for i, p in enumerate(m.parameters()) for key, v in sd["state"][i].items()
            if key != "step")
        if name == "adamw":
            buf = io.BytesIO()
            torch.save(sd, buf)
            buf.seek(0)
            fresh = make(m.parameters())
            fresh.load_state_dict(torch.load(buf))
            _steps(m, ref, fresh, ro, mesh, 2, 5)
            row["resumed"] = _err(m, ref)
            from_one = make(m.parameters())                 # one device's state, laid out
            from_one.load_state_dict(copy.deepcopy(ro.state_dict()))
            _steps(m, ref, from_one, ro, mesh, 2, 7)
            row["from_one_device"] = _err(m, ref)
    ref, m = _mk(), _mk()
    wb.parallelize_module(m, mesh, PLAN)
    opt, ro = makers["sgd"](m.parameters()), makers["sgd"](ref.parameters())
    sc = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) for _ in range(2)]
    _steps(m, ref, opt, ro, mesh, 3, 2, scalers=sc)
    row["scaler"] = _err(m, ref)
    row["scales"] = [s.get_scale() for s in sc]     # halved on both after the overflow
    print(json.dumps(row), flush=True)
    wb.distributed.shutdown()


if __name__ == "__main__":
    main()
