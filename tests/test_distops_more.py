"""DistTensor op coverage, as a PyTorch user meets it: flip / roll / repeat_interleave,
sort / argsort, prod / cumprod, vector_norm / norm / normalize, addmm and the BLAS
updates, addcmul / addcdiv, where with scalars, clamp with tensor bounds, more
elementwise math, losses (l1, smooth_l1, huber, bce_with_logits, kl_div), softmin,
cosine_similarity, std_mean / aminmax / nansum..., tile / hstack / tensor_split, and
``x.to(x.dtype) is x``. Each was NoRuleError (or a copy where torch returns ``x``).

Every op is held to one device (value, dtype, shape, requires_grad and the input's
gradient) on meshes of 1, 2, 3 and 2x2 ranks over a (5, 7) tensor (uneven on all of
them) in every layout R / S(0) / S(1) / P (Partial from unequal parts); placements and
communication are counted for the layouts where the answer is known; a hypothesis test
draws meshes, layouts and ops."""
import math
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import workbench as wb
from tests.spmd_harness import distribute

M1, M2, M3 = (wb.Mesh.grid(n, ["a"]) for n in (1, 2, 3))
M22 = wb.Mesh.grid((2, 2), ["a", "b"])
R, S0, S1, P = wb.Replicate(), wb.Shard(0), wb.Shard(1), wb.Partial()
LAYOUTS = [(m, (p,)) for m in (M1, M2, M3) for p in (R, S0, S1, P)] + \
          [(M22, ps) for ps in ((S0, S1), (S1, P), (P, R), (R, S0), (P, P))]

_g = torch.Generator().manual_seed(0)
W = torch.randn(7, 3, generator=_g, dtype=torch.float64)
B = torch.randn(3, generator=_g, dtype=torch.float64)
G5 = torch.randn(5, 5, generator=_g, dtype=torch.float64)
Y = torch.randn(5, 7, generator=_g, dtype=torch.float64)
PROB = torch.rand(5, 7, generator=_g, dtype=torch.float64)
IDX = torch.randint(0, 7, (5, 4), generator=_g)

