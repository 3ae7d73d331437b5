"""Run under torchrun (gloo, 8 processes): the programs of tests/test_tdreshard.py on
torch.distributed.  Every rank prints one JSON line per case: what it computed against
plain PyTorch, the collectives its trace recorded (kind, bytes, group) and, for the
training case, its records and the names of its parameters' shards, which it saves (with
their gradients and bounds) to ``train_rank<r>.pt`` in the directory given as argv[1], for
the test to hold to the simulator's.  The test runs the same programs on simulated ranks.

The programs are written once, here, for both executors: ``mesh`` is a simulated Mesh or
a distributed one."""
import json
import os
import sys

import torch
import torch.nn.functional as F

import workbench as wb


def _inputs(*shapes):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*s, generator=g) for s in shapes]


def uneven_1d(mesh):
    """Uneven shards over 2 ranks: 5 rows 3/2, a vocabulary of 5 columns 3/2; reshards
    by all-to-all (uneven both ways), all-gather, reduce-scatter and slice, and a
    cross-entropy over the uneven vocabulary."""
    X, W = _inputs((5, 6), (6, 5))
    T = torch.tensor([0, 4, 2, 3, 1])
    refs = [t.clone().requires_grad_() for t in (X, W)]
    X.requires_grad_(), W.requires_grad_()
    x = wb.shard_tensor(X, mesh, [wb.Shard(0)])
    w = wb.shard_tensor(W, mesh, [wb.Shard(1)])
    xc = wb.reshard(x, mesh, [wb.Shard(1)])                  # S(0) -> S(1): 5 x 6 over 2
    logits = xc @ w                                          # (5, 5): 3/2 columns
    vocab = wb.reshard(logits, mesh, [wb.Shard(1)])          # the vocabulary 3/2
    loss = F.cross_entropy(vocab, wb.shard_tensor(T, mesh, [wb.Replicate()]))
    p = wb.reshard(logits * 2.0, mesh, [wb.Shard(0)])        # rows 3/2
    total = loss + (p * p).sum() * 1e-3
    total.backward()
    rx, rw = refs
    rl = rx @ rw
    rtotal = F.cross_entropy(rl, T) + ((rl * 2.0) ** 2).sum() * 1e-3
    rtotal.backward()
    return {"loss": _diff(total.full(), rtotal), "logits": _diff(logits.full(), rl),
            "grad_x": _diff(X.grad, rx.grad), "grad_w": _diff(W.grad, rw.grad)}


def empty_shard(mesh):
    """One row over 2 ranks (torch.chunk gives 1 and 0): the second rank holds an empty
    shard; the gather pads it, the gradient's slice keeps it empty."""
    (Z,) = _inputs((1, 3))
    ref = Z.clone().requires_grad_()
    Z.requires_grad_()
    z = wb.shard_tensor(Z, mesh, [wb.Shard(0)])
    r = wb.reshard(z * 3.0, mesh, [wb.Replicate()])
    out = (r * r).sum()
    out.backward()
    ((ref * 3.0) ** 2).sum().backward()
    return {"out": _diff(out.full(), ((ref * 3.0) ** 2).sum()), "grad": _diff(Z.grad, ref.grad)}


def uneven_2d(mesh):
    """A 2 x 2 mesh, a (5, 7) tensor sharded on both dims (3/2 and 4/3): all-to-all on
    one mesh dim while the other shards too, gathers, and the gradient back."""
    (X,) = _inputs((5, 7))
    ref = X.clone().requires_grad_()
    X.requires_grad_()
    x = wb.shard_tensor(X, mesh, [wb.Shard(0), wb.Shard(1)])
    y = wb.reshard(x, mesh, [wb.Shard(1), wb.Shard(0)])
    z = wb.reshard(torch.sin(y), mesh, [wb.Replicate(), wb.Shard(1)])
    out = (z * z).sum()
    out.backward()
    (torch.sin(ref) ** 2).sum().backward()
    return {"out": _diff(out.full(), (torch.sin(ref) ** 2).sum()), "grad": _diff(X.grad, ref.grad)}


