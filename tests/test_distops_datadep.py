"""Ops whose output size depends on the values (ops_table/datadep.py): masked_select,
nonzero / argwhere, unique / unique_consecutive and x[mask] run on replicated inputs,
equal to one device (values, dtypes, gradients) on every input placement, with the
gathers traced and counted."""
import pytest
import torch

import workbench as wb
from tests.spmd_harness import distribute

R, P = wb.Replicate(), wb.Partial()
MESHES = {"1": (1,), "2": (2,), "3": (3,), "2x2": (2, 2)}


def _mesh(shape):
    return wb.Mesh.grid(shape, [f"d{i}" for i in range(len(shape))])


def _placements(ndim, partial=True):
    return [R] + [wb.Shard(d) for d in range(ndim)] + ([P] if partial else [])


def _g(seed):
    return torch.Generator().manual_seed(seed)


def _layouts(shape, ndim, partial=True):
    """Every single placement on every mesh dim, and mixed ones on 2x2."""
    opts = _placements(ndim, partial)
    out = [[p] * len(shape) for p in opts]
    if len(shape) == 2:
        out += [[a, b] for a in opts for b in opts if a != b]
    return out


def _check(got, want):
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert isinstance(g, wb.DistTensor)
        assert all(p.is_replicate() for p in g.placements), g.placements
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, w.shape, g.dtype, w.dtype)
        f = g.full()
        assert f.dtype == w.dtype
        if w.is_floating_point():     # a Partial input's parts sum with rounding
            torch.testing.assert_close(f, w.detach())
        else:
            assert torch.equal(f, w), (f, w)


# ---- masked_select and x[mask]: values and gradients ------------------------------------------

SELECT = {
    "masked_select": lambda x, m: torch.masked_select(x, m),
    "method": lambda x, m: x.masked_select(m),
    "getitem": lambda x, m: x[m],
}


@pytest.mark.parametrize("mesh_name", MESHES)
@pytest.mark.parametrize("how", SELECT)
def test_masked_select_and_bool_index_match_one_device_with_gradients(mesh_name, how):
    shape = MESHES[mesh_name]
    mesh = _mesh(shape)
    f = SELECT[how]
    X = torch.randn(5, 7, generator=_g(1))          # 5, 7: uneven on 2, 3 and 2x2
    M = torch.rand(5, 7, generator=_g(2)) > 0.4
    W = torch.randn(int(M.sum()), generator=_g(3))
    xr = X.clone().requires_grad_()
    want = f(xr, M)
    (want * W).sum().backward()
    for xps in _layouts(shape, 2):
        for mps in ([R] * len(shape), [wb.Shard(1)] * len(shape)):
            x = distribute(X, mesh, xps, seed=4).detach().requires_grad_()
            m = wb.shard_tensor(M, mesh, mps)
            got = f(x, m)
            _check(got, want)
            (got * wb.shard_tensor(W, mesh, [R] * len(shape))).sum().backward()
            torch.testing.assert_close(x.grad.full(), xr.grad, msg=lambda s: f"{xps} {mps}: {s}")


def test_masked_select_broadcasts_and_takes_a_plain_mask_like_torch():
    mesh = _mesh((3,))
    X = torch.randn(7, 4, generator=_g(5))
    for M in (torch.tensor([True, False, True, True]), torch.rand(7, 1, generator=_g(6)) > 0.5):
        x = wb.shard_tensor(X, mesh, [wb.Shard(0)])
        _check(torch.masked_select(x, M), torch.masked_select(X, M))
        _check(torch.masked_select(x, wb.shard_tensor(M, mesh, [R])), torch.masked_select(X, M))
    # a mask bigger than x broadcasts x
    M = torch.rand(2, 7, 4, generator=_g(7)) > 0.5
    _check(torch.masked_select(wb.shard_tensor(X, mesh, [wb.Shard(1)]), M),
           torch.masked_select(X, M))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64])
def test_masked_select_keeps_the_dtype(dtype):
    mesh = _mesh((2,))
    X = (torch.randn(5, 3, generator=_g(8)) * 4).to(dtype)
    M = torch.rand(5, 3, generator=_g(9)) > 0.5
    _check(torch.masked_select(wb.shard_tensor(X, mesh, [wb.Shard(0)]), M),
           torch.masked_select(X, M))


