"""Sweep 18: complex views and ops (conj, real, imag, angle...), cumsum(dtype=int) of a
Partial, NaN through torch.distributed's MAX / MIN, and the sweep's programs.  Each test
holds a DistTensor call to torch on the full tensor (or the torch.distributed runner to
the simulator / one device); the docstrings say what was wrong before."""
import math
import random

import pytest
import torch
from torch import nn

import workbench as wb
from workbench.parallel.placement import parse_placements
from workbench.parallel.validate_inputs import distribute

M2 = wb.Mesh([[0, 1], [2, 3]])
NAN = float("nan")


def _d(x, ps, mesh=M2, seed=3):
    return distribute(x, mesh, parse_placements(ps), seed=seed)


def _cx(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.complex(torch.randn(shape, dtype=torch.float64, generator=g),
                         torch.randn(shape, dtype=torch.float64, generator=g))


# ---- conj / real / imag / angle of complex DistTensors ------------------------------------

Z = _cx(4, 6)
LAYOUTS = [["R", "S(0)"], ["S(1)", "R"], ["P(sum)", "S(1)"], ["S(0)", "P(avg)"],
           ["P(sum)", "P(sum)"]]
PROGRAMS = {
    "conj": lambda a: a.conj() * a.exp(),
    "conj_method_torch": lambda a: torch.conj(a) + a.conj().conj(),
    "real": lambda a: a.real * 2 + a.imag,
    "torch_real_imag": lambda a: torch.real(a).sin() * torch.imag(a),
    "angle": lambda a: a.angle(),
    "abs": lambda a: a.abs(),
    "conj_physical": lambda a: torch.conj_physical(a) * 1j,
    "resolve_conj": lambda a: a.conj().resolve_conj() * a,
    "H": lambda a: a.H @ a,
    "mH_real": lambda a: torch.view_as_real(a.mH.resolve_conj()),
    # vdot of a conjugate view (composites.vdot built conj from view_as_real, which now
    # refuses a conjugate view as torch's does: it takes conj itself)
    "vdot_conj": lambda a: torch.vdot(a.conj().flatten(), a.exp().flatten()),
    "logsumexp_conj": lambda a: torch.logsumexp(a.conj(), 1),     # (its max: of the real part)
}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_complex_ops_values_and_gradients_are_torchs(name):
    """conj / real / imag / angle / conj_physical / resolve_conj (and d.H, which conjugates)
    of a complex DistTensor give torch's values and (conjugate Wirtinger) gradients over
    layouts with shards and Partials.  Before: conj(), angle(), real(), conj_physical()
    had no rule (NoRuleError), d.real / d.imag raised AttributeError, d.H of a complex
    raised (its conj)."""
    f = PROGRAMS[name]
    g = torch.randn(f(Z).shape, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    for ps in LAYOUTS:
        t = _d(Z, ps, seed=1).requires_grad_(True)
        r = t.full().detach().clone().requires_grad_(True)
        out, ref = f(t), f(r)
        assert out.dtype == ref.dtype and out.shape == ref.shape
        torch.testing.assert_close(out.full().detach().resolve_conj(), ref.detach())
        gg = g.to(ref.dtype)
        (out * gg).sum().abs().backward() if ref.is_complex() else out.backward(gg)
        (ref * gg).sum().abs().backward() if ref.is_complex() else ref.backward(gg)
        assert t.grad.dtype == r.grad.dtype == torch.complex128
        torch.testing.assert_close(t.grad.full(), r.grad)


@pytest.mark.parametrize("op", ["conj", "real", "imag", "conj_physical"])
@pytest.mark.parametrize("reduce", ["sum", "avg"])
def test_linear_complex_ops_keep_the_partial(op, reduce):
    """conj, real, imag and conj_physical are linear over the reals: a P(sum) / P(avg)
    passes with no collective (DTensor's _UNARY_LINEAR_RULES); angle and abs reduce
    first (not linear)."""
    f = {"conj": torch.conj, "real": torch.real, "imag": torch.imag,
         "conj_physical": torch.conj_physical}[op]
    for other in ("R", "S(0)", f"P({reduce})"):
        t = _d(Z, [f"P({reduce})", other], seed=4)
        with wb.trace("a100") as tr:
            y = f(t)
        assert y.placements[0] == wb.Partial(reduce)
        assert not tr.collectives()
        torch.testing.assert_close(y.full().resolve_conj(), f(t.full()).resolve_conj())
    for g in (torch.angle, torch.abs):
        y = g(_d(Z, [f"P({reduce})", "S(1)"], seed=4))
        assert not y.placements[0].is_partial()
        torch.testing.assert_close(y.full(), g(Z), atol=1e-12, rtol=1e-12)


def test_conj_is_torchs_lazy_view():
    """z.conj() carries torch's conjugate bit (is_conj), resolve_conj clears it; a write
    through z.conj(), z.real, z.imag or the setter ``z.real = v`` reaches z as on one device;
    view_as_real of the conjugate view raises torch's RuntimeError (before: conj had no rule;
    view_as_real resolved silently)."""
    t, r = _d(Z, ["S(0)", "R"], seed=1), Z.clone()
    c = t.conj()
    assert c.is_conj() and r.conj().is_conj() and not c.resolve_conj().is_conj()
    assert not t.is_conj() and not t.real.is_conj()
    with pytest.raises(RuntimeError, match="unresolved conjugated"):
        torch.view_as_real(r.conj())
    with pytest.raises(RuntimeError, match="unresolved conjugated"):
        torch.view_as_real(c)
    for write in (lambda z: z.real.mul_(2), lambda z: z.imag.zero_(),
                  lambda z: z.conj().mul_(1j), lambda z: z.imag.add_(z.real)):
        write(t)
        write(r)
        torch.testing.assert_close(t.full(), r)
    v = torch.arange(6, dtype=torch.float64)
    t.real, r.real = v, v
    t.imag, r.imag = -v, -v
    torch.testing.assert_close(t.full(), r)
    assert torch.conj(t).conj().is_conj() == r.conj().conj().is_conj() is False


@pytest.mark.parametrize("ps", [["P(max)", "S(0)"], ["R", "P(min)"], ["P(sum)", "S(1)"]])
def test_conj_and_real_of_a_real_tensor_are_itself(ps):
    """Of a real tensor torch's conj() / real / resolve_conj() return the tensor itself (a
    P(max) stays, no copy); imag raises torch's RuntimeError; angle is 0 or pi (NaN kept)."""
    x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    x[1, 2] = NAN
    t = _d(x, ps)
    assert t.conj() is t and t.real is t and torch.real(t) is t and t.resolve_conj() is t
    assert x.conj() is x and x.real is x
    with pytest.raises(RuntimeError, match="non-complex"):
        x.imag
    with pytest.raises(RuntimeError, match="non-complex"):
        t.imag
    torch.testing.assert_close(t.angle().full(), t.full().angle(), equal_nan=True)
    i = _d((x.nan_to_num() * 3).round().long(), ["S(1)", "R"])
    assert i.angle().dtype == torch.float32
    torch.testing.assert_close(i.angle().full(), i.full().angle())


def test_complex_ops_have_no_wrong_candidate():
    """The validator forces every candidate of the new rules on every layout (2 and 3
    ranks, 2 x 2): none is wrong against one device."""
    from workbench.parallel.validate import validate
    rep = validate(["conj", "real", "imag", "angle", "conj_physical", "resolve_conj"],
                   meshes=((2,), (2, 2)), max_layouts=6, missing=False)
    assert rep.runs > 100 and rep.wrong == [], rep.format()


# ---- cumsum(dtype=int) of a Partial ------------------------------------------------------

@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_cumsum_to_int_of_a_float_partial_is_torchs(op, dtype):
    """x.cumsum(dim, dtype=int) truncates every element before the scan (as sum's dtype,
    sweep17): a float P(sum) is reduced first.  Before: P(sum) passed, each part truncated
    apart (1-3 off one device's cumsum, all 4 other layouts); an integer P(sum) still
    passes (exact)."""
    x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2)) * 3
    for other in ("R", "S(0)", "S(1)", f"P({op})"):
        t = _d(x, [f"P({op})", other], seed=5)
        held = t.full()
        for dim in (0, 1, -1):
            got = t.cumsum(dim, dtype=dtype)
            assert got.dtype == dtype
            assert torch.equal(got.full(), held.cumsum(dim, dtype=dtype)), (other, dim)
    i = _d((x * 2).round().long(), ["P(sum)", "S(0)"], seed=5)
    y = i.cumsum(1, dtype=torch.int64)
    assert y.placements[0] == wb.Partial("sum")
    assert torch.equal(y.full(), i.full().cumsum(1))


