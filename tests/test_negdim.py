"""``wb.spmd.infer`` with a negative dim decides what it decides for the wrapped dim.

The dispatcher's parse wraps a dim before the rule sees it; ``wb.spmd.infer`` (and any
caller of a rule) hands the rule the dim the user wrote. Every rule that takes a dim wraps
it as torch does: ``dim=-k`` gives the same Decision as ``dim=ndim-k`` (``stack``: a dim of
the output, ndim + 1), and an out-of-range dim raises torch's own IndexError, never wraps.
Specs, meshes and dims are drawn by hypothesis (derandomized: tests/conftest.py)."""
from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import workbench as wb
from workbench.parallel.ops_table import TABLE, load
from workbench.parallel.ops_table.samples import samples
from workbench.parallel.placement import Partial, Replicate, Shard

load()

MESHES = {"1": ([0], ["a"]), "2": ([0, 1], ["a"]), "3": ([0, 1, 2], ["a"]),
          "4": ([0, 1, 2, 3], ["a"]), "2x2": ([[0, 1], [2, 3]], ["a", "b"])}
_MESH_CACHE: dict = {}


def _mesh(name):
    if name not in _MESH_CACHE:
        ranks, names = MESHES[name]
        _MESH_CACHE[name] = wb.Mesh(ranks, dim_names=names)
    return _MESH_CACHE[name]


@dataclass(frozen=True)
class Case:
    """``build(x, rng_draw, dims) -> (specs, attrs)`` for the op on x's spec and the
    (possibly negative) dims; ``kind``: how many dims the op takes ("one", "some" (a
    subset), "two" (distinct), "perm" (all, permuted)); ``extra``: dims counted on
    ndim + extra; ``call(t, dims)``: torch's op on a plain tensor (its error is the
    reference); ``min_ndim``: the smallest input rank the op takes."""
    kind: str
    build: Callable
    call: Callable
    extra: int = 0
    min_ndim: int = 1


def _idx(x, shape=None):
    """An int64 index spec laid out like x (same shape unless given: replicated)."""
    if shape is None:
        ps = [Replicate() if p.is_partial() else p for p in x.placements]
        return wb.TensorSpec(x.shape, x.mesh, ps, torch.int64)
    return wb.TensorSpec(shape, x.mesh, [Replicate()] * x.mesh.ndim, torch.int64)


def _red(x, draw, d):
    return (x,), {"dim": tuple(d) if draw(st.booleans()) or len(d) > 1 else d[0],
                  "keepdim": draw(st.booleans()), "dtype": None}


def _chunks(x, d):
    return tuple(p.shape[d] for p in torch.empty(tuple(x.shape), device="meta").chunk(2, d))


def _t(shape, dtype=torch.float32):
    return torch.zeros(shape, dtype=dtype)


