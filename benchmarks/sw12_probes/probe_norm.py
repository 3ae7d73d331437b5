"""Probe: inf-norm gradients (and values) DistTensor vs torch."""
import math, itertools, sys, torch, warnings
import torch.nn.functional as F
import workbench as wb
from workbench.parallel.placement import parse_placements
from workbench.parallel.validate_inputs import distribute
warnings.filterwarnings("ignore")
inf, nan = math.inf, math.nan
M1 = wb.Mesh([0, 1, 2, 3]); M2 = wb.Mesh([[0, 1], [2, 3]]); M3 = wb.Mesh([0, 1, 2])
LAY = [(M1, ["R"]), (M1, ["S(0)"]), (M1, ["S(1)"]), (M1, ["P(sum)"]), (M3, ["S(0)"]), (M3, ["S(1)"]),
       (M2, ["S(0)", "S(1)"]), (M2, ["S(1)", "S(0)"]), (M2, ["P(sum)", "S(1)"]), (M2, ["S(0)", "P(sum)"])]
def X():
    b = torch.tensor([[1., -3., 2., 3., 0.], [-3., 1., nan, 2., 1.], [0., 0., 0., 0., 0.], [2., -2., 1., -1., 0.5],
                      [inf, 1., -inf, 2., 1.]], dtype=torch.float64)
    return {"nan_tie_inf": b, "ties": torch.tensor([[3., -3., 1.], [2., 2., -2.], [1., 3., 3.], [-1., 1., -1.], [0., 0., 0.]], dtype=torch.float64),
            "plain": torch.arange(20, dtype=torch.float64).reshape(5, 4).sin(),
            "nanrow": torch.tensor([[nan, 1., 2.], [1., nan, nan], [0., 0., 0.], [5., 1., -5.]], dtype=torch.float64),
            "empty0": torch.zeros(0, 3, dtype=torch.float64), "empty1": torch.zeros(3, 0, dtype=torch.float64),
            "f32": b.float()}
FNS = {}
for o in (inf, -inf):
    s = "inf" if o > 0 else "-inf"
    for dim in (None, 0, 1, (0, 1), -1):
        for kd in (False, True):
            FNS[f"vector_norm({s},{dim},{kd})"] = (lambda o, dim, kd: lambda t: torch.linalg.vector_norm(t, o, dim, kd))(o, dim, kd)
    FNS[f"t.norm({s})"] = (lambda o: lambda t: t.norm(o))(o)
    FNS[f"t.norm({s},1)"] = (lambda o: lambda t: t.norm(o, 1))(o)
    FNS[f"torch.norm({s},0,True)"] = (lambda o: lambda t: torch.norm(t, o, 0, True))(o)
    FNS[f"linalg.norm({s},1)"] = (lambda o: lambda t: torch.linalg.norm(t, o, 1))(o)
    FNS[f"linalg.norm({s},None) 2d"] = (lambda o: lambda t: torch.linalg.norm(t, o))(o)
    FNS[f"linalg.norm(flat {s})"] = (lambda o: lambda t: torch.linalg.norm(t.flatten(), o))(o)
    FNS[f"matrix_norm({s})"] = (lambda o: lambda t: torch.linalg.matrix_norm(t, o))(o)
    FNS[f"matrix_norm({s}) as 1"] = (lambda o: lambda t: torch.linalg.matrix_norm(t, 1 if o > 0 else -1))(o)
    FNS[f"normalize({s},1)"] = (lambda o: lambda t: F.normalize(t, o, 1))(o)
    FNS[f"0-d vector_norm({s})"] = (lambda o: lambda t: torch.linalg.vector_norm(t[1, 2] if t.numel() > 6 else t.sum(), o))(o)
    FNS[f"dist({s})"] = (lambda o: lambda t: torch.dist(t, t.detach() * 0.5, o))(o)

def outcome(f, t, leaf, w):
    try:
        y = f(t)
    except Exception as e:
        return ("raise", type(e).__name__)
    full = y.full() if hasattr(y, "full") else y
    res = [full.detach().clone(), str(full.dtype)]
    if y.requires_grad:
        ww = w(tuple(full.shape), full.dtype)
        if hasattr(y, "full"):
            from workbench.parallel.dist_tensor import shard_tensor
            from workbench.parallel.placement import Replicate
            ww = shard_tensor(ww, y.mesh, [Replicate()] * y.mesh.ndim)
        try:
            (y * ww).sum().backward()
        except Exception as e:
            return ("raise-backward", type(e).__name__, str(e)[:80])
        g = leaf.grad
        res.append(None if g is None else (g.full() if hasattr(g, "full") else g).clone())
    return tuple(res)

def same(a, b):
    if a[0] != b[0] if isinstance(a[0], str) or isinstance(b[0], str) else False:
        return False
    if isinstance(a[0], str):
        return a[:2] == b[:2]
    if len(a) != len(b) or a[1] != b[1]:
        return False
    for u, v in zip((a[0],) + a[2:], (b[0],) + b[2:]):
        if (u is None) != (v is None):
            return False
        if u is None: continue
        if u.shape != v.shape or not torch.allclose(u, v, rtol=1e-6, atol=1e-9, equal_nan=True):
            return False
    return True

def main(verbose=False):
    bad = tot = 0
    fails = {}
    for (xn, x), (fn, f), (mesh, ps) in itertools.product(X().items(), FNS.items(), LAY):
        def w(shape, dt):
            return (torch.arange(1, 1 + math.prod(shape), dtype=dt).reshape(shape) * 0.25 + 0.5) if shape else torch.tensor(1.5, dtype=dt)
        r = x.clone().requires_grad_()
        want = outcome(f, r, r, w)
        try:
            d = distribute(x.clone(), mesh, parse_placements(ps), seed=3).requires_grad_()
        except Exception as e:
            continue
        got = outcome(f, d, d, w)
        tot += 1
        if not same(want, got):
            bad += 1
            fails.setdefault(fn, []).append((xn, ps))
            if verbose and len(fails[fn]) == 1:
                print("DIFF", fn, xn, ps, "\n want", want, "\n got ", got)
    print(f"inf-norm probe: {bad} of {tot} unlike torch")
    for k, v in fails.items():
        print(" ", k, len(v), v[:3])
if __name__ == "__main__":
    main("-v" in sys.argv)