# ---- MAX / MIN under torch.distributed keep NaN ----------------------------------------

PARTS = {0: [NAN, 1.0, 2.0, 3.0, 4.0], 1: [0.0, NAN, 5.0, -1.0, 2.0]}
M1 = wb.Mesh.grid(2, ["dp"])


def _sim_reduce_scatter(op, n):
    locs = [torch.tensor(PARTS[r][:n], dtype=torch.float64) for r in (0, 1)]
    d = wb.DistTensor.from_local(locs, M1, parse_placements([f"P({op})"]))
    s = d.redistribute(M1, parse_placements(["S(0)"]))
    want = getattr(torch.stack(locs), f"a{op}")(0)          # torch's amax / amin: NaN kept
    torch.testing.assert_close(s.full(), want, equal_nan=True)
    return want


def _sim_clip(bad):
    w = wb.distribute_tensor(torch.ones(4, 3, dtype=torch.float64), M1, [wb.Shard(0)])
    w.requires_grad_(True)
    c = torch.ones(4, 3, dtype=torch.float64)
    c[bad, 1] = NAN
    (w * c).sum().backward()
    r = torch.ones(4, 3, dtype=torch.float64, requires_grad=True)
    (r * c).sum().backward()
    want = torch.nn.utils.clip_grad_norm_([r], 1.0, norm_type=math.inf)
    got = torch.nn.utils.clip_grad_norm_([w], 1.0, norm_type=math.inf)
    torch.testing.assert_close(got, want, equal_nan=True)
    return want


