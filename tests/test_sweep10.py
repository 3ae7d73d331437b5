"""Random sweep 10 and ``x[index] = value`` on DistTensors read as torch reads the index:
the index applied in the form the user wrote it (a top-level bool, a top-level list), torch's
checks in torch's order, uint8 masks, k-d masks after ``...`` (getitem too), torch's errors
for indices it refuses.  Each test compares with torch on the full tensor (see each
docstring for what was wrong before)."""
import warnings

import pytest
import torch

import workbench as wb
from workbench.parallel.placement import parse_placements
from workbench.parallel.validate_inputs import distribute

MESH = wb.Mesh([[0, 1], [2, 3]])
LAYOUTS = (["R", "R"], ["S(0)", "S(1)"], ["P(sum)", "S(2)"], ["S(1)", "P(max)"])


def _x(dtype=torch.float64):
    g = torch.Generator().manual_seed(10)
    if dtype.is_floating_point:
        return torch.randn(4, 6, 5, generator=g, dtype=dtype)
    return torch.randint(-9, 9, (4, 6, 5), generator=g, dtype=dtype)


def _d(x, ps):
    return distribute(x, MESH, parse_placements(ps), seed=3)


def _setitem_as_torch(ps, index, value, *, aug=False, dtype=torch.float64):
    """d[index] = value (or +=) on a DistTensor and on its full tensor: equal values and
    unchanged placements, or the same exception type with d untouched."""
    d = _d(_x(dtype), ps)
    ref, before, places = d.full().clone(), d.full().clone(), d.placements
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            if aug:
                ref[index] += value
            else:
                ref[index] = value
            want = None
        except Exception as e:              # noqa: BLE001 (torch's verdict, any type)
            want = type(e)
        if want is None:
            if aug:
                d[index] += value
            else:
                d[index] = value
            assert d.placements == places
            torch.testing.assert_close(d.full(), ref, rtol=0, atol=0, equal_nan=True)
        else:
            with pytest.raises(want):
                if aug:
                    d[index] += value
                else:
                    d[index] = value
            torch.testing.assert_close(d.full(), before, rtol=0, atol=0, equal_nan=True)
            assert d.placements == places


@pytest.mark.parametrize("ps", LAYOUTS)
def test_top_level_bool_index_casts_the_value_as_torch(ps):
    """``x[True] = v`` is a copy in torch (the value cast to x's dtype); the index was
    wrapped as ``(True,)``, index_put_'s form, which raised "Index put requires the source
    and destination dtypes match" for a float32 or int64 value into a float64 x."""
    _setitem_as_torch(ps, True, torch.arange(5, dtype=torch.float32))
    _setitem_as_torch(ps, torch.tensor(False), torch.tensor(3))
    _setitem_as_torch(ps, True, torch.arange(30).reshape(6, 5))


@pytest.mark.parametrize("ps", LAYOUTS)
def test_top_level_list_of_lists_indexes_as_a_tuple(ps):
    """torch reads ``x[[[0, 1], [1, 2]]]`` as ``x[[0, 1], [1, 2]]`` (treatSequenceAsTuple);
    wrapped as a tuple it was one 2-d index on dim 0: other elements written (a silently
    wrong result), or a shape-mismatch error where torch writes."""
    _setitem_as_torch(ps, [[0, 1], [1, 2]], 2.5)
    _setitem_as_torch(ps, [[0, 1], [1, 2]], torch.arange(10.0, dtype=torch.float64)
                      .reshape(2, 5))
    _setitem_as_torch(ps, [0, slice(1, 3)], -1.0)
    _setitem_as_torch(ps, [None, 0], torch.ones(6, 5, dtype=torch.float64), aug=True)


def test_checks_come_in_torchs_order_and_leave_x_untouched():
    """torch converts a number to x's dtype, then checks the value's dtype, then the index:
    an int64 x given NaN at an out-of-bounds index raises torch's RuntimeError ("value
    cannot be converted"), and a float32 value at an out-of-bounds index tensor raises its
    dtype RuntimeError; both were IndexErrors (the index was checked first)."""
    for ps in (["S(0)", "R"], ["P(sum)", "S(1)"]):
        _setitem_as_torch(ps, 10, float("nan"), dtype=torch.int64)
        _setitem_as_torch(ps, torch.tensor([0, 7]), torch.tensor(7.0))
        _setitem_as_torch(ps, torch.tensor([0, 7]), torch.ones(2, dtype=torch.float64))
        _setitem_as_torch(ps, ([0, 1], [0, 1, 2]), 1.0)
        _setitem_as_torch(ps, torch.tensor([True, False]), 1.0)


