"""A PyTorch user's habits on the wrappers, round 11 (habits11, second part; the first part,
tests/test_habits11.py, is an earlier round's): module hooks on simulated ranks, in-place
init after wrapping, ``load_state_dict(strict=False)``, weight / spectral norm, on
habits15's sweep (DDP, FSDP, fully_shard, DDP + ZeroRedundancyOptimizer on 4 simulated dp
ranks; the same, ZeRO-1/2 and Zero3 over tensor parallelism on dp 2 x tp 2), each held to
one device's plain PyTorch, or a raise naming the fix.

Hooks (``rank_hooks.py``): on simulated ranks a hook on the module or a submodule fires once
per rank with that rank's tensors (torch.nn.DataParallel's documented behaviour, and what
each process of a torchrun job does); a hook that changes the forward changes each rank's,
so the step is one device's; over DistTensors, and on the wrapper itself, one call with the
global tensors.  ``wb.simulated_rank()`` (new) tells a hook which rank it serves, so
``if wb.simulated_rank() in (None, 0)`` reads what rank 0 of a torchrun job reads (and one
device's on one device).

Found and fixed (each test failed before):

1. ``nn.init.eye_`` / ``orthogonal_`` / ``sparse_`` on the parameters of DDP / FSDP /
   fully_shard / ZeRO (rows or flat chunks), and FSDP / fully_shard / Zero3 over tensor
   parallelism: torch's own errors from the storage's shape ("shape '[4, 4]' is invalid for
   input of size 72", "eye() received an invalid combination of arguments"), orthogonal_
   having drawn from the generator first.  Now the in-place-init refusal naming the fix,
   before any draw;
2. ``nn.init.trunc_normal_`` on DDP over tensor parallelism's ``ddp.parameters()`` (replica
   storages): its rejection redraw (``torch.empty_like(result).normal_()``, torch 2.13) drew
   in the storage's shape, each replica its own: ``0.weight`` 1.23 off one device's draw
   (std=1; with std=0.02 nothing is rejected and it was exact), silently until the next
   forward refused the unequal replicas.  Now one device's draw, the generator as far;
3. a weight tied across a ``fully_shard`` block's boundary (``m[2].weight = m[0].weight``,
   ``fully_shard(m[0])`` then ``fully_shard(m)``): the root's call sharded the plain weight
   again, two parameters trained apart (0.0685 off one device's after two SGD steps),
   silently.  Now the root's call raises naming the fix (one call holding every use);
4. a tie made after wrapping DDP over tensor parallelism: torch's reducer error one step
   later, naming ``find_unused_parameters``; now the next forward raises naming the tie.
"""
import copy

import pytest
import torch
from torch import nn

import workbench as wb

from .test_habits11 import close
from .test_habits15 import KINDS, OVER_TP, PLAIN, Wrapped, batches, full_state, mk
from .test_habits18 import sgd_pair, train_step

N = 4                                       # simulated dp ranks of the PLAIN kinds


def sharded(wr, t):
    """``t`` split over the dp ranks (its rows), as a data loader's shard each rank reads."""
    return wb.shard_tensor(t, wr.mesh, [wb.Shard(0)] + ([wb.Replicate()] if wr.kind in OVER_TP
                                                        else []))


def dp_step(wr, x, y):
    """Forward over the dp-sharded batch, the loss of the global batch, backward."""
    out = wr.w(sharded(wr, x))
    ((out - sharded(wr, y)) ** 2).mean().backward()
    return out


def plain(t):
    return t.full() if isinstance(t, wb.DistTensor) else t


def same_before_and_after_a_step(wr, opt, ref, ro):
    """The wrapper's full state is one device's, and again after one SGD step of both."""
    for _ in range(2):
        got = full_state(wr.m.state_dict())
        for k, v in ref.state_dict().items():
            close(got[k], v)
        if _ == 0:
            train_step(wr, opt, ref, ro, *batches(1)[0])


