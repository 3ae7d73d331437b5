"""ZeRO-3 / FSDP over DistTensor parameters beside tensor parallelism: the module's own
parameters (``model.named_parameters()``, ``model.parameters()``, ``model.fc.weight``,
``wb.dist_parameters``) read the trained values after every step, as FSDP2's sharded
DTensor parameters do (stepped in place), for every wrapper with the template / shard
split: ``wb.FullyShardedDataParallel`` and ``Zero3`` on a ``wb.parallelize``'d module,
``fully_shard`` after TP, ``Hybrid(zero=3)`` with and without a pipeline.  Before, with
tp they silently kept the values at wrapping (fsdp_dist_views).  Every value is held to a
plain single-device torch model."""
import copy
from collections import Counter

import pytest
import torch
from torch import nn

import workbench as wb
from workbench.parallel.strategies.fsdp_dist_views import is_view
from workbench.parallel.strategies.zero3 import Zero3

PLAN = {"0": "colwise", "2": "rowwise"}


def mlp(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.GELU(), nn.Linear(10, 6)).to(dtype)


def data(k, dtype=torch.float32):
    g = torch.Generator().manual_seed(1 + k)
    return torch.randn(6, 6, generator=g).to(dtype), torch.randn(6, 6, generator=g).to(dtype)


def wrapped(kind, dims=(2, 2), names=("dp", "tp"), dtype=torch.float32):
    """(model, wrapper, optimizer or None (Zero3 steps itself), mesh, the batch placements)"""
    mesh = wb.Mesh.grid(dims, list(names))
    model = wb.parallelize(mlp(dtype), mesh, PLAN, mesh_dim="tp")
    if kind == "zero3":
        w, opt = Zero3(model, mesh, "dp", lr=1e-2), None
    else:
        w = wb.FullyShardedDataParallel(model, mesh, "dp")
        opt = torch.optim.AdamW(w.parameters(), lr=1e-2, weight_decay=0.0)
    pl = [wb.Replicate()] * len(names)
    pl[list(names).index("dp")] = wb.Shard(0)
    return model, w, opt, mesh, pl


def step(w, opt, mesh, pl, ref, ropt, k, dtype=torch.float32):
    x, y = data(k, dtype)
    out = w(wb.shard_tensor(x, mesh, pl))
    ((out - wb.shard_tensor(y, mesh, pl)) ** 2).mean().backward()
    if opt is None:
        w.step()
    else:
        w.finish_gradient_synchronization()
        opt.step()
        opt.zero_grad()
    ((ref(x) - y) ** 2).mean().backward()
    ropt.step()
    ropt.zero_grad()


def reference(dtype=torch.float32):
    ref = mlp(dtype)
    return ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)


def assert_reads(model, ref, msg="", **tol):
    """named_parameters, parameters, each attribute, dist_parameters and the state dict:
    the single-device model's values (and dtypes)."""
    want = dict(ref.named_parameters())
    got = dict(model.named_parameters())
    assert list(got) == list(want)
    for n, p in got.items():
        assert p.dtype == want[n].dtype and tuple(p.shape) == tuple(want[n].shape), n
        torch.testing.assert_close(p.full().detach(), want[n].detach(), msg=f"{msg} {n}",
                                   **tol)
        mod, _, attr = n.rpartition(".")
        torch.testing.assert_close(getattr(model.get_submodule(mod), attr).full().detach(),
                                   want[n].detach(), msg=f"{msg} attribute {n}", **tol)
    for p, (n, q) in zip(model.parameters(), want.items()):
        torch.testing.assert_close(p.full().detach(), q.detach(), msg=f"{msg} {n}", **tol)
    for n, p in wb.dist_parameters(model):
        torch.testing.assert_close(p.full().detach(), want[n].detach(), msg=n, **tol)
    for n, v in model.state_dict().items():
        torch.testing.assert_close(v.full(), want[n].detach(), msg=f"{msg} sd {n}", **tol)


@pytest.mark.parametrize("kind,dims,names", [
    ("fsdp", (2, 2), ("dp", "tp")), ("zero3", (2, 2), ("dp", "tp")),
    ("fsdp", (3, 2), ("dp", "tp")),          # 15 and 3 elements a chunk: padded
    ("fsdp", (2, 2), ("tp", "dp")),          # dp the last mesh dim
    ("zero3", (2, 1), ("dp", "tp")), ("fsdp", (1, 2), ("dp", "tp"))],
    ids=["fsdp-dp2-tp2", "zero3-dp2-tp2", "fsdp-dp3-tp2", "fsdp-tp2-dp2", "zero3-dp2-tp1",
         "fsdp-dp1-tp2"])