CASES = {
    **{k: Case("some", _red, lambda t, d, k=k: getattr(torch, k)(t, tuple(d)))
       for k in ("sum", "mean", "amax", "amin")},
    **{k: Case("some", lambda x, draw, d: ((x,), {"dim": tuple(d), "keepdim": draw(st.booleans())}),
               lambda t, d, k=k: getattr(torch, k)(t, tuple(d)))
       for k in ("any", "all")},
    "prod": Case("one", lambda x, draw, d: ((x,), {"dim": d[0], "keepdim": draw(st.booleans()),
                                                   "dtype": None}),
                 lambda t, d: torch.prod(t, d[0])),
    **{k: Case("one", lambda x, draw, d: ((x,), {"dim": d[0], "keepdim": draw(st.booleans())}),
               lambda t, d, k=k: getattr(torch, k)(t, d[0]))
       for k in ("argmax", "argmin")},
    **{k: Case("one", lambda x, draw, d: ((x,), {"dim": d[0], "dtype": None}),
               lambda t, d, k=k: getattr(torch, k)(t, d[0]))
       for k in ("softmax", "log_softmax", "cumsum", "cumprod")},
    **{k: Case("one", lambda x, draw, d, n=n: ((x,), {"dim": d[0], "n_out": n}),
               lambda t, d, k=k: getattr(torch, k)(t, d[0]))
       for k, n in (("cummax", 2), ("cummin", 2), ("logcumsumexp", 1))},
    **{k: Case("one", lambda x, draw, d, n=n: ((x,), {"dim": d[0], "descending": False,
                                                      "stable": False, "n_out": n}),
               lambda t, d: torch.sort(t, d[0]))
       for k, n in (("sort", 2), ("argsort", 1), ("msort", 2))},
    **{k: Case("one", lambda x, draw, d: ((x,), {"q": 0.5, "dim": d[0],
                                                 "keepdim": draw(st.booleans()),
                                                 "interpolation": "linear"}),
               lambda t, d, k=k: getattr(torch, k)(t, 0.5, d[0]))
       for k in ("quantile", "nanquantile")},                               # fixlist3
    "nanmedian": Case("one", lambda x, draw, d: ((x,), {"dim": d[0],
                                                         "keepdim": draw(st.booleans())}),
                      lambda t, d: torch.nanmedian(t, d[0])),                # fixlist6
    "kthvalue_rows": Case("one", lambda x, draw, d: ((x,), {"k": 1, "dim": d[0],
                                                           "keepdim": draw(st.booleans())}),
                          lambda t, d: torch.kthvalue(t, 1, d[0])),          # sweep11b
    "median_rows": Case("one", lambda x, draw, d: ((x,), {"dim": d[0],
                                                       "keepdim": draw(st.booleans())}),
                        lambda t, d: torch.median(t, d[0])),
    "mode": Case("one", lambda x, draw, d: ((x,), {"dim": d[0], "keepdim": draw(st.booleans())}),
                 lambda t, d: torch.mode(t, d[0])),                          # sweep14
    "renorm": Case("one", lambda x, draw, d: ((x,), {"p": 2, "dim": d[0], "maxnorm": 1.0}),
                   lambda t, d: torch.renorm(t, 2, d[0], 1.0), min_ndim=2),
    "unfold": Case("one", lambda x, draw, d: ((x,), {"dim": d[0], "size": 1, "step": 1}),
                   lambda t, d: t.unfold(d[0], 1, 1)),
    "topk": Case("one", lambda x, draw, d: ((x,), {"k": 1, "dim": d[0], "largest": True,
                                                   "sorted": True}),
                 lambda t, d: torch.topk(t, 1, d[0])),
    "cat": Case("one", lambda x, draw, d: ((x, x), {"dim": d[0]}),
                lambda t, d: torch.cat([t, t], d[0])),
    "stack": Case("one", lambda x, draw, d: ((x, x), {"dim": d[0]}),
                  lambda t, d: torch.stack([t, t], d[0]), extra=1, min_ndim=0),
    **{k: Case("one", lambda x, draw, d: ((x,), {"sizes": _chunks(x, d[0] % x.ndim), "dim": d[0]}),
               lambda t, d: torch.chunk(t, 2, d[0]))
       for k in ("split", "chunk")},
    "unbind": Case("one", lambda x, draw, d: ((x,), {"dim": d[0]}),
                   lambda t, d: torch.unbind(t, d[0])),
    "swiglu": Case("one", lambda x, draw, d: ((x,), {"dim": d[0]}),
                   lambda t, d: torch.chunk(t, 2, d[0])),     # its halves (wb.ops.swiglu
    # on a plain tensor raises a ValueError of its own for an out-of-range dim)
    **{k: Case("perm", lambda x, draw, d: ((x,), {"dims": tuple(d)}),
               lambda t, d: t.permute(*d), min_ndim=0)
       for k in ("permute", "transpose")},
    "diagonal": Case("two", lambda x, draw, d: ((x,), {"offset": 0, "dim1": d[0], "dim2": d[1]}),
                     lambda t, d: torch.diagonal(t, 0, d[0], d[1]), min_ndim=2),
    "flip": Case("some", lambda x, draw, d: ((x,), {"dims": tuple(d)}),
                 lambda t, d: torch.flip(t, tuple(d))),
    "roll": Case("some", lambda x, draw, d: ((x,), {"shifts": (1,) * len(d), "dims": tuple(d)}),
                 lambda t, d: torch.roll(t, (1,) * len(d), tuple(d))),
    "repeat_interleave": Case("one", lambda x, draw, d: ((x,), {"repeats": 2, "dim": d[0]}),
                              lambda t, d: torch.repeat_interleave(t, 2, d[0])),
    "gather": Case("one", lambda x, draw, d: ((x, _idx(x)), {"dim": d[0]}),
                   lambda t, d: torch.gather(t, d[0], _t(t.shape, torch.int64))),
    "scatter": Case("one", lambda x, draw, d: ((x, _idx(x), x), {"dim": d[0], "value": None}),
                    lambda t, d: torch.scatter(t, d[0], _t(t.shape, torch.int64), t)),
    "scatter_add": Case("one", lambda x, draw, d: ((x, _idx(x), x), {"dim": d[0]}),
                        lambda t, d: torch.scatter_add(t, d[0], _t(t.shape, torch.int64), t)),
    "index_select": Case("one", lambda x, draw, d: ((x, _idx(x, (1,))), {"dim": d[0]}),
                         lambda t, d: torch.index_select(t, d[0], _t(1, torch.int64))),
    "index_fill": Case("one", lambda x, draw, d: ((x, _idx(x, (1,))), {"dim": d[0], "value": 0.0}),
                       lambda t, d: torch.index_fill(t, d[0], _t(1, torch.int64), 0.0)),
    "index_add": Case("one", lambda x, draw, d: ((x, _idx(x, (x.shape[d[0] % x.ndim],)), x),
                                                 {"dim": d[0], "alpha": 1}),
                      lambda t, d: torch.index_add(t, d[0], _t(1, torch.int64), t)),
    **{k: Case("one", lambda x, draw, d, more=more: ((x,), {
        **more, "return_inverse": False, "return_counts": False, "dim": d[0], "n_out": 1}),
        lambda t, d: torch.unique(t, dim=d[0]))
       for k, more in (("unique", {"sorted": True}), ("unique_consecutive", {}))},
}