# ---- 1. module hooks ---------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_forward_hooks_fire_once_per_simulated_rank_with_its_rows(kind):
    """A forward hook and a forward pre-hook recording (rank, tensor): on simulated ranks one
    call per rank (0 .. 3, in order), rank k's the rows of its shard, one device's values;
    over DistTensors one call with the global tensor.  A hook that keeps to rank 0's view
    (``wb.simulated_rank() in (None, 0)``) reads once: on one device the whole batch, on
    simulated ranks rank 0's rows (torchrun rank 0's)."""
    ref, wr = mk(), Wrapped(kind)
    ref.eval()
    wr.w.eval()
    x, y = batches(1)[0]

    def recorders(m):
        seen = {"out": [], "in": [], "rank0": []}
        m[0].register_forward_hook(
            lambda mod, a, o: seen["out"].append((wb.simulated_rank(), plain(o).detach())))
        m[2].register_forward_pre_hook(
            lambda mod, a: seen["in"].append((wb.simulated_rank(), plain(a[0]).detach())))

        def rank0(mod, a, o):
            if wb.simulated_rank() in (None, 0):
                seen["rank0"].append(plain(o).detach())
        m[0].register_forward_hook(rank0)
        return seen
    want, got = recorders(ref), recorders(wr.m)
    ref(x)
    wr.w(sharded(wr, x))
    assert [r for r, _ in want["out"]] == [None]
    full_out, full_in = want["out"][0][1], want["in"][0][1]
    if kind in OVER_TP:
        assert [r for r, _ in got["out"]] == [r for r, _ in got["in"]] == [None]
        close(got["out"][0][1], full_out)
        close(got["in"][0][1], full_in)
        close(got["rank0"][0], full_out)
        return
    assert [r for r, _ in got["out"]] == [r for r, _ in got["in"]] == list(range(N))
    rows = len(x) // N
    for k in range(N):
        close(got["out"][k][1], full_out[k * rows:(k + 1) * rows])
        close(got["in"][k][1], full_in[k * rows:(k + 1) * rows])
    assert len(got["rank0"]) == 1
    close(got["rank0"][0], full_out[:rows])
    assert wb.simulated_rank() is None


@pytest.mark.parametrize("kind", KINDS)
def test_hooks_that_change_the_forward_train_as_one_device(kind):
    """A pre-hook returning new inputs (``x * 0.5``) and a forward hook changing its output
    in place (``o.mul_(2)``): each rank's forward changed as each torchrun process's hook
    changes its own, so two SGD steps are one device's (a guard: it passed before)."""
    ref, wr, ro, opt = sgd_pair(kind)
    calls = []

    def pre(mod, args):
        calls.append(1)
        return (args[0] * 0.5,)

    def post(mod, args, out):
        out.mul_(2)
    for m in (ref, wr.m):
        m[2].register_forward_pre_hook(pre)
        m[0].register_forward_hook(post)
    for x, y in batches(2):
        train_step(wr, opt, ref, ro, x, y)
    assert len(calls) == 2 * (1 + (1 if kind in OVER_TP else N))
    got, want = full_state(wr.m.state_dict()), ref.state_dict()
    for k in want:
        close(got[k], want[k])


@pytest.mark.parametrize("kind", PLAIN)
def test_a_module_backward_hook_fires_per_rank_with_its_gradient_rows(kind):
    """``register_full_backward_hook`` recording (rank, grad_output): one call per rank
    (backward reaches them last rank first), rank k's gradient the rows of its shard of one
    device's gradient (the loss of the global batch); ``wb.simulated_rank()`` inside it
    names the rank.  Over DistTensors torch's module backward hooks raise (habits18)."""
    ref, wr = mk(), Wrapped(kind)
    ref.eval()
    wr.w.eval()
    x, y = batches(1)[0]
    want, got = [], []
    ref[2].register_full_backward_hook(lambda m, gi, go: want.append(go[0].detach()))
    wr.m[2].register_full_backward_hook(
        lambda m, gi, go: got.append((wb.simulated_rank(), go[0].detach())))
    ((ref(x) - y) ** 2).mean().backward()
    glob = []
    h = nn.modules.module.register_module_full_backward_hook(
        lambda m, gi, go: glob.append(wb.simulated_rank()) if m is wr.m[2] else None)
    try:
        dp_step(wr, x, y)
    finally:
        h.remove()
    assert sorted(glob) == list(range(N))          # a global one too
    assert len(want) == 1 and sorted(r for r, _ in got) == list(range(N))
    rows = len(x) // N
    for k, g in got:
        close(g, want[0][k * rows:(k + 1) * rows])
    assert wb.simulated_rank() is None


