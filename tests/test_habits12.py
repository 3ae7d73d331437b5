"""A PyTorch user's habits on the wrappers, round 12 (habits12): reductions over
``fully_shard``'s gradients under torch.distributed.  FSDP2's ``p.grad`` is a DTensor whose
``numel()`` and reductions are the full tensor's (torch 2.13
``torch/distributed/tensor/_api.py``); ``wb.fully_shard``'s read this process's chunk
(``rank_grads.ShardGrad``), silently.  Held to one device and to torch's own
``fully_shard`` on one gloo launch (shared with test_habits11's check).

Second part (each failed before): a bfloat16 / float16 partial sum is reduced before an
add or a scale rounds it (eager equals wb.compile at O0 / O1 / O2: softmax(x @ w1 + x @ w2)
0.150 -> 0.087 off one device in bf16, 0.0068 -> 0.00049 in fp16); weight / spectral norm
on a tensor-parallel Linear (``_weight_norm``, ``norm_except_dim``, ``vdot``, ``W.H``,
``out=`` a plain buffer) train as one device, or (a parametrization after wrapping) raise
naming the fix; every random ``nn.init`` after wrapping is one device's draw.
"""
import os

import pytest


CASES = ["numel", "nelement", "sum", "mean", "abs_mean", "pow_sum", "std", "max", "min",
         "zeros", "sum_dim0", "norm", "norm_inf", "norm_dim0", "data_norm", "clone_sum",
         "detach_norm", "double_mean", "detach_mean", "clip_2", "clip_inf", "clip_1_foreach",
         "total_0", "total_-inf", "sgd_clip_steps"]


def _flat(v):
    return [x for e in v for x in _flat(e)] if isinstance(v, list) else [v]


@pytest.mark.slow
def test_fully_shard_gradient_reads_on_gloo_are_fsdp2s(tmp_path_factory):
    """2 gloo processes, ``Sequential(Linear(3, 5), ReLU, Linear(5, 3))`` (the weights' 15
    elements in chunks of 8 and 7, padded), each process half the batch.  Before (measured):
    ``p.grad.numel()`` [8, 3, 8, 2] for [15, 5, 15, 3], ``sum`` / ``mean`` / ``std`` /
    ``max`` / ``(g == 0).sum()`` / ``sum(0)``, and ``g.data.norm()`` / ``g.detach()``'s norm
    (Lightning's, fairseq's logging) this process's chunk's (the last weight's norm 0.1794
    for 0.3041); torch's ``get_total_norm`` of order 0 / -inf raised.  Now every read is
    the full gradient's, as torch's FSDP2 and one device give; and a loop that clips and
    steps SGD with momentum (its buffer a clone of the gradient) still trains as one
    device (``sgd_clip_steps``: the parameters after two steps)."""
    from tests.torchrun_support import json_rows, two_proc
    out, text = two_proc(tmp_path_factory, "habits12_check.py")   # one launch: 2-process parts
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {r["case"]: r for r in json_rows(text)}
    assert sorted(rows) == sorted(CASES)
    assert rows["numel"]["wb"] == [15, 5, 15, 3]
    for c in CASES:
        r = rows[c]
        one, theirs, mine = (_flat(r[k]) for k in ("one", "torch", "wb"))
        assert all(isinstance(v, (int, float)) for v in mine), r      # no error text
        assert len(mine) == len(one) == len(theirs), r
        assert mine == pytest.approx(one, abs=1e-6), r
        assert theirs == pytest.approx(one, abs=1e-6), r


# ---- round 12, second part: 16-bit partial sums, weight / spectral norm on TP layers -------
import torch                                                     # noqa: E402
from torch import nn                                             # noqa: E402
from torch.nn.utils import parametrizations as PZ                # noqa: E402

import workbench as wb                                           # noqa: E402
from workbench.parallel.placement import Partial, Replicate, Shard   # noqa: E402


def _sum2(x, w1, w2):
    return ((x @ w1) + (x @ w2)).softmax(-1)


