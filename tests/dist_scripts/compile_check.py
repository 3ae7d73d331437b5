"""Run under torchrun (gloo, 4 processes): a program compiled with wb.compile runs on the
real process group with eager's results: the tiny Llama on dp 2 x tp 2, forward and
backward (loss and every gradient shard), compiled at O2.  Each rank prints one
JSON line."""
import json

import torch

import workbench as wb
from workbench.models import build_model, get_config


def main():
    wb.distributed.init(timeout_s=120)
    rank = wb.distributed.rank()
    mesh = wb.distributed.mesh((2, 2), ["dp", "tp"])
    R, S = wb.Replicate(), wb.Shard(0)
    cfg = get_config("tiny")

    def llama():
        m = build_model(cfg, seed=0)
        return wb.parallelize(m, mesh, m.tp_plan(2), mesh_dim="tp")
    g = torch.Generator().manual_seed(0)
    ids, tg = (torch.randint(0, cfg.vocab_size, (4, 32), generator=g) for _ in range(2))
    x, y = wb.shard_tensor(ids, mesh, [S, R]), wb.shard_tensor(tg, mesh, [S, R])
    eager = llama()
    _, loss = eager(x, y)
    loss.backward()
    out = {"rank": rank, "eager": loss.full().item()}
    grads = dict(eager.named_parameters())
    for level in ("O2",):          # (O2 runs the O1 program: its passes edit the schedule)
        m = llama()
        prog = wb.compile(m, x, y, level=level, method="trace")
        _, closs = prog(x, y)
        closs.backward()
        out[level] = closs.full().item()
        out[level + "_grad_diff"] = max(
            (p.grad.to_local() - grads[n].grad.to_local()).abs().max().item()
            for n, p in m.named_parameters())
    print(json.dumps(out), flush=True)
    wb.distributed.shutdown()


if __name__ == "__main__":
    main()
