"""Communication of the eager (op-by-op) DistTensor step against the compiled program at O0
and against PyTorch DTensor: collectives and bytes per rank, forward and backward.

For each program below the same inputs run

* eagerly on DistTensors (``workbench.parallel.dispatch``): the trace's collectives that
  rank 0 takes part in, counted in forward (the program) and backward (``backward()`` of
  the loss, the leaves' gradients in their layouts);
* as one compiled program at O0 (``wb.compile(fn, *inputs, level="O0")``), traced alike;
* where the program is made of plain functional ops, as PyTorch DTensor under
  ``LocalTensorMode`` on a fake process group (``tests/dtensor_support.py``), its
  collectives logged by ``tests/test_dtensor_ops_comm.CommRecorder`` and every leaf's
  gradient redistributed to the leaf's own placements (what ``.grad`` holds here).

Bytes are buffer bytes (the cost model's convention, ``sim_mesh/cost.py``: an all-gather
counts its gathered buffer), summed over the collectives rank 0 runs.  Each O0 program's
``prog.bytes`` (its forward reshards) and ``prog.backward_bytes`` (its schedule's backward)
are printed beside the wire bytes its traced run sent (a module's loss runs eagerly after
its program: any reshard the loss needs is in the traced figures only).  The loss is
``(out * G).sum()`` with ``G`` replicated (linear in ``out``: a Partial ``out`` stays
Partial, a sharded one meets its slice of ``G``; the loss's own communication, if any, is
counted in backward), or a module's ``y.pow(2).mean()``.

    python -m benchmarks.eager_comm_probe [--no-dtensor] [name ...]

Measured (eager13, backward collectives / buffer bytes on rank 0, eager before -> after;
O0 and the forward unchanged): mlp col->row dp2xtp2 6 / 4,992 -> 5 / 4,864; uneven S(0)
read by 2 (tp4) AR 2 / 1,536 -> RS 1 / 768; attention block dp2xtp2 13 / 2,912 -> 12 /
2,848; gpt layer dp2xtp2 20 / 8,032 -> 18 / 7,904; llama dp2xtp2 batch 2 20 / 55,040 ->
19 / 54,016.  Every program's eager backward is now O0's; the gradients are bit for bit
what they were.

eager14: the op-by-op choice (eager and O0's, ``ops_table/strategy.py``) prices the
transposes of an input's re-layout when the input requires grad (``backward_price``): an
all-to-all runs again in backward, a local slice's gradient is all-gathered (a Partial's
reduce-scatter is still ranked on its forward: its docstring says why).  Rank 0,
(forward + backward) collectives / buffer bytes, eager = O0 before and after (python -m
benchmarks.eager_comm_probe): slice rows S(0) 3 / 5,120 -> 1 / 2,048 (DTensor's one
all-gather; modeled comm on the a100 15.07 -> 5.03 us); pad rows alike; slice cols S(1)
3 / 2,560 -> 1 / 1,024 (16.49 -> 5.02 us); slice+pad cols (new) 3 / 4,608 -> 1 / 1,024
(16.55 -> 5.02 us); embedding dim-sharded 1 / 4,096 -> 1 / 3,072; attention block tp4
11 / 2,816 -> 7 / 3,584 (more bytes, fewer latencies: the chooser ranks modeled time
first); gpt layer tp4 17 / 6,656 -> 11 / 5,760; the others unchanged.  DTensor's column: under
LocalTensorMode the replicated bias b2's gradient (mlp dp2xtp2) comes back Replicate with
no collective logged (its value right): its 4 all-reduces are a floor, not a count.
"""
from __future__ import annotations

import argparse
import math
import sys
import warnings
from collections import Counter

import torch
import torch.nn as nn
import torch.nn.functional as F

import workbench as wb

R, S, P = wb.Replicate, wb.Shard, wb.Partial
PROFILE = "a100"


def _v(shape, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=dtype)


# ---- functional programs: (mesh shape, [(shape, placements)], fn) ------------------------

def _mlp(x, w1, b1, w2, b2):                      # Megatron MLP: column then row parallel
    return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)


def _residual3(x, w1, w3, w2):                    # x read by w1, w3 and the residual add
    return x + F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


def _qkv(x, wq, wk, wv):                          # x read by three column-parallel linears
    return F.linear(x, wq) * F.linear(x, wk) + F.linear(x, wv)


def _slice_rows(x, w):                            # a row slice of a row-sharded tensor
    return F.linear(x[2:14], w)


def _pad_rows(x, w):                              # zero rows padded onto a sharded tensor
    return F.linear(F.pad(x, (0, 0, 2, 2)), w)


def _slice_cols(x, w):                            # a slice of the sharded feature dim
    return F.linear(x[:, 4:12], w)


