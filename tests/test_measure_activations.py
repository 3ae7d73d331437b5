"""The activations a Hybrid step keeps for backward are counted only when asked
(task simperf2): ``plan.meta_run.SavedCounter`` watches every op of the forward (measured
a quarter of a gpt-tiny Hybrid(dp=2, tp=2) step, 25.3 -> 19.6 ms without it), and every
step paid it to fill ``last_activation_bytes``.  Now ``strategy.measure_activations()``
turns the count on (``wb.train`` does, for its records); a step outside it has no figure,
and reading one raises, never an earlier step's."""
import pytest
import torch

import workbench as wb
from workbench.train import train
from workbench.models.config import get_config
from workbench.models.data import get_batch
from workbench.plan import meta_run
from workbench.recipes.context_parallel import ContextParallel
from workbench.recipes.hybrid import Hybrid

CFG = get_config("tiny", dropout=0.0)
BATCH = 4


def _setup(strategy):
    torch.manual_seed(0)
    strategy.check(CFG, BATCH)
    model = strategy.build_model(CFG, 0)
    opt = strategy.build_optimizer(model, 1e-3, 0.0)
    x, y = get_batch(CFG, BATCH, 0, 0)
    return model, opt, x, y


def _counted_forwards(monkeypatch):
    """How many times SavedCounter counted a forward."""
    n = [0]
    real = meta_run.SavedCounter.counting

    def counting(self):
        n[0] += 1
        return real(self)
    monkeypatch.setattr(meta_run.SavedCounter, "counting", counting)
    return n


@pytest.mark.parametrize("make", [lambda: Hybrid(dp=2, tp=2), lambda: ContextParallel(cp=2)])
def test_a_plain_step_does_not_count_and_its_figure_raises(monkeypatch, make):
    """Failed before: every forward_backward ran SavedCounter (1 count per step) and
    last_activation_bytes gave a number without being asked."""
    h = make()
    model, opt, x, y = _setup(h)
    n = _counted_forwards(monkeypatch)
    h.forward_backward(model, x, y)
    assert n[0] == 0
    with pytest.raises(RuntimeError, match=r"last_activation_bytes: .*measure_activations"):
        h.last_activation_bytes
    with wb.trace() as tr:
        h.forward_backward(model, x, y)
    with pytest.raises(RuntimeError, match=r"measure_activations\(\)"):
        h.step_report(tr, opt)


@pytest.mark.parametrize("make", [lambda: Hybrid(dp=2, tp=2), lambda: ContextParallel(cp=2)])
def test_measured_figure_is_the_step_s_own_and_never_stale(monkeypatch, make):
    """Inside measure_activations the step counts once, with the same figure as
    SavedCounter over the recipe's forward; the next step outside it leaves no figure
    (not the earlier one), and a step that raised leaves none either."""
    h = make()
    model, opt, x, y = _setup(h)
    with pytest.raises(RuntimeError, match="no forward_backward has run yet"):
        h.last_activation_bytes
    n = _counted_forwards(monkeypatch)
    with h.measure_activations():
        loss = h.forward_backward(model, x, y)
    assert n[0] == 1
    got = h.last_activation_bytes
    assert got > 0
    # the same count, made by hand around the recipe's own forward
    from workbench.parallel.module import dist_parameters
    mesh = h.meshes[0]
    model.zero_grad(set_to_none=True)
    params = [p for _, p in dist_parameters(model)] + list(model.buffers())
    with meta_run.SavedCounter(mesh, params).counting() as saved:
        again = h._loss(h._stage(model, 0, h._batch(x, mesh)), h._batch(y, mesh))
    assert saved.bytes == got
    torch.testing.assert_close(again.full().detach(), loss)
    h.forward_backward(model, x, y)             # outside: the figure is gone
    with pytest.raises(RuntimeError, match="did not count"):
        h.last_activation_bytes
    with h.measure_activations():
        h.forward_backward(model, x, y)
    assert h.last_activation_bytes == got

    def boom(*a):
        raise ValueError("a loss that raised")
    monkeypatch.setattr(h, "_loss", boom)
    with h.measure_activations():
        with pytest.raises(ValueError, match="a loss that raised"):
            h.forward_backward(model, x, y)
    with pytest.raises(RuntimeError, match="raised before"):
        h.last_activation_bytes
    assert not h._measuring                     # the block restored the switch