DIM_NAMES = ("dim", "dims", "dim1", "dim2")
# ops whose rule has a dim parameter that their own calls never set (a rule shared with
# an op that takes one)
NO_DIM = {"masked_select", "nonzero", "argwhere", "bool_mask_index"}


def _placements(draw, mesh, ndim):
    opts = [Replicate(), Partial("sum")] + [Shard(d) for d in range(ndim)]
    return [draw(st.sampled_from(opts)) for _ in range(mesh.ndim)]


def _dims(draw, case, n):
    """Non-negative dims of the kind the op takes, on n = ndim + extra dims."""
    if case.kind == "perm":
        return list(draw(st.permutations(list(range(n)))))
    if case.kind == "two":
        return draw(st.lists(st.integers(0, n - 1), min_size=2, max_size=2, unique=True))
    if case.kind == "some":
        return sorted(draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True)))
    return [draw(st.integers(0, n - 1))]


def _spec(draw, case):
    mesh = _mesh(draw(st.sampled_from(sorted(MESHES))))
    lo = max(case.min_ndim, 1 if case.extra == 0 else 0)
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=lo, max_size=3)))
    return wb.TensorSpec(shape, mesh, _placements(draw, mesh, len(shape)))


def _same(a, b):
    """Two Decisions alike: every candidate (placements, plans' collectives, cost) and the
    reason."""
    assert a.op == b.op and a.specs == b.specs
    assert [(c.strategy.inputs, c.strategy.outputs, c.collectives, c.time, c.bytes)
            for c in a.candidates] == \
        [(c.strategy.inputs, c.strategy.outputs, c.collectives, c.time, c.bytes)
         for c in b.candidates]
    assert a.reason == b.reason