def _slice_pad_cols(x, w):                        # a feature slice, padded back, then tanh
    return torch.tanh(F.linear(F.pad(x[:, 2:], (0, 2)), w))


def _two_readers(x, w1, w2):                      # two column-parallel readers of x
    return F.linear(x, w1) * F.linear(x, w2)


def _embed(idx, w, w2):                           # an embedding, then a linear
    return F.linear(F.embedding(idx, w), w2)


D, H = 16, 32
FUNCS = {
    # name: (mesh shape, inputs [(shape, placements) or ("idx", shape, placements)], fn)
    "mlp col->row tp4": ((4,), [((8, D), [R()]), ((H, D), [S(0)]), ((H,), [S(0)]),
                                ((D, H), [S(1)]), ((D,), [R()])], _mlp),
    "mlp col->row dp2xtp2": ((2, 2), [((8, D), [S(0), R()]), ((H, D), [R(), S(0)]),
                                      ((H,), [R(), S(0)]), ((D, H), [R(), S(1)]),
                                      ((D,), [R(), R()])], _mlp),
    "residual x3 tp4": ((4,), [((8, D), [R()]), ((H, D), [S(0)]), ((H, D), [S(0)]),
                               ((D, H), [S(1)])], _residual3),
    "qkv tp4": ((4,), [((8, D), [R()])] + [((H, D), [S(0)])] * 3, _qkv),
    "qkv dp2xtp2": ((2, 2), [((8, D), [S(0), R()])] + [((H, D), [R(), S(0)])] * 3, _qkv),
    # 6 rows over 4 ranks: 2, 2, 2, 0 (torch.chunk), held as cells; each reader gathers it
    "uneven S(0) read by 2 tp4": ((4,), [((6, D), [S(0)]), ((H, D), [S(0)]),
                                         ((H, D), [S(0)])], _two_readers),
    "slice rows S(0) tp4": ((4,), [((16, D), [S(0)]), ((H, D), [R()])], _slice_rows),
    "pad rows S(0) tp4": ((4,), [((16, D), [S(0)]), ((H, D), [R()])], _pad_rows),
    "slice cols S(1) tp4": ((4,), [((8, D), [S(1)]), ((H, 8), [R()])], _slice_cols),
    "slice+pad cols S(1) tp4": ((4,), [((8, D), [S(1)]), ((H, D), [R()])], _slice_pad_cols),
    "embedding vocab-sharded tp4": ((4,), [("idx", (4, 6), [R()]), ((24, D), [S(0)]),
                                           ((H, D), [S(0)])], _embed),
    "embedding dim-sharded tp4": ((4,), [("idx", (4, 6), [R()]), ((24, D), [S(1)]),
                                         ((H, D), [R()])], _embed),
}


def _names(shape):
    return ["dp", "tp"][-len(shape):]


def _func_inputs(mesh_shape, specs):
    """(global tensors, placements, requires_grad) per input."""
    out = []
    for k, sp in enumerate(specs):
        if sp[0] == "idx":
            _, shape, ps = sp
            g = torch.Generator().manual_seed(100 + k)
            out.append((torch.randint(0, 24, shape, generator=g), ps, False))
        else:
            shape, ps = sp
            out.append((_v(shape, k), ps, True))
    return out


def _comm(tr, start=0):
    """(count, buffer bytes, {kind: count}) of the collectives rank 0 runs."""
    ev = [e for e in tr.collectives()[start:] if 0 in e.ranks]
    return (len(ev), sum(int(e.args.get("buffer_bytes", e.bytes)) for e in ev),
            Counter(e.name for e in ev))


def _run_ours(name, level):
    mesh_shape, specs, fn = FUNCS[name]
    mesh = wb.Mesh.grid(mesh_shape, _names(mesh_shape))
    ins = _func_inputs(mesh_shape, specs)
    xs = [wb.shard_tensor(t, mesh, ps) for t, ps, _ in ins]
    xs = [x.requires_grad_() if rg else x for x, (_, _, rg) in zip(xs, ins)]
    call = fn if level == "eager" else wb.compile(fn, *xs, level=level)
    with wb.trace(PROFILE) as tr:
        out = call(*xs)
        n = len(tr.collectives())
        G = wb.shard_tensor(_v(tuple(out.shape), 99), mesh, [R()] * mesh.ndim)
        (out * G).sum().backward()
    fwd, bwd = _comm_split(tr, n)
    grads = [x.grad.full() if rg else None for x, (_, _, rg) in zip(xs, ins)]
    if level != "eager":
        _PROG[name] = _prog_bytes(call, tr, n)
    return fwd, bwd, out.full().detach(), grads