# name -> f(a) on a (5, 7) float64 tensor (a DistTensor or the one-device reference)
OPS = {
    "flip": lambda a: torch.flip(a, [1]), "flip0": lambda a: a.flip(0),
    "flip_both": lambda a: a.flip(0, -1), "fliplr": torch.fliplr, "flipud": lambda a: a.flipud(),
    "roll": lambda a: torch.roll(a, 2, 1), "roll_flat": lambda a: a.roll(-3),
    "roll_two": lambda a: a.roll((1, 2), (0, -1)),
    "sort": lambda a: torch.sort(a, 1), "sort_desc": lambda a: a.sort(0, descending=True),
    "argsort": lambda a: a.argsort(), "msort": torch.msort,
    "prod": lambda a: a.prod(1), "prod_all": lambda a: torch.prod(a),
    "prod_keep": lambda a: a.prod(-2, keepdim=True), "cumprod": lambda a: a.cumprod(1),
    "cumprod_dtype": lambda a: torch.cumprod(a, 0, dtype=torch.float32),
    "vector_norm": lambda a: torch.linalg.vector_norm(a),
    "vector_norm_1": lambda a: torch.linalg.vector_norm(a, 1, 1),
    "vector_norm_inf": lambda a: torch.linalg.vector_norm(a, math.inf, -1, True),
    "vector_norm_-inf": lambda a: torch.linalg.vector_norm(a, -math.inf, 0),
    "vector_norm_3": lambda a: torch.linalg.vector_norm(a, 3, 0),
    "vector_norm_0": lambda a: torch.linalg.vector_norm(a, 0, 1),
    "norm": lambda a: a.norm(), "norm_dim": lambda a: a.norm(dim=1),
    "norm_p1": lambda a: torch.norm(a, 1, 0, keepdim=True), "norm_fro": lambda a: torch.norm(a, "fro", (0, 1)),
    "linalg_norm": lambda a: torch.linalg.norm(a), "linalg_norm_dim": lambda a: torch.linalg.norm(a, dim=-1),
    "matrix_norm_inf": lambda a: torch.linalg.matrix_norm(a, math.inf),
    "matrix_norm_-1": lambda a: torch.linalg.norm(a, -1),
    "normalize": lambda a: F.normalize(a, dim=1), "normalize_p1": lambda a: F.normalize(a, p=1, dim=0),
    "addmm": lambda a: torch.addmm(B, a, W),
    "addmm_scaled": lambda a: torch.addmm(B, a, W, beta=0.5, alpha=2.0),
    "addmm_beta0": lambda a: torch.addmm(B * math.nan, a, W, beta=0),
    "addmv": lambda a: torch.addmv(a[:, 0], a, a[0]), "mv": lambda a: a.mv(a[2]),
    "addr": lambda a: torch.addr(a, a[:, 1], a[0], alpha=3),
    "baddbmm": lambda a: torch.baddbmm(a[:, :5], a[None], a.t()[None], beta=0.3),
    "addbmm": lambda a: torch.addbmm(G5, a.unflatten(0, (5, 1)).transpose(0, 1), a.t()[None]),
    "addcmul": lambda a: torch.addcmul(a, a, a.flip(0), value=0.5),
    "addcdiv": lambda a: a.addcdiv(a, a.abs() + 1, value=-2),
    "where_scalar": lambda a: torch.where(a > 0, a, 0.0),
    "where_scalar_first": lambda a: torch.where(a > 0, 1.5, a),
    "clamp_tensor": lambda a: torch.clamp(a, min=torch.zeros(7, dtype=torch.float64)),
    "clamp_tensors": lambda a: a.clamp(torch.full((5, 1), -0.2, dtype=torch.float64), W[:, 0]),
    "exp2": torch.exp2, "log2": lambda a: torch.log2(a.abs() + 0.5), "atan": torch.atan,
    "trunc": lambda a: torch.trunc(a * 3), "hardswish": F.hardswish, "logsigmoid": F.logsigmoid,
    "selu": F.selu, "softsign": F.softsign, "erfinv": lambda a: torch.erfinv(a.tanh() * 0.9),
    "nan_to_num": lambda a: torch.nan_to_num(torch.log(a), nan=0.5, neginf=-9.0),
    "fmax": lambda a: torch.fmax(a, a.flip(1)), "hypot": lambda a: torch.hypot(a, a.roll(1, 0)),
    "xlogy": lambda a: torch.xlogy(a, a.abs() + 1), "copysign": lambda a: torch.copysign(a, a.flip(0)),
    "float_power": lambda a: torch.float_power(a.abs() + 0.5, 1.5),
    "absolute": torch.absolute, "multiply": lambda a: torch.multiply(a, 2.5),
    "repeat_interleave": lambda a: a.repeat_interleave(2, 0),
    "repeat_interleave_last": lambda a: torch.repeat_interleave(a, 3, dim=-1),
    "repeat_interleave_flat": lambda a: a.repeat_interleave(torch.tensor(2)),
    "l1_loss": lambda a: F.l1_loss(a, Y), "l1_loss_sum": lambda a: F.l1_loss(a, Y, reduction="sum"),
    "smooth_l1_loss": lambda a: F.smooth_l1_loss(a, Y, beta=0.5),
    "smooth_l1_loss_none": lambda a: F.smooth_l1_loss(a, Y, reduction="none"),
    "huber_loss": lambda a: F.huber_loss(a, Y, delta=0.7),
    "bce_with_logits": lambda a: F.binary_cross_entropy_with_logits(a, PROB),
    "bce_with_logits_weights": lambda a: F.binary_cross_entropy_with_logits(
        a, PROB, weight=Y.abs(), pos_weight=W[:, 1].abs() + 0.5, reduction="sum"),
    "bce_with_logits_target_grad": lambda a: F.binary_cross_entropy_with_logits(Y, a.sigmoid()),
    "binary_cross_entropy": lambda a: F.binary_cross_entropy(a.sigmoid(), PROB),
    "binary_cross_entropy_weighted": lambda a: F.binary_cross_entropy(
        PROB, a.sigmoid(), weight=Y.abs(), reduction="sum"),
    "kl_div": lambda a: F.kl_div(F.log_softmax(a, 1), F.softmax(Y, 1), reduction="batchmean"),
    "kl_div_log_target": lambda a: F.kl_div(a, Y.clamp(max=0.), reduction="sum", log_target=True),
    "softmin": lambda a: F.softmin(a, dim=1), "cosine_similarity": lambda a: F.cosine_similarity(a, Y),
    "cosine_similarity_0": lambda a: torch.cosine_similarity(a, a.flip(0), dim=0),
    "std_mean": lambda a: torch.std_mean(a, 1),
    "var_mean": lambda a: torch.var_mean(a, 0, correction=0, keepdim=True),
    "aminmax": lambda a: torch.aminmax(a, dim=1), "aminmax_all": lambda a: a.aminmax(),
    "count_nonzero": lambda a: torch.count_nonzero(a.round(), 1),
    "nansum": lambda a: torch.nansum(torch.log(a), 0), "nanmean": lambda a: torch.log(a).nanmean(1),
    "tile": lambda a: a.tile(2), "tile_more_dims": lambda a: torch.tile(a, (2, 1, 1)),
    "hstack": lambda a: torch.hstack([a, a * 2]), "vstack": lambda a: torch.vstack([a, a[0]]),
    "tensor_split": lambda a: torch.tensor_split(a, 3, dim=1),
    "tensor_split_at": lambda a: a.tensor_split([1, 4]),
    "pad": lambda a: F.pad(a, (1, 2)), "pad_rows": lambda a: F.pad(a, (0, 0, 2, 1), value=-1.5),
    "pad_crop": lambda a: F.pad(a, (-1, 1)), "pad_both": lambda a: F.pad(a, (1, 1, 1, 1), value=0.0),
    "cummax": lambda a: torch.cummax(a, 1), "cummin": lambda a: a.cummin(0),
    "logcumsumexp": lambda a: a.logcumsumexp(-1),
    "glu": lambda a: F.glu(a[:, :6]), "glu_rows": lambda a: F.glu(a[:4], 0),
    "dist": lambda a: torch.dist(a, a.flip(0)), "dist_1": lambda a: a.dist(a * 2, 1),
    "kthvalue": lambda a: torch.kthvalue(a, 2, 1), "kthvalue_keep": lambda a: a.kthvalue(3, 0, keepdim=True),
    "median": lambda a: a.median(), "median_dim": lambda a: torch.median(a, 1),
    "median_even": lambda a: a[:4].median(0),
    "scatter_add": lambda a: torch.scatter_add(a, 1, IDX, Y[:, :4]),
    "scatter_add_src": lambda a: torch.zeros(5, 7, dtype=torch.float64).scatter_add(1, IDX, a[:, :4]),
    "index_add": lambda a: a.index_add(0, torch.tensor([0, 2, 2, 4]), Y[:4], alpha=0.5),
    "index_add_source": lambda a: torch.index_add(torch.ones(3, 7, dtype=torch.float64), 0,
                                                  torch.tensor([0, 1, 1, 2, 0]), a),
    "index_add_cols": lambda a: a.index_add(1, torch.tensor([6, 0]), a[:, :2]),
    "diagonal": lambda a: a.diagonal(), "diagonal_below": lambda a: torch.diagonal(a, -2),
    "diagonal_swapped": lambda a: a.diagonal(1, -1, -2),
    "diagonal_3d": lambda a: a.unflatten(0, (5, 1)).diagonal(0, 0, 2),
    "trace": torch.trace, "diag_of_matrix": lambda a: torch.diag(a, 1),
    "diag_of_vector": lambda a: torch.diag(a[0]), "diag_below": lambda a: a[:, 2].diag(-2),
    "diag_above": lambda a: a[1].diag(3),
    "rot90": torch.rot90, "rot90_twice": lambda a: a.rot90(2),
    "rot90_back": lambda a: torch.rot90(a, 3, (1, 0)), "rot90_full_turn": lambda a: a.rot90(4),
    "tensordot": lambda a: torch.tensordot(a, W, 1), "tensordot_2": lambda a: torch.tensordot(a, Y, 2),
    "tensordot_lists": lambda a: torch.tensordot(a, W[:, :2].unflatten(1, (2, 1)), ([1], [0])),
    "tensordot_outer": lambda a: torch.tensordot(a[0], W[:, 0], 0),
    "index_fill": lambda a: a.index_fill(1, torch.tensor([0, 4]), -1.5),
    "index_fill_zero_rows": lambda a: torch.index_fill(a, 0, torch.tensor([2]), 0.0),
    "bucketize": lambda a: torch.bucketize(a, torch.tensor([-1.0, 0.0, 0.5], dtype=a.dtype)),
    "isreal": torch.isreal,
}


