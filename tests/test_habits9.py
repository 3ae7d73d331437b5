"""A PyTorch user's habits on the wrappers, fifth sweep (habits9): each test holds a habit to
plain PyTorch on one device (or torch's own wrapper) and failed before its fix, unless it
says it pins behaviour that already held.

1. ``p.flatten().normal_()`` (``reshape(-1)``, ``ravel()``, ``contiguous()``) on
   ``fully_shard`` over tensor-parallel DistTensors (non-contiguous chunks): a copy,
   written and dropped, the parameter silently unchanged (one device: a view that writes
   it).  Now a write into such a copy raises; reading it is torch's copy;
2. ``torch.autograd.grad(loss, ddp.parameters())`` (or the module's DistTensor parameters)
   under DDP over DistTensors returned each replica's own gradient share, never averaged
   (0.034 off one device's): raises as over plain DDP's rows (habits7);
3. ``head.weight = wte.weight`` (or a new ``nn.Parameter``) after wrapping: FSDP /
   fully_shard put their own shard back at the forward (the tie undone, 1.9 off one
   device's tied model), DDP a bare KeyError, fully_shard over DistTensors dropped a plain
   ``nn.Parameter`` assigned over one (0.17 off): the forward raises, naming the fix;
4. (a pin, no fix) ``fully_shard``'s ``set_requires_gradient_sync(False)`` + ``zero_grad``
   + a synced step: equal to torch FSDP2's on gloo, bitwise;
5. an optimizer built before wrapping (nanoGPT's order) stepped the replaced tensors, which
   get no gradient: nothing trained (0.020 off one device), silently; torch's DDP trains.
   Now it follows the wrapper's parameters (and its states from before) at its next step;
6. torch FSDP1's ``model.clip_grad_norm_(max_norm)`` raised AttributeError on
   ``FullyShardedDataParallel``: one device's total norm and clipping now;
7. nanoGPT's ``model.require_backward_grad_sync = False`` (its no_sync) was an attribute
   nothing read: every micro-batch all-reduced (3x the collectives), silently;
8. an EMA folding ``model.parameters()`` into its tensors in place (``AveragedModel``,
   timm's ``mul_().add_()``, ``lerp_``, ``copy_``) raised torch's broadcasting error over
   DDP's rows / FSDP's chunks: now one device's EMA.
"""
import pytest
import torch
from torch import nn

import workbench as wb

from .test_habits6 import full, mlp, mse, wrap  # noqa: F401  (the same tiny MLP, wrappers)


# ---- 1. a reshape that copies a non-contiguous wrapped parameter -------------------------
RESHAPES = {"flatten": lambda p: p.flatten(), "reshape": lambda p: p.reshape(-1),
            "ravel": lambda p: p.ravel(), "contiguous": lambda p: p.contiguous(),
            "torch.flatten": lambda p: torch.flatten(p), "data_flatten": lambda p:
            p.data.flatten(), "detach_reshape": lambda p: p.detach().reshape(-1),
            "view_of_copy": lambda p: p.flatten()[3:]}
WRITES = {"normal_": lambda t: t.normal_(0.0, 0.2), "init.normal_": lambda t:
          nn.init.normal_(t, std=0.2), "uniform_": lambda t: t.uniform_(-0.1, 0.1),
          "zero_": lambda t: t.zero_(), "mul_": lambda t: t.mul_(2.0),
          "copy_": lambda t: t.copy_(torch.ones_like(t)), "setitem": lambda t:
          t.__setitem__(0, 1.0), "iadd": lambda t: t.__iadd__(1.0)}


def _tp_fully_shard():
    from tests.test_fixlist7 import _tp_fully_shard as make
    return make()