def _sum2_args(dtype, mesh):
    g = torch.Generator().manual_seed(0)
    ts = (torch.randn(16, 64, generator=g) * 3, torch.randn(64, 64, generator=g),
          torch.randn(64, 64, generator=g))
    ts = tuple(t.to(dtype) for t in ts)
    return ts, [wb.distribute_tensor(t, mesh, [p]) for t, p in
                zip(ts, (Shard(1), Shard(0), Shard(0)))]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_16_bit_partial_sum_is_reduced_before_it_is_added(dtype):
    """``x @ w1 + x @ w2`` with x Shard(1), w Shard(0): two partial sums.  Before, eager
    (and wb.compile O0) added them part by part in 16 bits (each rank's cancelling parts
    rounded at their own size): softmax 0.150 off one device in bf16, 0.0068 in fp16,
    where O1 / O2 reduced each product first (0.087 / 0.00049).  Now eager reduces each
    product first, as O1 does: the same values as adding the two reduced products, equal
    at every level.  (What is left, 1 bf16 ulp of the logits, is each rank's product
    rounded to 16 bits before the reduction, as torch's DTensor does too.)"""
    mesh = wb.init_device_mesh("cpu", (4,))
    (x, w1, w2), args = _sum2_args(dtype, mesh)
    s = (args[0] @ args[1]) + (args[0] @ args[2])
    assert not any(p.is_partial() for p in s.placements)
    eager = _sum2(*args).full_tensor()
    m1, m2 = ((args[0] @ w).full_tensor() for w in args[1:])
    assert torch.equal(eager, (m1 + m2).softmax(-1))
    for level in ("O0", "O1", "O2"):
        assert torch.equal(wb.compile(_sum2, *args, level=level)(*args).full_tensor(), eager)
    off = (eager.float() - _sum2(x, w1, w2).float()).abs().max()
    assert off <= {torch.bfloat16: 0.087, torch.float16: 4.9e-4}[dtype], off


def test_a_16_bit_partial_sum_under_autocast_compiles_as_eager():
    """Under CPU autocast the capture records float32 values; the search now asks the add's
    rule with the bf16 dtypes the run gives (before: O0 kept P + P at capture and the run's
    rule, seeing bf16, refused it: "the chosen strategy ... is not among the rule's
    candidates")."""
    mesh = wb.init_device_mesh("cpu", (4,))
    _, args = _sum2_args(torch.float32, mesh)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager = _sum2(*args).full_tensor()
        for level in ("O0", "O1"):
            got = wb.compile(_sum2, *args, level=level)(*args).full_tensor()
            assert got.dtype == torch.bfloat16 and torch.equal(got, eager), level


def test_float32_and_exact_ops_keep_a_partial_sum_partial():
    """A guard: in float32 ``P + P`` stays partial (no collective more), and so does an
    exact op of a bf16 partial (neg, clone, detach: no rounding)."""
    mesh = wb.init_device_mesh("cpu", (4,))
    _, args = _sum2_args(torch.float32, mesh)
    assert (args[0] @ args[1] + args[0] @ args[2]).placements == (Partial("sum"),)
    _, args = _sum2_args(torch.bfloat16, mesh)
    p = args[0] @ args[1]
    for f in (torch.neg, torch.clone, torch.detach):
        assert f(p).placements == (Partial("sum"),)
        assert torch.equal(f(p).full_tensor(), f(p.full_tensor()))


TP_MESH = lambda: wb.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))  # noqa: E731
NORMS = {"weight_norm": PZ.weight_norm,
         "weight_norm_dim1": lambda m: PZ.weight_norm(m, dim=1),
         "spectral_norm": PZ.spectral_norm,
         "old_weight_norm": torch.nn.utils.weight_norm,
         "old_spectral_norm": torch.nn.utils.spectral_norm}


def _tp_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 4))


def _norm_steps(norm, layer, after):
    """(one device's model, the TP one) after the norm on ``layer`` and two SGD steps."""
    ref, m = _tp_mlp(), _tp_mlp()
    torch.manual_seed(3)
    NORMS[norm](ref[layer])
    if not after:
        torch.manual_seed(3)
        NORMS[norm](m[layer])
    wb.parallelize_module(m, TP_MESH(), {"0": wb.ColwiseParallel(), "2": wb.RowwiseParallel()})
    if after:
        torch.manual_seed(3)
        NORMS[norm](m[layer])
    ro, opt = (torch.optim.SGD(mm.parameters(), lr=0.5) for mm in (ref, m))
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randn(5, 4, generator=g)
        (ref(x) ** 2).mean().backward()
        (m(wb.distribute_tensor(x, TP_MESH(), [Replicate()])) ** 2).mean().backward()
        for o in (ro, opt):
            o.step()
            o.zero_grad()
    return ref, m


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@pytest.mark.parametrize("layer", [0, 2], ids=["colwise", "rowwise"])
@pytest.mark.parametrize("norm,after", [(n, False) for n in NORMS] +
                         [("old_weight_norm", True), ("old_spectral_norm", True)])
