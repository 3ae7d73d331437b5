"""The random programs of tests/random_programs.py (and ``wide``: random_programs_wide.py)
under ``wb.compile`` at each level, held to the same program run eagerly (op by op) on the
same DistTensors, and to one device (helper compile12).

    nice python -m tests.compile_probe [--start 0] [--cases 40] [--wide] [--reasons]

``--reasons``: each (seed, level) that did not compile whole, and a tally of the breaks and
refusals by reason (its place, shapes and numbers left out), most common first.

A program: the first leaf, then the drawn chain of ops (binary ops read further leaves,
which the chain's functions hold as closures: the compiled program reads them from
outside, as a user function reading a module global does).  Each is run eagerly on the
DistTensors (skipped when eager refuses it: that is random_sweep's business), then
compiled at O0 / O1 / O2 and called on the same first leaf; the outputs' values, dtypes,
shapes and, where the result needs grad, every leaf's gradient after ``(out * g).sum()``
are compared with eager's (O0: exactly, and its collectives counted equal).  Outcomes per
(program, level): compiled (equal, no break), eager (a graph break: ran op by op; equal),
refused (ValueError / NotImplementedError naming why), differ (a silent difference),
raised (another exception).
"""
from __future__ import annotations

import argparse
import collections
import random
import re
import sys
import traceback
import warnings
from collections import Counter

import torch

import workbench as wb
from tests import random_programs as rp
from tests import random_programs_wide as _wide

LEVELS = ("O0", "O1", "O2")


class Differ(Exception):
    pass


def draw(seed: int, wide: bool):
    """(lines, leaves [(name, dist, ref, placements)], fns [f], x0) or None (eager or torch
    refused a step: nothing to hold compile to)."""
    rng = random.Random(seed)
    p = rp._Prog(rng, rp.KNOWN + rp.SLOW)
    p.wide = wide
    # the wide kinds the probe's seeds were drawn from (random_programs_wide.WIDE14; the
    # ops NEW15 added are held to eager by tests/test_compile15.py one by one)
    p.wide_kinds = _wide.WIDE14
    p.mesh = rp._mesh(rng)
    p.lines.append(f"mesh = wb.Mesh({p.mesh.tolist()})")
    try:
        shape = p.shape()
        first = _wide.dtype(rng) if wide else (
            torch.float32 if rng.random() < 0.1 else torch.float64)
        cur = p.leaf(shape, dtype=first)
        fns = []
        for _ in range(rng.randint(1, 6)):
            for _try in range(20):
                drawn = rp._op(p, cur)
                if drawn is None:
                    continue
                txt, f = drawn
                try:
                    ref = f(cur[2])
                except Exception:     # noqa: BLE001 - torch refuses it: not drawn
                    continue
                d = f(cur[1])
                nm = p.name()
                p.lines.append(f"{nm} = {txt}")
                cur = (nm, d, ref)
                fns.append(f)
                break
    except Exception:     # noqa: BLE001 - eager refused (random_sweep reports those)
        return None
    if not fns:
        return None
    return p, fns


def _cells(fns, leaves):
    """[(cell, leaf index)]: the closure cells of the chain's functions (and of functions
    they hold) that hold a leaf DistTensor."""
    ids = {id(ld): i for i, (_, ld, _, _) in enumerate(leaves)}
    # (and the one-device twin: under capture the stand-ins are no DistTensor, so the
    # builders' ``_pick(t, yd, yr)`` reads the twin; both are bound to the input)
    ids.update({id(lr): i for i, (_, _, lr, _) in enumerate(leaves)})
    out, seen = [], set()

    def walk(fn):
        if id(fn) in seen or not callable(fn):
            return
        seen.add(id(fn))
        for c in getattr(fn, "__closure__", None) or ():
            try:
                v = c.cell_contents
            except ValueError:
                continue
            if id(v) in ids:
                out.append((c, ids[id(v)]))
            elif callable(v) and hasattr(v, "__code__"):
                walk(v)
            elif isinstance(v, (list, tuple)):
                for u in v:
                    if callable(u) and hasattr(u, "__code__"):
                        walk(u)
    for f in fns:
        walk(f)
    return out