def _weights(shape):
    return torch.linspace(-1.0, 2.0, math.prod(shape), dtype=torch.float64).reshape(shape)


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def as_one_device(fn, mesh, ps, x):
    """fn on x laid out as ps equals fn on x: values, dtype, shape, requires_grad, and
    the input's gradient."""
    x0 = x.clone().requires_grad_()
    ref = fn(x0)
    t = distribute(x, mesh, list(ps)).requires_grad_()
    out = fn(t)
    where = f"mesh {mesh.shape} {[str(p) for p in ps]}"
    assert type(out) is type(ref) or isinstance(out, wb.DistTensor), (where, type(out))
    refs, outs = (ref, out) if isinstance(ref, tuple) else ((ref,), (out,))
    for o, r in zip(outs, refs):
        assert isinstance(o, wb.DistTensor), where
        assert (o.dtype, o.shape, o.requires_grad) == (r.dtype, r.shape, r.requires_grad), where
        torch.testing.assert_close(o.full(), r.detach(), equal_nan=True,
                                   msg=lambda m: f"{where}: {m}")
    r, o = _first(ref), _first(out)
    if r.requires_grad:
        (r * _weights(r.shape).to(r.dtype)).sum().backward()
        (o * _weights(r.shape).to(r.dtype)).sum().backward()
        if x0.grad is None:             # vector_norm ord 0: torch gives no gradient
            assert t.grad is None, (where, "torch's gradient is None")
        else:
            torch.testing.assert_close(t.grad.full(), x0.grad,
                                       msg=lambda m: f"grad, {where}: {m}")
    return out


@pytest.mark.parametrize("name", sorted(OPS))
def test_op_equals_one_device_on_every_mesh_and_layout(name):
    x = torch.randn(5, 7, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for mesh, ps in LAYOUTS:
        as_one_device(OPS[name], mesh, ps, x)


# ---- placements and communication ------------------------------------------------------

def _run(fn, mesh, ps, x=None):
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(2)) if x is None else x
    t = distribute(x, mesh, list(ps))
    with wb.trace() as tr:
        out = fn(t)
    torch.testing.assert_close(_first(out).full(), _first(fn(x)))
    return _first(out), Counter(tr.counts())