def test_weight_and_spectral_norm_on_a_tp_layer_train_as_one_device(norm, after, layer):
    """weight / spectral norm on a Colwise or Rowwise Linear (the parametrizations before
    parallelize_module, the hook-based ones before or after): two SGD steps, then an eval
    forward, as one device.  Before: NoRuleError for ``_weight_norm`` /
    ``norm_except_dim`` / ``vdot``, ``TypeError`` for spectral_norm's
    ``F.normalize(..., out=self._u)`` (a plain buffer), AttributeError for ``W.H``."""
    ref, m = _norm_steps(norm, layer, after)
    got = {n: _full(p).detach() for n, p in m.named_parameters()}
    want = dict(ref.named_parameters())
    assert sorted(got) == sorted(want)
    for n in want:
        torch.testing.assert_close(got[n], want[n].detach(), rtol=1e-5, atol=1e-6)
    ref.eval(), m.eval()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        torch.testing.assert_close(_full(m(wb.distribute_tensor(x, TP_MESH(), [Replicate()]))),
                                   ref(x), rtol=1e-5, atol=1e-6)


def test_the_weight_norm_parametrization_after_tp_raises_naming_the_fix():
    """torch's parametrize keeps only torch.Tensor originals: after parallelize_module it
    raised "'right_inverse' must return a Tensor ... Got ... DistTensor"; now an error that
    names the fixes, the layer left as it was."""
    m = _tp_mlp()
    wb.parallelize_module(m, TP_MESH(), {"0": wb.ColwiseParallel(), "2": wb.RowwiseParallel()})
    w = m[0].weight
    with pytest.raises(RuntimeError, match=r"before wrapping.*hook-based"):
        PZ.weight_norm(m[0])
    assert m[0].weight is w and not hasattr(m[0], "parametrizations")


def test_out_into_a_plain_tensor_and_conjugate_transposes():
    """``func(DistTensor..., out=plain)`` writes the global result (torch's own op on the
    gathered inputs; its autograd refusal kept); ``d.H`` / ``d.mH`` / ``torch.vdot`` as
    torch's (were AttributeError / NoRuleError)."""
    mesh = TP_MESH()
    a, b = torch.randn(4, 6), torch.randn(4, 6)
    da, db = (wb.distribute_tensor(t, mesh, [Shard(0)]) for t in (a, b))
    out = torch.empty(4, 6)
    assert torch.add(da, db, out=out) is out and torch.equal(out, a + b)
    with pytest.raises(RuntimeError, match="out=... arguments don't support automatic"):
        torch.add(da.requires_grad_(), db, out=torch.empty(4, 6))
    assert torch.equal(db.H.full_tensor(), b.H) and torch.equal(db.mH.full_tensor(), b.mH)
    with pytest.raises(RuntimeError, match="only supported on matrices"):
        wb.distribute_tensor(torch.randn(2, 2, 3), mesh, [Shard(0)]).H
    u, v = torch.randn(6), torch.randn(6)
    got = torch.vdot(wb.distribute_tensor(u, mesh, [Shard(0)]), v)
    torch.testing.assert_close(_full(got), torch.vdot(u, v))


# ---- every nn.init after wrapping: one device's draw ------------------------------------
INITS = {
    "normal_": lambda p: nn.init.normal_(p, std=0.5),
    "uniform_": lambda p: nn.init.uniform_(p, -0.5, 0.5),
    "kaiming_uniform_": lambda p: nn.init.kaiming_uniform_(p, a=5 ** 0.5) if p.dim() > 1
    else nn.init.zeros_(p),
    "kaiming_normal_": lambda p: nn.init.kaiming_normal_(p, mode="fan_out") if p.dim() > 1
    else nn.init.ones_(p),
    "xavier_uniform_": lambda p: nn.init.xavier_uniform_(p) if p.dim() > 1
    else nn.init.constant_(p, 0.3),
    "xavier_normal_": lambda p: nn.init.xavier_normal_(p, gain=2.0) if p.dim() > 1
    else nn.init.constant_(p, 0.3),
    "trunc_normal_": lambda p: nn.init.trunc_normal_(p, std=1.0),   # draws again
    "data.uniform_": lambda p: p.data.uniform_(-1, 1),
    "data.normal_": lambda p: p.data.normal_(0, 0.02),             # Hugging Face's
    "reset_parameters": None,
}


def _init_all(model_params, modules, fn):
    with torch.no_grad():
        torch.manual_seed(7)
        if fn is None:
            for m in modules:
                if isinstance(m, nn.Linear):
                    m.reset_parameters()
        else:
            for p in model_params:
                fn(p)
        return torch.rand(())


def _kinds():
    from .test_habits15 import KINDS
    return KINDS


