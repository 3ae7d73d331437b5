"""One program under sequence parallelism, run under torchrun (sp_norms_check.py, gloo, 4
processes) and on simulated ranks (tests/test_sp_norms_torchrun.py): the tiny GPT on a
dp 2 x tp 2 mesh with sequence parallelism (the norms' weight and bias gradients partial
sums over tp, summed ONCE per step, as Megatron-LM's ``_allreduce_layernorm_grads``), two
steps of two micro-batches each (gradient accumulation), the gradients clipped by their
total norm (small ``max_norm``: every step clips), then AdamW.  ``run`` returns, per step,
the total norm, the clipped gradients and, after the last step, the parameters: full
tensors, by name, equal on every process."""
import contextlib
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


# ---- the same under wb.DistributedDataParallel: no_sync() for the first micro-batch ----------

class Block(torch.nn.Module):
    """x + MLP(LayerNorm(x)), the MLP Megatron's tp region (column- then row-parallel)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.norm = torch.nn.LayerNorm(8)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                       torch.nn.Linear(16, 8))
        with torch.no_grad():                   # a weight and bias whose gradients matter
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.5, 0.5)

    def forward(self, x):                       # (B, S, H)
        return x + self.mlp(self.norm(x))


def _data(i):
    return torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(i))


def run_no_sync(mesh=None):
    """``Block`` on ``mesh`` (dims ("dp", "tp"), sequence parallel; None: one device) under
    DDP, SGD (a gradient off by a factor shows), two steps of two micro-batches (the first
    inside ``no_sync()``), clipped by ``wb.clip_grad_norm_``: per step the norm and rank
    0's collectives, then the parameters (full tensors, by name)."""
    from torch import nn
    from workbench.parallel.strategies.tensor_parallel import (sequence_parallel_norms,
                                                               tensor_parallel_region)
    m = Block()
    if mesh is not None:
        wb.parallelize(m, mesh, {"mlp.0": "colwise", "mlp.2": "rowwise"}, mesh_dim="tp")
        tensor_parallel_region(m.mlp, mesh, "tp", sp=True, seq_dim=1)
        norms = sequence_parallel_norms(m, mesh, nn.LayerNorm)
        ddp = wb.DistributedDataParallel(m, mesh, "dp", partial_grads=norms)
        params = [p for _, p in wb.dist_parameters(m)]
    else:
        ddp, params = m, list(m.parameters())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)

    def loss(i):
        x = _data(i) if mesh is None else wb.shard_tensor(_data(i), mesh, [wb.Shard(0),
                                                                            wb.Shard(1)])
        return ddp(x).pow(2).mean()
    out = {"norms": [], "collectives": []}
    for step in range(STEPS):
        with wb.trace("a100") as tr:
            with ddp.no_sync() if mesh is not None else contextlib.nullcontext():
                loss(step * MICRO).backward()
            loss(step * MICRO + 1).backward()
            out["norms"].append(float(wb.clip_grad_norm_(params, MAX_NORM)))
            opt.step()
            opt.zero_grad()
        out["collectives"].append(collectives(tr))
    with suspend():
        out["params"] = {k: v.detach().clone() for k, v in m.state_dict().items()} \
            if mesh is None else ddp.full_state_dict()
    return out
