"""Run under torchrun (gloo, 2 processes): the same user program on the workbench's
wrappers and on torch's own (DDP, ZeroRedundancyOptimizer, FSDP2's fully_shard) on one
job, a BatchNorm's buffers under DDP, and a user's FSDP checkpoint (model and optimizer)
saved and resumed.  Every process prints one JSON line; ``argv[1]``: a directory for the
checkpoint (the test loads it again on simulated ranks)."""
import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import workbench as wb


def mlp(bn=False):
    torch.manual_seed(0)
    mid = nn.BatchNorm1d(7) if bn else nn.Identity()
    return nn.Sequential(nn.Linear(5, 7), mid, nn.Tanh(), nn.Linear(7, 3))


def batches(steps=3, batch=8):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 5, generator=g), torch.randint(0, 3, (batch,), generator=g))
            for _ in range(steps)]


def buffers(m):
    return [b.detach().clone() for b in m.buffers()]


def diff(a, b):
    return max([(x.double() - y.double()).abs().max().item() for x, y in zip(a, b)] + [0.0])


def full(sd):
    """Plain full tensors of a state dict (DTensor / DistTensor gathered), no prefix."""
    out = {}
    for k, v in sd.items():
        v = v.full_tensor() if hasattr(v, "full_tensor") else v
        out[k.removeprefix("module.")] = v.detach()
    return [out[k] for k in sorted(out)]


def ddp_loop(w, opt, n, k, bn_log=None, fsdp2=False):
    """Three steps: the second accumulates two micro-batches (the first without
    gradient synchronization), zero_grad(set_to_none=False), torch's clip_grad_norm_."""
    norms = []
    for i, (x, y) in enumerate(batches()):
        opt.zero_grad(set_to_none=False)
        xs, ys = x.chunk(n)[k], y.chunk(n)[k]
        if i == 1:
            (a, b), (ya, yb) = xs.chunk(2), ys.chunk(2)
            if fsdp2:
                w.set_requires_gradient_sync(False)
                F.cross_entropy(w(a), ya).div(2).backward()
                w.set_requires_gradient_sync(True)
            else:
                with w.no_sync():
                    F.cross_entropy(w(a), ya).div(2).backward()
                if bn_log is not None:
                    bn_log.append(buffers(w.module))   # this process's own, not synced
            F.cross_entropy(w(b), yb).div(2).backward()
        else:
            F.cross_entropy(w(xs), ys).backward()
        if bn_log is not None:
            bn_log.append(buffers(w.module))
        norms.append(torch.nn.utils.clip_grad_norm_(w.parameters(), 0.5).item())
        opt.step()
    return norms


def batchnorm(n, k):
    """wb DDP and torch DDP over a BatchNorm: every process's buffers after each forward,
    the parameters, eval() outputs; the SyncBatchNorm on CPU refused as torch DDP does."""
    logs = [[], []]
    for log, wrap in zip(logs, (nn.parallel.DistributedDataParallel,
                                wb.DistributedDataParallel)):
        w = wrap(mlp(bn=True))
        ddp_loop(w, torch.optim.SGD(w.parameters(), lr=0.1), n, k, log)
        w.eval()
        with torch.no_grad():
            log.append([w(torch.randn(5, 5, generator=torch.Generator().manual_seed(3)))])
        log.append(full(w.state_dict()))
    out = {"bn_buffers": max(diff(a, b) for a, b in zip(logs[0][:-2], logs[1][:-2])),
           "bn_eval": diff(logs[0][-2], logs[1][-2]), "bn_state": diff(logs[0][-1], logs[1][-1]),
           "bn_eval_out": logs[1][-2][0].tolist()}
    try:
        wb.DistributedDataParallel(nn.SyncBatchNorm.convert_sync_batchnorm(mlp(bn=True)))
        out["syncbn"] = None
    except ValueError as e:
        out["syncbn"] = str(e)
    return out