def test_bool_index_on_leading_dims_and_empty_and_all():
    mesh = _mesh((2, 2))
    X = torch.randn(3, 5, 2, generator=_g(10))
    x = wb.shard_tensor(X, mesh, [wb.Shard(0), wb.Shard(2)])
    for M in (torch.rand(3, 5, generator=_g(11)) > 0.5, torch.zeros(3, 5, dtype=torch.bool),
              torch.ones(3, 5, dtype=torch.bool)):
        _check(x[M], X[M])                                   # a plain 2-d mask
        _check(x[wb.shard_tensor(M, mesh, [wb.Shard(1), R])], X[M])
        _check(x[(wb.shard_tensor(M, mesh, [R, R]),)], X[M])
    m1 = wb.shard_tensor(torch.tensor([True, False, True]), mesh, [wb.Shard(0), R])
    _check(x[m1], X[torch.tensor([True, False, True])])     # a 1-d DistTensor mask


def test_bool_mask_errors_like_torch_and_leave_inputs_untouched():
    mesh = _mesh((2,))
    X = torch.randn(4, 3, generator=_g(12))
    x = wb.shard_tensor(X, mesh, [wb.Shard(0)])
    with pytest.raises(IndexError, match="shape of the mask"):
        x[wb.shard_tensor(torch.ones(3, 4, dtype=torch.bool), mesh, [R])]
    with pytest.raises(RuntimeError, match="BoolTensor"):
        torch.masked_select(x, torch.ones(4, 3))
    with pytest.raises(RuntimeError):
        torch.masked_select(x, torch.ones(5, 3, dtype=torch.bool))
    assert x.placements == (wb.Shard(0),)
    torch.testing.assert_close(x.full(), X)


# ---- nonzero / argwhere -----------------------------------------------------------------------

def _exact(X, mesh, ps):
    """X laid out as ``ps``; a Partial's parts are whole numbers that sum to X exactly."""
    if not any(p.is_partial() for p in ps):
        return wb.shard_tensor(X, mesh, ps)
    n = mesh.size if hasattr(mesh, "size") else len(mesh.ranks)
    parts = [X - 3 * (n - 1) if r == 0 else torch.full_like(X, 3) for r in range(n)]
    return wb.from_local(parts, mesh, ps, shape=X.shape)


@pytest.mark.parametrize("mesh_name", MESHES)
def test_nonzero_and_argwhere_match_one_device(mesh_name):
    shape = MESHES[mesh_name]
    mesh = _mesh(shape)
    for X in (torch.randint(-1, 2, (5, 3), generator=_g(13)),
              torch.randint(-1, 2, (5, 3), generator=_g(13)).float()):
        for ps in _layouts(shape, 2):
            if len(shape) == 2 and any(p.is_partial() for p in ps) and ps[0] != ps[1]:
                continue                     # _exact builds all-Partial layouts only
            x = _exact(X, mesh, ps)
            _check(torch.nonzero(x), torch.nonzero(X))
            _check(x.nonzero(), X.nonzero())
            _check(torch.nonzero(x, as_tuple=True), torch.nonzero(X, as_tuple=True))
            _check(x.nonzero(as_tuple=True), X.nonzero(as_tuple=True))
            _check(torch.argwhere(x), torch.argwhere(X))
            _check(x.argwhere(), X.argwhere())
            _check(torch.nonzero(x > 0), torch.nonzero(X > 0))


def test_nonzero_of_empty_and_0d_and_bool():
    mesh = _mesh((3,))
    for X in (torch.zeros(0, 4), torch.zeros(2, 0), torch.tensor(1.5), torch.tensor(0.0),
              torch.tensor([True, False, True, True])):
        x = wb.shard_tensor(X, mesh, [R])
        _check(torch.nonzero(x), torch.nonzero(X))
        _check(torch.nonzero(x, as_tuple=True), torch.nonzero(X, as_tuple=True))


# ---- unique / unique_consecutive --------------------------------------------------------------

UNIQUE_FLAGS = [dict(), dict(sorted=False), dict(return_inverse=True), dict(return_counts=True),
                dict(return_inverse=True, return_counts=True), dict(dim=0),
                dict(dim=1, return_inverse=True, return_counts=True), dict(dim=-1)]


@pytest.mark.parametrize("mesh_name", MESHES)
def test_unique_matches_one_device_on_every_placement_and_flag(mesh_name):
    shape = MESHES[mesh_name]
    mesh = _mesh(shape)
    X = torch.randint(0, 3, (5, 3), generator=_g(14))
    for ps in _layouts(shape, 2, partial=False):
        x = wb.shard_tensor(X, mesh, ps)
        for kw in UNIQUE_FLAGS:
            if kw.get("sorted") is False:   # torch's order is unspecified: as one device's
                assert torch.equal(torch.unique(x, **kw).full().sort().values,
                                   torch.unique(X, **kw).sort().values)
                continue
            _check(torch.unique(x, **kw), torch.unique(X, **kw))
            _check(x.unique(**kw), X.unique(**kw))
            kw.pop("sorted", None)
            _check(torch.unique_consecutive(x, **kw), torch.unique_consecutive(X, **kw))
            _check(x.unique_consecutive(**kw), X.unique_consecutive(**kw))