@pytest.mark.parametrize("reshape", list(RESHAPES))
def test_a_write_into_a_copying_reshape_of_a_non_contiguous_parameter_raises(reshape):
    """Before: no error, the parameter unchanged (the copy took the draw).  Since habits14
    a user's reshape of fully_shard's parameter over tensor parallelism is the gathered
    module value's (no view of the storage): it raises naming p.full_tensor(), except
    contiguous() (the storage's copy, whose write still raises as before)."""
    m, ref, mesh = _tp_fully_shard()
    params = dict(m.named_parameters())
    p = params["blocks.0.up.weight"]
    with torch._C.DisableTorchFunctionSubclass():
        assert not p.is_contiguous()            # the wrapper's layout, dp-minor chunks
    before = {n: q.detach().clone() for n, q in params.items()}
    for name, write in WRITES.items():
        with pytest.raises(RuntimeError, match="(into a copy of a wrapped parameter: .*not "
                           "contiguous.*Write through the parameter itself)|"
                           r"no view of the whole parameter.*p\.full_tensor\(\)"):
            with torch.no_grad():
                write(RESHAPES[reshape](p))
    for n, q in params.items():
        assert torch.equal(q.detach(), before[n]), n
    from tests.test_fixlist7 import _trains_as_one_device
    _trains_as_one_device(m, ref, mesh)


def test_a_copying_reshape_still_reads_and_backprops_as_torchs():
    """Since habits14 a user's p.flatten() here raises (the module's value is gathered,
    habits13's torchrun rule); the storage's copy, read through the storage, still
    backprops as torch's."""
    from workbench.parallel.strategies.laid_out_whole import storage
    m, _, _ = _tp_fully_shard()
    p = dict(m.named_parameters())["blocks.0.up.weight"]
    with pytest.raises(NotImplementedError, match=r"p\.full_tensor\(\)"):
        p.flatten()
    with torch._C.DisableTorchFunctionSubclass():
        want = p.detach().reshape(-1).clone()
    f = storage(p).flatten()
    assert torch.equal(f.detach().as_subclass(torch.Tensor), want)
    assert f.requires_grad and type(f * 2) is torch.Tensor and type(f.clone()) is torch.Tensor
    weights = torch.arange(f.numel(), dtype=f.dtype)
    (f * weights).sum().backward()
    with torch._C.DisableTorchFunctionSubclass():
        torch.testing.assert_close(p.grad.reshape(-1), weights)


@pytest.mark.parametrize("kind", ["fsdp", "fully_shard", "ddp"])
def test_a_contiguous_storage_still_gives_views_and_torchs_copies(kind):
    """Over contiguous storages (DDP's rows, FSDP's chunks) flatten() is a view (habits8:
    elementwise writes reach the parameter); p.mT.flatten() is a plain copy, as torch's
    (one device copies there too)."""
    mesh, w = wrap(kind, mlp())
    p = next(q for n, q in w.named_parameters() if n.endswith("0.weight"))
    t = p.mT.flatten()
    assert type(t) is torch.Tensor
    with torch.no_grad():
        t.zero_()                               # a copy, as torch's: p unchanged
        assert p.detach().abs().sum() > 0
        p.flatten().zero_()                     # a view: p zeroed
    assert full(w)["0.weight"].abs().sum() == 0


# ---- 2. torch.autograd.grad over DDP over DistTensors ------------------------------------
def _ddp_dist():
    from tests.test_habits5 import PLAN, mlp as mlp16
    mesh = wb.Mesh([[0, 1], [2, 3]], ["dp", "tp"])
    model = wb.parallelize(mlp16(), mesh, PLAN, mesh_dim="tp")
    return mesh, model, wb.DistributedDataParallel(model, mesh, "dp")


@pytest.mark.parametrize("which", ["ddp.parameters", "model.parameters", "one_replica"])
def test_autograd_grad_over_ddp_over_dist_tensors_raises(which):
    """Before: each replica its own rank's share, not summed over dp (0.034 off one
    device's gradient of 0.weight); now torch DDP's unsupported call raises, nothing run,
    and the graph is still there for loss.backward()."""
    from tests.test_habits5 import batches, dist, mlp as mlp16
    mesh, model, ddp = _ddp_dist()
    x, y = batches(1)[0]
    loss = mse(ddp(dist(x, mesh)), dist(y, mesh))
    inputs = {"ddp.parameters": lambda: list(ddp.parameters()),
              "model.parameters": lambda: list(model.parameters()),
              "one_replica": lambda: next(iter(ddp.parameters()))}[which]()
    with pytest.raises(RuntimeError, match="torch.autograd.grad over DistributedDataParallel"
                       ".*loss.backward\\(\\)"):
        torch.autograd.grad(loss, inputs)
    assert all(p.grad is None for p in ddp.parameters())
    loss.backward()
    ref = mlp16()
    mse(ref(x), y).backward()
    sd = dict(ddp.module.named_parameters())
    for n, q in ref.named_parameters():
        torch.testing.assert_close(sd[n].grad.full(), q.grad, rtol=1e-5, atol=1e-6)