@pytest.mark.parametrize("kind", _kinds())
def test_every_nn_init_after_wrapping_is_one_devices_draw(kind):
    """On habits15's sweep, every ``nn.init`` random init of the parameters the user's
    optimizer takes (and ``Linear.reset_parameters``, ``p.data.normal_``) after wrapping:
    the values one device draws with the same seed, the generator advanced as far.
    Before (measured): only ``nn.init.normal_`` was; on DDP / FSDP / fully_shard / ZeRO
    (rows or flat chunks) and FSDP / fully_shard / Zero3 over tensor parallelism every
    other one raised ("in-place init of a parameter after wrapping"): 62 of these 100
    cases, now 2 (``reset_parameters`` of FSDP's / Zero3's DistTensor templates, refused
    as every write into them is); the fans were read from the storage's shape
    (``reset_parameters``: its bias bound from DDP's rows, 0.159 off, once the fill
    itself was allowed)."""
    from .test_habits15 import Wrapped, full_state, mk
    for name, fn in INITS.items():
        ref, wr = mk(), Wrapped(kind)
        after = _init_all(ref.parameters(), ref.modules(), fn)
        params = wr.w.parameters() if kind in ("zero_tp", "zero2_tp") else wr.params()
        if fn is None and kind in ("fsdp_tp", "zero3_tp"):
            # the module's parameters are templates of the shards: every write refused
            with pytest.raises(RuntimeError, match="initialize before wrapping"):
                _init_all(params, wr.m.modules(), fn)
            continue
        assert torch.equal(_init_all(params, wr.m.modules(), fn), after), name
        got = full_state(wr.m.state_dict())
        for k, v in ref.state_dict().items():
            assert torch.equal(got[k], v), (name, k)


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_a_random_fill_after_wrapping_keeps_torchs_refusals(kind):
    """``p.normal_()`` of a leaf that requires grad under grad mode: torch's own error;
    ``trunc_normal_`` whose interval holds little mass (torch draws again in the storage's
    shape) or, on padded chunks, leaves 0 out: refused naming the fix, nothing drawn;
    a fill with a tensor argument (``bernoulli_(probs)``): refused as before."""
    from .test_habits15 import Wrapped, full_state
    wr = Wrapped(kind)
    w, b = wr.params()[:2]
    before = full_state(wr.m.state_dict())
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad"):
        w.normal_()
    with pytest.raises(RuntimeError, match="trunc_normal_.*before wrapping"):
        nn.init.trunc_normal_(w, a=-0.2, b=0.2)
    with pytest.raises(RuntimeError, match="in-place init"):
        with torch.no_grad():
            b.bernoulli_(torch.full((6,), 0.5))
    if kind == "fsdp":
        with pytest.raises(RuntimeError, match="padding"):
            nn.init.trunc_normal_(w, mean=2.0, a=1.0, b=3.0)
    after = full_state(wr.m.state_dict())
    assert all(torch.equal(after[k], v) for k, v in before.items())


# ---- p.grad *= c on DistTensor parameters ------------------------------------------------
@pytest.mark.parametrize("kind", ["tp", "zero_tp"])
def test_scaling_a_dist_tensor_gradient_in_place_is_torchs(kind):
    """``for p in model.parameters(): p.grad *= 0.5`` (a hand-made gradient scale): Python
    assigns the in-place result back to ``p.grad``, which raised "set .grad to None" on a
    tensor-parallel model's DistTensor parameters and ZeRO-1's (they were scaled first);
    now the same gradient given back is taken, and the steps are one device's.  A new
    tensor assigned (``p.grad = p.grad * 0.5``) still raises, naming the in-place forms."""
    from .test_habits15 import Wrapped, batches, full_state, mk
    ref = mk()
    ref.eval()
    if kind == "tp":
        m = mk()
        wb.parallelize_module(m, TP_MESH(), {"0": wb.ColwiseParallel(),
                                             "2": wb.RowwiseParallel()})
        m.eval()
        params, opt = list(m.parameters()), torch.optim.SGD(m.parameters(), lr=0.1)
        out = lambda x: _full(m(wb.distribute_tensor(x, TP_MESH(), [Replicate()])))  # noqa
    else:
        wr = Wrapped(kind)
        wr.w.eval()
        m, params, opt, out = wr.m, wr.params(), wr.optimizer(cls=torch.optim.SGD, lr=0.1), \
            wr.out
    ro = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in batches(2):
        for o in (opt, ro):
            o.zero_grad()
        ((out(x) - y) ** 2).mean().backward()
        ((ref(x) - y) ** 2).mean().backward()
        for ps in (params, list(ref.parameters())):
            for p in ps:
                p.grad *= 0.5
        with pytest.raises(ValueError, match=r"in place \(p\.grad\.mul_"):
            params[0].grad = params[0].grad * 0.5
        opt.step()
        ro.step()
    got = full_state(m.state_dict())
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6)
