"""Exhaustive validator for SPMD rules (as PyTorch DTensor's): run an op under every
combination of input placements on small meshes and hold the result to one device.

    check_op(torch.relu, [torch.randn(5, 4)])

For every mesh in MESHES and every combination of Replicate / Shard(d) / Partial
for each tensor input (Partial built from deliberately unequal parts so that
coincidences cannot pass), the op's result gathered from the shards must equal
the single-device result, the output placements must be the ones the rule
announced (``infer``), and "replicated" outputs must really be identical on
every rank (dispatch.VALIDATE).
"""
import itertools

import torch

import workbench as wb
from workbench.parallel.validate_inputs import partial_slot
from workbench.parallel import dispatch

_SLOTS = [a for a in wb.DistTensor.__slots__ if a not in ("_spec", "__weakref__")]
MESHES = [wb.Mesh.grid(2, ["a"]), wb.Mesh.grid(4, ["a"]), wb.Mesh.grid((2, 2), ["a", "b"])]


def unequal_parts(x: torch.Tensor, n: int, seed: int = 0) -> list[torch.Tensor]:
    """n tensors that sum to x, deliberately unequal (and not x/n)."""
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randn(x.shape, generator=g, dtype=torch.float64).to(x.dtype) * (k + 1)
             for k in range(n - 1)]
    parts.append(x - sum(parts) if parts else x)
    return parts


def placement_options(ndim, partial=True):
    opts = [wb.Replicate()] + [wb.Shard(d) for d in range(ndim)]
    if partial:
        opts.append(wb.Partial("sum"))
    return opts


def distribute(x, mesh, ps, seed=0):
    """A DistTensor of x with placements ps (Partial from unequal parts)."""
    if not any(p.is_partial() for p in ps):
        return wb.shard_tensor(x, mesh, ps)
    # build on R for the partial dims, then split the value unequally along them
    base = [wb.Replicate() if p.is_partial() else p for p in ps]
    t = wb.shard_tensor(x, mesh, base)
    locals_ = []
    for r in mesh.ranks:
        k, n = partial_slot(mesh, ps, r)
        locals_.append(unequal_parts(t.local(r), n, seed)[k])
    return wb.from_local(locals_, mesh, ps, shape=x.shape)


def check_op(fn, inputs, *, op=None, meshes=MESHES, partial=True, rtol=1e-4, atol=1e-5,
             skip=lambda mesh, combo: False, max_combos=None):
    """Run ``fn(*inputs)`` under every placement combination; return the number of
    combinations checked. Non-tensor inputs are passed through unchanged."""
    ref = fn(*inputs)
    refs = ref if isinstance(ref, tuple) else (ref,)
    idx = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor) and x.is_floating_point()]
    checked = 0
    # each input's DistTensor for a placement is built once a call and met by every
    # combination holding it (linear's 2 x 2 mesh: 41 tensors for 2,448 combinations;
    # building them was ~40% of test_rules_exhaustive[linear]'s CPU, task speed17b);
    # one an op touched (its shards' version counters, or any attribute but the cached
    # spec, by identity) is built again
    built = {}

    def state(t):
        return ([getattr(t, a, None) for a in _SLOTS], [x._version for x in t.locals()])

    def arg(i, mesh, ps):
        key = (i, id(mesh), tuple(ps))
        got = built.get(key)
        if got is not None:
            t, (attrs, versions) = got
            now, vnow = state(t)
            if vnow == versions and all(a is b for a, b in zip(now, attrs)):
                return t
        t = distribute(inputs[i], mesh, ps, seed=i)
        built[key] = (t, state(t))
        return t

    dispatch.VALIDATE.append(True)
    try:
        for mesh in meshes:
            per_input = []
            for i in idx:
                opts = placement_options(inputs[i].dim(), partial)
                per_input.append(list(itertools.product(opts, repeat=mesh.ndim)))
            combos = list(itertools.product(*per_input))
            if max_combos:
                combos = combos[:max_combos]
            for combo in combos:
                if skip(mesh, combo):
                    continue
                args = list(inputs)
                for i, ps in zip(idx, combo):
                    args[i] = arg(i, mesh, ps)
                where = f"mesh {mesh.shape}, input placements {[[str(p) for p in ps] for ps in combo]}"
                try:
                    out = fn(*args)
                except Exception as e:  # noqa: BLE001 - rethrown with the case
                    raise AssertionError(f"{where}: raised {type(e).__name__}: {e}") from e
                outs = out if isinstance(out, tuple) else (out,)
                for o, r in zip(outs, refs):
                    if not isinstance(o, wb.DistTensor):
                        continue
                    got = o.full()
                    assert got.shape == r.shape, f"{where}: shape {tuple(got.shape)} != {tuple(r.shape)}"
                    if r.is_floating_point():
                        torch.testing.assert_close(got, r.detach(), rtol=rtol, atol=atol,
                                                   msg=lambda m: f"{where}: {m}")
                    else:
                        assert torch.equal(got, r), f"{where}: values differ"
                checked += 1
    finally:
        dispatch.VALIDATE.pop()
    return checked
