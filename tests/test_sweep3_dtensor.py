"""PyTorch DTensor as an independent oracle for a sample of the random sweep's ops: every
rank's local shard of our result is held to DTensor's.

For each case (an op, a mesh, input placements drawn with a fixed seed) the op runs on
our DistTensors and on DTensors under ``LocalTensorMode`` (every rank simulated in this
process over the fake process group, as tests/test_dtensor_oracle.py does).  Output
placements may differ (each side picks its own strategy), so DTensor's result is
redistributed to OUR output placements, then each rank's local tensor must equal ours:
the full value and the per-rank layout (nested ``torch.chunk``, uneven shards included)
both come from DTensor.  Our results left Partial are compared by their full value.
Cases DTensor cannot run (no strategy for the op or the layout) are skipped; values are
small integers, so sums are exact."""
from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from workbench.parallel.dist_tensor import DistTensor
from tests.dtensor_support import (DTensor, LocalTensor, LocalTensorMode,  # noqa: F401
                                   distribute_tensor, oracle, partial_locals, to_dt)
from tests.dtensor_support import DReplicate  # noqa: F401

R, S, P = wb.Replicate, wb.Shard, wb.Partial

OPS = {  # name -> (fn, input shapes)
    "relu": (torch.relu, [(5, 3)]), "exp": (lambda x: torch.exp(x / 4), [(3, 5)]),
    "add": (torch.add, [(5, 3), (5, 3)]), "mul_bcast": (torch.mul, [(4, 3), (3,)]),
    "sum1": (lambda x: x.sum(1), [(5, 3)]), "mean0": (lambda x: x.mean(0), [(5, 3)]),
    "amax": (lambda x: x.amax(-1), [(3, 5)]), "softmax": (lambda x: torch.softmax(x, 1), [(3, 5)]),
    "transpose": (lambda x: x.transpose(0, 1), [(5, 3)]), "reshape": (lambda x: x.reshape(-1), [(4, 3)]),
    "unsqueeze": (lambda x: x.unsqueeze(1), [(5, 3)]), "matmul": (torch.matmul, [(5, 4), (4, 3)]),
    "linear_vec": (F.linear, [(4,), (3, 4)]), "linear": (F.linear, [(5, 4), (3, 4), (3,)]),
    "cumsum": (lambda x: torch.cumsum(x, 0), [(5, 3)]), "flip": (lambda x: x.flip(1), [(3, 5)]),
    "tril": (torch.tril, [(5, 5)]), "cat": (lambda a, b: torch.cat([a, b], 0), [(3, 4), (2, 4)]),
    "stack": (lambda a, b: torch.stack([a, b], 1), [(5, 3), (5, 3)]),
    "where": (lambda x: torch.where(x > 0, x, 0.0), [(5, 3)]),
    "clamp": (lambda x: torch.clamp(x, -1, 2), [(5, 3)]), "neg": (torch.neg, [(7,)]),
    "sort": (lambda x: torch.sort(x, 1)[0], [(3, 5)]), "argmax": (lambda x: x.argmax(1), [(5, 3)]),
    "layer_norm": (lambda x: F.layer_norm(x, (3,)), [(5, 3)]),
    "index_select": (lambda x: x.index_select(0, torch.tensor([2, 0, 4])), [(5, 3)]),
}
MESHES = [(2,), (3,), (2, 2)]


def dtensor_cases(ops, n, seed):
    """``n`` cases cycling through ``ops`` (name -> (fn, input shapes)): a mesh of
    ``MESHES`` and, per input and mesh dim, Replicate / Shard / Partial drawn from ``seed``."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        name = sorted(ops)[i % len(ops)]
        mesh = rng.choice(MESHES)
        ins = []
        for shape in ops[name][1]:
            ps = []
            for _ in mesh:
                k = rng.random()
                ps.append(R() if k < 0.35 or not shape else
                          S(rng.randrange(len(shape))) if k < 0.85 else P("sum"))
            ins.append((shape, tuple(ps)))
        out.append(pytest.param(name, mesh, ins, i, id=f"{name}-{'x'.join(map(str, mesh))}-{i}"))
    return out


def hold_case(oracle, fn, mesh_shape, ins, seed):
    """One case of :func:`dtensor_cases`: small integers as float64 inputs, ``fn`` on our
    DistTensors against DTensor's, rank by rank."""
    g = torch.Generator().manual_seed(seed)
    xs = [(torch.randint(-4, 5, shape, generator=g).to(torch.float64), ps) for shape, ps in ins]
    hold_to_dtensor(oracle, fn, mesh_shape, xs)


@pytest.mark.parametrize("name,mesh_shape,ins,seed", dtensor_cases(OPS, 48, 3))
def test_locals_equal_dtensors(oracle, name, mesh_shape, ins, seed):  # noqa: F811
    hold_case(oracle, OPS[name][0], mesh_shape, ins, seed)


def hold_to_dtensor(oracle, fn, mesh_shape, xs):  # noqa: F811
    """``fn`` of the ``(tensor, placements)`` inputs ``xs``: our result equals one device,
    and every rank's local equals DTensor's redistributed to our output placements (the
    full value when ours is left Partial); skips what DTensor cannot run."""
    world = math.prod(mesh_shape)
    wmesh = wb.Mesh(torch.arange(world).reshape(mesh_shape).tolist())
    ours = fn(*[_ours(x, wmesh, mesh_shape, ps) for x, ps in xs])
    torch.testing.assert_close(ours.full(), fn(*[x for x, _ in xs]))
    dmesh = oracle.mesh(mesh_shape)
    try:
        with LocalTensorMode(world):
            args = []
            for x, ps in xs:
                dps = [to_dt(p) for p in ps]
                if any(p.is_partial() for p in ps):
                    parts = partial_locals(x, mesh_shape, ps)
                    lt = LocalTensor({r: parts[r].clone() for r in range(world)})
                    args.append(DTensor.from_local(lt, dmesh, dps, shape=x.shape,
                                                   stride=x.stride()))
                else:
                    lt = LocalTensor({r: x.clone() for r in range(world)})
                    args.append(distribute_tensor(lt, dmesh, dps))
            e = fn(*args)
            if any(p.is_partial() for p in ours.placements):
                e = e.redistribute(dmesh, [DReplicate()] * len(mesh_shape))
                theirs = {r: e.to_local()._local_tensors[r] for r in range(world)}
                want_full = True
            else:
                e = e.redistribute(dmesh, [to_dt(p) for p in ours.placements])
                theirs = {r: e.to_local()._local_tensors[r] for r in range(world)}
                want_full = False
    except (NotImplementedError, RuntimeError, AssertionError) as err:
        pytest.skip(f"DTensor cannot run it: {type(err).__name__}: {str(err)[:80]}")
    for r in range(world):
        got = ours.full() if want_full else ours.local(r)
        assert got.shape == theirs[r].shape, (r, ours.placements)
        torch.testing.assert_close(got, theirs[r], msg=f"rank {r} {ours.placements}")


def _ours(x, wmesh, mesh_shape, ps):
    if not any(p.is_partial() for p in ps):
        return wb.shard_tensor(x, wmesh, list(ps))
    parts = partial_locals(x, mesh_shape, ps)
    return DistTensor.from_local(parts, wmesh, list(ps), shape=x.shape)