def _gathered_twice(mesh, rows, x_pl=(wb.Shard(0),), w_pl=(wb.Shard(1),)):
    X, W1, W2 = _inputs((rows, 6), (6, 8), (6, 8))
    refs = [t.clone().requires_grad_() for t in (X, W1, W2)]
    for t in (X, W1, W2):
        t.requires_grad_()
    x = wb.shard_tensor(X, mesh, list(x_pl))
    w1 = wb.shard_tensor(W1, mesh, list(w_pl))
    w2 = wb.shard_tensor(W2, mesh, list(w_pl))
    out = ((x @ w1) * (x @ w2)).sum()        # each matmul gathers x itself
    out.backward()
    rx, r1, r2 = refs
    ((rx @ r1) * (rx @ r2)).sum().backward()
    return {"out": _diff(out.full(), ((rx @ r1) * (rx @ r2)).sum()),
            "grad_x": _diff(X.grad, rx.grad), "grad_w1": _diff(W1.grad, r1.grad),
            "grad_w2": _diff(W2.grad, r2.grad)}


def gather_even(mesh):
    """Two matmuls each gather the same row-sharded input (4 rows over 2) and give every
    rank its view: one reduce-scatter of the summed gradients in backward, as DTensor."""
    return _gathered_twice(mesh, 4)


def gather_uneven(mesh):
    """The same with 5 rows (3/2): one reduce-scatter of the summed gradient as well (the
    simulator's cells and this process's padded shard, eager13; each reader's all-reduce
    before)."""
    return _gathered_twice(mesh, 5)


def gather_2d(mesh):
    """dp x tp: the input sharded on tp, replicated on dp (held once), gathered by two
    matmuls whose weights shard their columns over both mesh dims: the summed gradient
    goes back on both dims (Partial on each)."""
    return _gathered_twice(mesh, 4, (wb.Replicate(), wb.Shard(0)), (wb.Shard(1), wb.Shard(1)))


def gather_mixed(mesh):
    """The same with 2 rows: the matmuls gather x itself over tp (cheaper than the weight)
    and give every rank a view over dp, where x is replicated and held once: one
    reduce-scatter over tp, then one all-reduce over dp, for both readers."""
    return _gathered_twice(mesh, 2, (wb.Replicate(), wb.Shard(0)), (wb.Shard(1), wb.Shard(1)))


def gather_sliced(mesh):
    """x [R, S(0)] read by two matmuls whose weights are [S(0), S(1)]: each op's plan
    slices x over dp (to S(1)) then gathers it over tp.  The readers' gradients meet in
    that layout ([S(1), P]) and one redistribution reduces first: a reduce-scatter over
    tp, then an all-gather over dp (tdreshard4; the simulator recorded the dp slice's
    all-gather per reader before the one reduce-scatter, torch.distributed all-reduced
    per reader)."""
    X, W1, W2 = (t * 0.5 for t in _inputs((4, 8), (8, 32), (8, 32)))   # (float32 sums)
    refs = [t.clone().requires_grad_() for t in (X, W1, W2)]
    for t in (X, W1, W2):
        t.requires_grad_()
    x = wb.shard_tensor(X, mesh, [wb.Replicate(), wb.Shard(0)])
    w1, w2 = (wb.shard_tensor(W, mesh, [wb.Shard(0), wb.Shard(1)]) for W in (W1, W2))
    out = ((x @ w1) * (x @ w2)).sum()
    out.backward()
    rx, r1, r2 = refs
    ((rx @ r1) * (rx @ r2)).sum().backward()
    return {"out": _diff(out.full(), ((rx @ r1) * (rx @ r2)).sum()),
            "grad_x": _diff(X.grad, rx.grad), "grad_w1": _diff(W1.grad, r1.grad),
            "grad_w2": _diff(W2.grad, r2.grad)}


# (name, mesh shape, mesh dim names, program): meshes over ranks 0 ..
PROGRAMS = [("uneven_1d", (2,), ("tp",), uneven_1d),
            ("empty_shard", (2,), ("tp",), empty_shard),
            ("uneven_2d", (2, 2), ("dp", "tp"), uneven_2d),
            ("gather_even", (2,), ("tp",), gather_even),
            ("gather_uneven", (2,), ("tp",), gather_uneven),
            ("gather_2d", (2, 2), ("dp", "tp"), gather_2d),
            ("gather_mixed", (2, 2), ("dp", "tp"), gather_mixed),
            ("gather_sliced", (2, 2), ("dp", "tp"), gather_sliced)]
