"""Probe: median() / nanmedian() of every element (values, gradients) DistTensor vs torch."""
import itertools, math, torch, warnings, sys
import workbench as wb
from workbench.parallel.placement import parse_placements, Replicate
from workbench.parallel.validate_inputs import distribute
from workbench.parallel.dist_tensor import shard_tensor
warnings.filterwarnings("ignore")
nan = math.nan
M1 = wb.Mesh([0, 1, 2, 3]); M2 = wb.Mesh([[0, 1], [2, 3]]); M3 = wb.Mesh([0, 1, 2])
LAY = [(M1, ["R"]), (M1, ["S(0)"]), (M1, ["S(1)"]), (M1, ["P(sum)"]), (M3, ["S(0)"]), (M3, ["S(1)"]),
       (M2, ["S(0)", "S(1)"]), (M2, ["P(sum)", "S(1)"])]
XS = {"ties": torch.tensor([[1., 2., 2.], [2., 3., 2.], [0., 2., 5.], [2., 1., 4.]], dtype=torch.float64),
      "nan": torch.tensor([[1., nan, 2.], [2., 3., nan], [0., 2., 5.], [2., 1., 4.]], dtype=torch.float64),
      "plain": torch.arange(12, dtype=torch.float64).reshape(4, 3).cos(),
      "even_n": torch.tensor([[3., 1.], [2., 2.], [1., 3.]], dtype=torch.float64),
      "empty": torch.zeros(0, 3, dtype=torch.float64), "f32ties": torch.tensor([[1., 1.], [1., 0.], [2., 1.]])}
FNS = {"median()": lambda t: torch.median(t), "t.median()": lambda t: t.median(), "nanmedian()": lambda t: torch.nanmedian(t),
       "median(x*2)": lambda t: (t * 2).median(), "median(flat)": lambda t: t.flatten().median()}
def out(f, t):
    try: y = f(t)
    except Exception as e: return ("raise", type(e).__name__)
    full = y.full() if hasattr(y, "full") else y
    if y.requires_grad:
        (y * 1.5).backward()
    g = t.grad
    return ("ok", full.detach(), full.dtype, None if g is None else (g.full() if hasattr(g, "full") else g))
def same(a, b):
    if a[0] != b[0] or a[0] == "raise": return a == b
    if a[2] != b[2]: return False
    if not torch.allclose(a[1], b[1], equal_nan=True): return False
    if (a[3] is None) != (b[3] is None): return (a[3] is None and b[3].abs().sum() == 0) or (b[3] is None and a[3].abs().sum() == 0)
    return a[3] is None or torch.allclose(a[3], b[3], equal_nan=True)
bad = tot = 0; fails = {}
for (xn, x), (fn, f), (m, ps) in itertools.product(XS.items(), FNS.items(), LAY):
    want = out(f, x.clone().requires_grad_())
    got = out(f, distribute(x.clone(), m, parse_placements(ps), seed=3).requires_grad_())
    tot += 1
    if not same(want, got):
        bad += 1; fails.setdefault((fn, xn), []).append(ps)
        if "-v" in sys.argv and len(fails[(fn, xn)]) == 1: print(fn, xn, ps, want, got)
print(f"median probe: {bad} of {tot} unlike torch"); [print(" ", k, len(v), v[:3]) for k, v in fails.items()]