def _sim_ddp_raises(on):
    from workbench.parallel.strategies.laid_out_whole import storage as rows
    torch.manual_seed(0)
    ddp = wb.DistributedDataParallel(nn.Linear(3, 2), M1)
    with torch.no_grad():
        for r in on:
            rows(ddp.module.weight)[r, 0, 1] = NAN       # rank r's copy (test_ddp's way)
    try:
        ddp.check_replicas()
        return ""
    except RuntimeError as e:
        return type(e).__name__


def test_simulated_nan_cases_are_one_devices():
    """The simulator's side of the torchrun cases below: P(max) / P(min) -> S(0) keeps a
    NaN part (torch's amax); an inf-norm clip over a gradient with one NaN is NaN (torch's
    clip_grad_norm_); DDP.check_replicas raises for a weight NaN on one replica only, not
    for the same NaN on both (before: it raised for equal NaN replicas, NaN != NaN)."""
    for op in ("max", "min"):
        for n in (4, 5):
            assert _sim_reduce_scatter(op, n)[:2].isnan().all()
    for bad in (0, 3):
        assert _sim_clip(bad).isnan()
    assert _sim_ddp_raises([1]) == "RuntimeError"
    assert _sim_ddp_raises([0, 1]) == ""


@pytest.fixture(scope="module")
def dist_rows(tmp_path_factory):
    from tests.torchrun_support import json_rows, two_proc
    out, text = two_proc(tmp_path_factory, "sweep18_check.py")     # the shared launch
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {(r["rank"], r["case"]): r for r in json_rows(text)}
    raised = [r for r in rows.values() if "raised" in r and r["raised"] and
              not r["case"].startswith("ddp_")]
    assert not raised, raised
    return rows


def _floats(row, key="value"):
    return torch.tensor([float(v) for v in row[key]], dtype=torch.float64)


def test_torch_distributed_max_min_keep_nan(dist_rows):
    """tests/dist_scripts/sweep18_check.py (2 gloo processes): P(max) / P(min) ->
    S(0) reduce-scatters (even: backends, uneven: padded), the inf-norm clip of a
    DistTensor parameter and of fully_shard's partial norms, and DDP.check_replicas give
    the simulator's / one device's answers.  Before: gloo's MAX / MIN dropped rank 1's
    NaN (rs element 1: 1.0 for NaN), the clip totals with the NaN in rank 1's shard were
    1.0 (DistTensor) and 2.0 (fully_shard) for NaN, and check_replicas raised for equal
    NaN replicas."""
    for r in (0, 1):
        for op in ("max", "min"):
            for n in (4, 5):
                want = _sim_reduce_scatter(op, n)
                torch.testing.assert_close(_floats(dist_rows[(r, f"rs_{op}_{n}")]), want,
                                           equal_nan=True)
        for bad in (0, 3):
            want = _sim_clip(bad)
            for case in ("clip_inf", "fully_shard_inf"):
                got = _floats(dist_rows[(r, f"{case}_{bad}")], "total")
                torch.testing.assert_close(got[0], want.double(), equal_nan=True)
        assert dist_rows[(r, "ddp_nan_one")]["raised"] == _sim_ddp_raises([1])
        assert dist_rows[(r, "ddp_nan_both")]["raised"] == _sim_ddp_raises([0, 1])


