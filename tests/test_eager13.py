"""The eager backward moves no more than the compiled program at O0 (eager13).

Two cases where the op-by-op backward reduced more than it needed
(``python -m benchmarks.eager_comm_probe`` lists the programs, before -> after):

* a row-parallel linear's REPLICATED bias on a dp x tp mesh: the bias is made Partial over
  tp for the op (R -> P, the first rank keeps it, a local step) and expanded over dp; its
  gradient's way back recorded Partial over tp, an all-reduce of the bias's gradient over
  tp, where the first rank's gradient is already the whole one (DTensor's redistribute
  backward keeps a Partial target's gradient Replicate; the compiled program records
  none).  Now one all-reduce over dp only.
* an input sharded UNEVENLY (held as cells) that column-parallel ops gather for
  themselves: each reader all-reduced the gathered copy's gradient (and the all-gather's
  backward sliced it locally) where one reduce-scatter of the summed gradient does, as
  for even shards (``reshard_backward.gather``) and as O0.

Values are held to one device (float64) and, where the path changed, bit for bit to the
per-reader path it replaces.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from workbench.parallel import reshard_backward as _rb
from workbench.parallel import storage

R, S = wb.Replicate, wb.Shard


def _v(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64)


def _bwd(fn, mesh, specs, level="eager"):
    """(backward collectives {(kind, mesh dim, buffer bytes): n} on rank 0, output, grads)."""
    xs = [wb.shard_tensor(_v(s, k), mesh, ps).requires_grad_() for k, (s, ps) in
          enumerate(specs)]
    call = fn if level == "eager" else wb.compile(fn, *xs, level=level)
    with wb.trace("a100") as tr:
        out = call(*xs)
        n = len(tr.collectives())
        G = wb.shard_tensor(_v(tuple(out.shape), 99), mesh, [R()] * mesh.ndim)
        (out * G).sum().backward()
    c = Counter((e.name, e.args["mesh_dim"], e.args["buffer_bytes"])
                for e in tr.collectives()[n:] if 0 in e.ranks)
    return c, out, xs


def _one_device(fn, specs):
    xs = [_v(s, k).requires_grad_() for k, (s, _) in enumerate(specs)]
    out = fn(*xs)
    (out * _v(tuple(out.shape), 99)).sum().backward()
    return out.detach(), [x.grad for x in xs]


def _assert_one_device(fn, specs, out, xs):
    ref, grads = _one_device(fn, specs)
    torch.testing.assert_close(out.full(), ref, rtol=1e-12, atol=1e-12)
    for x, g, (_, ps) in zip(xs, grads, specs):
        torch.testing.assert_close(x.grad.full(), g, rtol=1e-12, atol=1e-12)
        assert x.grad.placements == tuple(ps)


# ---- 1. a row-parallel linear's replicated bias ----------------------------------------

def _mlp(x, w1, b1, w2, b2):
    return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)


MLP = [((8, 16), [S(0), R()]), ((32, 16), [R(), S(0)]), ((32,), [R(), S(0)]),
       ((16, 32), [R(), S(1)]), ((16,), [R(), R()])]


def test_row_parallel_bias_reduced_over_dp_only():
    """x's gradient all-reduced over tp (512 B), w1, b1, w2 and b2 over dp (the batch is
    dp-sharded): five all-reduces, 4,864 B.  Before: b2's gradient also all-reduced over
    tp (128 B, 'grad of a replicated input P(sum)->R on tp'), six, 4,992 B."""
    mesh = wb.Mesh.grid((2, 2), ["dp", "tp"])
    c, out, xs = _bwd(_mlp, mesh, MLP)
    want = Counter([("all_reduce", "tp", 8 * 16 // 2 * 8),     # x: its (4, 16) f64
                    ("all_reduce", "dp", 32 * 16 // 2 * 8),    # w1: its (16, 16)
                    ("all_reduce", "dp", 32 // 2 * 8),         # b1: its (16,)
                    ("all_reduce", "dp", 16 * 32 // 2 * 8),    # w2: its (16, 16)
                    ("all_reduce", "dp", 16 * 8)])             # b2: (16,)
    assert c == want and sum(want.values()) == 5, c
    _assert_one_device(_mlp, MLP, out, xs)
    o0, _, _ = _bwd(_mlp, mesh, MLP, level="O0")
    assert c == o0


def test_row_parallel_bias_tp_only_unchanged():
    """On a tp-only mesh the bias needed nothing and still needs nothing: one all-reduce,
    x's gradient (1,024 B)."""
    mesh = wb.Mesh.grid((4,), ["tp"])
    specs = [(s, ps[1:]) for s, ps in MLP]
    specs[0] = ((8, 16), [R()])
    c, out, xs = _bwd(_mlp, mesh, specs)
    assert c == Counter({("all_reduce", "tp", 8 * 16 * 8): 1}), c
    _assert_one_device(_mlp, specs, out, xs)