def _compose(fns, leaves):
    """program(*leaves): the chain, every leaf it reads an input (the closures' cells
    bound to the call's arguments for the call, then back)."""
    cells = _cells(fns, leaves)

    def program(*xs):
        old = [c.cell_contents for c, _ in cells]
        for c, i in cells:
            c.cell_contents = xs[i]
        try:
            x = xs[0]
            for f in fns:
                x = f(x)
            return x
        finally:
            for (c, _), o in zip(cells, old):
                c.cell_contents = o
    return program


def _comm(tr) -> Counter:
    return Counter(e.name for e in tr.events if e.stream == "comm" and 0 in e.ranks)


def _snapshot(leaves):
    return [(ld.full().detach().clone(), None if ld.grad is None else ld.grad.full().clone())
            for _, ld, _, _ in leaves]


def _restore(leaves, snap):
    with torch.no_grad():
        for (_, ld, _, _), (v, _g) in zip(leaves, snap):
            if not torch.equal(ld.full().detach(), v):
                raise Differ("a leaf changed value between runs (the program writes it)")
            ld.grad = None


def _run(call, xs, leaves, backward, g):
    """(out full, out dtype, leaves' gradients, collectives) of one call."""
    with wb.trace() as tr:
        out = call(*xs)
    grads, bwd = None, Counter()
    if backward and isinstance(out, wb.DistTensor) and out.requires_grad:
        with wb.trace() as tb:
            (out * g).sum().backward()
        bwd = _comm(tb)
        grads = [None if ld.grad is None else ld.grad.full().clone()
                 for _, ld, _, _ in leaves]
    full = out.full().detach().clone() if isinstance(out, wb.DistTensor) else out
    return full, grads, (_comm(tr), bwd), type(out)


def _cmp(got, want, what, exact, p):
    if isinstance(want, torch.Tensor) != isinstance(got, torch.Tensor):
        raise Differ(f"{what}: {type(got).__name__}, eager {type(want).__name__}")
    if not isinstance(want, torch.Tensor):
        if got != want:
            raise Differ(f"{what}: {got!r}, eager {want!r}")
        return
    if exact:
        if got.dtype != want.dtype or got.shape != want.shape or \
                not torch.equal(got.nan_to_num(0.125), want.nan_to_num(0.125)):
            raise Differ(f"{what}: not exactly eager's ({got.dtype} {tuple(got.shape)}; "
                         f"eager {want.dtype} {tuple(want.shape)})")
        return
    try:
        rp._close(got, want, what, loose=p.low, half=p.half)
    except rp._Wrong as e:
        raise Differ(str(e)) from None


def _why(brk) -> str:
    """A break's reason without its place (``at file:line (code)``)."""
    r = brk.reason.replace(f" at {brk.file}:{brk.line} ({brk.code})", "")
    return r.replace("capture runs the program on meta tensors of the global shapes (plain "
                     "tensors, no data) and it raised ", "the meta run raised ")[:300]