_PROG: dict = {}         # name -> the O0 program's bytes against its traced run's


def _prog_bytes(prog, tr, n):
    """(prog.bytes, prog.backward_bytes, traced forward, traced backward): bytes each rank
    sends (wire bytes, ``Trace`` events' ``bytes``)."""
    if getattr(prog, "eager", False):
        return None
    ev = tr.collectives()
    return (prog.bytes, prog.backward_bytes, sum(e.bytes for e in ev[:n] if 0 in e.ranks),
            sum(e.bytes for e in ev[n:] if 0 in e.ranks))


def _comm_split(tr, n):
    ev = [e for e in tr.collectives()]
    a = [e for e in ev[:n] if 0 in e.ranks]
    b = [e for e in ev[n:] if 0 in e.ranks]

    def c(es):
        return (len(es), sum(int(e.args.get("buffer_bytes", e.bytes)) for e in es),
                Counter(e.name for e in es))
    return c(a), c(b)


def _reference(name):
    mesh_shape, specs, fn = FUNCS[name]
    ins = _func_inputs(mesh_shape, specs)
    xs = [t.clone().requires_grad_() if rg else t for t, _, rg in ins]
    out = fn(*xs)
    (out * _v(tuple(out.shape), 99)).sum().backward()
    return out.detach(), [x.grad if rg else None for x, (_, _, rg) in zip(xs, ins)]


_ORACLE = None


def _run_dtensor(name):
    """DTensor's forward and backward collectives (None where it cannot run)."""
    global _ORACLE
    try:
        from tests.dtensor_support import LocalTensorMode, Oracle, distribute_tensor, to_dt
        from tests.test_dtensor_ops_comm import CommRecorder
    except BaseException:                  # noqa: BLE001 (pytest.skip at import)
        return None
    if _ORACLE is None:
        _ORACLE = Oracle()
    mesh_shape, specs, fn = FUNCS[name]
    mesh = _ORACLE.mesh(mesh_shape)
    ins = _func_inputs(mesh_shape, specs)
    with LocalTensorMode(math.prod(mesh_shape)):
        xs = []
        for t, ps, rg in ins:
            d = distribute_tensor(t, mesh, [to_dt(p) for p in ps])
            xs.append(d.detach().requires_grad_() if rg else d)
        rec = CommRecorder()
        with rec:
            out = fn(*xs)
            n = len(rec.log)
            G = distribute_tensor(_v(tuple(out.shape), 99), mesh,
                                  [to_dt(R())] * len(mesh_shape))
            (out * G).sum().backward()
            for x, (_, ps, rg) in zip(xs, ins):
                if rg:
                    x.grad.redistribute(mesh, [to_dt(p) for p in ps])

    def c(log):
        return (len(log), sum(b for _, _, b, _ in log), Counter(k for k, _, _, _ in log))
    return c(rec.log[:n]), c(rec.log[n:])


# ---- modules: (maker, tp plan, input maker, mesh shape, input placements) ----------------

class _Attention(nn.Module):
    """A pre-norm attention block (q, k, v column-parallel, o row-parallel)."""

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
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(a.transpose(1, 2).reshape(b, s, d))


_ATT_PLAN = {"q": "colwise", "k": "colwise", "v": "colwise", "o": "rowwise"}


def _gpt_layer():
    from workbench.models.gpt import GPTLayer
    return GPTLayer(16, 2, dropout=0.0, dtype=torch.float32)


def _llama():
    from workbench.models import build_model, get_config
    cfg = get_config("tiny", n_layer=1, d_model=32, n_head=2, d_ff=64, seq_len=8,
                     dropout=0.0, dtype="float32")
    return build_model(cfg, seed=0)


def _gpt_plan():
    from workbench.models.gpt import TP_PLAN
    return TP_PLAN


def _llama_plan():
    from workbench.models import TP_PLAN
    return TP_PLAN


def _llama_loss(out):
    return out[0].pow(2).mean()


MODULES = {
    # name: (maker, plan maker, input (shape or "idx"), mesh shape, placements, loss)
    "attention block tp4": (_Attention, lambda: _ATT_PLAN, (2, 4, 16), (4,), [R()], None),
    "attention block dp2xtp2": (_Attention, lambda: _ATT_PLAN, (2, 4, 16), (2, 2),
                                [S(0), R()], None),
    "gpt layer tp4": (_gpt_layer, _gpt_plan, (4, 2, 16), (4,), [R()], None),
    "gpt layer dp2xtp2": (_gpt_layer, _gpt_plan, (4, 2, 16), (2, 2), [S(1), R()], None),
    "llama tp2": (_llama, _llama_plan, "idx", (2,), [R()], _llama_loss),
    "llama dp2xtp2": (_llama, _llama_plan, ("idx", 4), (2, 2), [S(0), R()], _llama_loss),
    # batch 2 over dp 2: each dp rank's one row reduce-scattered over tp is uneven (1, 0)
    "llama dp2xtp2 batch 2": (_llama, _llama_plan, "idx", (2, 2), [S(0), R()], _llama_loss),
}


