"""Run under torchrun (gloo): a user's loop over ``Hybrid(pp=2, ...)`` that clips and
evaluates, on torch.distributed.

Three steps of ``--preset tiny`` (two layers, batch 8): step 0 clipped by the 2-norm,
step 1 by the inf-norm, step 2 by value, each followed by AdamW; then the evaluation loss
and logits of another batch.  Each rank saves, per layout, the clip norms, the evaluation
loss and logits, and its stage's parameters after the steps (gathered over its stage
mesh) to ``OUT/rank<k>.pt``; the test holds them to one device and to the simulated mesh
(run in the test's own process: a simulated Hybrid in a process whose meshes are
registered on torch.distributed would read them as distributed, Mesh equality being by
value).  ``python pipeline_clip_eval_check.py N OUT`` runs the simulation instead."""
import math
import os
import sys

import torch

import workbench as wb
from workbench.models import build_model, get_batch, get_config
from workbench.recipes.hybrid import Hybrid

LAYOUTS = {2: {"pp2": dict(pp=2)},
           4: {"pp2dp2": dict(pp=2, dp=2), "pp2tp2": dict(pp=2, tp=2, sp=True),
               "pp2dp2zero1": dict(pp=2, dp=2, zero=1),
               "pp2dp2zero3": dict(pp=2, dp=2, zero=3)}}
CLIPS = [("norm", 0.05, 2.0), ("norm", 0.02, math.inf), ("value", 1e-3, None)]
LR, WD = 3e-3, 0.01


def one_device(cfg):
    model = build_model(cfg, seed=0).train()
    opt = wb.ops.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    norms = []
    for step, (kind, c, p) in enumerate(CLIPS):
        x, y = get_batch(cfg, 8, 0, step)
        model(x, y)[1].backward()
        if kind == "norm":
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), c, p)))
        else:
            torch.nn.utils.clip_grad_value_(model.parameters(), c)
        opt.step()
        opt.zero_grad()
    model.eval()
    x, y = get_batch(cfg, 8, 0, 99)
    with torch.no_grad():
        logits, loss = model(x, y)
    params = {n: p.detach() for n, p in model.named_parameters()}
    return norms, float(loss), logits, params


def pipelined(cfg, distributed, **layout):
    st = Hybrid(distributed=distributed, **layout)
    model = st.build_model(cfg, 0)
    opts = st.build_optimizer(model, LR, WD)
    norms = []
    for step, (kind, c, p) in enumerate(CLIPS):
        x, y = get_batch(cfg, 8, 0, step)
        st.forward_backward(model, x, y)
        if kind == "norm":
            norms.append(float(st.clip_grad_norm_(opts, c, p)))
        else:
            st.clip_grad_value_(opts, c)
        st.optimizer_step(opts)
        for o in opts:
            o.zero_grad()
    model.eval()
    x, y = get_batch(cfg, 8, 0, 99)
    loss = float(st.evaluate(model, x, y))
    logits = st.evaluate(model, x)
    # this process's stage (all of them in the simulator), gathered over its mesh
    params = {n: p.full().detach() for n, p in wb.dist_parameters(model)}
    return norms, loss, logits, params


def run(distributed: bool, n: int) -> dict:
    cfg = get_config("tiny")
    return {name: dict(zip(("norms", "loss", "logits", "params"),
                           pipelined(cfg, distributed, **layout)))
            for name, layout in LAYOUTS[n].items()}


def prime():
    """One simulated step of the tensor-parallel layout (sequence parallelism: per-rank
    norm copies), before any mesh is registered on torch.distributed."""
    cfg = get_config("tiny")
    st = Hybrid(pp=2, tp=2, sp=True)
    model = st.build_model(cfg, 0)
    st.build_optimizer(model, LR, WD)
    st.forward_backward(model, *get_batch(cfg, 8, 0, 0))


def main():
    distributed = "RANK" in os.environ
    if distributed:
        wb.distributed.init(timeout_s=120)
        n, out, name = wb.distributed.world_size(), sys.argv[1], f"rank{wb.distributed.rank()}"
        if n == 4:      # a simulated step first, on meshes equal to the real ones: what
            prime()     # dispatch prepared for them is not the real meshes' (they were)
    else:
        n, out, name = int(sys.argv[1]), sys.argv[2], "simulated"
    torch.save(run(distributed, n), os.path.join(out, f"{name}.pt"))
    print(f"{name} ok", flush=True)
    if distributed:
        torch.distributed.barrier()
        wb.distributed.shutdown()


if __name__ == "__main__":
    main()