def probe(seed: int, wide: bool, levels=LEVELS):
    """{level: (status, detail)} for program ``seed`` (None: not drawn)."""
    drawn = draw(seed, wide)
    if drawn is None:
        return None
    p, fns = drawn
    leaves = p.leaves
    x0 = leaves[0][1]
    prog_fn = _compose(fns, leaves)
    xs = [ld for _, ld, _, _ in leaves]
    snap = _snapshot(leaves)
    _restore(leaves, snap)
    out = {}
    try:
        ref = prog_fn(*xs)
        # (a program that writes into a leaf: no two runs start alike, nothing to compare)
        _restore(leaves, snap)
    except Exception:      # noqa: BLE001
        return None
    backward = isinstance(ref, wb.DistTensor) and ref.requires_grad and \
        ref.is_floating_point()
    g = None
    if backward:
        g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(7),
                        dtype=ref.dtype)
    try:
        e_full, e_grads, e_comm, e_type = _run(prog_fn, xs, leaves, backward, g)
    except Exception:     # noqa: BLE001
        return None
    for level in levels:
        try:
            _restore(leaves, snap)
        except Differ as e:
            out[level] = ("differ", str(e))
            break
        try:
            prog = wb.compile(prog_fn, *xs, level=level)
            _restore(leaves, snap)
            c_full, c_grads, c_comm, c_type = _run(prog, xs, leaves, backward, g)
            ex = level == "O0"
            if c_type is not e_type:
                raise Differ(f"output type {c_type.__name__}, eager {e_type.__name__}")
            _cmp(c_full, e_full, "output", ex, p)
            if backward:
                for (ln, *_r), a, b in zip(leaves, c_grads, e_grads):
                    if (a is None) != (b is None):
                        raise Differ(f"{ln}.grad {'None' if a is None else 'set'}, eager "
                                     f"{'None' if b is None else 'set'}")
                    if a is not None:
                        _cmp(a, b, f"{ln}.grad", ex, p)
            # O0: the forward's collectives are eager's; the backward's never more (a
            # Shard -> Partial pad's backward: the compiled reshard's reduce-scatter where
            # eager's op all-reduces the gradient, narrow seed 25: equal values)
            if ex and not prog.breaks and (c_comm[0] != e_comm[0] or
                                           sum(c_comm[1].values()) > sum(e_comm[1].values())):
                raise Differ(f"O0 collectives {c_comm}, eager {e_comm}")
            status = "eager" if prog.breaks else "compiled"
            out[level] = (status, _why(prog.breaks[0]) if prog.breaks else "")
        except Differ as e:
            out[level] = ("differ", str(e))
        except (ValueError, NotImplementedError) as e:
            out[level] = ("refused", f"{type(e).__name__}: {str(e)[:160]}")
        except Exception as e:    # noqa: BLE001
            tb = [f for f in traceback.extract_tb(e.__traceback__) if "/workbench/" in f.filename]
            w = f"{tb[-1].filename.split('/workbench/')[-1]}:{tb[-1].lineno}" if tb else "?"
            out[level] = ("raised", f"{type(e).__name__} at {w}: {str(e)[:160]}")
    return p, out


def reason_key(det: str) -> str:
    """A break's reason with its place (file:line, the code, shapes, numbers) left out,
    so that breaks by one op or construct tally together."""
    k = det
    k = re.sub(r"\(\d+(, \d+)*,?\)", "(shape)", k)
    k = re.sub(r"\d+", "N", k)
    return k[:200]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--cases", type=int, default=40)
    ap.add_argument("--wide", action="store_true")
    ap.add_argument("-v", action="store_true")
    ap.add_argument("--reasons", action="store_true",
                    help="tally the graph breaks (and refusals) by reason, per level")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    counts = collections.Counter()
    per_level = {lv: collections.Counter() for lv in LEVELS}
    reasons = collections.Counter()
    shown = set()
    for s in range(a.start, a.start + a.cases):
        r = probe(s, a.wide)
        if r is None:
            counts["not drawn"] += 1
            continue
        p, out = r
        for lv, (st, det) in out.items():
            counts[st] += 1
            per_level[lv][st] += 1
            if st in ("eager", "refused"):
                reasons[(st, reason_key(det))] += 1
            if a.reasons and st != "compiled":
                print(f"seed {s} {lv} {st}: {reason_key(det)[:120]}", flush=True)
            key = (st, det[:60])
            if st in ("differ", "raised") or (a.v and st != "compiled" and key not in shown):
                shown.add(key)
                print(f"--- seed {s} {lv} {st}: {det[:160]}\n" + "\n".join(p.lines)[:1500],
                      flush=True)
    print(f"seeds {a.start}..{a.start + a.cases - 1} wide={a.wide}: {dict(counts)}", flush=True)
    for lv in LEVELS:
        print(f"  {lv}: {dict(per_level[lv])}", flush=True)
    if a.reasons:
        print("reasons (program-levels):")
        for (st, k), n in reasons.most_common():
            print(f"  {n:4d}  {st}: {k}")


if __name__ == "__main__":
    sys.exit(main())
