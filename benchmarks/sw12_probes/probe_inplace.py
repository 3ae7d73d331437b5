"""Probe: in-place methods x views x layouts, DistTensor vs torch (x, the written view, and
views taken before the write: values; torch's error type where torch raises)."""
import itertools, sys, warnings, gc
import torch
import workbench as wb
from workbench.parallel.placement import parse_placements
from workbench.parallel.validate_inputs import distribute
warnings.filterwarnings("ignore")
M1 = wb.Mesh([0, 1, 2, 3]); M2 = wb.Mesh([[0, 1], [2, 3]]); M3 = wb.Mesh([0, 1, 2])
LAY = [(M1, ["R"]), (M1, ["S(0)"]), (M1, ["P(sum)"]),
       (M3, ["S(1)"]), (M2, ["S(0)", "S(1)"]), (M2, ["S(1)", "P(max)"])]
MASK = torch.tensor([[1, 0, 0, 1], [0, 1, 0, 0], [1, 1, 0, 0], [0, 0, 0, 1]], dtype=torch.bool)
I2 = torch.tensor([0, 2])
VIEWS = {  # written-to tensor from x
    "x": lambda x: x, "x[1:]": lambda x: x[1:], "x[:,1:]": lambda x: x[:, 1:], "x.t()": lambda x: x.t(),
    "x[:1].expand(4,4)": lambda x: x[:1].expand(4, 4), "x[:,2:3].expand(4,4)": lambda x: x[:, 2:3].expand(4, 4),
    "x.detach()": lambda x: x.detach(), "x[1:].detach()": lambda x: x[1:].detach(),
    "x.data": lambda x: x.data, "x[:,1:].detach()": lambda x: x[:, 1:].detach(),
    "x.view(2,8)": lambda x: x.view(2, 8), "x[::2]": lambda x: x[::2], "x[1]": lambda x: x[1],
    "x.diagonal()": lambda x: x.diagonal(), "x.detach()[1:]": lambda x: x.detach()[1:],
    "x[1:].detach()[0]": lambda x: x[1:].detach()[0],
}
def _m(v):
    return MASK[tuple(slice(0, s) for s in v.shape)] if v.dim() == 2 else MASK[0, :v.shape[0]] if v.dim() == 1 else MASK[0, 0]
OPS = {  # (x, v) -> in-place call on v (may read x)
    "add_(1)": lambda x, v: v.add_(1), "mul_(2)": lambda x, v: v.mul_(2), "fill_(3)": lambda x, v: v.fill_(3.),
    "zero_()": lambda x, v: v.zero_(), "clamp_(max=1)": lambda x, v: v.clamp_(max=1.),
    "copy_(const)": lambda x, v: v.copy_(torch.arange(float(v.numel()), dtype=v.dtype).reshape(v.shape)),
    "copy_(bcast)": lambda x, v: v.copy_(torch.tensor(7., dtype=v.dtype)),
    "masked_fill_(m,9)": lambda x, v: v.masked_fill_(_m(v), 9.),
    "masked_fill_(m,0d)": lambda x, v: v.masked_fill_(_m(v), torch.tensor(8., dtype=v.dtype)),
    "index_fill_(-1,i,9)": lambda x, v: v.index_fill_(-1, I2[:min(2, v.shape[-1])] if v.dim() else I2[:0], 9.),
    "add_(x[:-1])": lambda x, v: v.add_(x[:-1].reshape(-1)[:v.numel()].reshape(v.shape) if v.numel() <= 12 else x[:-1].sum(0)),
    "add_(x[0])": lambda x, v: v.add_(x[0][:v.shape[-1]] if v.dim() else x[0, 0]),
    "copy_(x[0])": lambda x, v: v.copy_(x[0][:v.shape[-1]] if v.dim() else x[0, 0]),
    "mul_(x.t()[..])": lambda x, v: v.mul_(x.t()[tuple(slice(0, s) for s in v.shape)]),
    "masked_fill_(m,x[0,0])": lambda x, v: v.masked_fill_(_m(v), x[0, 0]),
    "index_fill_(-1,i,x[1,1])": lambda x, v: v.index_fill_(-1, I2[:min(2, v.shape[-1])] if v.dim() else I2[:0], x[1, 1]),
}
def run(x0, make, vn, on):
    """(x, written view, kept views) after the op, or the error type."""
    x = make(x0.clone())
    keep = {"v1": x[1:], "vc": x[:, 1:], "dv": x[1:].detach()}
    try:
        v = VIEWS[vn](x)
        OPS[on](x, v)
    except Exception as e:
        return ("raise", type(e).__name__, str(e)[:90])
    full = lambda t: t.full() if hasattr(t, "full") else t
    gc.collect()
    return ("ok", full(x).clone(), full(v).clone(), {k: full(t).clone() for k, t in keep.items()})
def eq(u, v):
    return u.shape == v.shape and torch.allclose(u, v, rtol=1e-12, atol=1e-12)
def same(a, b):
    if a[0] != b[0]: return False
    if a[0] == "raise": return a[1] == b[1]
    return eq(a[1], b[1]) and eq(a[2], b[2]) and all(eq(a[3][k], b[3][k]) for k in a[3])
def main(verbose=False):
    g = torch.Generator().manual_seed(11)
    x0 = torch.rand((4, 4), generator=g, dtype=torch.float64) + 0.5
    bad = tot = refused = 0; fails = {}
    for vn, on in itertools.product(VIEWS, OPS):
        want = run(x0, lambda t: t, vn, on)
        for mesh, ps in LAY:
            got = run(x0, lambda t: distribute(t, mesh, parse_placements(ps), seed=3), vn, on)
            tot += 1
            if want[0] == "ok" and got[0] == "raise" and got[1] == "NotImplementedError":
                refused += 1
                continue
            if not same(want, got):
                bad += 1
                fails.setdefault((vn, on), []).append(ps)
                if verbose and len(fails[(vn, on)]) == 1:
                    w = want if want[0] == "raise" else "ok"
                    gg = got if got[0] == "raise" else "ok"
                    print("DIFF", vn, on, ps, "want", w, "got", gg, flush=True)
    print(f"in-place probe: {bad} of {tot} unlike torch, {refused} refused (NotImplementedError naming the fix) where torch computes ({len(VIEWS)} views x {len(OPS)} ops x {len(LAY)} layouts)")
    for k, v in fails.items():
        print(" ", k, len(v), v[:4])
if __name__ == "__main__":
    main("-v" in sys.argv)