def test_the_modules_parameters_read_the_trained_values_after_1_2_3_steps(kind, dims, names):
    model, w, opt, mesh, pl = wrapped(kind, dims, names)
    ref, ropt = reference()
    assert_reads(model, ref, "at wrapping")
    for k in range(3):
        step(w, opt, mesh, pl, ref, ropt, k)
        assert_reads(model, ref, f"after step {k + 1}")
    # the templates hold no copy: views of the shards
    assert all(is_view(e[2], e[3]) for e in w.entries)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_other_dtypes_read_the_trained_values(dtype):
    """In bfloat16 a gradient element near 0 (one device's -1.8e-4, float64's -1.1e-4) can
    round to 0 or the other sign on the sharded run (its dp parts rounded apart), which
    AdamW's first step turns into a whole lr (0.0098): each read is held to the trained
    model read exactly, and to one device within rounding in the mean, within one step's
    lr at most (a stale value is an lr off in every element; measured mean 1.9e-4 at most)."""
    model, w, opt, mesh, pl = wrapped("fsdp", dtype=dtype)
    ref, ropt = reference(dtype)
    for k in range(2):
        step(w, opt, mesh, pl, ref, ropt, k, dtype)
        if dtype != torch.bfloat16:
            assert_reads(model, ref, f"after step {k + 1}")
            continue
        trained = copy.deepcopy(ref)
        with torch.no_grad():
            for n, p in model.named_parameters():
                trained.get_submodule(n.rpartition(".")[0]).get_parameter(
                    n.rpartition(".")[2]).copy_(p.full())
        assert_reads(model, trained, f"after step {k + 1}")
        for (n, p), q in zip(trained.named_parameters(), ref.parameters()):
            d = (p.detach().double() - q.detach().double()).abs()
            assert d.mean() < 1e-3 and d.max() <= 1.01e-2, (n, k, d.mean(), d.max())


def test_an_optimizer_step_records_no_collective():
    # nothing is gathered to keep the module's parameters current: a step over the
    # shards records no collective, and the trace of a training step is what it was
    model, w, opt, mesh, pl = wrapped("fsdp")
    ref, ropt = reference()
    x, y = data(0)
    with wb.trace() as tr:
        out = w(wb.shard_tensor(x, mesh, pl))
        ((out - wb.shard_tensor(y, mesh, pl)) ** 2).mean().backward()
        w.finish_gradient_synchronization()
        before = dict(tr.counts())
        zero3 = Counter(e.name for e in tr.collectives()
                        if e.label.startswith("zero-3") and tuple(e.ranks) == (0, 2))
        opt.step()
        assert dict(tr.counts()) == before
    # on dp group (0, 2): 2 modules gathered in forward and again in backward, their 4
    # gradients reduce-scattered
    assert zero3 == {"all_gather": 4, "reduce_scatter": 4}, zero3


def test_fully_shard_after_tp_reads_the_trained_values_after_1_2_3_steps():
    from tests.test_fully_shard import batches, tp_model, wrap_tp_fsdp
    from tests.test_audit_tp_fsdp import _loss
    mesh = wb.Mesh.grid((2, 2), ["dp", "tp"])
    m, ref = wrap_tp_fsdp(tp_model(), mesh), tp_model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for k, (ids, y) in enumerate(batches(k=3)):
        for model, o, me in ((m, opt, mesh), (ref, ropt, None)):
            o.zero_grad()
            _loss(model, me, ids, y).backward()
            o.step()
        want = dict(ref.named_parameters())
        for n, p in m.named_parameters():       # the dp shards: full_tensor()
            torch.testing.assert_close(p.full_tensor(), want[n].detach(), msg=f"{k} {n}")
            mod, _, attr = n.rpartition(".")
            torch.testing.assert_close(getattr(m.get_submodule(mod), attr).full().detach(),
                                       want[n].detach(), msg=f"{k} attribute {n}")
        for n, v in m.state_dict().items():
            v = v.full() if isinstance(v, wb.DistTensor) else v
            torch.testing.assert_close(v, want[n].detach(), msg=f"{k} sd {n}")


