"""Run under torchrun (4 processes): the tiny Llama with dropout 0.1 on dp x tp x pp
= 1 x 2 x 2 processes; rank 0 prints the losses as one JSON line."""
import json

import torch

import workbench as wb
from workbench.recipes.hybrid import Hybrid
from workbench.train import train

wb.distributed.init(timeout_s=60)
losses = [r["loss"] for r in train("tiny", steps=2, seed=0, timing=False, n_layer=4,
                                   dropout=0.1, strategy=Hybrid(tp=2, pp=2, distributed=True))]
if wb.distributed.rank() == 0:
    print(json.dumps(losses), flush=True)
torch.distributed.barrier()
wb.distributed.shutdown()