def test_unique_of_a_partial_sum_counts_the_summed_values():
    mesh = _mesh((2,))
    X = torch.tensor([[3, 1, 3], [2, 1, 0]])
    parts = [X - 5, torch.full_like(X, 5)]                    # sums to X exactly
    x = wb.from_local(parts, mesh, [P], shape=X.shape)
    with wb.trace() as tr:
        got = torch.unique(x, return_counts=True)
    _check(got, torch.unique(X, return_counts=True))
    assert [e.name for e in tr.events if e.stream != "compute"][:1] == ["all_reduce"] or \
        any("all_reduce" in e.name for e in tr.events), [e.name for e in tr.events]


def test_unique_dtypes_and_floats():
    mesh = _mesh((3,))
    for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.int32, torch.bool):
        X = (torch.randn(7, generator=_g(15)).round()).to(dtype)
        x = wb.shard_tensor(X, mesh, [wb.Shard(0)])
        _check(torch.unique(x, return_inverse=True, return_counts=True),
               torch.unique(X, return_inverse=True, return_counts=True))


def test_unique_bad_dim_raises_like_torch():
    x = wb.shard_tensor(torch.ones(4, 3), _mesh((2,)), [wb.Shard(0)])
    with pytest.raises(IndexError):
        torch.unique(x, dim=2)
    with pytest.raises(IndexError):
        torch.unique_consecutive(x, dim=-3)


# ---- the plan: gathers traced, explained, priced ------------------------------------------------

def test_the_gather_is_traced_counted_and_explained():
    mesh = _mesh((2,))
    X = torch.randn(6, 4, generator=_g(16))
    M = X > 0
    x = wb.shard_tensor(X, mesh, [wb.Shard(0)])
    m = wb.shard_tensor(M, mesh, [wb.Shard(0)])
    with wb.trace() as tr:
        torch.masked_select(x, m)
    gathers = [e for e in tr.events if e.stream != "compute"]
    assert len(gathers) >= 2 and all("gather" in e.name for e in gathers), \
        [(e.name, e.stream) for e in tr.events]
    assert sum(e.bytes for e in gathers) > 0
    comp = [e for e in tr.events if e.stream == "compute" and e.name == "masked_select"]
    assert comp and comp[0].bytes > 0 and comp[0].duration > 0
    ex = wb.explain(lambda a, b: torch.masked_select(a, b), x, m)
    row = [r for r in ex.rows if r.op == "masked_select"][0]
    assert row.outputs == ((R,),) or list(row.outputs[0]) == [R]
    assert row.collectives and row.bytes > 0
    # replicated inputs: nothing to gather
    xr, mr = wb.shard_tensor(X, mesh, [R]), wb.shard_tensor(M, mesh, [R])
    with wb.trace() as tr:
        torch.masked_select(xr, mr)
    assert not [e for e in tr.events if e.stream != "compute"]


def test_backward_is_traced_and_under_no_grad_nothing_requires_grad():
    mesh = _mesh((2,))
    X = torch.randn(6, 4, generator=_g(17))
    x = wb.shard_tensor(X, mesh, [wb.Shard(1)]).requires_grad_()
    with torch.no_grad():
        assert not torch.masked_select(x, X > 0).requires_grad
    with wb.trace() as tr:
        y = x[wb.shard_tensor(X > 0, mesh, [R])]
        assert y.requires_grad
        y.sum().backward()
    assert [e for e in tr.events if e.name == "bool_mask_index" and
            e.args.get("phase") == "backward"]
    torch.testing.assert_close(x.grad.full(), (X > 0).float())
    assert x.grad.placements == x.placements


# ---- the op table's samples (tests/test_op_table.py adds these) ----------------------------

_X = torch.randn(4, 6, generator=_g(18))
DATADEP_SAMPLES = {
    "masked_select": (lambda x: torch.masked_select(x, x > 0), [_X]),
    "nonzero": (lambda x: torch.nonzero(x > 0), [_X]),
    "argwhere": (lambda x: torch.argwhere(x > 0.5), [_X]),
    "unique": (lambda x: tuple(torch.unique((x > 0).float(), return_counts=True)), [_X]),
    "unique_consecutive": (lambda x: torch.unique_consecutive((x > 0).float(), dim=1), [_X]),
    "bool_mask_index": (lambda x: x[x > 0], [_X]),
}