# ---- 3. a parameter assigned on the module after wrapping (weight tying) -----------------
class LM(nn.Module):
    """nanoGPT's shape in miniature: an embedding, a block, a head tied to the embedding."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Embedding(10, 6)
        self.mid = nn.Linear(6, 6)
        self.head = nn.Linear(6, 10, bias=False)

    def forward(self, ids):                                 # (B, T) -> (B, T, 10)
        return self.head(torch.tanh(self.mid(self.wte(ids))))


def lm_wrap(kind, m, n=2):
    mesh = wb.Mesh.grid(n, ["dp"])
    if kind == "ddp":
        return mesh, wb.DistributedDataParallel(m, mesh), m
    if kind == "fsdp":
        return mesh, wb.FullyShardedDataParallel(m, mesh), m
    wb.fully_shard(m.mid, mesh=mesh)
    return mesh, wb.fully_shard(m, mesh=mesh), m


def lm_loss(out, y):
    out = out.full() if isinstance(out, wb.DistTensor) else out
    return nn.functional.cross_entropy(out.reshape(-1, 10), y.reshape(-1))


def lm_batches(k=2):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 10, (4, 3), generator=g), torch.randint(0, 10, (4, 3), generator=g))
            for _ in range(k)]


@pytest.mark.parametrize("kind", ["ddp", "fsdp", "fully_shard"])
@pytest.mark.parametrize("how", ["tie", "new_parameter"])
def test_a_parameter_assigned_after_wrapping_raises(kind, how):
    """Before: FSDP / fully_shard put their own head shard back at the forward (the tie
    undone, 1.9 off one device's tied model after two steps), silently; DDP: a bare
    KeyError.  Now the forward raises naming the parameter, the module as the user left
    it."""
    mesh, w, inner = lm_wrap(kind, LM())
    if how == "tie":
        inner.head.weight = inner.wte.weight
    else:
        inner.head.weight = nn.Parameter(torch.zeros(10, 6))
    assigned = inner.head.weight
    ids, y = lm_batches(1)[0]
    with pytest.raises(RuntimeError, match="parameter 'head.weight' was assigned after "
                       "wrapping.*Tie or replace parameters before wrapping"):
        w(wb.shard_tensor(ids, mesh, [wb.Shard(0)]))
    assert inner.head.weight is assigned


@pytest.mark.parametrize("kind", ["ddp", "fsdp", "fully_shard"])
def test_a_tie_before_wrapping_trains_as_one_device(kind):
    """nanoGPT's order (tied in __init__, then wrapped): unchanged, one device's."""
    ref, m = LM(), LM()
    ref.head.weight = ref.wte.weight
    m.head.weight = m.wte.weight
    mesh, w, inner = lm_wrap(kind, m)
    opt, ropt = (torch.optim.SGD(x.parameters(), lr=0.5) for x in (w, ref))
    for ids, y in lm_batches():
        for o, model, xx in ((opt, w, wb.shard_tensor(ids, mesh, [wb.Shard(0)])), (ropt, ref, ids)):
            o.zero_grad()
            lm_loss(model(xx), y).backward()
            o.step()
    assert inner.head.weight is inner.wte.weight
    got = full(w)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6)


# ---- 4. fully_shard: set_requires_gradient_sync(False), zero_grad, then a synced step -----
@pytest.mark.parametrize("how", ["none", "model", "optimizer", "set_to_none_false"])
def test_fully_shard_held_gradients_outlive_zero_grad_as_fsdp2(how):
    """Pins what held already (no fix): FSDP2 keeps the gradients of a backward under
    set_requires_gradient_sync(False) on its unsharded parameters, which no zero_grad
    reaches, and reduce-scatters them with the next synced backward's (torch 2.13
    _fsdp_param_group.py:603-626); measured on gloo, wb.fully_shard equals torch's
    fully_shard bitwise (test_fully_shard_grad_sync_and_tie_on_gloo_as_torchs).  On
    simulated ranks: one device's step over both batches' gradients."""
    from .test_habits6 import batches
    from .test_habits7 import dist
    mesh, w = wrap("fully_shard", mlp(), 2)
    opt = torch.optim.SGD(w.parameters(), lr=1.0)
    (x0, y0), (x1, y1) = batches(2)
    w.set_requires_gradient_sync(False)
    mse(w(dist(x0, mesh)), dist(y0, mesh)).backward()
    w.set_requires_gradient_sync(True)
    if how == "model":
        w.zero_grad()
    elif how == "optimizer":
        opt.zero_grad()
    elif how == "set_to_none_false":
        opt.zero_grad(set_to_none=False)
    mse(w(dist(x1, mesh)), dist(y1, mesh)).backward()
    opt.step()
    ref = mlp()
    for x, y in ((x0, y0), (x1, y1)):
        mse(ref(x), y).backward()
    torch.optim.SGD(ref.parameters(), lr=1.0).step()
    got = full(w)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_fully_shard_grad_sync_and_tie_on_gloo_as_torchs(tmp_path_factory):
    """2 gloo processes: wb.fully_shard's held gradients after a zero_grad are torch
    FSDP2's, bitwise; a tie after wrapping: torch DDP raises (its reducer), wb's DDP and
    fully_shard raise (torch FSDP2 follows the tie: not built here, .replaced_params); an
    optimizer built before wrapping trains as one device on wb's DDP and fully_shard."""
    from tests.torchrun_support import json_rows, two_proc
    out, text = two_proc(tmp_path_factory, "habits9_check.py")   # one launch: 2-process parts
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {r["case"]: r for r in json_rows(text)}
    assert len(rows) == 14, rows
    for how in ("none", "model", "optimizer", "set_to_none_false"):
        r = rows[f"grad_sync_{how}"]
        assert r["wb_vs_torch"] == 0.0 and r["torch_one_device_both"] < 1e-6, r
    assert "Expected to have finished reduction" in rows["tie_torch_ddp"]["raised"]
    for w in ("wb_ddp", "wb_fully_shard"):
        assert "was assigned after wrapping" in rows[f"tie_{w}"]["raised"], rows
    assert rows["tie_torch_fsdp2"]["tied"] and rows["tie_torch_fsdp2"]["one_device"] < 1e-6
    # an optimizer built before wrapping: torch DDP's and ours train as one device (wb
    # fully_shard's optimizer follows its shards; torch FSDP2's steps the old tensors)
    for w in ("torch_ddp", "wb_ddp", "wb_fully_shard"):
        assert rows[f"opt_before_{w}"]["one_device"] < 1e-6, rows
    # nanoGPT's require_backward_grad_sync: torch DDP's numbers, no_sync()'s all-reduces
    r = rows["grad_sync_flag"]
    assert r["wb_vs_torch"] == 0.0 and r["all_reduces"][0] == r["all_reduces"][1] > 0, r
    # an EMA of the wrapped model's parameters (each process's chunk gathered): torch DDP's
    assert rows["ema"]["wb_fsdp"] < 1e-6 and rows["ema"]["wb_fully_shard"] < 1e-6, rows


