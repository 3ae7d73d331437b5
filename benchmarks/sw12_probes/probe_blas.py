"""Probe: addbmm / baddbmm / addmm / addmv / addr with empty products and mixed dtypes, DistTensor vs torch."""
import torch, itertools, warnings, sys
import workbench as wb
from workbench.parallel.placement import parse_placements
from workbench.parallel.validate_inputs import distribute
warnings.filterwarnings("ignore")
M1 = wb.Mesh([0, 1]); M2 = wb.Mesh([[0, 1]])
def o(f):
    try: r = f(); r = r.full() if hasattr(r, "full") else r; return ("ok", r.dtype, r.detach())
    except Exception as e: return (type(e).__name__, str(e)[:80])
F = [(torch.addbmm, (1, 3), (0, 1, 2), (0, 2, 3)), (torch.addbmm, (1, 3), (2, 1, 2), (2, 2, 3)), (torch.addbmm, (3,), (0, 1, 2), (0, 2, 3)),
     (torch.baddbmm, (0, 1, 3), (0, 1, 2), (0, 2, 3)), (torch.baddbmm, (2, 1, 3), (2, 1, 2), (2, 2, 3)), (torch.addmm, (1, 3), (1, 0), (0, 3)),
     (torch.addmv, (3,), (3, 0), (0,)), (torch.addr, (0, 2), (0,), (2,))]
DT = (torch.float64, torch.float32, torch.int64)
bad = tot = 0
g = torch.Generator().manual_seed(0)
for (fn, si, s1, s2), dts, (beta, alpha) in itertools.product(F, itertools.product(DT, repeat=3), ((1, 1), (0, 1), (-0.16, -1.18), (2, 3))):
    a = (torch.randn(si, generator=g) * 3).to(dts[0]); b = (torch.randn(s1, generator=g) * 3).to(dts[1]); c = (torch.randn(s2, generator=g) * 3).to(dts[2])
    want = o(lambda: fn(a, b, c, beta=beta, alpha=alpha))
    for mesh, pa, pb in ((M1, ["R"], ["R"]), (M1, ["S(0)"] if a.dim() else ["R"], ["S(0)"]), (M2, ["R", "P(sum)"] if dts[0] != torch.int64 else ["R", "R"], ["R", "S(0)"])):
        got = o(lambda: fn(distribute(a, mesh, parse_placements(pa), seed=1), distribute(b, mesh, parse_placements(pb), seed=2), distribute(c, mesh, parse_placements(["R"] * mesh.ndim)), beta=beta, alpha=alpha))
        tot += 1
        ok = want[0] == got[0] and (want[0] != "ok" or (want[1] == got[1] and want[2].shape == got[2].shape and torch.allclose(want[2].double(), got[2].double(), equal_nan=True)))
        if not ok:
            bad += 1
            if "-v" in sys.argv: print("BAD", fn.__name__, si, s1, s2, [str(d)[6:] for d in dts], beta, alpha, pa, want[:2], got[:2])
print(f"blas probe: {bad} of {tot} unlike torch")