def _run_module(name, level):
    make, plan, inp, mesh_shape, pl, lossf = MODULES[name]
    mesh = wb.Mesh.grid(mesh_shape, _names(mesh_shape))
    torch.manual_seed(0)
    m = wb.parallelize(make(), mesh, plan(), mesh_dim="tp")
    if inp == "idx" or inp[0] == "idx":
        b = 2 if inp == "idx" else inp[1]
        X = torch.randint(0, 75, (b, 8), generator=torch.Generator().manual_seed(0))
        x = wb.shard_tensor(X, mesh, pl)
    else:
        X = _v(inp, 0, torch.float32)
        x = wb.shard_tensor(X, mesh, pl).requires_grad_()
    call = m if level == "eager" else wb.compile(m, x, level=level)
    lossf = lossf or (lambda y: y.pow(2).mean())
    with wb.trace(PROFILE) as tr:
        loss = lossf(call(x))
        n = len(tr.collectives())
        loss.backward()
    fwd, bwd = _comm_split(tr, n)
    grads = [p.grad.full() for p in m.parameters()]
    extra = getattr(call, "breaks", None)
    if level != "eager":
        _PROG[name] = _prog_bytes(call, tr, n)
    return fwd, bwd, float(loss.full()), grads, extra


def _fmt(c):
    if c is None:
        return "-"
    n, b, kinds = c
    short = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS",
             "all_to_all": "A2A", "broadcast": "BC", "send_recv": "SR"}
    ks = " ".join(f"{short.get(k, k)}{v}" for k, v in sorted(kinds.items()))
    return f"{n:2d} {b:7,d} B ({ks})" if n else " 0       0 B"


def measure(names=None, dtensor=True):
    """{name: {executor: (forward, backward)}}, each (count, bytes, kinds)."""
    res = {}
    for name in names or list(FUNCS) + list(MODULES):
        row = {}
        if name in FUNCS:
            ref_out, ref_g = _reference(name)
            for level in ("eager", "O0"):
                try:
                    fwd, bwd, out, grads = _run_ours(name, level)
                except Exception as e:       # noqa: BLE001 (reported, the probe goes on)
                    row[level] = f"{type(e).__name__}: {str(e)[:80]}"
                    continue
                err = max([float((out - ref_out).abs().max())] +
                          [float((a - b).abs().max()) for a, b in zip(grads, ref_g)
                           if a is not None])
                row[level] = (fwd, bwd, err)
            if dtensor:
                try:
                    d = _run_dtensor(name)
                    row["dtensor"] = d if d is None else (d[0], d[1], None)
                except Exception as e:       # noqa: BLE001
                    row["dtensor"] = f"{type(e).__name__}: {str(e)[:80]}"
        else:
            for level in ("eager", "O0"):
                try:
                    fwd, bwd, loss, grads, br = _run_module(name, level)
                except Exception as e:       # noqa: BLE001
                    row[level] = f"{type(e).__name__}: {str(e)[:80]}"
                    continue
                if level == "eager":
                    g0 = grads
                    err = 0.0
                else:
                    err = max(float((a - b).abs().max()) for a, b in zip(grads, g0))
                row[level] = (fwd, bwd, err, "graph break" if br else "")
        res[name] = row
    return res


def report(res):
    lines = []
    for name, row in res.items():
        lines.append(name)
        for ex, r in row.items():
            if isinstance(r, str) or r is None:
                lines.append(f"   {ex:8s} {r}")
                continue
            note = "" if r[2] is None else f"  max err {r[2]:.1e}"
            if len(r) > 3 and r[3]:
                note += f" ({r[3]})"
            lines.append(f"   {ex:8s} fwd {_fmt(r[0]):34s} bwd {_fmt(r[1]):34s}{note}")
        pb = _PROG.get(name)
        if pb is not None:
            lines.append(f"   O0 prog.bytes {pb[0]:,d} B, prog.backward_bytes {pb[1]:,d} B; "
                         f"traced (wire) {pb[2]:,d} B / {pb[3]:,d} B")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*")
    ap.add_argument("--no-dtensor", action="store_true")
    a = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    print(report(measure(a.names or None, not a.no_dtensor)), flush=True)
    if _ORACLE is not None:
        _ORACLE.close()


if __name__ == "__main__":
    sys.exit(main())