# ---- 5. an optimizer built before wrapping (nanoGPT's order) -------------------------------
@pytest.mark.parametrize("kind", ["ddp", "fsdp", "fsdp_units", "fully_shard"])
@pytest.mark.parametrize("steps_before", [0, 1])
def test_an_optimizer_built_before_wrapping_trains_as_one_device(kind, steps_before):
    """nanoGPT: optimizer = model.configure_optimizers(...); model = DDP(model).  torch DDP
    keeps the parameters (one device's, on gloo); here the wrapper's new tensors took
    their place and the optimizer stepped the old ones, which get no gradient: nothing
    trained (0.020 off one device after two AdamW steps), silently.  Now the optimizer
    follows them at its next step, its states from a step before wrapping too."""
    from .test_habits6 import batches
    from .test_habits7 import dist
    ref, m = mlp(), mlp()
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    ropt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    bs = batches(3)
    for x, y in bs[:steps_before]:
        for o, model in ((opt, m), (ropt, ref)):
            o.zero_grad()
            mse(model(x), y).backward()
            o.step()
    mesh, w = wrap(kind, m)
    for x, y in bs[steps_before:]:
        opt.zero_grad()
        mse(w(dist(x, mesh)), dist(y, mesh)).backward()
        opt.step()
        ropt.zero_grad()
        mse(ref(x), y).backward()
        ropt.step()
    got = full(w)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=1e-6, atol=1e-6)
    params = {id(p) for p in w.parameters()}
    assert all(id(p) in params for g in opt.param_groups for p in g["params"])
    assert opt.state_dict()["param_groups"] == ropt.state_dict()["param_groups"]


