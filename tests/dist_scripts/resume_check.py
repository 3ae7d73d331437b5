"""Run under torchrun (gloo, 2 processes): train --save on one layout, --resume on
another, against one uninterrupted run; rank 0 prints the three loss lists as JSON."""
import json
import sys

import torch

import workbench as wb
from workbench.recipes.hybrid import Hybrid
from workbench.train import train


def losses(**kw):
    return [r["loss"] for r in train("tiny", seed=0, timing=False, **kw)]


def main(root):
    wb.distributed.init(timeout_s=120)
    whole = losses(steps=4, strategy=Hybrid(dp=2, zero=1, distributed=True))
    a = losses(steps=2, strategy=Hybrid(dp=2, zero=1, distributed=True), save=f"{root}/a")
    b = losses(steps=4, strategy=Hybrid(tp=2, distributed=True), resume=f"{root}/a")
    c = losses(steps=2, strategy=Hybrid(pp=2, distributed=True), save=f"{root}/c")
    d = losses(steps=4, strategy=Hybrid(dp=2, zero=2, distributed=True), resume=f"{root}/c")
    # ZeRO-3's Adam moments saved, resumed on tp 2 (its gradients were once dp times
    # too big on torch.distributed: the moments then disagree with the new layout's)
    e = losses(steps=2, strategy=Hybrid(dp=2, zero=3, distributed=True), save=f"{root}/e")
    f = losses(steps=4, strategy=Hybrid(tp=2, distributed=True), resume=f"{root}/e")
    if wb.distributed.rank() == 0:
        print(json.dumps({"whole": whole, "dp2_then_tp2": a + b, "pp2_then_zero2": c + d,
                          "zero3_then_tp2": e + f}),
              flush=True)
    torch.distributed.barrier()
    wb.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