@pytest.mark.parametrize("op", sorted(CASES))
@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_negative_dim_same_decision(op, data):
    case = CASES[op]
    draw = data.draw
    x = _spec(draw, case)
    n = x.ndim + case.extra
    dims = _dims(draw, case, n)
    neg = [d - n if draw(st.booleans()) else d for d in dims]
    if neg == dims:                                  # at least one negative
        neg[0] -= n
    ref_draws = []

    def replay(strategy):                            # the same extra draws for both forms
        v = draw(strategy)
        ref_draws.append(v)
        return v
    specs_n, attrs_n = case.build(x, replay, neg)
    it = iter(ref_draws)
    specs_p, attrs_p = case.build(x, lambda s: next(it), dims)
    _same(wb.spmd.infer(op, *specs_n, **attrs_n), wb.spmd.infer(op, *specs_p, **attrs_p))


def _torch_error(case, shape, dims):
    try:
        case.call(torch.zeros(shape), dims)
    except IndexError as e:
        return str(e)
    raise AssertionError(f"torch took dims {dims} on shape {shape}")


@pytest.mark.parametrize("op", sorted(CASES))
@settings(max_examples=4, deadline=None)
@given(data=st.data())
def test_out_of_range_dim_is_torchs_index_error(op, data):
    case = CASES[op]
    draw = data.draw
    x = _spec(draw, case)
    n = x.ndim + case.extra
    dims = _dims(draw, case, n)
    k = draw(st.integers(0, len(dims) - 1))
    bad = draw(st.sampled_from([n, n + 2, -n - 1, -n - 3]))
    dims = list(dims)
    dims[k] = bad
    specs, attrs = case.build(x, lambda s: False, [d if d != bad else 0 for d in dims]) \
        if op in ("split", "chunk", "index_add") else case.build(x, lambda s: False, dims)
    if op in ("split", "chunk", "index_add"):        # the builder reads x.shape[dim]
        attrs = dict(attrs, dim=bad)
    msg = _torch_error(case, tuple(x.shape), dims)
    assert msg.startswith("Dimension out of range")
    with pytest.raises(IndexError, match=re.escape(msg)):
        wb.spmd.infer(op, *specs, **attrs)


def test_every_rule_taking_a_dim_is_covered():
    """A rule that takes a dim (its signature, or the attrs its op's parse gives) is
    in CASES: a new one must wrap its dims and be added here."""
    takes = set()
    for name, e in TABLE.items():
        if e.rule is None:
            continue
        if set(inspect.signature(e.rule).parameters) & set(DIM_NAMES):
            takes.add(name)
    from workbench.parallel.ops_table.table import BY_FUNC
    for name, ss in samples().items():
        for s in ss:
            parse = BY_FUNC.get(s.fn, (None, TABLE[name].parse))[1]
            if set(parse(*s.args, **s.kwargs)[1]) & set(DIM_NAMES):
                takes.add(name)
    assert sorted(takes - NO_DIM - set(CASES)) == []


@pytest.mark.parametrize("op,attrs,pos", [
    ("sum", {"dim": (-1,)}, {"dim": (1,)}), ("mean", {"dim": -1}, {"dim": 1}),
    ("amax", {"dim": (0, -1)}, {"dim": (0, 1)}), ("all", {"dim": -1}, {"dim": 1}),
    ("cat", {"dim": -1}, {"dim": 1}), ("stack", {"dim": -1}, {"dim": 2}),
    ("unbind", {"dim": -1}, {"dim": 1}), ("swiglu", {"dim": -1}, {"dim": 1})])
def test_found_cases(op, attrs, pos):
    """The finder's cases: dim 1 of a (4, 6) tensor sharded on dim 1 over 2 ranks."""
    x = wb.TensorSpec((4, 6), _mesh("2"), [Shard(1)])
    specs = (x, x) if op in ("cat", "stack") else (x,)
    neg, ref = wb.spmd.infer(op, *specs, **attrs), wb.spmd.infer(op, *specs, **pos)
    _same(neg, ref)
    reduced = op in ("sum", "mean", "amax", "all")
    assert not any(p == Shard(1) for o in neg.outputs for p in o) or op == "stack"
    if reduced:                 # each rank reduces its own columns: partial, no gather
        assert neg.outputs[0][0].is_partial() and not neg.chosen.collectives