@pytest.mark.parametrize("when", ["before_first_forward", "after_first_forward"])
def test_a_plain_parameter_assigned_over_fully_shard_dist_tensors_raises(when):
    """fully_shard over tensor-parallel DistTensors: m.bias = nn.Parameter(t) after
    wrapping was dropped (the shards built from, or put back as, the old DistTensor: 0.17
    off one device's forward with the new bias), silently; now the forward raises."""
    from tests.test_habits5 import PLAN, batches, dist, mlp as mlp16
    mesh = wb.Mesh([[0, 1], [2, 3]], ["dp", "tp"])
    model = wb.parallelize(mlp16(), mesh, PLAN, mesh_dim="tp")
    wb.fully_shard(model, mesh=mesh["dp"])
    x, _ = batches(1)[0]
    if when == "after_first_forward":
        model(dist(x, mesh))
    model[2].bias = nn.Parameter(torch.zeros(16))
    with pytest.raises(RuntimeError, match="parameter '2.bias' was assigned after wrapping"):
        model(dist(x, mesh))
    assert type(model[2]._parameters["bias"]) is nn.Parameter


# ---- 6. FSDP1's model.clip_grad_norm_ -------------------------------------------------------
def _fsdp_over_dist_tensors():
    from tests.test_habits5 import PLAN, mlp as mlp16
    mesh = wb.Mesh([[0, 1], [2, 3]], ["dp", "tp"])
    model = wb.parallelize(mlp16(), mesh, PLAN, mesh_dim="tp")
    put = lambda t: wb.shard_tensor(t, mesh, [wb.Shard(0), wb.Replicate()])    # noqa: E731
    return model, wb.FullyShardedDataParallel(model, mesh, "dp"), mlp16(), put


@pytest.mark.parametrize("kind", ["fsdp", "fsdp_units", "fsdp_dist"])
@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_fsdp1_clip_grad_norm_method_is_torchs(kind, norm_type):
    """torch FSDP1 loops clip with model.clip_grad_norm_(max_norm) (AttributeError before):
    one device's total norm returned, the gradients clipped as one device's."""
    from .test_habits6 import batches
    from .test_habits7 import dist
    from tests.test_habits5 import batches as batches16
    if kind == "fsdp_dist":
        model, w, ref, put = _fsdp_over_dist_tensors()
        data = batches16(2)
    else:
        ref, (mesh, w) = mlp(), wrap(kind, mlp())
        model, data = w, batches(2)
        put = lambda t: dist(t, mesh)   # noqa: E731
    opt, ropt = (torch.optim.SGD(x.parameters(), lr=0.5) for x in (w, ref))
    for x, y in data:
        opt.zero_grad()
        mse(w(put(x)), put(y)).backward()
        got = w.clip_grad_norm_(0.05, norm_type)
        opt.step()
        ropt.zero_grad()
        mse(ref(x), y).backward()
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type)
        ropt.step()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    sd = model.state_dict()
    for k, v in ref.state_dict().items():
        g = sd[k].full() if isinstance(sd[k], wb.DistTensor) else sd[k]
        torch.testing.assert_close(g, v, rtol=1e-5, atol=1e-6)


