"""Run under torchrun (gloo, 4 processes): the programs of tests/test_slice15.py and
tests/test_chooser17.py (a marked copy, ``t.redistribute(mesh, [R])``, sliced by its
readers) on torch.distributed, eager and compiled O0.  Every rank prints one JSON line
per program and level: the output's placements, the forward and backward collectives its
trace recorded (kind, buffer bytes), and the output's and x's gradient's largest
differences from plain PyTorch.  tests/test_tdway17.py runs the same programs on
simulated ranks (written once, here: ``mesh`` is a simulated Mesh or a distributed one)
and holds the two equal."""
import json

import torch

import workbench as wb
from workbench.parallel import storage

R, S = wb.Replicate, wb.Shard
PROFILE = "a100"


def _v(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-4, 5, shape, generator=g).double()    # small integers: exact sums


def _one_reader(mesh):
    def f(t, o):
        return t.redistribute(mesh, [R()] * mesh.ndim) * o
    return f


def _two_readers(mesh):
    def f(t, o1, o2):
        y = t.redistribute(mesh, [R()] * mesh.ndim)
        return y * o1 + y * o2
    return f


def _mixed(mesh):
    def f(t, w, o):
        y = t.redistribute(mesh, [R()] * mesh.ndim)
        return (y @ w) + y * o          # y read per rank (column-parallel), then sliced
    return f


def _reference(others):
    xr = _v((8, 16), 0).requires_grad_()
    if others[0][0] == (16, 16):               # _mixed's
        return xr, xr @ _v((16, 16), 1) + xr * _v(others[1][0], 2)
    out = None
    for k, (shape, _) in enumerate(others):
        term = xr * _v(shape, k + 1)
        out = term if out is None else out + term
    return xr, out


def run(mesh, level, x_pl, others):
    """x (8, 16) laid out ``x_pl``, ``t.redistribute`` to R everywhere, times each of
    ``others`` ((shape, placements)), summed; forward and backward (eager, or compiled at
    ``level``) under a trace.  This rank's (rank 0's on the simulator) collectives."""
    x = wb.shard_tensor(_v((8, 16), 0), mesh, list(x_pl)).requires_grad_()
    os_ = [wb.shard_tensor(_v(shape, k + 1), mesh, list(pl))
           for k, (shape, pl) in enumerate(others)]
    f = (_mixed if others[0][0] == (16, 16) else
         _one_reader if len(others) == 1 else _two_readers)(mesh)
    if level != "eager":
        f = wb.compile(f, x, *os_, level=level, profile=PROFILE)
    rank = wb.distributed.rank() if storage.holds_own(mesh) else 0
    g = _v((8, 16), 9)
    with wb.trace(PROFILE) as tr:
        y = f(x, *os_)
        n = len(tr.events)
        (y * wb.shard_tensor(g, mesh, list(y.placements))).sum().backward()
    xr, ref = _reference(others)
    (ref * g).sum().backward()
    return result(tr, n, rank, y, ref, x, xr)


def result(tr, n, rank, y, ref, x, xr, sent=False) -> dict:
    """One program's row: ``y``'s placements, the collectives of trace ``tr`` on ``rank``
    before event ``n`` (forward) and after (backward), [kind, buffer bytes] each (and the
    bytes sent, ``sent``), and ``y`` / ``x.grad``'s largest differences from plain
    PyTorch's ``ref`` / ``xr.grad``."""
    def comm(evs):
        return [[e.name, int(e.args["buffer_bytes"])] + ([int(e.bytes)] if sent else [])
                for e in evs if e.stream == "comm" and rank in e.ranks]
    return {"placements": [repr(p) for p in y.placements],
            "fwd": comm(tr.events[:n]), "bwd": comm(tr.events[n:]),
            "diff_out": float((y.full().detach() - ref.detach()).abs().max()),
            "diff_grad": float((x.grad.full() - xr.grad).abs().max()),
            "grad_placements": [repr(p) for p in x.grad.placements]}


# (name, mesh shape, dim names, x's placements, others: (shape, placements) each)
PROGRAMS = [
    ("S1-R-mul-S0", (4,), ("tp",), (S(1),), [((8, 16), (S(0),))]),
    ("S1-R-mul-S1", (4,), ("tp",), (S(1),), [((8, 16), (S(1),))]),
    ("S0S1-RR-mul-S1S0", (2, 2), ("dp", "tp"), (S(0), S(1)), [((8, 16), (S(1), S(0)))]),
    ("S1-R-mul-row-S0", (4,), ("tp",), (S(1),), [((16,), (S(0),))]),
    ("two-slices", (4,), ("tp",), (S(1),), [((8, 16), (S(0),)), ((8, 1), (S(0),))]),
    # read per rank by a column-parallel matmul (a Partial gradient), then sliced to S(0)
    # by the product with o (8, 1): the simulator merges the two uses into one
    # reduce-scatter (reshard_backward._merged)
    ("per-rank-then-slice", (4,), ("tp",), (S(1),), [((16, 16), (S(1),)), ((8, 1), (S(0),))]),
]
LEVELS = ("eager", "O0")


def main():
    wb.distributed.init(timeout_s=120)
    rank = wb.distributed.rank()
    meshes = {}
    for name, shape, names, x_pl, others in PROGRAMS:
        if (shape, names) not in meshes:
            meshes[(shape, names)] = wb.distributed.mesh(shape, names)
        for level in LEVELS:
            try:
                row = run(meshes[(shape, names)], level, x_pl, others)
            except Exception as e:       # noqa: BLE001 (reported, the test fails on it)
                row = {"raised": f"{type(e).__name__}: {e}"}
            row.update(case=name, level=level, rank=rank)
            print(json.dumps(row), flush=True)
    wb.distributed.shutdown()


if __name__ == "__main__":
    main()