class _Tapped(nn.Module):
    """habits15's MLP with a user's gradient tap on its hidden activation."""

    def __init__(self, seen):
        super().__init__()
        self.net, self.seen = mk(), seen

    def forward(self, x):
        h = self.net[1](self.net[0](x))
        if h.requires_grad:
            h.register_hook(lambda g: self.seen.append(g.detach()))
        return self.net[3](self.net[2](h))


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_a_tensor_hook_inside_forward_fires_per_rank_with_its_rows(kind):
    """``h.register_hook(fn)`` on an activation inside ``forward``: registered once per
    rank's forward, so called once per rank, each with its shard's rows of one device's
    gradient."""
    want, got = [], []
    ref, m = _Tapped(want), _Tapped(got)
    ref.eval()
    m.eval()
    mesh = wb.Mesh.grid(N, ["dp"])
    w = wb.DistributedDataParallel(m, mesh) if kind == "ddp" else \
        wb.FullyShardedDataParallel(m, mesh)
    x, y = batches(1)[0]
    ((ref(x) - y) ** 2).mean().backward()
    out = w(wb.shard_tensor(x, mesh, [wb.Shard(0)]))
    ((out - wb.shard_tensor(y, mesh, [wb.Shard(0)])) ** 2).mean().backward()
    assert len(want) == 1 and len(got) == N
    rows = len(x) // N
    shards = [want[0][k * rows:(k + 1) * rows] for k in range(N)]
    for g in got:               # each call is one rank's rows (tensor hooks carry no rank)
        assert sum(torch.allclose(g, s, atol=1e-6) for s in shards) == 1
    close(torch.stack(got).sum(0), torch.stack(shards).sum(0))


@pytest.mark.parametrize("kind", PLAIN)
def test_a_hook_on_the_wrapper_and_a_global_hook(kind):
    """A forward hook on the wrapper fires once with the global output (a DistTensor, one
    device's values); a global ``register_module_forward_hook`` fires once for the wrapper
    and once per rank for each submodule (torch.nn.DataParallel's count).  ``fully_shard``
    changes the module in place (FSDP2): the wrapper is the module, its hooks per rank."""
    ref, wr = mk(), Wrapped(kind)
    ref.eval()
    wr.w.eval()
    x = batches(1)[0][0]
    outs, calls = [], []
    wr.w.register_forward_hook(lambda mod, a, o: outs.append(o))
    h = nn.modules.module.register_module_forward_hook(
        lambda mod, a, o: calls.append((mod, wb.simulated_rank())))
    try:
        wr.w(sharded(wr, x))
    finally:
        h.remove()
    assert [r for mod, r in calls if mod is wr.m[0]] == list(range(N))
    if kind == "fully_shard":       # the wrapper is the module itself (FSDP2): its hooks
        assert [r for mod, r in calls if mod is wr.w] == list(range(N))     # per rank
        rows = len(x) // N
        for k in range(N):
            close(outs[k], ref(x)[k * rows:(k + 1) * rows])
        return
    assert len(outs) == 1 and isinstance(outs[0], wb.DistTensor)
    close(outs[0].full(), ref(x))
    assert [r for mod, r in calls if mod is wr.w] == [None]


class _Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = mk()

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(lambda t: self.net[1](self.net[0](t)), x,
                                              use_reentrant=False)
        return self.net[2](h)


def test_a_hook_in_a_checkpoint_recompute_names_its_rank():
    """Activation checkpointing reruns a module's forward in backward, its hooks with it
    (torch's too): on DDP's simulated ranks each rank's recompute names its rank (before:
    None), and the gradients are one device's."""
    ref, m = _Checkpointed(), _Checkpointed()
    seen_ref, seen = [], []
    ref.net[0].register_forward_hook(lambda mod, a, o: seen_ref.append(wb.simulated_rank()))
    m.net[0].register_forward_hook(lambda mod, a, o: seen.append(wb.simulated_rank()))
    mesh = wb.Mesh.grid(N, ["dp"])
    ddp = wb.DistributedDataParallel(m, mesh)
    x, y = batches(1)[0]
    ((ref(x) - y) ** 2).mean().backward()
    out = ddp(wb.shard_tensor(x, mesh, [wb.Shard(0)]))
    ((out - wb.shard_tensor(y, mesh, [wb.Shard(0)])) ** 2).mean().backward()
    assert seen_ref == [None, None]
    assert seen[:N] == list(range(N)) and sorted(seen[N:]) == list(range(N))
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        close(p.grad, q.grad)