def torch_wrappers(n, k):
    """The same loop on ours and on torch's: parameters and clip norms (max difference)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
    out = {}
    for name in ("ddp", "zero", "fully_shard", "fsdp_no_sync"):
        runs = []
        for ours in (False, True):
            m = mlp()
            if name == "fsdp_no_sync" and ours:
                # FSDP1's no_sync (habits5): held unsharded, the sum reduce-scattered once;
                # against FSDP2's set_requires_gradient_sync(False), the same math
                w = wb.FullyShardedDataParallel(m, units=[m[0]])
                opt = torch.optim.AdamW(w.parameters(), lr=1e-2)
            elif name in ("fully_shard", "fsdp_no_sync"):
                shard = wb.fully_shard if ours else fully_shard
                shard(m[0])
                shard(m)
                w, opt = m, torch.optim.AdamW(m.parameters(), lr=1e-2)
            else:
                w = (wb.DistributedDataParallel if ours else nn.parallel.DistributedDataParallel)(m)
                opt = torch.optim.AdamW(w.parameters(), lr=1e-2) if name == "ddp" else \
                    (wb.ZeroRedundancyOptimizer if ours else TorchZero)(
                        w.parameters(), torch.optim.AdamW, lr=1e-2)
            # the all-gathers of the loop, [in forward, in backward]: FSDP2's and ours both
            # send them with dist.all_gather_single (torch 2.13 _fsdp_collectives.py
            # DefaultAllGather; fsdp_units.all_gather), counted by wrapping it for the
            # loop's length; inside autograd's engine (a graph task running) is backward
            real, count = dist.all_gather_single, [0, 0]

            def counted(*a, **kw):
                count[torch._C._current_graph_task_id() != -1] += 1
                return real(*a, **kw)
            dist.all_gather_single = counted
            try:
                norms = ddp_loop(w, opt, n, k, fsdp2=name == "fully_shard" or
                                 (name == "fsdp_no_sync" and not ours))
            finally:
                dist.all_gather_single = real
            if name in ("fully_shard", "fsdp_no_sync"):
                out.setdefault(name + "_gathers", []).append(count)
            states = []
            if name == "zero":
                opt.consolidate_state_dict(0)
                if k == 0:
                    states = [t for st in opt.state_dict()["state"].values()
                              for t in st.values()]
            runs.append((norms, full(w.state_dict()), states))
        (n0, p0, s0), (n1, p1, s1) = runs
        out[name] = [diff(p0, p1), max(abs(a - b) for a, b in zip(n0, n1)), diff(s0, s1)]
    return out


def fsdp_checkpoint(root, n, k):
    """A user's FSDP program: two steps, save model and optimizer, two more; a fresh
    program loads the checkpoint and takes the same two steps."""
    def build():
        w = wb.FullyShardedDataParallel(mlp())
        return w, torch.optim.AdamW(w.parameters(), lr=1e-2)

    def step(w, opt, x, y):
        opt.zero_grad()
        loss = F.cross_entropy(w(x.chunk(n)[k]), y.chunk(n)[k])
        loss.backward()
        opt.step()
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        return loss.item() / n

    bs = batches(steps=4)
    w, opt = build()
    first = [step(w, opt, *b) for b in bs[:2]]
    sd = opt.state_dict()
    shapes = sorted({tuple(v.shape) for st in sd["state"].values() for v in st.values()})
    wb.checkpoint.save(root, {"model": w.state_dict(), "optim": sd})
    whole = [step(w, opt, *b) for b in bs[2:]]
    w, opt = build()
    step(w, opt, *bs[0])                   # the optimizer's states exist after a step
    state = {"model": w.state_dict(), "optim": opt.state_dict()}
    wb.checkpoint.load(root, state)
    w.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    return {"ckpt_first": first, "ckpt_whole": whole, "ckpt_shapes": shapes,
            "ckpt_resumed": [step(w, opt, *b) for b in bs[2:]]}


def normal_after_wrapping(k):
    """nn.init.normal_ of an FSDP shard after wrapping, the processes' generators apart:
    one device's draw from rank 0's generator; p.copy_(full) into every chunk."""
    w = wb.FullyShardedDataParallel(mlp())
    torch.manual_seed(5 + k)
    nn.init.normal_(w.module[0].weight, 0.0, 0.02)
    torch.manual_seed(5)
    want = torch.empty(7, 5).normal_(0.0, 0.02)
    value = torch.arange(21.0).reshape(3, 7)
    with torch.no_grad():                   # a value of the module's shape: every chunk
        w.module[3].weight.copy_(value)
    full = w.full_state_dict()
    return {"normal_": torch.equal(full["0.weight"], want),
            "copy_": torch.equal(full["3.weight"], value)}


HYBRID = {"tp2": dict(tp=2), "dp2zero1": dict(dp=2, zero=1), "dp2zero2": dict(dp=2, zero=2),
          "dp2zero3": dict(dp=2, zero=3)}


def hybrid_clip(distributed=True, layouts=HYBRID):
    """Hybrid without a pipeline, the README's loop: two steps of two accumulated
    forward_backward calls, zero_grad(set_to_none=False), the 2-norm then the inf-norm
    clip and a value clip, the stage optimizers' step; the norms, the evaluation loss and
    the parameters (the model's state_dict, gathered) against one device."""
    from workbench.models import build_model, get_batch, get_config
    from workbench.recipes.hybrid import Hybrid
    cfg = get_config("tiny")

    def batch(step, mb):
        return get_batch(cfg, 8, 0, 2 * step + mb)
    ref = build_model(cfg, seed=0).train()
    opt = wb.ops.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.01)
    want = []
    for step, p in enumerate((2.0, float("inf"))):
        opt.zero_grad(set_to_none=False)
        for mb in range(2):
            ref(*batch(step, mb))[1].backward()
        want.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, p).item())
        torch.nn.utils.clip_grad_value_(ref.parameters(), 2e-3)
        opt.step()
    ref.eval()
    with torch.no_grad():
        want_loss = ref(*batch(9, 0))[1].item()
    out = {}
    for name, layout in layouts.items():
        st = Hybrid(distributed=distributed, **layout)
        model = st.build_model(cfg, 0)
        opts = st.build_optimizer(model, 3e-3, 0.01)
        norms = []
        for step, p in enumerate((2.0, float("inf"))):
            for o in opts:
                o.zero_grad(set_to_none=False)
            for mb in range(2):
                st.forward_backward(model, *batch(step, mb))
            norms.append(st.clip_grad_norm_(opts, 0.05, p).item())
            st.clip_grad_value_(opts, 2e-3)
            st.optimizer_step(opts)
        sd = {k: v.full() if isinstance(v, wb.DistTensor) else v
              for k, v in model.state_dict().items()}
        params = max((sd[k] - v).abs().max().item() for k, v in ref.state_dict().items())
        # the module's own parameters read after the step, before any forward (ZeRO-3
        # on processes: they were the values at wrapping, or the last forward's)
        reads = [max((p.full() - sd[k]).abs().max().item() for k, p in it)
                 for it in (model.named_parameters(), wb.dist_parameters(model))]
        model.eval()
        loss = float(st.evaluate(model, *batch(9, 0)))
        out[name] = {"norms": norms, "want": want, "loss": [loss, want_loss],
                     "params": params, "reads": reads}
    return {"hybrid": out}


def main(root):
    wb.distributed.init(timeout_s=60)
    n, k = dist.get_world_size(), dist.get_rank()
    row = {"rank": k}
    row.update(batchnorm(n, k))
    row.update(torch_wrappers(n, k))
    row.update(fsdp_checkpoint(root, n, k))
    row.update(normal_after_wrapping(k))
    row.update(hybrid_clip())
    print(json.dumps(row), flush=True)
    wb.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
