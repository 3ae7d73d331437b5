"""inplace16: a write into ``a`` after an op read a view of ``a`` (or ``a`` itself, with the
write made through ``a.detach()``) through a copy, held to torch on one device over
test_inplace15's layouts (the same error type and words, or the same values and gradient).

1. ``torch.bmm(a.unsqueeze(0), x.unsqueeze(0)); a.mul_(2)`` over P(sum)-S(1)@2d answered the
   old values' gradient: the dispatcher's copy of the view was recorded under the view's
   local tensor, which the write into ``a`` did not look up.  versions.derive / bump now
   key the copies by the root base (a view shares its base's version counter), and bump
   follows DistTensor.detach's aliases (``a.detach().mul_(2)`` bumps ``a``'s counter on one
   device too: silent over P(sum)-S(1)@2d before, for ``a @ x`` as well).
2. ``torch.einsum("ij,jk->ik", a, x); a.mul_(2)`` over P(sum)-S(1)@2d, S(0)-S(1)@2d: torch.einsum
   of the stacked local operands saved its own copy of ``a`` (permute, then a reshape that
   cannot be a view) where one device's saves a view of ``a``; now the operand is checked by
   the product's hook (ops_table/matmul._einsum_local, versions.saved_check).
No false raise where torch passes: a write before the op, into a clone, into an unrelated
tensor, an operand torch does not save (the other needs no grad), or an in-place op's own
computation (``a.mul_(w)`` over a moved ``a``).
"""
import pytest
import torch

from tests.test_inplace15 import IDS, LAYOUTS, _nograd, _same_as_torch, _then, _x


def _bmm(a, x):
    return torch.bmm(a.unsqueeze(0), x.unsqueeze(0)).squeeze(0)


def _es(eq):
    return lambda a, x: torch.einsum(eq, a, x)


RAISES = {
    "bmm_view.write_a": lambda x: (lambda a: _then(_bmm(a, x), lambda _: a.mul_(2)))(x * 1.5),
    "bmm_view.write_row": lambda x: (lambda a: _then(_bmm(a, x), lambda _: a[0].mul_(2)))(
        x * 1.5),
    "bmm_view.write_detach": lambda x: (lambda a: _then(_bmm(a, x), lambda _: a.detach().mul_(
        2)))(x * 1.5),
    "at_view.write_a": lambda x: (lambda a: _then(a.t() @ x, lambda _: a.mul_(2)))(x * 1.5),
    "at.write_view": lambda x: (lambda a: _then(a @ x, lambda _: a.t().mul_(2)))(x * 1.5),
    "mm.write_detach": lambda x: (lambda a: _then(a @ x, lambda _: a.detach().mul_(2)))(
        x * 1.5),
    "einsum.write_a": lambda x: (lambda a: _then(_es("ij,jk->ik")(a, x), lambda _: a.mul_(
        2)))(x * 1.5),
    "einsum_t.write_a": lambda x: (lambda a: _then(_es("ij,kj->ik")(a, x), lambda _: a.mul_(
        2)))(x * 1.5),
    "einsum.write_row": lambda x: (lambda a: _then(_es("ij,jk->ik")(a, x), lambda _: a[1].mul_(
        2)))(x * 1.5),
    "einsum.write_x_nograd": lambda x: _then(_es("ij,jk->ik")(x * 1.5, x), lambda _: _nograd(
        lambda: x.mul_(2))),
    "einsum_outer.write_a": lambda x: (lambda a: _then(_es("ij,kl->ijkl")(a, x).sum((2, 3)),
                                                       lambda _: a.mul_(2)))(x * 1.5),
}

PASSES = {
    "bmm_view.write_before": lambda x: (lambda a: _bmm(_then(a, lambda v: v.mul_(2)), x))(
        x * 1.5),
    "bmm_view.write_view_before": lambda x: (lambda a: torch.bmm(
        _then(a.unsqueeze(0), lambda v: v.mul_(2)), x.unsqueeze(0)).squeeze(0))(x * 1.5),
    "bmm_view.write_other": lambda x: (lambda a, b: _then(_bmm(a, x), lambda _: b.mul_(2)))(
        x * 1.5, x * 2.5),
    "bmm_view.write_clone": lambda x: (lambda a: _then(_bmm(a, x), lambda _: a.clone().mul_(
        2)))(x * 1.5),
    "einsum.const": lambda x: (lambda a: _then(_es("ij,jk->ik")(a, _x(seed=2)),
                                               lambda _: a.mul_(2)))(x * 1.5),
    "einsum.write_clone": lambda x: (lambda a: _then(_es("ij,jk->ik")(a, x),
                                                     lambda _: a.clone().mul_(2)))(x * 1.5),
    "einsum_diag.write_a": lambda x: (lambda a: _then(_es("ii,jk->jk")(a, x),
                                                      lambda _: a.mul_(2)))(x * 1.5),
    "mul_.tracked_w": lambda x: (x * 1.5).mul_(x * 2),
    "einsum_then_mul_": lambda x: _es("ij,jk->ik")(x * 1.5, x).mul_(x),
}


@pytest.mark.parametrize("layout", range(len(LAYOUTS)), ids=IDS)
@pytest.mark.parametrize("name", sorted(RAISES))
def test_write_after_copy_of_view_raises_as_torch(name, layout):
    err = _same_as_torch(RAISES[name], layout)
    assert err is not None                  # torch raises: so does the DistTensor


@pytest.mark.parametrize("layout", range(len(LAYOUTS)), ids=IDS)
@pytest.mark.parametrize("name", sorted(PASSES))
def test_no_false_raise(name, layout):
    assert _same_as_torch(PASSES[name], layout) is None


def test_einsum_check_decided_once_per_layout():
    """_einsum_local decides which operands to check once per layout (a dict read after)."""
    from workbench.parallel.ops_table import matmul as MM
    from tests.test_inplace15 import _d
    MM._EINSUM_KEEP.clear()
    mesh, ps = LAYOUTS[IDS.index("S(0)-S(1)@2d")]
    x = _d(_x(), mesh, ps)
    for _ in range(3):
        torch.einsum("ij,jk->ik", x * 1.5, x)
    assert len(MM._EINSUM_KEEP) == 1
    assert any(any(v) for v in MM._EINSUM_KEEP.values())   # this layout checks an operand