# ---- 2. in-place init after wrapping -----------------------------------------------------
INDEX_INITS = {"eye_": nn.init.eye_, "orthogonal_": nn.init.orthogonal_,
               "sparse_": lambda t: nn.init.sparse_(t, 0.5)}


@pytest.mark.parametrize("kind", PLAIN + ["fsdp_tp", "fully_shard_tp", "zero3_tp"])
@pytest.mark.parametrize("name", list(INDEX_INITS))
def test_index_and_identity_inits_after_wrapping_raise_naming_the_fix(kind, name):
    """``nn.init.eye_`` / ``orthogonal_`` / ``sparse_`` of a wrapped parameter held as
    rows or flat chunks: the in-place-init refusal naming the fix, before any draw (the
    generator untouched) or write.  Before: torch's errors from the storage's shape."""
    wr = Wrapped(kind)
    p = next(q for q in wr.params() if q.dim() == 2 or len(getattr(q, "_wb_shape", ())) == 2)
    before = [plain(q).detach().clone() for q in wr.m.state_dict().values()]
    rng = torch.get_rng_state()
    with pytest.raises(RuntimeError, match=rf"in-place init of a parameter after wrapping.*"
                                           rf"nn\.init\.{name}.*Initialize the module before"):
        with torch.no_grad():
            INDEX_INITS[name](p)
    assert torch.equal(torch.get_rng_state(), rng)
    after = [plain(q).detach() for q in wr.m.state_dict().values()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("kw", [{}, {"std": 1.0, "a": -1.0, "b": 1.0},
                                {"std": 1.0, "a": -0.1, "b": 0.1}], ids=["std1", "wide", "narrow"])
@pytest.mark.parametrize("seed", [0, 1])
def test_trunc_normal_of_ddp_over_tp_parameters_is_one_devices_draw(kw, seed):
    """``nn.init.trunc_normal_`` of ``ddp.parameters()`` over tensor parallelism (replica
    storages), seeded: one device's values, its generator advanced as far, the replicas
    equal (the forward runs), and a step one device's.  Before: a rejected element's redraw
    drew in the storage's shape (0.weight 1.23 off one device's with std=1)."""
    ref, wr, ro, opt = sgd_pair("ddp_tp")
    torch.manual_seed(seed)
    with torch.no_grad():
        for q in ref.parameters():
            nn.init.trunc_normal_(q, **kw)
    want_rng = torch.get_rng_state()
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in wr.params():
            nn.init.trunc_normal_(p, **kw)
    assert torch.equal(torch.get_rng_state(), want_rng)
    same_before_and_after_a_step(wr, opt, ref, ro)


@pytest.mark.parametrize("kind", KINDS)
def test_model_apply_init_after_wrapping_is_one_devices_or_raises(kind):
    """``model.apply(init_fn)`` on the wrapper (``normal_(0, 0.02)`` weights, zero biases,
    GPT-2's init) after wrapping, seeded: one device's values and step; FSDP / Zero3 over
    DistTensors refuse the write into the module's template, naming load_state_dict."""
    ref, wr, ro, opt = sgd_pair(kind)

    def init_fn(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, 0.02)
            nn.init.zeros_(m.bias)
    torch.manual_seed(3)
    ref.apply(init_fn)
    torch.manual_seed(3)
    if kind in ("fsdp_tp", "zero3_tp"):
        with pytest.raises(RuntimeError, match=r"template.*load_state_dict"):
            wr.w.apply(init_fn)
        return
    wr.w.apply(init_fn)
    same_before_and_after_a_step(wr, opt, ref, ro)


# ---- 3. load_state_dict(strict=False), weight / spectral norm ------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_load_state_dict_strict_false_is_torchs(kind):
    """``load_state_dict(sd, strict=False)`` with one key dropped and one added: torch's
    missing / unexpected keys (under the wrapper's own names: ``module.`` for DDP), the
    other values loaded, the dropped one left, as one device's."""
    ref, wr = mk(), Wrapped(kind)
    other = mk(seed=5).state_dict()
    sd = {k: plain(v) for k, v in wr.w.state_dict().items()}
    pre = "module." if kind in ("ddp", "zero", "ddp_tp") else ""
    assert list(sd) == [pre + k for k in other]
    load = {pre + k: v.clone() for k, v in other.items() if k != "0.weight"}
    load["extra.weight"] = torch.zeros(2)
    res = wr.w.load_state_dict(load, strict=False)
    want = ref.load_state_dict({k[len(pre):] if k.startswith(pre) else k: v
                                for k, v in load.items()}, strict=False)
    assert res.missing_keys == [pre + k for k in want.missing_keys] == [pre + "0.weight"]
    assert res.unexpected_keys == want.unexpected_keys == ["extra.weight"]
    got = full_state(wr.m.state_dict())
    for k, v in ref.state_dict().items():
        close(got[k], v)


NORMS = {"weight_norm": lambda m: torch.nn.utils.parametrizations.weight_norm(m[0]),
         "spectral_norm": lambda m: torch.nn.utils.parametrizations.spectral_norm(m[2]),
         "old_spectral_norm": lambda m: torch.nn.utils.spectral_norm(m[2])}


@pytest.mark.parametrize("kind", PLAIN)
@pytest.mark.parametrize("norm", list(NORMS))
def test_weight_and_spectral_norm_before_wrapping_train_as_one_device(kind, norm):
    """``parametrizations.weight_norm`` / ``spectral_norm`` and the hook-based
    ``nn.utils.spectral_norm`` (a forward pre-hook: it runs on each rank, as on each
    process), applied before wrapping: two SGD steps in train mode (the power iteration
    runs) and an eval forward are one device's (a guard: it passed before)."""
    ref, m = mk(), mk()
    torch.manual_seed(11)
    NORMS[norm](ref)
    torch.manual_seed(11)
    NORMS[norm](m)
    ref[3].p = m[3].p = 0.0             # the power iteration runs in train mode; no dropout
    wr = Wrapped(kind, m)
    ro, opt = torch.optim.SGD(ref.parameters(), lr=0.5), wr.optimizer(cls=torch.optim.SGD,
                                                                      lr=0.5)
    for x, y in batches(2):
        train_step(wr, opt, ref, ro, x, y)
    ref.eval()
    wr.w.eval()
    x = batches(3)[2][0]
    with torch.no_grad():
        close(wr.out(x), ref(x))


def test_deepcopy_of_a_module_under_old_weight_norm_is_torchs_refusal():
    """``copy.deepcopy`` of a module under the hook-based ``nn.utils.weight_norm``: torch
    itself refuses (its weight is a non-leaf), wrapped or not; the fix is the
    parametrization, which copies."""
    m = mk()
    torch.nn.utils.weight_norm(m[0])
    with pytest.raises(RuntimeError, match="deepcopy"):
        copy.deepcopy(m)
    m = mk()
    torch.nn.utils.parametrizations.weight_norm(m[0])
    copy.deepcopy(m)


# ---- 4. weight tying before and after wrapping ---------------------------------------------
def mk_tied(tie=True, seed=0):
    """4 -> 4 -> 4 with the second layer's weight the first's (``head.weight =
    emb.weight``'s shape of habit); both Colwise over tensor parallelism (one layout)."""
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4), nn.Dropout(0.5))
    if tie:
        m[2].weight = m[0].weight
    return m


