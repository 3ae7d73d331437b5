"""User modules under ``wb.compile`` at each level over two optimizer steps, against the
same module run eagerly on the same DistTensors and against one device (helper compile12).

    nice python -m tests.compile_probe_modules
"""
from __future__ import annotations

import math
import sys
import warnings
from collections import Counter

import torch
import torch.nn as nn
import torch.nn.functional as F

import workbench as wb
from workbench.parallel import Replicate, Shard


class Attention(nn.Module):
    def __init__(self, d=16, h=2):
        super().__init__()
        self.h = h
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.o = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        b, s, d = x.shape
        y = self.norm(x)
        q, k, v = (m(y).view(b, s, self.h, d // self.h).transpose(1, 2)
                   for m in (self.q, self.k, self.v))
        a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // self.h), -1) @ v
        return x + self.o(a.transpose(1, 2).reshape(b, s, d))


class SDPA(Attention):
    def forward(self, x):
        b, s, d = x.shape
        y = self.norm(x)
        q, k, v = (m(y).view(b, s, self.h, d // self.h).transpose(1, 2)
                   for m in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(a.transpose(1, 2).reshape(b, s, d))


def _seq():
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 16),
                         nn.Tanh(), nn.Linear(16, 8))


# name -> (maker, tp plan, input shape, input placements on a (2, 2) mesh)
MODULES = {
    "seq dp": (_seq, {}, (4, 8), [Shard(0), Replicate()]),
    "seq tp": (_seq, {"0": "colwise", "3": "rowwise"}, (4, 8), [Shard(0), Replicate()]),
    "seq replicated": (_seq, {}, (4, 8), [Replicate(), Replicate()]),
    "attention dp": (Attention, {}, (2, 4, 16), [Shard(0), Replicate()]),
    "attention tp": (Attention, {"q": "colwise", "k": "colwise", "v": "colwise",
                                 "o": "rowwise"}, (2, 4, 16), [Shard(0), Replicate()]),
    "sdpa seq-sharded": (SDPA, {}, (2, 4, 16), [Replicate(), Shard(1)]),
}


def _comm(tr):
    return Counter(e.name for e in tr.events if e.stream == "comm" and 0 in e.ranks)


def run(name, level, opt=torch.optim.AdamW, steps=2):
    """{kind: max difference} and the collectives, compiled vs eager vs one device."""
    make, plan, shape, pl = MODULES[name]
    mesh = wb.Mesh.grid((2, 2), ("dp", "tp"))
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(shape, generator=g) for _ in range(steps)]
    res = []
    for mode in ("one", "eager", "compiled"):
        torch.manual_seed(0)
        m = make()
        if mode != "one":
            m = wb.parallelize(m, mesh, plan, mesh_dim="tp")
        o = opt(m.parameters(), lr=1e-2)
        call, rec = m, []
        for x in xs:
            xin = x if mode == "one" else wb.shard_tensor(x, mesh, pl)
            if mode == "compiled" and call is m:
                call = wb.compile(m, xin, level=level)
            o.zero_grad()
            with wb.trace() as tr:
                y = call(xin)
                loss = y.pow(2).mean()
            with wb.trace() as tb:
                loss.backward()
            full = (lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t)
            rec.append((full(y).detach(), [full(p.grad) for p in m.parameters()],
                        (_comm(tr), _comm(tb)),
                        y.dtype))
            o.step()
        res.append((rec, [full(p).detach() for p in m.parameters()],
                    getattr(call, "breaks", None)))
    (one, p1, _), (eag, pe, _), (com, pc, br) = res
    d_ce = d_e1 = 0.0
    for (ye, ge, ce, te), (yc, gc, cc, tc), (y1, g1, _, t1) in zip(eag, com, one):
        assert te == tc == t1, (te, tc, t1)
        d_ce = max(d_ce, float((yc - ye).abs().max()), *[float((a - b).abs().max())
                                                        for a, b in zip(gc, ge)])
        d_e1 = max(d_e1, float((ye - y1).abs().max()), *[float((a - b).abs().max())
                                                        for a, b in zip(ge, g1)])
        # O0: the forward's collectives are eager's, the backward's never more (its
        # gradient all-reduces of a replicated input read by several ops: the compiled
        # backward measured one fewer on tp than eager's for equal gradients, seq / attention tp)
        if level == "O0" and not br:
            assert cc[0] == ce[0] and sum(cc[1].values()) <= sum(ce[1].values()), (cc, ce)
    # (parameters after AdamW apart: a gradient near 0, k.bias's 1e-9, moves by up to lr
    # whatever its last bits)
    p_ce = max(float((a - b).abs().max()) for a, b in zip(pc, pe))
    p_e1 = max(float((a - b).abs().max()) for a, b in zip(pe, p1))
    comm = (sum(sum(c.values()) for c in com[0][2]), sum(sum(c.values()) for c in eag[0][2]))
    return d_ce, d_e1, br, comm, p_ce, p_e1


def main():
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    for name in MODULES:
        for level in ("O0", "O1", "O2"):
            try:
                d_ce, d_e1, br, comm, p_ce, p_e1 = run(name, level)
                st = "eager" if br else "compiled"
                print(f"{name:18s} {level}: {st} compiled-eager {d_ce:.2e} eager-one "
                      f"{d_e1:.2e} (values, grads); params {p_ce:.1e} / {p_e1:.1e}; "
                      f"collectives compiled/eager {comm}"
                      + (f" break: {br[0].reason[:100]}" if br else ""), flush=True)
            except Exception as e:     # noqa: BLE001
                print(f"{name:18s} {level}: {type(e).__name__}: {str(e)[:200]}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
