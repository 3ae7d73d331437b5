"""One small tensor-parallel program, run under torchrun (tp_optim_state_check.py) and on
simulated ranks (tests/test_tpoptstate.py): an MLP language model whose blocks' up / down
projections are column / row parallel (14 hidden features: uneven tensor-parallel shards
raise on torch.distributed; 5 model features: FSDP's flat chunks padded), wrapped in
wb.DistributedDataParallel, wb.FullyShardedDataParallel or wb.fully_shard over the dp
dim, trained with torch.optim.AdamW over the wrapper's parameters()."""
import torch
from torch import nn
from torch.nn import functional as F

import workbench as wb

V, W, H = 11, 5, 14
PLAN = {"blocks.*.up": wb.ColwiseParallel(), "blocks.*.down": wb.RowwiseParallel()}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(W, H)
        self.down = nn.Linear(H, W)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, W)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(W, V, bias=False)

    def forward(self, ids):                     # (B, T) int64
        h = self.emb(ids)
        for b in self.blocks:
            h = b(h)
        return self.head(h)                     # (B, T, V)


def make(seed=0):
    torch.manual_seed(seed)
    return Net()


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def wrapped(kind, mesh):
    """The program's model on ``mesh`` (dims ("dp", "tp")): the TP plan, then ``kind``
    ("ddp", "fsdp" or "fully_shard") over "dp"; and AdamW over the wrapper's parameters()."""
    m = make()
    wb.parallelize_module(m, mesh, PLAN)
    wb.parallelize(m, mesh)
    if kind == "ddp":
        w = wb.DistributedDataParallel(m, mesh, dim="dp")
    elif kind == "fsdp":
        w = wb.FullyShardedDataParallel(m, mesh, dim="dp")
    else:                                       # torchtitan's order: blocks, then the root
        for b in m.blocks:
            wb.fully_shard(b, mesh=mesh["dp"])
        w = wb.fully_shard(m, mesh=mesh["dp"])
    return w, adamw(w.parameters())


def batches(k=5, b=6, t=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, V, (b, t), generator=g), torch.randint(0, V, (b, t), generator=g))
            for _ in range(k)]


def steps(w, opt, mesh, which):
    """Train on the batches ``which`` (``mesh`` None: one device); the losses."""
    data, out = batches(), []
    for i in which:
        ids, y = data[i]
        opt.zero_grad()
        logits = w(wb.shard_tensor(ids, mesh, ["S(0)", "R"]) if mesh is not None else ids)
        if isinstance(logits, wb.DistTensor):
            logits = logits.full()
        loss = F.cross_entropy(logits.reshape(-1, V), y.reshape(-1))
        loss.backward()
        if hasattr(w, "finish_gradient_synchronization"):
            w.finish_gradient_synchronization()     # DDP's DistTensor mode sums here
        opt.step()
        out.append(loss.item())
    return out


def one_device(n):
    """The plain model and its AdamW after ``n`` steps on one device."""
    m = make()
    o = adamw(m.parameters())
    steps(m, o, None, range(n))
    return m, o


def full_weights(w):
    """The model's weights as one device's (FQN keys, full tensors)."""
    from workbench.checkpoint import StateDictOptions, get_model_state_dict
    sd = get_model_state_dict(w, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in sd.items()}


def max_err(got, want):
    assert list(got) == list(want), (list(got), list(want))
    return max(float((got[k] - v).abs().max()) for k, v in want.items())