def batches4(n):
    return [(torch.cat([x, x[:, :1]], 1), torch.cat([y, y[:, :1]], 1)) for x, y in batches(n)]


def tied_steps(wr, ref, tie_after=False):
    ref.eval()
    wr.w.eval()
    ro, opt = torch.optim.SGD(ref.parameters(), lr=0.5), wr.optimizer(cls=torch.optim.SGD,
                                                                      lr=0.5)
    if tie_after:               # after the optimizers too: torch's optimizer keeps the old one
        ref[2].weight = ref[0].weight
        wr.m[2].weight = wr.m[0].weight
    for x, y in batches4(2):
        train_step(wr, opt, ref, ro, x, y)
    x = batches4(3)[2][0]
    with torch.no_grad():
        close(wr.out(x), ref(x))


@pytest.fixture
def colwise_both(monkeypatch):
    from . import test_habits15
    monkeypatch.setattr(test_habits15, "TP_PLAN", {"0": wb.ColwiseParallel(),
                                                   "2": wb.ColwiseParallel()})


@pytest.mark.parametrize("kind", KINDS)
def test_a_tie_before_wrapping_trains_as_one_device_or_raises(kind, colwise_both):
    """``m[2].weight = m[0].weight`` before wrapping: two SGD steps as one device's (the
    tied weight one parameter, its gradient both uses'), on every kind but fully_shard
    applied to the first block alone: that call shards the weight for the block's uses
    only, and the root's call raised nothing, sharded the plain one again and trained the
    two apart (0.0685 off one device's, silently); now the root's call raises naming the
    fix, the module as it was."""
    ref, m = mk_tied(), mk_tied()
    if kind == "fully_shard":
        mesh = wb.Mesh.grid(N, ["dp"])
        wb.fully_shard(m[0], mesh=mesh)
        with pytest.raises(ValueError, match=r"'2\.weight' is tied to a parameter of '0'.*"
                                             r"do not call fully_shard on '0'"):
            wb.fully_shard(m, mesh=mesh)
        assert not isinstance(m, wb.FSDPModule) and type(m[2].weight) is nn.Parameter
        return
    tied_steps(Wrapped(kind, m), ref)