W8 = torch.randn(8, 3, generator=torch.Generator().manual_seed(3))
PLACED = [   # (case, fn, layout, output placements, collectives)
    ("flip a kept dim", lambda a: a.flip(1), (S0,), (S0,), {}),
    ("flip a partial", lambda a: a.flip(0), (P,), (P,), {}),
    ("roll a kept dim", lambda a: a.roll(3, 0), (S1,), (S1,), {}),
    ("sort rows", lambda a: torch.sort(a, 1), (S0,), (S0,), {}),
    ("argsort rows", lambda a: a.argsort(1), (S0,), (S0,), {}),
    ("prod over a kept dim", lambda a: a.prod(1), (S0,), (S0,), {}),
    ("cumprod along", lambda a: a.cumprod(0), (S1,), (S1,), {}),
    ("sum of squares, one all-reduce", torch.linalg.vector_norm, (S0,), (R,), {"all_reduce": 1}),
    ("row norms stay sharded", lambda a: a.norm(dim=1), (S0,), (S0,), {}),
    ("max norm left P(max)", lambda a: torch.linalg.vector_norm(a, math.inf), (S0,),
     (wb.Partial("max"),), {}),
    ("1-norm left P(sum)", lambda a: torch.linalg.vector_norm(a, 1, 0), (S0,), (P,), {}),
    ("normalize rows", lambda a: F.normalize(a, dim=1), (S0,), (S0,), {}),
    ("addmm column parallel", lambda a: torch.addmm(torch.zeros(3), a, W8), (S0,), (S0,), {}),
    ("addcmul", lambda a: torch.addcmul(a, a, a), (S1,), (S1,), {}),
    ("where with a zero", lambda a: torch.where(a > 0, a, 0.0), (S0,), (S0,), {}),
    ("GQA's repeated heads stay sharded", lambda a: a.repeat_interleave(2, 0), (S0,), (S0,), {}),
    ("repeat_interleave another dim", lambda a: a.repeat_interleave(3, 1), (S0,), (S0,), {}),
    ("l1_loss left P(sum), reduced when read", lambda a: F.l1_loss(a, torch.zeros(6, 8)),
     (S0,), (P,), {}),
    ("cosine_similarity of rows", lambda a: F.cosine_similarity(a, a.flip(1)), (S0,), (S0,), {}),
    ("std_mean of rows", lambda a: torch.std_mean(a, 1)[0], (S0,), (S0,), {}),
    ("tile", lambda a: a.tile(2, 1), (S1,), (S1,), {}),
    ("pad the last dim of rows", lambda a: F.pad(a, (1, 1)), (S0,), (S0,), {}),
    ("pad a partial with zeros", lambda a: F.pad(a, (1, 1)), (P,), (P,), {}),
    ("cummax along rows", lambda a: a.cummax(1), (S0,), (S0,), {}),
    ("index_add of columns", lambda a: a.index_add(1, torch.tensor([6, 0]), a[:, :2]), (S0,),
     (S0,), {}),
    ("scatter_add along rows", lambda a: a.scatter_add(1, torch.zeros(6, 8, dtype=torch.long), a),
     (S0,), (S0,), {}),
]


@pytest.mark.parametrize("case,fn,ps,want,comms", PLACED, ids=[c[0] for c in PLACED])
def test_placements_and_communication(case, fn, ps, want, comms):
    out, counts = _run(fn, M2, ps)
    assert out.placements == want, (case, out.placements)
    assert counts == Counter(comms), (case, counts)


def test_a_sharded_operated_dim_is_moved_once():
    # S(1) -> the op over dim 1 needs it whole: one collective (all-gather to R, or an
    # all-to-all to S(0)), and the output is not sharded on dim 1
    for fn in (lambda a: a.flip(1), lambda a: a.roll(1, 1), lambda a: a.sort(1),
               lambda a: a.argsort(1), lambda a: a.cumprod(1), lambda a: a.cumsum(1)):
        out, counts = _run(fn, M2, (S1,))
        assert not any(p.is_shard(1) for p in out.placements), out.placements
        assert sum(counts.values()) == 1, counts
    out, counts = _run(lambda a: a.prod(1), M2, (S1,))
    assert sum(counts.values()) == 1, counts


def test_addmm_row_parallel_reduces_before_the_bias():
    # x S(1) @ w S(0) is P(sum): the bias is added once, after one all-reduce
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(4))
    b = torch.randn(3)
    xt, wt = wb.shard_tensor(x, M3, [S1]), wb.shard_tensor(W8, M3, [S0])
    with wb.trace() as tr:
        out = torch.addmm(b, xt, wt)
    torch.testing.assert_close(out.full(), torch.addmm(b, x, W8))
    assert sum(tr.counts().values()) == 1 and out.placements[0] in (R, S0, S1)