@pytest.mark.parametrize("mesh_shape", [(2, 2), (4,)])
def test_gpt_layer_backward_is_o0s(mesh_shape):
    """GPTLayer (biased q/k/v, proj, fc1, fc2) under Megatron's plan: the eager backward
    records the compiled O0 program's collectives (dp x tp: 20 -> 18, 8,032 -> 7,904 B),
    gradients one device's."""
    from workbench.models.gpt import TP_PLAN, GPTLayer
    names = ["dp", "tp"][-len(mesh_shape):]
    mesh = wb.Mesh.grid(mesh_shape, names)
    X = _v((4, 2, 16), 0).float()
    pl = [S(1), R()] if len(mesh_shape) == 2 else [R()]
    res = {}
    for level in ("eager", "O0"):
        layer = wb.parallelize(GPTLayer(16, 2, dropout=0.0, dtype=torch.float32), mesh,
                               TP_PLAN, mesh_dim="tp")
        x = wb.shard_tensor(X, mesh, pl)
        call = layer if level == "eager" else wb.compile(layer, x, level="O0")
        with wb.trace("a100") as tr:
            loss = call(x).pow(2).mean()
            n = len(tr.collectives())
            loss.backward()
        res[level] = (Counter((e.name, e.args["mesh_dim"], e.args["buffer_bytes"])
                              for e in tr.collectives()[n:] if 0 in e.ranks),
                      [p.grad.full() for p in layer.parameters()])
    assert res["eager"][0] == res["O0"][0]
    ref = GPTLayer(16, 2, dropout=0.0, dtype=torch.float32)
    ref(X).pow(2).mean().backward()
    for g, p in zip(res["eager"][1], ref.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-6)
    # (tp4: 10 -> 7 with eager14's choice, which prices a re-layout's backward: the
    # all-to-alls of the head split and their transposes give way to all-gathers, as O0)
    assert sum(res["eager"][0].values()) == (18 if len(mesh_shape) == 2 else 7)


# ---- 2. an uneven shard gathered by its readers ------------------------------------------

def _readers(k):
    def fn(x, *ws):
        out = F.linear(x, ws[0])
        for w in ws[1:]:
            out = out * F.linear(x, w)
        return out
    return fn


def _uneven(k):
    # 6 rows over 4 ranks: 2, 2, 2, 0 (torch.chunk), held one tensor per rank (cells)
    return [((6, 16), [S(0)])] + [((32, 16), [S(0)])] * k


@pytest.mark.parametrize("k", [1, 2, 3])
def test_uneven_shard_reduce_scattered_once(k):
    """x (6, 16) f64 sharded 2, 2, 2, 0 over tp 4, read by k column-parallel linears,
    each gathering it: one reduce-scatter of the summed gradient (its 768 B buffer), as
    O0.  Before: one all-reduce of 768 B per reader ('linear input')."""
    mesh = wb.Mesh.grid((4,), ["tp"])
    specs = _uneven(k)
    x0 = wb.shard_tensor(_v(specs[0][0], 0), mesh, specs[0][1])
    assert storage.is_cells(x0._local)                    # the case under test
    c, out, xs = _bwd(_readers(k), mesh, specs)
    assert c == Counter({("reduce_scatter", "tp", 6 * 16 * 8): 1}), c
    _assert_one_device(_readers(k), specs, out, xs)
    o0, _, _ = _bwd(_readers(k), mesh, specs, level="O0")
    assert c == o0


def test_uneven_shard_values_bit_identical_to_the_per_reader_path(monkeypatch):
    """The same gradients, bit for bit, as the path it replaces (each reader's expand,
    the all-gather's local slice); that path recorded two all-reduces."""
    mesh = wb.Mesh.grid((4,), ["tp"])
    specs = _uneven(2)
    new, out_new, xs_new = _bwd(_readers(2), mesh, specs)
    gather = _rb.gather

    def old(t, *a, **kw):
        return None if storage.is_cells(t._local) else gather(t, *a, **kw)
    monkeypatch.setattr(_rb, "gather", old)
    was, out_old, xs_old = _bwd(_readers(2), mesh, specs)
    assert was == Counter({("all_reduce", "tp", 6 * 16 * 8): 2}), was
    assert new == Counter({("reduce_scatter", "tp", 6 * 16 * 8): 1})
    assert torch.equal(out_new.full(), out_old.full())
    for a, b in zip(xs_new, xs_old):
        assert torch.equal(a.grad.full(), b.grad.full())


