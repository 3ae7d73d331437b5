"""One program under sequence parallelism, run under torchrun (sp_norms_check.py, gloo, 4
processes) and on simulated ranks (tests/test_sp_norms_torchrun.py): the tiny GPT on a
dp 2 x tp 2 mesh with sequence parallelism (the norms' weight and bias gradients partial
sums over tp, summed ONCE per step, as Megatron-LM's ``_allreduce_layernorm_grads``), two
steps of two micro-batches each (gradient accumulation), the gradients clipped by their
total norm (small ``max_norm``: every step clips), then AdamW.  ``run`` returns, per step,
the total norm, the clipped gradients and, after the last step, the parameters: full
tensors, by name, equal on every process."""
from collections import Counter

import torch

import workbench as wb
from workbench.models.config import get_config
from workbench.models.data import get_batch
from workbench.sim_mesh.trace import suspend
from workbench.train import SingleDevice

STEPS, MICRO, BATCH, MAX_NORM, LR = 2, 2, 4, 0.05, 1e-2


def config():
    return get_config("tiny", vocab_size=128, dropout=0.0, n_layer=1)


def _full(t):
    return (t.full() if isinstance(t, wb.DistTensor) else t).detach().clone()


def run(strategy=None):
    """The program on ``strategy`` (a Hybrid; None: one device)."""
    cfg = config()
    one = strategy is None
    s = SingleDevice() if one else strategy
    if not one:
        s.check(cfg, BATCH)
    model = s.build_model(cfg, 0)
    opts = s.build_optimizer(model, LR, 0.0)
    named = list(model.named_parameters()) if one else list(wb.dist_parameters(model))
    out = {"norms": [], "grads": [], "modeled_ms": [], "collectives": []}
    for step in range(STEPS):
        with wb.trace("a100") as tr:
            for mb in range(MICRO):
                x, y = get_batch(cfg, BATCH, 0, step * MICRO + mb)
                s.forward_backward(model, x, y)
            if one:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            else:
                norm = s.clip_grad_norm_(opts, MAX_NORM)
            with suspend():                 # (the gathers of the check: not the program's)
                grads = {n: _full(p.grad) for n, p in named}
            s.optimizer_step(opts)
        out["norms"].append(float(norm))
        out["grads"].append(grads)
        out["modeled_ms"].append(tr.time() * 1e3)
        out["collectives"].append(collectives(tr))
    out["params"] = {n: _full(p) for n, p in named}
    return out


def collectives(tr) -> list:
    """[kind, label, count] of the collectives rank 0 took part in, sorted."""
    seen = Counter((e.name, e.label) for e in tr.events
                   if e.stream != "compute" and 0 in e.ranks)
    return sorted([k, lab, n] for (k, lab), n in seen.items())