def _hybrid(steps, **kw):
    from tests.test_review_revN import _tiny, _trained
    from workbench.recipes.hybrid import Hybrid
    return _trained(Hybrid(**kw), _tiny(embed_norm=False), steps=steps)[0]


@pytest.mark.parametrize("kw,steps", [
    (dict(dp=2, tp=2, zero=3), 1), (dict(dp=2, tp=2, zero=3), 3),
    (dict(dp=2, tp=2, pp=2, zero=3), 2)], ids=["dp2-tp2-1", "dp2-tp2-3", "dp2-tp2-pp2-2"])
def test_hybrid_zero3_with_tp_parameters_read_what_the_state_dict_holds(kw, steps):
    # the state dict gathers the shards (held to one device in test_review_revN); the
    # module's parameters and attributes were the values at wrapping with tp
    model = _hybrid(steps, **kw)
    sd = model.state_dict()
    init = _hybrid(0, **kw).state_dict()
    moved = 0
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.full().detach(), sd[n].full(), rtol=0, atol=0, msg=n)
        mod, _, attr = n.rpartition(".")
        torch.testing.assert_close(getattr(model.get_submodule(mod), attr).full().detach(),
                                   sd[n].full(), rtol=0, atol=0, msg=f"attribute {n}")
        moved += not torch.equal(sd[n].full(), init[n].full())
    assert moved > 10           # it trained


# ---- the module's other habits with tp ------------------------------------------------

@pytest.mark.parametrize("when", ["at wrapping", "after a forward", "after a step"])
@pytest.mark.parametrize("init", ["normal", "zeros"])
def test_writing_a_parameter_in_place_raises_and_changes_nothing(when, init):
    # after a forward, model[0].weight is the copy the forward gathered (a view of the
    # shards now): a write to it reached nothing, silently; it raises as the template's
    model, w, opt, mesh, pl = wrapped("fsdp")
    ref, ropt = reference()
    if when == "after a step":
        step(w, opt, mesh, pl, ref, ropt, 0)
    elif when == "after a forward":
        w(wb.shard_tensor(data(0)[0], mesh, pl))
    before = {n: p.full().detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(RuntimeError, match="initialize before wrapping"):
        with torch.no_grad():
            if init == "normal":
                torch.nn.init.normal_(model[0].weight)
            else:
                model[0].bias.zero_()
    for n, v in model.state_dict().items():
        assert torch.equal(v.full(), before[n]), n
        assert torch.equal(getattr(model[int(n[0])], n[2:]).full().detach(), before[n]), n


def test_load_state_dict_then_read_and_train_on():
    model, w, opt, mesh, pl = wrapped("fsdp")
    ref, ropt = reference()
    step(w, opt, mesh, pl, ref, ropt, 0)
    g = torch.Generator().manual_seed(7)
    new = {k: torch.randn(v.shape, generator=g) for k, v in ref.state_dict().items()}
    model.load_state_dict(new)
    ref.load_state_dict(new)
    assert_reads(model, ref, "after load")
    for k in (1, 2):
        step(w, opt, mesh, pl, ref, ropt, k)
        assert_reads(model, ref, f"after load and step {k}")


def test_zero_grad_and_requires_grad_keep_the_reads_and_the_training():
    model, w, opt, mesh, pl = wrapped("zero3")
    ref, ropt = reference()
    x, y = data(0)
    out = w(wb.shard_tensor(x, mesh, pl))
    ((out - wb.shard_tensor(y, mesh, pl)) ** 2).mean().backward()
    model.zero_grad()
    assert all(p.grad is None for p in w.parameters())
    assert all(p.grad is None for p in model.parameters())
    model.requires_grad_(False)
    assert not any(p.requires_grad for p in model.parameters())
    assert not any(p.requires_grad for p in w.parameters())
    model.requires_grad_(True)
    assert all(p.requires_grad for p in model.parameters())
    assert all(is_view(e[2], e[3]) for e in w.entries)
    for k in range(2):
        step(w, None, mesh, pl, ref, ropt, k)
        assert_reads(model, ref, f"step {k + 1}")


def test_a_manual_update_of_the_shards_reaches_the_modules_parameters():
    # a training loop without torch.optim: in place, and by assigning .data (torch's
    # vector_to_parameters does): the module's parameters follow both
    model, w, _, mesh, pl = wrapped("fsdp")
    ref = mlp()
    for k in range(2):
        x, y = data(k)
        out = w(wb.shard_tensor(x, mesh, pl))
        ((out - wb.shard_tensor(y, mesh, pl)) ** 2).mean().backward()
        ((ref(x) - y) ** 2).mean().backward()
        with torch.no_grad():
            for p, q in zip(w.parameters(), ref.parameters()):
                if k == 0:
                    p -= 0.1 * p.grad
                    q -= 0.1 * q.grad
                else:
                    p.data = p.data - 0.1 * p.grad
                    q.data = q.data - 0.1 * q.grad
                p.grad = q.grad = None
        want = dict(ref.named_parameters())
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.full().detach(), want[n].detach(), msg=f"{k} {n}")
    assert all(is_view(e[2], e[3]) for e in w.entries)
    # and the next forward reads them: one device's output
    x, _ = data(5)
    torch.testing.assert_close(w(wb.shard_tensor(x, mesh, pl)).full().detach(),
                               ref(x).detach())


