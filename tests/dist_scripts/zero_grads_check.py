"""Run under torchrun (gloo, 2 processes) or plainly (the simulator): one step of
``--preset tiny`` under each ZeRO stage at dp 2; rank 0 prints, per layout, the sum of
squares of Adam's first moments over the whole model, (1 - beta1) times the step's
gradient (the gradient's sum of squares times 0.01), as JSON."""
import json
import os

import torch

import workbench as wb
from workbench.checkpoint.training import optimizer_states
from workbench.recipes.hybrid import Hybrid
from workbench.train import train

LAYOUTS = {"zero1": dict(dp=2, zero=1), "zero2": dict(dp=2, zero=2),
           "zero3": dict(dp=2, zero=3)}


def moments_sumsq(distributed, **layout):
    got = []
    strategy = Hybrid(distributed=distributed, **layout)
    real, build = strategy.optimizer_step, strategy.build_model

    def keep(cfg, seed):
        strategy._model = build(cfg, seed)
        return strategy._model

    def step_and_grab(opt):
        real(opt)
        total = 0.0
        for _, d in sorted(optimizer_states(strategy, strategy._model, opt).items()):
            m = d["exp_avg"]
            m = m.full() if isinstance(m, wb.DistTensor) else m
            total += float(m.double().pow(2).sum())
        got.append(total)
    strategy.build_model, strategy.optimizer_step = keep, step_and_grab
    train("tiny", steps=1, seed=0, batch_size=8, timing=False, strategy=strategy)
    return got[0]


def main():
    distributed = "RANK" in os.environ
    if distributed:
        wb.distributed.init(timeout_s=120)
    out = {k: moments_sumsq(distributed, **v) for k, v in LAYOUTS.items()}
    if not distributed or wb.distributed.rank() == 0:
        print(json.dumps(out), flush=True)
    if distributed:
        torch.distributed.barrier()
        wb.distributed.shutdown()


if __name__ == "__main__":
    main()