def test_a_pipeline_step_says_why_it_has_no_figure():
    h = Hybrid(pp=2)
    model, opt, x, y = _setup(h)
    with h.measure_activations():
        h.forward_backward(model, x, y)
    with pytest.raises(RuntimeError, match="pipeline"):
        h.last_activation_bytes


def test_train_records_still_count_every_step():
    """wb.train measures each step for its records: the figure of a measured step."""
    rows = train(CFG, steps=2, batch_size=BATCH, timing=False, strategy=Hybrid(dp=2))
    h = Hybrid(dp=2)
    model, opt, x, y = _setup(h)
    with h.measure_activations():
        h.forward_backward(model, x, y)
    assert rows[0]["activation_bytes"] == rows[1]["activation_bytes"] == h.last_activation_bytes


def test_saved_counter_and_the_shared_rule_differ_where_its_docstring_says():
    """plan.meta_run.SavedCounter uses the shared layout rule (memory._ranks_splitting)
    but not saved_activation_bytes itself; two of the documented reasons, measured."""
    from workbench.parallel.strategies.memory import saved_activation_bytes
    mesh = wb.Mesh.grid(2, ["dp"])
    # a local kernel flattened the lead dims: the shared rule raises, the counter splits
    # the storage over the mesh's ranks
    x = torch.randn(2, 4, 8, requires_grad=True)          # (mesh, B, h)

    def flat():
        return x.reshape(8, 8).exp().sum()                 # exp keeps its (8, 8) output
    with pytest.raises(ValueError, match="no lead axes matching the mesh"):
        saved_activation_bytes(flat, lead_dims=1, mesh=mesh)
    with meta_run.SavedCounter(mesh, [x]).counting() as c:
        flat()
    assert c.bytes == 8 * 8 * 4 // 2
    # a stacked view (1, B, S) of a plain (B, S) batch whose B equals the mesh size: the
    # shared rule reads the base first (B taken for ranks), the counter the view itself
    tok = torch.randn(2, 64, requires_grad=True)

    def view():
        return tok.unsqueeze(0).sin().sum()                # sin keeps its input
    _, rep = saved_activation_bytes(view, lead_dims=1, mesh=mesh)
    with meta_run.SavedCounter(mesh).counting() as c:
        view()
    assert rep.bytes == 2 * 64 * 4 // 2 and c.bytes == 2 * 64 * 4


def test_saved_counter_splits_a_flattened_tensor_over_the_axes_its_inputs_vary_along():
    """Task savedtp.  Before: a saved tensor without mesh lead axes was split over every
    rank, so one computed from tp-replicated inputs (the loss's log-softmax on a
    non-vocab-parallel head, the expert-parallel layer's per-group tensors taken at tp
    index 0) was counted 1/tp of what each tp rank holds: 64 and 2 x 32 bytes here where
    each rank holds 128 (and tiny tp 2's (64, 75) log-softmax 9,600 B, not 19,200)."""
    mesh = wb.Mesh.grid((2, 2), ["dp", "tp"])
    x = torch.randn(2, 1, 4, 8, requires_grad=True)       # (dp, tp replicated, B, h)
    with meta_run.SavedCounter(mesh, [x]).counting() as c:
        x.reshape(8, 8).exp().sum()                        # flattened: (dp B, h)
    assert c.bytes == 8 * 8 * 4 // 2                       # split over dp only
    with meta_run.SavedCounter(mesh, [x]).counting() as c:
        sum(x[i, 0].exp().sum() for i in range(2))         # one piece per dp rank
    assert c.bytes == 2 * (4 * 8 * 4 // 2)                  # = the 128 B one rank holds
    y = torch.randn(2, 2, 4, 8, requires_grad=True)       # varies over dp and tp
    with meta_run.SavedCounter(mesh, [y]).counting() as c:
        y.reshape(16, 8).exp().sum()
    assert c.bytes == 16 * 8 * 4 // 4