def test_cosine_similarity_of_tiny_vectors_has_torchs_gradient():
    # torch clamps the norms to eps outside autograd: the gradient flows through the
    # unclamped norm (a differentiable clamp gave gradients 5e5 off for a 1e-10 row)
    x = torch.randn(5, 7, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    x[2], x[3] = 0.0, 1e-10
    for ps in ((R,), (S0,), (S1,)):
        as_one_device(lambda a: F.cosine_similarity(a, Y), M3, ps, x)
        as_one_device(lambda a: F.cosine_similarity(a, a + 1), M3, ps, x)


def test_norm_of_a_zero_vector_has_gradient_zero():
    # a plain sqrt(sum(x^2)) would give nan; torch masks the zero norm
    x = torch.zeros(4, 6, dtype=torch.float64)
    x[0] = torch.arange(6.)
    for ps in ((R,), (S0,), (S1,)):
        for f in (lambda a: a.norm(dim=1), lambda a: F.normalize(a, dim=1),
                  lambda a: torch.linalg.vector_norm(a, 3, 1)):
            as_one_device(f, M3, ps, x)


# ---- dtypes, PyTorch's promotion and errors -------------------------------------------

def _same(fn, x, ps=(S0,), mesh=M3):
    ref = fn(x)
    out = fn(wb.shard_tensor(x, mesh, list(ps)))
    ref, out = _first(ref), _first(out)
    assert out.dtype == ref.dtype and out.shape == ref.shape, (out.dtype, ref.dtype)
    torch.testing.assert_close(out.full(), ref)


@pytest.mark.parametrize("fn,x", [
    (lambda a: a.prod(1), torch.arange(-3, 11).reshape(7, 2)),           # int -> int64
    (lambda a: a.prod(), torch.ones(5, 2, dtype=torch.bool)),             # bool -> int64
    (lambda a: a.cumprod(0), torch.arange(1, 8, dtype=torch.int32)),
    (lambda a: a.cumsum(0), torch.arange(1, 8, dtype=torch.int8)),
    (lambda a: a.prod(0, dtype=torch.float64), torch.randn(7, 2)),
    (lambda a: a.sort(0).values, torch.randint(0, 4, (7, 3))),
    (lambda a: a.flip(0), torch.randn(7, 2).bfloat16()),
    (lambda a: torch.linalg.vector_norm(a, dim=1), torch.randn(7, 40).bfloat16()),
    (lambda a: torch.linalg.vector_norm(a, dtype=torch.float64), torch.randn(7, 3)),
    (lambda a: a.norm(dim=0), torch.randn(7, 3).half()),
    (lambda a: torch.float_power(a, 2), torch.randn(7, 3)),
    (lambda a: torch.where(a > 0, a, 0.0), torch.randn(7, 3).bfloat16()),
    (lambda a: torch.where(a > 0, 1.0, 0.0), torch.randn(7, 3).double()),
    (lambda a: torch.where(a > 0, a, 2.5), torch.arange(-3, 4)),         # int, float -> float
    (lambda a: a.clamp(min=0.5), torch.arange(7)),                        # -> float
    (lambda a: torch.addmm(a, a, a, alpha=0.5), torch.arange(49).reshape(7, 7)),  # alpha -> 0
    (lambda a: torch.addcmul(a, a.double(), a), torch.randn(7, 3)),
    (lambda a: torch.addcmul(a, a, a.flip(0), value=-1.5), torch.arange(7)),   # value -> -1
    (lambda a: a.repeat(2, 1), torch.arange(14).reshape(7, 2)),   # int R: was "no reshard
    (lambda a: a.expand(2, 7, 2), torch.arange(14).reshape(7, 2)),  # plan to P(avg)"
    (lambda a: torch.triu(a), torch.arange(14).reshape(7, 2)),
    (lambda a: F.huber_loss(a, a.double()), torch.randn(7, 3)),          # input's dtype
    (lambda a: F.binary_cross_entropy_with_logits(a.double(), a.sigmoid()), torch.randn(7, 3)),
    (lambda a: F.cosine_similarity(a, a.double() + 1), torch.arange(14).reshape(7, 2)),
    (lambda a: torch.isinf(a), torch.tensor([1.0, math.inf, -math.inf, math.nan, 0.0])),
    (lambda a: F.binary_cross_entropy(a, torch.tensor([1.0, 0.0, 0.5, 1.0])),   # log(0): -100
     torch.tensor([0.0, 1.0, 0.5, 1.0])),
    (lambda a: a.roll(1, 0), torch.randn(1, 3)),                          # a batch of one
    (lambda a: a.sort(1).indices, torch.randn(0, 3)),                     # empty
    (lambda a: a.prod(0), torch.randn(0, 3)),                             # empty: 1
    (lambda a: torch.linalg.vector_norm(a), torch.randn(0, 3)),           # empty: 0
    (lambda a: torch.linalg.vector_norm(a, dim=()), torch.randn(7, 3)),   # (): every dim
    (lambda a: torch.linalg.matrix_norm(a[None].expand(2, 7, 3), 1, keepdim=True),
     torch.randn(7, 3)),
    (lambda a: torch.linalg.matrix_norm(a, -math.inf, dim=(1, 0)), torch.randn(7, 3)),
    (lambda a: a.norm(2, 1, True, dtype=torch.float64), torch.randn(7, 3)),
    (lambda a: torch.linalg.vector_norm(torch.view_as_complex(a), dim=0), torch.randn(7, 3, 2)),
    (lambda a: torch.view_as_complex(a).norm(p=3), torch.randn(7, 3, 2)),
])
def test_dtypes_and_edge_sizes_as_torch(fn, x):
    _same(fn, x, ps=(S0,) if x.ndim else (R,))
    _same(fn, x, ps=(R,))


def test_zero_dim_inputs():
    s = torch.tensor(-2.5)
    for fn in (lambda a: a.flip(()), lambda a: a.roll(1), lambda a: a.sort(0).values,
               lambda a: a.argsort(), lambda a: a.prod(), lambda a: a.cumprod(0),
               lambda a: torch.linalg.vector_norm(a), lambda a: a.norm(p=1)):
        _same(fn, s, ps=(R,))


@pytest.mark.parametrize("fn,err", [
    (lambda a: a.flip(2), IndexError), (lambda a: a.flip(0, 0), RuntimeError),
    (lambda a: a.roll(1, 2), IndexError), (lambda a: a.roll((1, 2), 0), RuntimeError),
    (lambda a: a.roll((1, 2)), RuntimeError), (lambda a: a[0].fliplr(), RuntimeError),
    (lambda a: a.sort(-3), IndexError), (lambda a: a.argsort(2), IndexError),
    (lambda a: a.prod(2), IndexError), (lambda a: a.cumprod(-3), IndexError),
    (lambda a: torch.linalg.vector_norm(a, dim=2), IndexError),
    (lambda a: torch.linalg.vector_norm(a.long()), RuntimeError),
    (lambda a: torch.linalg.vector_norm(a[:0], math.inf), RuntimeError),
    (lambda a: torch.addmm(torch.zeros(3), a, a), RuntimeError),          # shapes
    (lambda a: torch.mv(a, torch.zeros(5)), RuntimeError),
    (lambda a: torch.addcdiv(a.long(), a.long(), a.long()), RuntimeError),
    (lambda a: torch.linalg.norm(a[None], 2), RuntimeError),
    (lambda a: F.pad(a, (1, 1, 1, 1, 1, 1)), RuntimeError),
    (lambda a: a.cummax(2), IndexError), (lambda a: a.kthvalue(9, 1), RuntimeError),
    (lambda a: F.glu(a, 1), RuntimeError),                                 # 7 is odd
    (lambda a: F.glu(a.long(), 0), (RuntimeError, NotImplementedError)),
    (lambda a: F.huber_loss(a.long(), a.double()), RuntimeError),          # can't be cast
    (lambda a: F.binary_cross_entropy_with_logits(a.long(), a), NotImplementedError),
    (lambda a: F.cosine_similarity(a.long(), a.long()), RuntimeError),
    (lambda a: F.smooth_l1_loss(a, a, beta=-1.0), RuntimeError),
    (lambda a: F.huber_loss(a, a, delta=0.0), RuntimeError),
    (lambda a: F.l1_loss(a, a, reduction="avg"), ValueError),
    (lambda a: F.binary_cross_entropy_with_logits(a, a[:2]), ValueError),
])

def test_bad_arguments_raise_as_torch(fn, err):
    x = torch.randn(5, 7)
    with pytest.raises(err):
        fn(x)
    t = wb.shard_tensor(x, M3, [S0])
    with pytest.raises(err):
        fn(t)


@pytest.mark.parametrize("fn", [lambda a: F.l1_loss(a, a[0]), lambda a: F.huber_loss(a, a[0]),
                                lambda a: F.kl_div(a, a.softmax(1))])
def test_losses_warn_once_as_torch(fn):
    x = torch.randn(5, 7)
    for z in (x, wb.shard_tensor(x, M3, [S0])):
        with pytest.warns(UserWarning) as rec:
            fn(z)
        assert len(rec) == 1


@pytest.mark.parametrize("fn,match", [
    (lambda a: a.prod((0, 1)), "one int"),                                 # torch: TypeError
    (lambda a: torch.addmm(torch.zeros(7).double(), a, torch.zeros(7, 7)), "dtypes must be"),
    (lambda a: torch.linalg.matrix_norm(a, 2), "singular values"),
    (lambda a: a.norm(p="nuc"), "singular values"),
    (lambda a: F.pad(a, (1, 1), mode="reflect"), "mode='constant'"),
])
def test_unsupported_or_mismatched_raise_clearly(fn, match):
    t = wb.shard_tensor(torch.randn(5, 7), M3, [S0])
    with pytest.raises((TypeError, RuntimeError, NotImplementedError), match=match):
        fn(t)


def test_a_cast_to_the_same_dtype_returns_the_tensor_itself():
    # was a copy; torch returns self (x.to(x.dtype) is x), unless copy=True
    x = torch.randn(5, 7)
    t = wb.shard_tensor(x, M3, [S0]).requires_grad_()
    for f in (lambda a: a.to(a.dtype), lambda a: a.float(), lambda a: a.to("cpu"),
              lambda a: a.to(torch.float32), lambda a: a.type_as(torch.ones(1)),
              lambda a: a.to(torch.ones(2))):
        assert f(x) is x and f(t) is t
    for f in (lambda a: a.to(torch.float32, copy=True), lambda a: a.double(),
              lambda a: a.to(torch.float64).to(torch.float32)):
        assert f(x) is not x and f(t) is not t
        torch.testing.assert_close(f(t).full(), f(x))
    assert t.to(torch.float64).dtype == torch.float64


def test_repeat_interleave_of_uneven_shards_moves_them():
    # 5 rows on 4 ranks (2, 2, 1, 0) repeated 3 times are not torch.chunk's blocks of 15
    # rows (4, 4, 4, 3): the rows are moved first, never labelled wrongly
    x = torch.randn(5, 3)
    t = wb.shard_tensor(x, wb.Mesh.grid(4, ["a"]), [S0])
    with wb.trace() as tr:
        out = t.repeat_interleave(3, dim=0)
    torch.testing.assert_close(out.full(), x.repeat_interleave(3, 0))
    assert sum(tr.counts().values()) == 1
    with pytest.raises(NotImplementedError, match="one int"):
        t.repeat_interleave(torch.tensor([1, 2, 1, 1, 1]), dim=0)
    with pytest.raises(RuntimeError, match="non-negative"):
        t.repeat_interleave(-1, dim=0)


@pytest.mark.parametrize("ps", [(S0,), (S1,), (R,)])
def test_in_place_forms_write_one_devices_answer(ps):
    # x.addcmul_ (Adam's second moment), x.cumprod_, x.clamp_(tensor), F.hardswish(inplace)
    x = torch.randn(5, 7, generator=torch.Generator().manual_seed(6))
    for f in (lambda a: a.addcmul_(a * 1, a * 2, value=0.5),
              lambda a: a.addcdiv_(a * 1, a.abs() + 1, value=-2), lambda a: a.cumprod_(1),
              lambda a: a.clamp_(min=torch.zeros(7)), lambda a: a.nan_to_num_(posinf=1.0),
              lambda a: F.hardswish(a, inplace=True), lambda a: a.exp2_().log2_()):
        r, t = x.clone(), wb.shard_tensor(x, M3, list(ps))
        out = f(t)
        f(r)
        assert out is t and t.placements == ps
        torch.testing.assert_close(t.full(), r)


@pytest.mark.parametrize("ps", [(R,), (S0,), (S1,)])
def test_one_hot(ps):
    y = torch.randint(0, 5, (7, 2), generator=torch.Generator().manual_seed(7))
    t = wb.shard_tensor(y, M3, list(ps))
    with wb.trace() as tr:
        out = F.one_hot(t, 6)
    assert out.placements == ps and out.dtype == torch.int64 and not tr.counts()
    assert torch.equal(out.full(), F.one_hot(y, 6))
    with wb.trace() as tr:
        out = F.one_hot(t)                        # num_classes = the largest id + 1
    assert torch.equal(out.full(), F.one_hot(y)) and out.shape == F.one_hot(y).shape
    assert sum(tr.counts().values()) == (0 if ps == (R,) else 1)     # the global max
    for bad, match in ((lambda a: F.one_hot(a, 3), "smaller than num_classes"),
                       (lambda a: F.one_hot(a - 3, 6), "non-negative"),
                       (lambda a: F.one_hot(a.int(), 6), "LongTensor")):
        for z in (y, t):
            with pytest.raises(RuntimeError, match=match):
                bad(z)


def test_a_distributed_bool_mask_index_selects_like_torch():
    # was IndexError "tensors used as indices must be long, int, byte or bool tensors", then
    # a NotImplementedError naming torch.where; now run replicated (ops_table/datadep.py)
    x = torch.randn(4, 3)
    t = wb.shard_tensor(x, M2, [S0])
    got = t[t > 0]
    assert got.placements == (R,) and torch.equal(got.full(), x[x > 0])
    torch.testing.assert_close(t[(x > 0)[:, 0]].full(), x[(x > 0)[:, 0]])   # a plain mask


@pytest.mark.parametrize("ps", [(R,), (S0,), (S1,)])
def test_writes_through_a_diagonal_reach_the_tensor(ps):
    # diagonal is a view, as torch's: x.diagonal().fill_(1) writes x's diagonal
    t = wb.shard_tensor(torch.zeros(4, 4), M2, list(ps))
    t.diagonal().fill_(1.0)
    assert torch.equal(t.full(), torch.eye(4))
    v = torch.tensor([1.0, math.inf, math.nan, -2.0])       # no 0 * inf off the diagonal
    torch.testing.assert_close(torch.diag(wb.shard_tensor(v, M2, [S0]), 1).full(),
                               torch.diag(v, 1), equal_nan=True)


def _llama_rope(xq, freqs_cis):
    """Llama's reference rotary embedding (complex multiply)."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    fc = freqs_cis.view(1, xq.shape[1], 1, xq.shape[-1] // 2)
    return torch.view_as_real(xq_ * fc).flatten(3).type_as(xq)


@pytest.mark.parametrize("mesh,ps,comms", [
    (M2, (S0,), 0), (M2, (wb.Shard(2),), 0), (M3, (wb.Shard(1),), 0), (M2, (R,), 0),
    (M2, (P,), 0), (M2, (wb.Shard(3),), 1), (M22, (S0, wb.Shard(2)), 0)])
def test_llama_complex_rotary_embedding(mesh, ps, comms):
    # view_as_complex / view_as_real (were NoRuleError): batch, sequence and heads shards
    # pass, a partial input stays partial (linear), a split head dim is moved once
    B, T, H, D = 2, 5, 4, 6
    freqs = torch.outer(torch.arange(T).float(), 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D)))
    freqs_cis = torch.polar(torch.ones_like(freqs), freqs)
    xq = torch.randn(B, T, H, D, generator=torch.Generator().manual_seed(11))
    x0 = xq.clone().requires_grad_()
    ref = _llama_rope(x0, freqs_cis)
    t = distribute(xq, mesh, list(ps)).requires_grad_()
    with wb.trace() as tr:
        out = _llama_rope(t, freqs_cis)
    torch.testing.assert_close(out.full(), ref.detach())
    assert sum(tr.counts().values()) == comms
    w = _weights(ref.shape).float()
    (ref * w).sum().backward()
    (out * w).sum().backward()
    torch.testing.assert_close(t.grad.full(), x0.grad)


def test_where_of_a_condition_alone_is_nonzero_as_tuple():
    # was TypeError "<lambda>() missing 2 required positional arguments", then a
    # NotImplementedError naming nonzero; now nonzero's form, run replicated (datadep.py)
    x = torch.randn(5, 7)
    t = wb.shard_tensor(x, M3, [S0])
    got, want = torch.where(t > 0), torch.where(x > 0)
    assert len(got) == len(want) and all(torch.equal(g.full(), w) for g, w in zip(got, want))


def test_tensor_type():
    x = torch.randn(5, 7)
    t = wb.shard_tensor(x, M3, [S0])
    assert t.type() == x.type() == "torch.FloatTensor"
    assert t.type(torch.float32) is t
    for arg in (torch.float64, "torch.DoubleTensor"):
        assert t.type(arg).dtype == x.type(arg).dtype == torch.float64
        torch.testing.assert_close(t.type(arg).full(), x.type(arg))


def test_aliases_are_the_ops_they_name():
    x = torch.randn(5, 7)
    t = wb.shard_tensor(x, M3, [S1])
    for f in (torch.absolute, torch.negative, lambda a: torch.subtract(a, 1.0),
              lambda a: torch.divide(a, 2.0), lambda a: torch.true_divide(a, 4),
              lambda a: torch.greater(a, 0), lambda a: a.less_equal(0.1), torch.fix,
              lambda a: torch.arctan(a), lambda a: a.not_equal(0)):
        out = f(t)
        assert out.placements == (S1,)
        torch.testing.assert_close(out.full(), f(x))


# ---- hypothesis: random meshes, layouts and ops ----------------------------------------

MESH_CHOICES = [M1, M2, M3, M22]
ANY_SIZE = {"flip", "flip0", "roll", "roll_flat", "sort", "argsort", "msort", "prod", "prod_all",
            "cumprod", "vector_norm", "vector_norm_1", "vector_norm_inf", "norm_dim",
            "normalize", "where_scalar", "exp2", "hardswish", "fmax", "addcmul",
            "repeat_interleave", "repeat_interleave_last", "softmin", "std_mean", "aminmax",
            "aminmax_all", "nansum", "tile", "hstack", "tensor_split", "pad", "pad_both",
            "cummax", "logcumsumexp", "median", "median_dim"}              # no (5, 7) partner


@settings(max_examples=60, deadline=None)
@given(mesh=st.sampled_from(MESH_CHOICES), data=st.data(),
       name=st.sampled_from(sorted(OPS)), rows=st.integers(1, 6), cols=st.integers(3, 8))
def test_random_layouts_equal_one_device(mesh, data, name, rows, cols):
    ps = tuple(data.draw(st.sampled_from([R, S0, S1, P])) for _ in range(mesh.ndim))
    fn = OPS[name]
    x = torch.randn(5, 7, generator=torch.Generator().manual_seed(rows * 10 + cols),
                    dtype=torch.float64)
    if name in ANY_SIZE:
        x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(cols),
                        dtype=torch.float64)
    as_one_device(fn, mesh, ps, x)


# the op table's enumeration (tests/test_op_table.py) takes these samples: one call of
# each op registered here, on the 2-rank mesh in every layout
_X = torch.randn(4, 6, generator=torch.Generator().manual_seed(5))
TABLE_SAMPLES = {
    "flip": (lambda x: torch.flip(x, [1]), [_X]), "roll": (lambda x: torch.roll(x, 2, 0), [_X]),
    "sort": (lambda x: tuple(torch.sort(x, 1)), [_X]), "argsort": (lambda x: x.argsort(0), [_X]),
    "msort": (torch.msort, [_X]), "prod": (lambda x: x.prod(1), [_X]),
    "cumprod": (lambda x: torch.cumprod(x, 0), [_X]),
    "repeat_interleave": (lambda x: x.repeat_interleave(2, 1), [_X]),
    "pad": (lambda x: F.pad(x, (1, 2)), [_X]), "cummax": (lambda x: tuple(x.cummax(1)), [_X]),
    "cummin": (lambda x: tuple(torch.cummin(x, 0)), [_X]),
    "logcumsumexp": (lambda x: x.logcumsumexp(1), [_X]),
    "one_hot": (lambda x: F.one_hot((x > 0).long() + (x > 1).long(), 4), [_X]),
    "scatter_add": (lambda x, s: torch.scatter_add(x, 1, IDX[:4, :3] % 6, s),
                    [_X, torch.randn(4, 3, generator=torch.Generator().manual_seed(8))]),
    "diagonal": (lambda x: x.diagonal(1), [_X]),
    "index_fill": (lambda x: x.index_fill(1, torch.tensor([0, 4]), -1.5), [_X]),
    "bucketize": (lambda x: torch.bucketize(x, torch.tensor([-1.0, 0.0, 0.5]), right=True),
                  [_X]),
    "view_as_complex": (lambda x: torch.view_as_real(torch.view_as_complex(x.reshape(4, 3, 2))
                                                     * (1 + 2j)), [_X]),
    "view_as_real": (lambda x: torch.view_as_real(torch.view_as_complex(x.unflatten(1, (3, 2)))),
                     [_X]),
    "complex": (lambda a, b: torch.view_as_real(torch.complex(a, b)), [_X, _X.flip(1)]),
    "polar": (lambda a, b: torch.view_as_real(torch.polar(a.abs() + 0.5, b)), [_X, _X.flip(0)]),
    "index_add": (lambda x, s: x.index_add(0, torch.tensor([0, 3, 3]), s, alpha=2.0),
                  [_X, torch.randn(3, 6, generator=torch.Generator().manual_seed(9))]),
}


def _table_samples():
    from workbench.parallel.ops_table.pointwise_math import BINARY_MORE, UNARY_MORE
    from workbench.parallel.ops_table.samples import Gen
    for name, (fs, _, _, make) in UNARY_MORE.items():
        args = make(Gen())[0]
        TABLE_SAMPLES[name] = (lambda *a, f=fs[0], rest=args[1:]: f(*a, *rest), [args[0]])
    for name, (fs, _, _, make) in BINARY_MORE.items():
        s = make(Gen())[0]
        TABLE_SAMPLES[name] = (s.fn, list(s.args))
    TABLE_SAMPLES["logical_xor"] = (lambda a, b: torch.logical_xor(a > 0, b > 0), [_X, _X.flip(0)])
    # sweep14: integer ops laid out through floats; mode, unfold, renorm
    for name in ("gcd", "lcm"):
        TABLE_SAMPLES[name] = (lambda a, b, f=getattr(torch, name): f((a * 4).long(),
                                                                        (b * 4).long()),
                               [_X, _X.flip(0)])
    TABLE_SAMPLES["mode"] = (lambda x: tuple(torch.mode(x, 1)), [_X])
    TABLE_SAMPLES["unfold"] = (lambda x: x.unfold(1, 3, 2), [_X])
    TABLE_SAMPLES["renorm"] = (lambda x: torch.renorm(x, 2, 0, 1.0), [_X])


_table_samples()