def test_bool_index_after_full_slices():
    mesh = _mesh((3,))
    X = torch.randn(2, 5, 4, generator=_g(19))
    x = wb.shard_tensor(X, mesh, [wb.Shard(1)]).requires_grad_()
    xr = X.clone().requires_grad_()
    M = torch.rand(5, 4, generator=_g(20)) > 0.5
    for m in (M, wb.shard_tensor(M, mesh, [wb.Shard(0)])):
        _check(x[:, m], xr[:, M])
    _check(x[:, wb.shard_tensor(M[:, 0], mesh, [R])], X[:, M[:, 0]])
    x[:, wb.shard_tensor(M, mesh, [R])].sum().backward()
    xr[:, M].sum().backward()
    torch.testing.assert_close(x.grad.full(), xr.grad)
    with pytest.raises(IndexError, match="shape of the mask"):
        x[:, wb.shard_tensor(M.T, mesh, [R])]


def test_where_of_a_condition_alone_is_nonzero_as_tuple():
    # was NotImplementedError naming nonzero (torch.where(condition) is nonzero's form)
    X = torch.randn(5, 3, generator=_g(21))
    x = wb.shard_tensor(X, _mesh((3,)), [wb.Shard(0)])
    _check(torch.where(x > 0), torch.where(X > 0))
    _check(torch.where(condition=x > 0), torch.where(condition=X > 0))
    _check(torch.where(x[0, 0] > 0), torch.where(X[0, 0] > 0))         # 0-d
    three = torch.where(x > 0, x, 0.0)                                  # the 3-argument form
    assert three.placements == (wb.Shard(0),) and torch.equal(three.full(),
                                                              torch.where(X > 0, X, 0.0))
    with pytest.raises(TypeError):
        torch.where(x > 0, x)


@pytest.mark.slow
def test_on_gloo_each_process_holding_its_shard(tmp_path_factory):
    from tests.torchrun_support import json_rows, two_proc
    out, text = two_proc(tmp_path_factory, "datadep_check.py")      # one launch: 2-process checks
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json_rows(text)
    assert len(rows) == 2 and all(all(v for key, v in r.items() if key != "rank")
                                  for r in rows), rows


def test_a_uint8_index_is_a_mask_as_torch_reads_it():
    # was read as integer indices: x[tensor([1, 0, 1], dtype=uint8)] gave x[[1, 0, 1]]
    mesh = _mesh((2,))
    X = torch.randn(3, 2, generator=_g(22))
    x = wb.shard_tensor(X, mesh, [wb.Shard(0)])
    for M in (torch.tensor([1, 0, 1], dtype=torch.uint8),
              (torch.rand(3, 2, generator=_g(23)) > 0.5).to(torch.uint8)):
        with pytest.warns(UserWarning, match="uint8"):
            want = X[M]
        with pytest.warns(UserWarning, match="uint8"):
            _check(x[M], want)
        with pytest.warns(UserWarning, match="uint8"):
            _check(x[wb.shard_tensor(M, mesh, [wb.Shard(0)])], want)


def test_a_uint8_mask_beside_slices_is_a_mask_too():
    mesh = _mesh((2,))
    X = torch.randn(3, 4, generator=_g(24))
    x = wb.shard_tensor(X, mesh, [wb.Shard(1)])
    M = torch.tensor([1, 0, 1], dtype=torch.uint8)
    with pytest.warns(UserWarning, match="uint8"):
        want = X[M, :]
    with pytest.warns(UserWarning, match="uint8"):
        got = x[M, :]                        # a plain 1-d mask: an index_select, kept S(1)
    assert got.placements == (wb.Shard(1),) and torch.equal(got.full(), want)


# torch's C indexing reads the DistTensor (no torch.Tensor) as a sequence and warns first
@pytest.mark.filterwarnings("ignore:Using a non-tuple sequence:UserWarning")
def test_a_plain_tensor_indexed_by_a_distributed_mask():
    # was NotImplementedError "DistTensor indexing takes ints, slices, None and Ellipsis"
    mesh = _mesh((2,))
    X = torch.randn(4, 3, generator=_g(25), requires_grad=True)
    M = X.detach() > 0
    got = X[wb.shard_tensor(M, mesh, [wb.Shard(0)])]
    _check(got, X[M])
    got.sum().backward()
    torch.testing.assert_close(X.grad, M.float())