def test_uneven_shard_reduced_after_every_reader():
    """The reduce-scatter is recorded once the readers' backward kernels have run."""
    mesh = wb.Mesh.grid((4,), ["tp"])
    specs = _uneven(3)
    xs = [wb.shard_tensor(_v(s, k), mesh, ps).requires_grad_() for k, (s, ps) in
          enumerate(specs)]
    with wb.trace("a100") as tr:
        out = _readers(3)(*xs)
        n = len(tr.events)
        out.sum().backward()
    ev = [e for e in tr.events[n:] if 0 in e.ranks]
    lin = [i for i, e in enumerate(ev) if e.stream != "comm" and e.name == "linear"]
    red = [i for i, e in enumerate(ev) if e.stream == "comm"]
    assert len(lin) >= 3 and len(red) == 1, [(e.name, e.label) for e in ev]
    assert red[0] > max(lin)


def test_llama_uneven_batch_backward_is_o0s():
    """Tiny Llama, one layer, batch 2 on dp 2 x tp 2: the norms' outputs are reduce-
    scattered over tp as 1 row over 2 ranks (uneven), then gathered by w1 and w3 (and q,
    k, v): the eager backward 20 collectives, 55,040 B -> 19, 54,016 B, O0's."""
    from workbench.models import TP_PLAN, build_model, get_config
    cfg = get_config("tiny", n_layer=1, d_model=32, n_head=2, d_ff=64, seq_len=8,
                     dropout=0.0, dtype="float32")
    mesh = wb.Mesh.grid((2, 2), ["dp", "tp"])
    idx = torch.randint(0, 75, (2, 8), generator=torch.Generator().manual_seed(0))
    res = {}
    for level in ("eager", "O0"):
        m = wb.parallelize(build_model(cfg, seed=0), mesh, TP_PLAN, mesh_dim="tp")
        x = wb.shard_tensor(idx, mesh, [S(0), R()])
        call = m if level == "eager" else wb.compile(m, x, level="O0")
        with wb.trace("a100") as tr:
            loss = call(x)[0].pow(2).mean()
            n = len(tr.collectives())
            loss.backward()
        ev = [e for e in tr.collectives()[n:] if 0 in e.ranks]
        res[level] = (Counter((e.name, e.args["mesh_dim"], e.args["buffer_bytes"])
                              for e in ev), [p.grad.full() for p in m.parameters()])
    assert res["eager"][0] == res["O0"][0]
    assert sum(res["eager"][0].values()) == 19
    ref = build_model(cfg, seed=0)
    ref(idx)[0].pow(2).mean().backward()
    for g, p in zip(res["eager"][1], ref.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-6)


# ---- 3. a compiled program's backward bytes ----------------------------------------------

@pytest.mark.parametrize("level", ["O0", "O1", "O2"])
@pytest.mark.parametrize("case", ["mlp", "uneven"])
def test_program_backward_bytes_are_its_traced_backward(case, level):
    """``prog.bytes`` counts the forward's reshards only; ``prog.backward_bytes`` is what
    the traced backward of the program sends per rank (wire bytes)."""
    if case == "mlp":
        fn, mesh, specs = _mlp, wb.Mesh.grid((2, 2), ["dp", "tp"]), MLP
    else:
        fn, mesh, specs = _readers(2), wb.Mesh.grid((4,), ["tp"]), _uneven(2)
    xs = [wb.shard_tensor(_v(s, k), mesh, ps).requires_grad_() for k, (s, ps) in
          enumerate(specs)]
    prog = wb.compile(fn, *xs, level=level)
    with wb.trace("a100") as tr:
        out = prog(*xs)
        n = len(tr.collectives())
        out.sum().backward()
    ev = tr.collectives()
    assert prog.bytes == sum(e.bytes for e in ev[:n] if 0 in e.ranks)
    assert prog.backward_bytes == sum(e.bytes for e in ev[n:] if 0 in e.ranks) > 0


def test_torchrun_row_parallel_bias_gradient(tmp_path_factory):
    """On 4 gloo processes (dp 2 x tp 2) the same MLP: the replicated bias's gradient is
    one device's and the backward runs the simulator's five all-reduces.  Before, the
    processes all-reduced the bias's gradient over tp as well (each already held the whole
    of it: KeepOnFirst's backward): b2.grad twice one device's, 5.06 off."""
    from tests.torchrun_support import four_proc, json_rows
    out, text = four_proc(tmp_path_factory, "eager13_check.py")   # the shared 4-process job
    assert out.returncode == 0, out.stderr[-3000:]
    row = {(r["rank"], r["case"]): r for r in json_rows(text)}[(0, "mlp")]
    assert max(row["errs"]) < 1e-12, row["errs"]
    mesh = wb.Mesh.grid((2, 2), ["dp", "tp"])
    sim, _, _ = _bwd(_mlp, mesh, MLP)
    assert Counter(tuple(b) for b in row["bwd"]) == sim