def test_uneven_tensor_parallel_shards_raise_naming_the_parameter():
    # 10 output rows on tp=4 are 3, 3, 3, 1 (torch.chunk): was AttributeError: 'Cells'
    # object has no attribute 'detach'
    mesh = wb.Mesh.grid((2, 4), ["dp", "tp"])
    model = wb.parallelize(mlp(), mesh, PLAN, mesh_dim="tp")
    with pytest.raises(NotImplementedError, match=r"0\.weight .*\(10, 6\).*divisible by the tp"):
        wb.FullyShardedDataParallel(model, mesh, "dp")


def test_new_storage_for_the_shards_reaches_the_modules_parameters():
    # p.data = a tensor of the shard's storage (what vector_to_parameters did before
    # habits15: new storage, dp-major): the template follows (relinked, laid out again)
    model, w, opt, mesh, pl = wrapped("fsdp")
    for p in w.parameters():
        p.data = p.detach() * 2
    ref = mlp()
    with torch.no_grad():
        for q in ref.parameters():
            q.mul_(2)
    assert_reads(model, ref, "after new .data")
    assert all(is_view(e[2], e[3]) for e in w.entries)


def test_a_view_the_shards_storage_cannot_give_says_why_and_what_to_use():
    # the shards read as the module's parameters (habits15; the storage's before:
    # p.numel() with the padding), and their storage is no view of them: torch's
    # parameters_to_vector (p.view(-1)) and vector_to_parameters raise naming
    # p.full_tensor(), which gives one device's flat vector; nothing changed
    model, w, opt, mesh, pl = wrapped("fsdp")
    before = [p.full_tensor() for p in w.parameters()]
    with pytest.raises(NotImplementedError, match=r"p\.view\(-1\).*p\.full_tensor\(\)"):
        torch.nn.utils.parameters_to_vector(w.parameters())
    vec = torch.cat([p.full_tensor().reshape(-1) for p in w.parameters()])
    assert vec.numel() == sum(p.numel() for p in w.parameters()) == \
        sum(p.numel() for p in mlp().parameters())
    torch.testing.assert_close(vec, torch.nn.utils.parameters_to_vector(mlp().parameters()))
    with pytest.raises(RuntimeError, match=r"view_as"):
        torch.nn.utils.vector_to_parameters(vec * 2, w.parameters())
    for p, b in zip(w.parameters(), before):
        assert torch.equal(p.full_tensor(), b)


def test_a_loss_term_on_a_weight_outside_forward_reaches_the_shard_or_raises():
    # after a step, module.weight is the copy the forward gathered, a view of the shard
    # with autograd to it: a weight penalty gives the shard one device's gradient (it had
    # the value before the step); the templates (model.parameters()) have no autograd to
    # the shards: a gradient reaching one raises instead of being dropped
    model, w, opt, mesh, pl = wrapped("fsdp")
    ref, ropt = reference()
    step(w, opt, mesh, pl, ref, ropt, 0)
    (model[0].weight.full() ** 2).sum().backward()
    (ref[0].weight ** 2).sum().backward()
    got = torch.nn.utils.clip_grad_norm_(w.parameters(), 1e9)
    torch.testing.assert_close(got, torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9))
    opt.zero_grad()
    with pytest.raises(RuntimeError,
                       match=r"gradient reached [02]\.(weight|bias) .*would not reach"):
        sum((p.full() ** 2).sum() for p in model.parameters()).backward()
    assert all(p.grad is None for p in model.parameters())