TRAIN = dict(dp=2, tp=2, pp=2, sp=True)       # tiny, 8 ranks, 2 steps
TRAIN_ZB = dict(TRAIN, schedule="zb-h1")      # the same under a split backward (B, W)
TRAIN_STEPS = 2


def _diff(a, b) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max())


def comm_of(tr, rank) -> list:
    """The collectives ``rank`` took part in, in order: [kind, bytes, group]."""
    return [[e.name, int(e.bytes), list(e.ranks)] for e in tr.events
            if e.stream == "comm" and rank in e.ranks]


def run_program(fn, mesh):
    with wb.trace() as tr:
        res = fn(mesh)
    return res, tr


def trained(strategy):
    """(records, the trace of the last step, the model) of tiny under ``strategy``."""
    from workbench.train import train
    got = {}
    orig = strategy.step_report

    def report(tr, opt):
        got["trace"] = tr
        return orig(tr, opt)
    strategy.step_report = report
    got["model"] = None
    build = strategy.build_model

    def build_model(*a, **k):
        got["model"] = build(*a, **k)
        return got["model"]
    strategy.build_model = build_model
    recs = train("tiny", steps=TRAIN_STEPS, seed=0, strategy=strategy, timing=False)
    return recs, got["trace"], got["model"]


def dist_params(model):
    """{name: this process's shard} of the parameters it holds, with its (start, size) per
    dim in the global tensor."""
    from workbench.parallel import layout
    out = {}
    for name, p in model.named_parameters():
        if not isinstance(p, wb.DistTensor) or wb.distributed.rank() not in p.mesh.ranks:
            continue
        b = layout.shard_bounds(p.shape, p.mesh, p.placements, wb.distributed.rank())
        out[name] = (p.local().detach(), b,
                     None if p.grad is None else p.grad.local().detach())
    return out


def main():
    wb.distributed.init(timeout_s=120)
    rank = wb.distributed.rank()
    meshes = {}
    for name, shape, names, _ in PROGRAMS:   # every process builds every mesh (new_group)
        if (shape, names) not in meshes:
            meshes[(shape, names)] = wb.distributed.mesh(shape, names)
    for name, shape, names, fn in PROGRAMS:
        mesh = meshes[(shape, names)]
        if rank not in mesh.ranks:
            continue
        try:
            res, tr = run_program(fn, mesh)
            row = {"case": name, "rank": rank, "diffs": res, "comm": comm_of(tr, rank)}
        except Exception as e:       # noqa: BLE001 (reported, the test fails on it)
            row = {"case": name, "rank": rank, "raised": f"{type(e).__name__}: {e}"}
        print(json.dumps(row), flush=True)
    from workbench.recipes.hybrid import Hybrid
    try:
        recs, tr, model = trained(Hybrid(**TRAIN, distributed=True))
        shards = dist_params(model)      # the test holds them to the simulator's
        torch.save(shards, os.path.join(sys.argv[1], f"train_rank{rank}.pt"))
        row = {"case": "train", "rank": rank, "records": recs, "comm": comm_of(tr, rank),
               "params": sorted(shards)}
    except Exception as e:           # noqa: BLE001
        import traceback
        row = {"case": "train", "rank": rank, "raised": traceback.format_exc()[-2000:]}
    print(json.dumps(row), flush=True)
    try:                             # zero bubble: each micro-batch's W reduces what it must
        recs, tr, _ = trained(Hybrid(**TRAIN_ZB, distributed=True))
        row = {"case": "train_zb", "rank": rank, "records": recs, "comm": comm_of(tr, rank)}
    except Exception:                # noqa: BLE001
        import traceback
        row = {"case": "train_zb", "rank": rank, "raised": traceback.format_exc()[-2000:]}
    print(json.dumps(row), flush=True)
    torch.distributed.barrier()
    wb.distributed.shutdown()


if __name__ == "__main__":
    main()