def test_torch_distributed_complex_partials(dist_rows):
    """conj / real / imag / conj_physical of a complex P(sum) under torch.distributed keep
    the Partial and gather to one device's answer on the summed value; angle and abs
    reduce first (before: conj / real / imag / angle had no rule).  A conjugate view
    (the lazy bit on each local) gathered, re-sliced and all-to-all'd gives the conjugated
    values (the collectives send the resolved memory: backends.wire; without it gloo's
    complex all-gather raised view_as_real's RuntimeError)."""
    fs = {"conj": torch.conj, "real": torch.real, "imag": torch.imag, "angle": torch.angle,
          "abs": torch.abs, "conj_physical": torch.conj_physical}
    for r in (0, 1):
        whole = torch.view_as_complex(_floats(dist_rows[(r, "complex_whole")]).reshape(3, 2, 2))
        for name, f in fs.items():
            row = dist_rows[(r, f"complex_{name}")]
            want = f(whole).resolve_conj()
            want = torch.view_as_real(want) if want.is_complex() else want
            torch.testing.assert_close(_floats(row), want.reshape(-1))
            assert (row["placements"] == ["P(sum)"]) == (name not in ("angle", "abs"))
        for name in ("gather", "slice", "all_to_all"):
            torch.testing.assert_close(_floats(dist_rows[(r, f"conj_{name}")]),
                                       torch.view_as_real(whole.conj().resolve_conj()).reshape(-1))
        torch.testing.assert_close(_floats(dist_rows[(r, "conj_imag")]),
                                   whole.conj().imag.resolve_neg().reshape(-1))


# ---- the sweep's programs ------------------------------------------------------------------

def _run(seed, dtypes=None, kinds=None):
    """``run_program(Random(seed), wide=True)`` as ``benchmarks/random_sweep.py --dtypes
    ... --focus ...`` draws it (the wide space's first-leaf dtypes and kinds narrowed)."""
    from tests import random_programs_wide as rw
    from tests.random_programs import run_program
    old = rw.WIDE, rw.DTYPES
    rw.WIDE = kinds if kinds is not None else rw.WIDE
    rw.DTYPES = tuple((d, 1) for d in dtypes) if dtypes is not None else rw.DTYPES
    try:
        return run_program(random.Random(seed), wide=True)
    finally:
        rw.WIDE, rw.DTYPES = old


INTS = (torch.complex128, torch.complex64, torch.int64, torch.int32, torch.uint8, torch.bool)


def test_batch_norm_of_one_value_per_channel_raises_torchs_value_error():
    """Wide seed 2021354 (--dtypes complex128,complex64,int64,int32,uint8,bool):
    F.batch_norm(t2, None, None, training=True) of an int64 (1, 1, 1): F.batch_norm checks
    the batch size first (ValueError 'Expected more than 1 value per channel'); here the
    kernel's dtype NotImplementedError came first.  torch.batch_norm (no size check) keeps
    the kernel's error."""
    import torch.nn.functional as F
    out = _run(2021354, INTS)
    assert out.status == "ok", out.detail
    for x in (torch.zeros(1, 3, 1, dtype=torch.int64), torch.zeros(1, 2)):
        t = _d(x, ["S(1)", "R"] if x.shape[1] > 2 else ["R", "S(1)"])
        with pytest.raises(ValueError, match="more than 1 value per channel"):
            F.batch_norm(x, None, None, training=True)
        with pytest.raises(ValueError, match="more than 1 value per channel"):
            F.batch_norm(t, None, None, training=True)
    i = _d(torch.zeros(1, 3, 1, dtype=torch.int64), ["R", "R"])
    with pytest.raises(NotImplementedError):
        torch.batch_norm(i.full(), None, None, None, None, True, 0.1, 1e-5, False)
    with pytest.raises(NotImplementedError):
        torch.batch_norm(i, None, None, None, None, True, 0.1, 1e-5, False)


def test_complex18_kinds_draw_the_new_ops():
    """The COMPLEX18 kinds (benchmarks/random_sweep.py --focus COMPLEX18 --dtypes
    complex128,complex64,float64,int64) run the new ops on complex / real / integer leaves
    against one device.  Before, seeds 2180000 and 2180003-5 were refused (NoRuleError: conj,
    angle...) and of the window 2180000..2180299 200 refused, 51 raised (d.real / d.imag
    AttributeError), 49 ok; now 300 ok."""
    from tests import random_programs_wide as rw
    dts = (torch.complex128, torch.complex64, torch.float64, torch.int64)
    outs = [_run(seed, dts, rw.COMPLEX18) for seed in range(2180000, 2180006)]
    assert [o.status for o in outs] == ["ok"] * 6, [o.detail for o in outs if o.status != "ok"]