# ---- 7. nanoGPT's require_backward_grad_sync flag ------------------------------------------
@pytest.mark.parametrize("kind", ["ddp", "ddp_dist"])
def test_require_backward_grad_sync_is_no_sync_as_torch_ddps(kind):
    """nanoGPT: model.require_backward_grad_sync = (micro_step == steps - 1) instead of
    no_sync().  It was a plain attribute nothing read: every micro-batch all-reduced (the
    same gradients, 3x the all-reduces in the trace), silently; now it is torch DDP's
    flag, the same collectives and numbers as no_sync()."""
    import contextlib
    from .test_habits6 import batches
    from .test_habits7 import dist
    from tests.test_habits5 import batches as batches16, ddp_dist, dist as dist16, mlp as mlp16
    counts, params = {}, {}
    for how in ("flag", "no_sync"):
        if kind == "ddp":
            mesh, w = wrap("ddp", mlp())
            data, put, model, ref = batches(6), (lambda t: dist(t, mesh)), w, mlp()
        else:
            mesh, model, w = ddp_dist()
            data, put, ref = batches16(6), (lambda t: dist16(t, mesh)), mlp16()
        opt, ropt = (torch.optim.AdamW(x.parameters(), lr=0.01) for x in (w, ref))
        with wb.trace() as tr:
            for s in range(2):
                for micro in range(3):
                    x, y = data[3 * s + micro]
                    if how == "flag":
                        w.require_backward_grad_sync = micro == 2
                        ctx = contextlib.nullcontext()
                    else:
                        ctx = w.no_sync() if micro < 2 else contextlib.nullcontext()
                    with ctx:
                        (mse(w(put(x)), put(y)) / 3).backward()
                    (mse(ref(x), y) / 3).backward()
                for o in (opt, ropt):
                    o.step()
                    o.zero_grad()
        counts[how] = sum(e.name == "all_reduce" for e in tr.collectives())
        sd = model.state_dict()
        params[how] = {k: v.full() if isinstance(v, wb.DistTensor) else v for k, v in sd.items()}
        for k, v in ref.state_dict().items():
            key = ("module." + k) if kind == "ddp" else k
            torch.testing.assert_close(params[how][key], v, rtol=1e-6, atol=1e-6)
    assert counts["flag"] == counts["no_sync"] > 0, counts
    assert w.require_backward_grad_sync is True
    with pytest.raises(TypeError, match="give True or False"):
        w.require_backward_grad_sync = 1


# ---- 8. an EMA of the weights folded in place from the wrapped model -----------------------
EMA_UPDATES = {
    "AveragedModel": None,      # torch.optim.swa_utils, get_ema_multi_avg_fn: _foreach_lerp_
    "timm_v2": lambda e, m: [a.mul_(0.9).add_(b.detach(), alpha=0.1)
                             for a, b in zip(e.parameters(), m.parameters())],
    "lerp": lambda e, m: [a.lerp_(b.detach(), 0.1) for a, b in zip(e.parameters(),
                                                                  m.parameters())],
    "copy": lambda e, m: [a.copy_(b) for a, b in zip(e.parameters(), m.parameters())]}


@pytest.mark.parametrize("kind", ["ddp", "fsdp", "fully_shard"])
@pytest.mark.parametrize("style", list(EMA_UPDATES))
def test_an_ema_folds_in_the_wrapped_models_weights_as_one_devices(kind, style):
    """The EMA (built from the plain model, as timm's before DDP) folds model.parameters()
    into its own tensors in place: on torch's DDP the module's parameters; here the rows /
    chunks failed with torch's broadcasting error ('output with shape [8, 6] doesn't match
    the broadcast shape [4, 8, 6]').  Now a wrapped parameter read into a plain tensor of
    its module's shape is its module value: one device's EMA."""
    import copy
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
    from .test_habits6 import batches
    from .test_habits7 import dist
    ref, m = mlp(), mlp()
    if style == "AveragedModel":
        ema, rema = (AveragedModel(x, multi_avg_fn=get_ema_multi_avg_fn(0.9)) for x in (m, ref))
        update = lambda e, model: e.update_parameters(model)     # noqa: E731
    else:
        ema, rema = copy.deepcopy(m), copy.deepcopy(ref)
        update = EMA_UPDATES[style]
    mesh, w = wrap(kind, m)
    opt, ropt = (torch.optim.SGD(x.parameters(), lr=0.1) for x in (w, ref))
    for x, y in batches(3):
        for o, model, e, xx, yy in ((opt, w, ema, dist(x, mesh), dist(y, mesh)),
                                    (ropt, ref, rema, x, y)):
            o.zero_grad()
            mse(model(xx), yy).backward()
            o.step()
            with torch.no_grad():
                update(e, model)
    for a, b in zip(ema.parameters(), rema.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