@pytest.mark.parametrize("ps", LAYOUTS)
def test_uint8_mask_augmented_assignment(ps):
    """``x[u8_mask] += v``: the written value is a tensor (index_put_ takes a uint8 mask);
    the mask of written places was set with a number, which torch writes by masked_fill_,
    bool masks only: a raw RuntimeError where torch adds."""
    u8 = torch.tensor([1, 0, 1, 1], dtype=torch.uint8)
    _setitem_as_torch(ps, u8, 1.5, aug=True)
    _setitem_as_torch(ps, u8, 1.5)                 # torch's own masked_fill_ error
    _setitem_as_torch(ps, (slice(None), torch.tensor([1, 0, 0, 1, 1, 0], dtype=torch.uint8)),
                      torch.ones(5, dtype=torch.float64))


@pytest.mark.parametrize("ps", LAYOUTS)
def test_nd_mask_after_ellipsis(ps):
    """``x[..., mask2d]`` (getitem, and so ``x[..., mask2d] += v``) was refused with an
    IndexError ("a 2-d bool mask on a DistTensor") where torch indexes with the mask's
    nonzero() indices; it now goes through mixed_index as ``x[i, j]``."""
    x = _x()
    mask = x[0] > 0                                        # (6, 5)
    d = _d(x, ps)
    full = d.full()
    for idx in ((Ellipsis, mask), (Ellipsis, mask.to(torch.uint8)), (x[:, :, 0] > 0, Ellipsis)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            y, r = d[idx], full[idx]
        assert y.shape == r.shape
        torch.testing.assert_close(y.full(), r, rtol=0, atol=0)
    _setitem_as_torch(ps, (Ellipsis, mask), 0.5, aug=True)
    _setitem_as_torch(ps, (Ellipsis, mask), torch.arange(int(mask.sum()), dtype=torch.float64))


@pytest.mark.parametrize("index", ["a", ("a",), 1.5, (0, 1.5), {}])
def test_unknown_index_kinds_raise_torchs_error(index):
    """``x['a']`` is torch's TypeError, ``x[1.5]`` its IndexError; both were a
    NotImplementedError naming DistTensor's supported indices."""
    x = torch.zeros(4, 3)
    d = wb.shard_tensor(x, MESH, [wb.Shard(0), wb.Replicate()])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(Exception) as want:
            x[index]
        with pytest.raises(want.type):
            d[index]
    _setitem_as_torch(["S(0)", "R"], index, 1.0, aug=True)


def test_tracked_values_through_new_index_forms():
    """The gradients of x and of the value through the index forms read anew (a top-level
    bool, a list of lists, a mask after ...) are torch's."""
    g = torch.Generator().manual_seed(4)
    x0 = torch.randn(4, 6, 5, generator=g, dtype=torch.float64)
    w = torch.randn(4, 6, 5, generator=g, dtype=torch.float64)
    for idx in (True, [[0, 1], [1, 2]], (Ellipsis, x0[0] > 0)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            v0 = torch.randn(x0[idx].shape, generator=g, dtype=torch.float64)
            xr, vr = x0.clone().requires_grad_(), v0.clone().requires_grad_()
            y = xr * 1.0
            y[idx] = vr
            (y * w).sum().backward()
            xd = _d(x0, ["S(1)", "P(sum)"]).detach().requires_grad_()
            vd = wb.shard_tensor(v0, MESH, [wb.Shard(0), wb.Replicate()]).detach() \
                .requires_grad_()
            yd = xd * 1.0
            yd[idx] = vd
        (yd * wb.shard_tensor(w, MESH, [wb.Replicate(), wb.Replicate()])).sum().backward()
        torch.testing.assert_close(yd.full(), y.detach())
        torch.testing.assert_close(xd.grad.full(), xr.grad)
        torch.testing.assert_close(vd.grad.full(), vr.grad)


# ---- item 1: the random sweep on seeds 1048000.. and 1051000.. ----------------------------
def test_seed_1051387_logcumsumexp_of_a_0d_tensor_passes_its_gradient():
    """torch's logcumsumexp_backward returns the gradient itself for a 0-d input; the 0-d
    shard was scanned as a 1-element dim, whose formula gives 0 for a NaN gradient (the
    seed: rsqrt of a negative sum downstream) and NaN for an infinite input."""
    from tests.random_programs import run_program
    import random
    assert run_program(random.Random(1051387)).status == "ok"
    mesh = wb.Mesh([0, 1])
    for v, g in ((-1.25, float("nan")), (float("inf"), 1.0), (0.5, -2.0)):
        x = torch.tensor(v, dtype=torch.float64, requires_grad=True)
        d = wb.shard_tensor(x.detach(), mesh, [wb.Replicate()]).requires_grad_()
        gt = torch.tensor(g, dtype=torch.float64)
        y, yd = torch.logcumsumexp(x, 0), torch.logcumsumexp(d, -1)
        y.backward(gt)
        yd.backward(wb.shard_tensor(gt, mesh, [wb.Replicate()]))
        torch.testing.assert_close(yd.full(), y.detach(), equal_nan=True)
        torch.testing.assert_close(d.grad.full(), x.grad, equal_nan=True)


def test_seed_1053778_expanded_shard_times_a_tensor_is_contiguous():
    """``t1.expand_as(t2) * t2`` with t1 (1, 8) on S(0): the expanded dim (stride 0) was
    ordered innermost, a transposed (3, 8), so ``floor(..).view(-1)`` raised torch's "view
    size is not compatible" where torch's product is contiguous (TensorIterator skips a
    stride-0 operand when it orders the dims)."""
    from tests.random_programs import run_program
    import random
    assert run_program(random.Random(1053778)).status == "ok"
    mesh = wb.Mesh([2, 0, 1])
    a, b = _x()[0, :1, :].clone(), _x()[1, :3, :].clone()          # (1, 5), (3, 5)
    t1 = distribute(a, mesh, parse_placements(["S(0)"]), seed=1)
    t2 = distribute(b, mesh, parse_placements(["P(min)"]), seed=2)
    e, r = t1.expand_as(t2), a.expand_as(b)
    # the expanded view's strides are torch's, (0, 1) (fsdpw17: were the dense (5, 1))
    assert e.stride() == r.stride() == (0, 1) and r.contiguous().stride() == (5, 1)
    y, ry = torch.floor(e * t2), torch.floor(r * t2.full())
    assert y.stride() == ry.stride() and y.is_contiguous()
    torch.testing.assert_close(y.view(-1).full(), ry.view(-1), rtol=0, atol=0)
    # a transposed layout is still told apart where no dim is expanded
    z = distribute(b.t().contiguous(), mesh, parse_placements(["S(1)"]), seed=3).t()
    assert z.stride() == b.t().contiguous().t().stride()


# ---- item 2: a value that is a view of x ----------------------------------------------------
@pytest.mark.parametrize("ps", [["R", "R"], ["S(0)", "S(1)"], ["P(sum)", "S(1)"]])
def test_value_view_of_x_overlapping_in_part(ps):
    """``x[1:] = x[:-1]``: torch's copy_ raises (both dense, partial overlap) where the
    value was read first and written, silently; ``x[:, 1:] = x[:, :-1]`` (neither dense)
    torch copies in its loop order (a result of that order): refused, naming clone().
    Order-free overlaps and disjoint views are written as torch writes them."""
    x = torch.arange(24.0, dtype=torch.float64).reshape(4, 6)
    d = _d(x, ps)
    before = d.full().clone()
    r = before.clone()
    with pytest.raises(RuntimeError) as want:
        r[1:] = r[:-1]
    with pytest.raises(RuntimeError, match=str(want.value)[:40]):
        d[1:] = d[:-1]
    with pytest.raises(NotImplementedError, match="clone"):
        d[:, 1:] = d[:, :-1]
    torch.testing.assert_close(d.full(), before, rtol=0, atol=0)
    for di, si in (((slice(None), slice(0, 3)), (slice(None), slice(2, 3))),
                   ((slice(None), slice(0, 3)), (slice(None), slice(3, 6))), (0, 1),
                   (slice(1, 3), slice(1, 3))):
        r = d.full().clone()
        r[di] = r[si]
        d[di] = d[si]
        torch.testing.assert_close(d.full(), r, rtol=0, atol=0)
    d[:, 1:] = d[:, :-1].clone()                    # the fix the message names
    r[:, 1:] = r[:, :-1].clone()
    torch.testing.assert_close(d.full(), r, rtol=0, atol=0)
