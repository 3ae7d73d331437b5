"""A small model with the awkward cases the data-parallel wrappers must handle: tied
weights, a frozen parameter, a parameter used nowhere, and a weight indexed by ids."""
import torch
from torch import nn

VOCAB, WIDTH = 12, 8


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.hid = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight                            # tied
        self.frozen = nn.Parameter(torch.randn(WIDTH), requires_grad=False)
        self.unused = nn.Parameter(torch.randn(3))                    # never used in forward

    def forward(self, ids):                                           # (B, T) int64
        h = torch.tanh(self.hid(self.emb.weight[ids]) + self.frozen)  # weight[ids], not F.embedding
        return self.head(h)                                           # (B, T, VOCAB)


def make(seed=0):
    torch.manual_seed(seed)
    return Toy()


def data(steps=5, batch=8, seq=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (batch, seq), generator=g),
             torch.randint(0, VOCAB, (batch, seq), generator=g)) for _ in range(steps)]


def optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)


def loss_fn(out, y):
    return torch.nn.functional.cross_entropy(out.reshape(-1, VOCAB).float(), y.reshape(-1))


def one_device(opt_name, compute_dtype=None, steps=5):
    """The reference: one device, the whole batch; with compute_dtype, weights cast
    for forward/backward as FSDP does (master weights fp32)."""
    m = make()
    opt = optimizer(opt_name, m.parameters())
    for ids, y in data(steps):
        opt.zero_grad()
        ps = {n: p.to(compute_dtype) if compute_dtype else p for n, p in m.named_parameters()}
        loss_fn(torch.func.functional_call(m, ps, (ids,)), y).backward()
        opt.step()
    return {n: t.detach().clone() for n, t in m.state_dict().items()}


def wrapped(kind, opt_name, mesh=None, compute_dtype=None, bucket_bytes=None, steps=5):
    """The same training through DDP / FSDP / DDP + ZeroRedundancyOptimizer, on a
    simulated mesh (DistTensor batches) or on torch.distributed (mesh=None, this
    process's slice of each batch).  Returns the full state dict."""
    import torch.distributed as dist

    import workbench as wb
    m = make()
    if kind == "fsdp":
        w = wb.FullyShardedDataParallel(m, mesh, compute_dtype=compute_dtype)
    elif kind == "fsdp_units":        # hid its own unit, prefetched; head tied to the root's
        w = wb.FullyShardedDataParallel(m, mesh, compute_dtype=compute_dtype,
                                        units={nn.Linear}, prefetch=True)
    else:
        # the toy's unused parameter: torch DDP trains it only with find_unused_parameters
        w = wb.DistributedDataParallel(m, mesh, bucket_bytes=bucket_bytes,
                                       find_unused_parameters=True)
    if kind == "zero":
        cls = torch.optim.SGD if opt_name == "sgd" else torch.optim.AdamW
        kw = dict(lr=0.05, momentum=0.9) if opt_name == "sgd" else dict(lr=1e-3, weight_decay=0.1)
        opt = wb.ZeroRedundancyOptimizer(w.parameters(), cls, mesh, **kw)
    else:
        opt = optimizer(opt_name, w.parameters())
    for ids, y in data(steps):
        if mesh is None:
            n, k = dist.get_world_size(), dist.get_rank()
            ids, y = ids.chunk(n)[k], y.chunk(n)[k]
        else:
            ids = wb.shard_tensor(ids, mesh, [wb.Shard(0)])
            y = wb.shard_tensor(y, mesh, [wb.Shard(0)])
        opt.zero_grad()
        loss_fn(w(ids), y).backward()
        w.finish_gradient_synchronization()
        opt.step()
    return w.full_state_dict()


CASES = [("ddp", "sgd", None, None), ("ddp", "adamw", None, 64), ("fsdp", "sgd", None, None),
         ("fsdp", "adamw", None, None), ("fsdp", "adamw", "bfloat16", None),
         ("fsdp", "adamw", "float16", None), ("zero", "sgd", None, None),
         ("zero", "adamw", None, 128), ("fsdp_units", "sgd", None, None),
         ("fsdp_units", "adamw", "bfloat16", None)]