def test_a_tie_under_one_fully_shard_call_trains_as_one_device():
    """The fix: fully_shard on the module that holds both uses (the root) alone."""
    ref, m = mk_tied(), mk_tied()
    wb.fully_shard(m, mesh=wb.Mesh.grid(N, ["dp"]))

    class _Root:
        kind, w = "fully_shard", m

        def __init__(self):
            self.m = m

        def optimizer(self, cls, **kw):
            return cls(m.parameters(), **kw)

        def out(self, x):
            return plain(m(x))

        def backward(self, x, y):
            ((self.out(x) - y) ** 2).mean().backward()
    tied_steps(_Root(), ref)


@pytest.mark.parametrize("kind", KINDS)
def test_a_tie_after_wrapping_raises_naming_the_fix_or_is_one_devices(kind, colwise_both):
    """The tie made after wrapping (and after building the optimizer): the wrappers that
    replace or hook the module's parameters refuse the next forward naming the fix; DDP
    over tensor parallelism now does too (before: torch's reducer error one step later,
    naming find_unused_parameters).  ZeRO-1/2 over DistTensors (the module's own
    parameters) is one device's: torch's optimizer keeps stepping the untied old one."""
    ref, m = mk_tied(tie=False), mk_tied(tie=False)
    wr = Wrapped(kind, m)
    if kind in ("zero_tp", "zero2_tp"):
        tied_steps(wr, ref, tie_after=True)
        return
    with pytest.raises(RuntimeError, match=r"'2\.weight' was assigned after wrapping.*"
                                           r"weight tying"):
        tied_steps(wr, ref, tie_after=True)


# ---- 5. names ----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_named_parameters_and_modules_are_the_modules_with_torchs_prefix(kind):
    """``named_parameters()`` / ``named_modules()`` / ``state_dict()`` keys: the plain
    module's names, with ``module.`` where torch's DDP puts it (its module is a child);
    fully_shard / FSDP2 keeps the module's own names, and so does our
    FullyShardedDataParallel.  (torch 2.13's FSDP1, measured on one gloo process with
    ``device_id=cpu``, ``use_orig_params=True``: named_modules ``['',
    '_fsdp_wrapped_module', '_fsdp_wrapped_module.0', ...]``, named_parameters
    ``'_fsdp_wrapped_module.0.weight'`` (the prefix stripped only inside
    ``summon_full_params``), state_dict ``'0.weight'``; by default its parameters are one
    ``'_fsdp_wrapped_module._flat_param'``.  Ours holds no nested wrapper module and keeps
    the plain names everywhere (habits12).)  A guard: it passed before."""
    ref, wr = mk(), Wrapped(kind)
    pre = "module." if kind in ("ddp", "zero", "ddp_tp") else ""
    want = [pre + n for n, _ in ref.named_parameters()]
    assert [n for n, _ in wr.w.named_parameters()] == want
    assert list(wr.w.state_dict()) == [pre + k for k in ref.state_dict()]
    mods = [n for n, _ in wr.w.named_modules()]
    assert mods == [""] + ([pre.rstrip(".")] if pre else []) + \
        [pre + n for n, _ in ref.named_modules() if n]