def test_sum_of_no_dims_is_every_dim():
    """sum(x, dim=()) reduces every dim (torch), as the parse says; any(dim=()) none."""
    x = wb.TensorSpec((4, 6), _mesh("2"), [Shard(1)])
    assert torch.sum(torch.ones(4, 6), dim=()).shape == ()
    _same(wb.spmd.infer("sum", x, dim=()), wb.spmd.infer("sum", x, dim=None))
    assert torch.any(torch.ones(4, 6), dim=()).shape == (4, 6)
    assert wb.spmd.infer("any", x, dim=()).outputs == ((Shard(1),),)


def test_permute_dims_checked_as_torch():
    x = wb.TensorSpec((4, 6, 2), _mesh("2"), [Shard(2)])
    for dims in ((0, 0, 1), (0, 1)):
        with pytest.raises(RuntimeError) as ref:
            torch.zeros(4, 6, 2).permute(*dims)
        with pytest.raises(RuntimeError, match=re.escape(str(ref.value))):
            wb.spmd.infer("permute", x, dims=dims)


def test_roll_repeated_dim_and_no_dims():
    """roll may name a dim twice (torch rolls it twice); dims=() rolls the flattened tensor."""
    x = wb.TensorSpec((4, 6), _mesh("2"), [Shard(0)])
    _same(wb.spmd.infer("roll", x, shifts=(1, 1), dims=(0, -2)),
          wb.spmd.infer("roll", x, shifts=(1,), dims=(0,)))
    _same(wb.spmd.infer("roll", x, shifts=(1,), dims=()),
          wb.spmd.infer("roll", x, shifts=(1,), dims=None))


# ---- a 0-d tensor along its dim 0 (or -1) runs on DistTensors as torch runs it -----------

ZERO_D = {
    "sum": lambda a, d: torch.sum(a, d), "sum_keepdim": lambda a, d: torch.sum(a, d, keepdim=True),
    "mean": lambda a, d: torch.mean(a, d), "amax": lambda a, d: torch.amax(a, d),
    "amin": lambda a, d: torch.amin(a, (d,)), "any": lambda a, d: torch.any(a, d),
    "all": lambda a, d: torch.all(a, d), "softmax": lambda a, d: torch.softmax(a, d),
    "log_softmax": lambda a, d: torch.log_softmax(a, d), "cumsum": lambda a, d: torch.cumsum(a, d),
    "argmax": lambda a, d: torch.argmax(a, d), "argmin": lambda a, d: torch.argmin(a, d, True),
    "topk": lambda a, d: torch.topk(a, 1, d), "gather": lambda a, d: torch.gather(
        a, d, a.new_zeros((), dtype=torch.int64) if isinstance(a, torch.Tensor) else
        wb.shard_tensor(torch.tensor(0), a.mesh, [Replicate()]))}


@pytest.mark.parametrize("dim", [0, -1])
@pytest.mark.parametrize("name", sorted(ZERO_D))
def test_zero_d_tensor_along_dim_0(name, dim):
    """torch.sum(x0d, 0), softmax, cumsum, argmax, topk, gather... on a 0-d DistTensor:
    torch's value (they crashed: the local op asked for a dim the stacked shards lack)."""
    fn = ZERO_D[name]
    t = torch.tensor(-1.5)
    x = wb.shard_tensor(t.clone(), _mesh("2"), [Replicate()])
    got, ref = fn(x, dim), fn(t, dim)
    got, ref = (got, ref) if isinstance(ref, tuple) else ((got,), (ref,))
    for g, r in zip(got, ref):
        assert g.full().shape == r.shape and g.full().dtype == r.dtype
        torch.testing.assert_close(g.full(), r)


def test_zero_d_softmax_cumsum_sum_and_grad():
    t = torch.tensor(2.0, requires_grad=True)
    x = wb.shard_tensor(t.detach().clone(), _mesh("2"), [Replicate()])
    x.requires_grad_(True)
    y = torch.cumsum(torch.softmax(x, -1) * 3.0, 0).sum(0)
    ref = torch.cumsum(torch.softmax(t, -1) * 3.0, 0).sum(0)
    torch.testing.assert_close(y.full(), ref.detach())
    y.backward()
    ref.backward()
    torch.testing.assert_close(x.grad.full(), t.grad)


