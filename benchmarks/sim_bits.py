"""Bit-identity fingerprint of the simulator's results over the programs the overhead work
touches: run it on two checkouts and compare (a speed change must change no record).

    OMP_NUM_THREADS=1 PYTHONPATH=<checkout> python benchmarks/sim_bits.py OUT.pkl
    python benchmarks/sim_bits.py --compare A.pkl B.pkl

Records (perf13's 3,222-record check, kept, plus perf14's placements, traces and modeled
clock): for the toy TP MLP (column- then row-parallel linear, pointwise ops between, sums)
on 1-d and 2-d meshes, float32 / float64, with and without bias and input gradient, twice
(first call, then the prepared op) and under ``torch.no_grad``: every output's and
gradient's value (sha1 of its bytes), shape, dtype, placements and its ranks' local
strides; for gpt-tiny under ``Hybrid(dp=2, tp=2)`` and ``Hybrid(dp=1, tp=4)``, three steps'
loss and every parameter gradient; then the same steps under ``wb.trace()`` (every event's
name, stream, start, duration, ranks, bytes, flops, label, args, by repr of the floats)
and with ``measure_activations()`` (the bytes counted).
"""
from __future__ import annotations

import hashlib
import pickle
import sys


def _digest(t):
    import torch
    t = t.detach().contiguous()
    if t.is_complex():
        t = torch.view_as_real(t).contiguous()
    raw = t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() and \
        t.dtype != torch.bool else repr(t.tolist()).encode()
    return str(t.dtype), tuple(t.shape), hashlib.sha1(raw).hexdigest()


def collect():
    import torch
    import torch.nn.functional as F
    import workbench as wb
    from workbench.parallel.dist_tensor import DistTensor
    from workbench.parallel import storage
    out = []

    def rec(name, t):
        if t is None:
            out.append((name, None))
            return
        if isinstance(t, DistTensor):
            locs = storage.tensors(t._local)
            out.append((name, "strides", tuple(tuple(loc.stride()) for loc in locs)))
            out.append((name, "placements", repr(tuple(t.placements)), tuple(t.shape)))
            t = t.full()
        out.append((name,) + _digest(t))

    def events(name, tr):
        for i, e in enumerate(tr.events):
            out.append((f"{name}ev{i}", e.name, e.stream, repr(e.start), repr(e.duration),
                        e.ranks, e.bytes, e.flops, e.label, repr(sorted(e.args.items()))))
        clock = sorted(tr._clock.items())
        out.append((f"{name}clock", repr(clock)))

    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        for mshape, T, H, bias, batch3, dt in [
                ((8,), 32, 64, False, False, torch.float32),
                ((4,), 5, 12, True, False, torch.float64),
                ((2,), 3, 4, False, True, torch.float32),
                ((2, 2), 4, 8, True, False, torch.float32),
                ((4,), 1, 8, False, False, torch.float32),
                ((2,), 6, 1, True, False, torch.float32)]:
            mesh = wb.Mesh.grid(mshape, ["a", "b"][:len(mshape)])
            X = torch.randn((2, T, H) if batch3 else (T, H), generator=g, dtype=dt)
            W1 = torch.randn(4 * H, H, generator=g, dtype=dt)
            W2 = torch.randn(H, 4 * H, generator=g, dtype=dt)
            B1 = torch.randn(4 * H, generator=g, dtype=dt)
            R = [wb.Replicate()] * len(mshape)
            S0 = [wb.Shard(0)] + [wb.Replicate()] * (len(mshape) - 1)
            S1 = [wb.Shard(1)] + [wb.Replicate()] * (len(mshape) - 1)
            for xgrad in (False, True):
                x = wb.shard_tensor(X, mesh, R)
                if xgrad:
                    x = x.requires_grad_()
                w1 = wb.shard_tensor(W1, mesh, S0).requires_grad_()
                w2 = wb.shard_tensor(W2, mesh, S1).requires_grad_()
                b1 = wb.shard_tensor(B1, mesh, S0).requires_grad_() if bias else None
                for rep in range(3):
                    tr_cm = wb.trace() if rep == 2 else None
                    tr = tr_cm.__enter__() if tr_cm is not None else None
                    h = F.linear(x, w1, b1)
                    a = torch.relu(h)
                    e = torch.tanh(h)
                    gl = F.gelu(h, approximate="tanh")
                    lr = F.leaky_relu(h, 0.1)
                    y = F.linear(a + e * gl - lr, w2)
                    s = y.sum()
                    s2 = y.sum(-1)
                    s3 = y.sum(dim=(0,), keepdim=True)
                    s4 = h.sum(dtype=torch.float64)
                    tag = f"{seed}{mshape}{T}{H}{bias}{xgrad}{rep}"
                    for nm, t in [("h", h), ("a", a), ("e", e), ("gl", gl), ("lr", lr),
                                  ("y", y), ("s", s), ("s2", s2), ("s3", s3), ("s4", s4)]:
                        rec(tag + nm, t)
                    (s + s3.sum() * 0.5 + s4.to(s.dtype)).backward()
                    if tr_cm is not None:
                        tr_cm.__exit__(None, None, None)
                        events(tag, tr)
                    for nm, p in [("w1", w1), ("w2", w2), ("b1", b1),
                                  ("x", x if xgrad else None)]:
                        rec(tag + "g" + nm, None if p is None else p.grad)
                    for p in (w1, w2, b1, x):
                        if p is not None and getattr(p, "requires_grad", False):
                            p.grad = None
                    with torch.no_grad():
                        rec(f"{seed}{mshape}nograd{rep}",
                            F.linear(torch.relu(F.linear(x, w1, b1)), w2).sum())
    # GPT hybrid (sim_overhead's case): loss and every parameter's gradient, 3 steps plain,
    # then traced, then traced with the activations counted
    from workbench.models.config import get_config
    from workbench.models.data import get_batch
    from workbench.recipes.hybrid import Hybrid
    cfg = get_config("gpt-tiny")
    for dp, tp in ((2, 2), (1, 4)):
        st = Hybrid(dp=dp, tp=tp)
        model = st.build_model(cfg, 0)
        for it in range(5):
            inp, tgt = get_batch(cfg, 4, 0, it)
            model.zero_grad(set_to_none=True)
            tag = f"gpt{dp}{tp}_{it}"
            if it < 3:
                loss = st.forward_backward(model, inp, tgt)
            elif it == 3:
                with wb.trace() as tr:
                    loss = st.forward_backward(model, inp, tgt)
                events(tag, tr)
            else:
                with wb.trace() as tr, st.measure_activations():
                    loss = st.forward_backward(model, inp, tgt)
                events(tag, tr)
                out.append((tag + "act", st.last_activation_bytes))
            rec(tag + "loss", loss)
            for pn, p in model.named_parameters():
                rec(tag + pn, p.grad)
    return out


def compare(a, b) -> int:
    A, B = pickle.load(open(a, "rb")), pickle.load(open(b, "rb"))
    bad = [(i, x, y) for i, (x, y) in enumerate(zip(A, B)) if x != y]
    print(f"{len(A)} vs {len(B)} records; {len(bad)} differ")
    for i, x, y in bad[:10]:
        print(i, x, "\n  ", y)
    return 1 if bad or len(A) != len(B) else 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--compare":
        return compare(argv[1], argv[2])
    import torch
    torch.manual_seed(0)
    out = collect()
    pickle.dump(out, open(argv[0], "wb"))
    print(f"{len(out)} records")
    return 0


if __name__ == "__main__":
    sys.exit(main())
