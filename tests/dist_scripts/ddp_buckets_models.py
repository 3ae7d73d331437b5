"""Models whose DDP buckets tell torch's rules apart (tests/test_ddp_buckets_default.py):
gradients over 1 MiB (the first bucket's cap), mixed dtypes, layers registered in another
order than they run, tied / frozen / unused parameters."""
import torch
from torch import nn

from wrappers_model import Toy, VOCAB


class Mixed(nn.Module):
    """fp32 and fp64 layers; c's weight is 2 MiB: past the first bucket's 1 MiB."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 512)
        self.b = nn.Linear(512, 512).double()
        self.c = nn.Linear(512, 1024)
        self.d = nn.Linear(1024, 8)

    def forward(self, x):                       # (B, 16)
        return self.d(self.c(torch.relu(self.b(self.a(x).double())).float()))


class Reordered(nn.Module):
    """Registered out, mid, inp; run inp, mid, out: backward's order is not the reverse
    of registration (mid's weight, 1.4 MB, closes a bucket)."""

    def __init__(self):
        super().__init__()
        self.out = nn.Linear(600, 8)
        self.mid = nn.Linear(600, 600)
        self.inp = nn.Linear(16, 600)

    def forward(self, x):                       # (B, 16)
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


class SmallMixed(nn.Module):
    """Small layers of three dtypes: every bucket is one left open at the end."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(16, 16).to(dt) for dt in
                                     (torch.float32, torch.bfloat16, torch.float64,
                                      torch.float32, torch.bfloat16)])

    def forward(self, x):                       # (B, 16)
        for layer in self.layers:
            x = layer(x.to(layer.weight.dtype))
        return x.float()


MODELS = {"mixed": Mixed, "reordered": Reordered, "small_mixed": SmallMixed, "toy": Toy}
# torch DDP's keyword arguments tried on each model; the toy model has an unused
# parameter, which torch trains only with find_unused_parameters=True
CONFIGS = [{}, {"bucket_cap_mb": 1}, {"static_graph": True}, {"gradient_as_bucket_view": True},
           {"find_unused_parameters": True},
           {"find_unused_parameters": True, "bucket_cap_mb": 0.5}]
STEPS = 4


def cases():
    for name in MODELS:
        for kw in CONFIGS:
            if name != "toy" or kw.get("find_unused_parameters"):
                yield name, kw


def dist_tensor_cases():
    """The cases also run in DDP's DistTensor mode (wb.parallelize over a dp mesh)."""
    for name, kw in cases():
        if name != "toy" and set(kw) <= {"bucket_cap_mb"}:
            yield name, kw


def make(name):
    torch.manual_seed(0)
    return MODELS[name]()


def batch(name, step, batch_size=4):
    """The global batch of ``step`` and the loss of the model's output."""
    g = torch.Generator().manual_seed(step)
    if name == "toy":
        return torch.randint(0, VOCAB, (batch_size, 3), generator=g)
    return torch.randn(batch_size, 16, generator=g)


def loss(out):
    return out.float().pow(2).mean()