# ---- other attrs infer takes as the user writes them ----------------------------------------

def test_reshape_shape_with_minus_one_and_a_wrong_size():
    """reshape(shape=(-1, 6)) infers the -1 as torch (it raised 'list index out of range');
    a size that does not fit is torch's own RuntimeError."""
    x = wb.TensorSpec((4, 6), _mesh("2"), [Shard(1)])
    _same(wb.spmd.infer("reshape", x, shape=(-1, 6)), wb.spmd.infer("reshape", x, shape=(4, 6)))
    _same(wb.spmd.infer("view", x, shape=(2, -1)), wb.spmd.infer("view", x, shape=(2, 12)))
    with pytest.raises(RuntimeError) as ref:
        torch.zeros(4, 6).reshape(5, 6)
    with pytest.raises(RuntimeError, match=re.escape(str(ref.value))):
        wb.spmd.infer("reshape", x, shape=(5, 6))


@pytest.mark.parametrize("op,extra", [("layer_norm", (None, None)), ("rms_norm", (None,))])
def test_norm_normalized_shape_int_is_torchs_type_error(op, extra):
    """F.layer_norm(x, 6) is a TypeError in torch; infer said "object of type 'int' has no
    len()": now torch's words and the fix."""
    x = wb.TensorSpec((4, 6), _mesh("2"), [Shard(0)])
    with pytest.raises(TypeError, match="must be tuple of ints, not int"):
        getattr(torch.nn.functional, op)(torch.zeros(4, 6), 6)
    with pytest.raises(TypeError, match=r"must be tuple of ints, not int: give e.g. "
                                        r"normalized_shape=\(6,\)"):
        wb.spmd.infer(op, x, *extra, normalized_shape=6)
    assert wb.spmd.infer(op, x, *extra, normalized_shape=(6,)).outputs[0] == (Shard(0),)


@pytest.mark.parametrize("idx", [(slice(None), 2), (slice(1, 3),), slice(1, 3), -1,
                                 (Ellipsis, None, slice(0, 6, 2)), (), (slice(None), -6)])
def test_getitem_index_as_the_user_writes_it(idx):
    """infer("getitem", x, index=(slice(None), 2)) raised "unhashable type: 'slice'": the
    index is frozen for the cache and normalized by the rule, as the parse does."""
    from workbench.parallel.ops_table.shape import normalize_index
    x = wb.TensorSpec((4, 6), _mesh("2x2"), [Shard(1), Shard(0)])
    _same(wb.spmd.infer("getitem", x, index=idx),
          wb.spmd.infer("getitem", x, index=normalize_index((4, 6), idx)))
    with pytest.raises(IndexError) as ref:
        torch.zeros(4, 6)[:, 9]
    with pytest.raises(IndexError, match=re.escape(str(ref.value))):
        wb.spmd.infer("getitem", x, index=(slice(None), 9))


@pytest.mark.parametrize("op,attrs,bad", [("sum", {"dims": -1}, "dims=-1"),
                                          ("mean", {"dim": -1, "keep": True}, "keep=True"),
                                          ("softmax", {"dims": -1}, "dims=-1"),
                                          ("cat", {"dims": 1}, "dims=1")])
def test_an_attribute_the_op_does_not_take_is_a_type_error(op, attrs, bad):
    """infer("sum", x, dims=-1) reduced every dim (the rule's **_ swallowed the typo, dim
    stayed None); torch.sum(x, dims=-1) is a TypeError, and so is infer's now."""
    x = wb.TensorSpec((4, 6), _mesh("2"), [Shard(1)])
    specs = (x, x) if op == "cat" else (x,)
    with pytest.raises(TypeError):
        getattr(torch, op)(*(([torch.zeros(4, 6)] * 2,) if op == "cat" else (torch.zeros(4, 6),)),
                           **attrs)
    with pytest.raises(TypeError, match=f"unexpected attribute {re.escape(bad)}; {op} takes "):
        wb.spmd.infer(op, *specs, **attrs)
    from workbench.parallel.ops_table.strategy import infer_on
    with pytest.raises(TypeError, match="unexpected attribute"):
        infer_on("a100", op, *specs, **attrs)


# ---- NumPy's names: torch's C-bound functions and Tensor methods take axis= / keepdims= ----

NUMPY_NAMES = {
    "sum": lambda a: torch.sum(a, axis=-1), "sum_keepdims": lambda a: torch.sum(a, -1, keepdims=True),
    "mean": lambda a: torch.mean(a, axis=0), "amax": lambda a: torch.amax(a, axis=-1),
    "any": lambda a: torch.any(a > 0, axis=1), "all": lambda a: torch.all(a > 0, -1, keepdims=True),
    "softmax": lambda a: torch.softmax(a, axis=-1), "cumsum": lambda a: torch.cumsum(a, axis=-1),
    "cat": lambda a: torch.cat([a, a], axis=-1), "stack": lambda a: torch.stack([a, a], axis=-1),
    "argmax": lambda a: torch.argmax(a, axis=-1), "prod": lambda a: torch.prod(a, axis=-1),
    "sort": lambda a: torch.sort(a, axis=-1), "std": lambda a: torch.std(a, axis=-1),
    "logsumexp": lambda a: torch.logsumexp(a, axis=-1), "topk": lambda a: torch.topk(a, 1, axis=-1),
    "max": lambda a: torch.max(a, axis=-1), "Tensor.sum": lambda a: a.sum(axis=-1),
    "Tensor.mean": lambda a: a.mean(-1, keepdims=True), "squeeze": lambda a: a[None].squeeze(axis=0),
    "unbind": lambda a: torch.unbind(a, axis=-1)}


@pytest.mark.parametrize("ps", [[Shard(1)], [Shard(0)]], ids=["S1", "S0"])
@pytest.mark.parametrize("name", sorted(NUMPY_NAMES))
def test_numpy_names_axis_and_keepdims(name, ps):
    """torch.sum(x, axis=-1), x.mean(-1, keepdims=True)... (torch's argument parser takes
    NumPy's names) on DistTensors: torch's values (they raised "unexpected keyword
    argument 'axis'")."""
    fn = NUMPY_NAMES[name]
    t = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
    x = wb.shard_tensor(t.clone(), _mesh("2"), ps)
    got, ref = fn(x), fn(t)
    got, ref = (got, ref) if isinstance(ref, tuple) else ((got,), (ref,))
    for g, r in zip(got, ref):
        torch.testing.assert_close(g.full(), r)


def test_numpy_names_not_on_python_functions():
    """F.softmax is a Python function: torch refuses axis= there, and so do we."""
    t = torch.randn(4, 6)
    x = wb.shard_tensor(t.clone(), _mesh("2"), [Shard(0)])
    for a in (t, x):
        with pytest.raises(TypeError, match="axis"):
            torch.nn.functional.softmax(a, axis=-1)


@pytest.mark.parametrize("dim", [1, -1])
def test_topk_of_one_on_the_sharded_dim(dim):
    """topk(k=1) of a dim sharded evenly (vocabulary parallel) returned no values (the
    k == 1 branch was argmax's): AttributeError 'NoneType' has no attribute 'shape'."""
    t = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    x = wb.shard_tensor(t.clone(), _mesh("2"), [Shard(1)])
    v, i = torch.topk(x, 1, dim)
    rv, ri = torch.topk(t, 1, dim)
    torch.testing.assert_close(v.full(), rv)
    torch.testing.assert_close(i.full(), ri)


def test_infer_takes_numpy_names_as_torch():
    x = wb.TensorSpec((4, 6), _mesh("2"), [Shard(1)])
    _same(wb.spmd.infer("sum", x, axis=-1, keepdims=True),
          wb.spmd.infer("sum", x, dim=1, keepdim=True))
    _same(wb.spmd.infer("softmax", x, axis=-1), wb.spmd.infer("softmax", x, dim=1))
