"""Probe: a user's ordinary PyTorch training idioms on every wrapper, each held to one device.

Each idiom is written once, as a user writes it, against a small context (``ctx.w`` the
model they call, ``ctx.m`` their module, ``ctx.params()`` what their optimizer takes,
``ctx.opt(cls, ...)`` their optimizer, ``ctx.loss(x, y)``); it runs on one device (a plain
``nn.Module``) and on each wrapper, and what it records (losses, gradients, learning rates,
optimizer state, the trained weights) is compared.  Each (idiom, wrapper) is counted as

    equal   every record within 1e-5 of one device's (``bitwise`` says how many exactly),
    raised  the wrapper raised (R: its own refusal, printed with -v: judge it names the
            fix; r: torch's error, no wrapper frame in the traceback),
    wrong   a record differs, or the wrapper went on where one device's run did something
            the wrapper's did not (a silent no-op).

Wrappers (simulated ranks): ``tp`` (parallelize_module on 2 tp ranks, the optimizer over
its DistTensors), habits15's sweep: DDP, FSDP, fully_shard, DDP + ZeroRedundancyOptimizer on
4 dp ranks, and over tensor parallelism on dp 2 x tp 2 DDP, FSDP, fully_shard, ZeRO-1 and
ZeRO-2 (``ZeroRedundancyOptimizer(partition="chunks")``) and Zero3.

    PYTHONPATH=$PWD python benchmarks/habits_probe.py [-v] [--kinds a,b] [--idioms a,b]

Measured (habits13b, 32 idioms x 11 wrappers = 352): before its fixes 267 equal (107
bitwise), 52 raised (6 by torch), 33 wrong; after 308 equal (111 bitwise), 44 raised (6 by
torch), 0 wrong.  The 33 wrong: ZeRO-1/2 / Zero3 over tensor parallelism's optimizer
``state_dict()`` in the chunks' storage shape (24), ``opt.state[p]`` reads of the storage
(7), ZeRO-1/2's ``zero_grad(set_to_none=False)`` leaving None (2).  The 8 raises gone:
Zero3's SGD state dict that did not deepcopy (3 lr-scheduler resumes), ZeRO-1/2's
``step()`` after ``zero_grad()`` (2), a one-device checkpoint's optimizer states refused by
ZeRO-1/2 / Zero3 (3).  Of the 44 raises now 38 are the wrappers' refusals, each naming the
call and the fix (``R``); 6 are torch's own (``r``, as before: ``vector_to_parameters`` of
a DistTensor vector, "expected torch.Tensor"; ZeRO's ``opt.state[p]``, a KeyError, as
torch's ZeroRedundancyOptimizer holds only the local partition's states).  BatchNorm is
held to one device's global-batch statistics: the simulated DDP gives them (FSDP refuses,
naming eval / SyncBatchNorm).
"""
import argparse
import contextlib
import copy
import io
import math
import sys
import traceback
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import workbench as wb
from workbench.parallel.strategies.zero3 import Zero3

warnings.filterwarnings("ignore")

PLAIN = ["ddp", "fsdp", "fully_shard", "zero"]
OVER_TP = ["ddp_tp", "fsdp_tp", "fully_shard_tp", "zero_tp", "zero2_tp", "zero3_tp"]
KINDS = ["tp"] + PLAIN + OVER_TP
TP_PLAN = {"0": wb.ColwiseParallel(), "2": wb.RowwiseParallel()}


# ---- models (Linear(3, 6) at "0", Linear(6, 3) at "2": the tensor-parallel plan's) ---------
def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 6), nn.GELU(), nn.Linear(6, 3))


def dropout_mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 6), nn.Dropout(0.5), nn.Linear(6, 3))


def bn_mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 6), nn.BatchNorm1d(6), nn.Linear(6, 3))


class Scale(nn.Module):
    """A persistent buffer read in the forward, a non-persistent one it counts in."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.tensor([1.0, 2.0, 0.5]))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long), persistent=False)

    def forward(self, x):
        self.calls += 1
        return x * self.scale


def buffer_mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 6), nn.GELU(), nn.Linear(6, 3), Scale())


class Checkpointed(nn.Module):
    """``torch.utils.checkpoint`` around a block with parameters."""

    def __init__(self, block, reentrant=False):
        super().__init__()
        self.block, self.reentrant = block, reentrant

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        return checkpoint(self.block, x, use_reentrant=self.reentrant)


def ckpt_mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 6), nn.GELU(), nn.Linear(6, 3),
                         Checkpointed(nn.Sequential(nn.Linear(3, 3), nn.Tanh())))


class TiedLM(nn.Module):
    """An embedding and an output head sharing one weight (``lm_head.weight = emb.weight``)."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(10, 3)
        self.body = nn.Sequential(nn.Linear(3, 6), nn.GELU(), nn.Linear(6, 3))
        self.lm_head = nn.Linear(3, 10, bias=False)
        self.lm_head.weight = self.emb.weight

    def forward(self, tok):
        return self.lm_head(self.body(self.emb(tok)))

    def __getitem__(self, i):           # fully_shard's inner unit: the body's first Linear
        return self.body[i]


def batches(n=3, seed=1, d=3):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, d, generator=g), torch.randn(8, 3, generator=g)) for _ in range(n)]


def tokens(n=3):
    g = torch.Generator().manual_seed(2)
    return [(torch.randint(0, 10, (8,), generator=g), torch.randint(0, 10, (8,), generator=g))
            for _ in range(n)]


# ---- one device, and the wrappers ------------------------------------------------------------
def full(t):
    """A wrapped tensor's one-device value (a plain copy)."""
    if t is None:
        return None
    if isinstance(t, wb.DistTensor):
        return t.full().detach().clone()
    if type(t) is not torch.Tensor and not isinstance(t, nn.Parameter) and \
            hasattr(t, "full_tensor"):
        return t.full_tensor().detach().clone()
    if isinstance(t, torch.Tensor):
        return t.detach().clone()
    return t


class OneDevice:
    kind = "one"

    def __init__(self, make):
        self.make = make
        self.m = self.w = make()

    def params(self):
        return list(self.m.parameters())

    def opt(self, cls=torch.optim.AdamW, params=None, **kw):
        params = self.params() if params is None else params
        return cls(params, **{"lr": 1e-2, **kw})

    def inp(self, x):
        return x

    def out(self, x):
        return self.w(x)

    def no_sync(self):
        return contextlib.nullcontext()

    def fresh(self, seed):
        return type(self)(lambda: self.make(seed))


class Wrapped(OneDevice):
    """One composed wrapper as a user holds it (tests/test_habits15.py's, and ``tp``)."""

    def __init__(self, kind, make, plan=None):
        self.kind, self.make = kind, make
        self.m = m = make()
        plan = TP_PLAN if plan is None else plan
        if kind == "tp":
            self.mesh = mesh = wb.Mesh.grid(2, ["tp"])
            wb.parallelize_module(m, mesh, plan)
            wb.parallelize(m, mesh)
        elif kind in OVER_TP:
            self.mesh = mesh = wb.Mesh.grid((2, 2), ["dp", "tp"])
            wb.parallelize_module(m, mesh, plan)
            wb.parallelize(m, mesh)             # the rest replicated DistTensors
        else:
            self.mesh = mesh = wb.Mesh.grid(4, ["dp"])
        self.plan = plan
        self.w = {
            "tp": lambda: m,
            "ddp": lambda: wb.DistributedDataParallel(m, mesh),
            "zero": lambda: wb.DistributedDataParallel(m, mesh),
            "fsdp": lambda: wb.FullyShardedDataParallel(m, mesh),
            "fully_shard": lambda: (wb.fully_shard(m[0], mesh=mesh),
                                    wb.fully_shard(m, mesh=mesh))[1],
            "ddp_tp": lambda: wb.DistributedDataParallel(m, mesh, dim="dp"),
            "fsdp_tp": lambda: wb.FullyShardedDataParallel(m, mesh, "dp"),
            "fully_shard_tp": lambda: wb.fully_shard(m, mesh=mesh["dp"]),
            "zero_tp": lambda: m, "zero2_tp": lambda: m,
            "zero3_tp": lambda: Zero3(m, mesh, "dp"),
        }[kind]()

    def params(self):
        if self.kind in ("tp", "zero_tp", "zero2_tp"):
            return [p for _, p in wb.dist_parameters(self.m)]
        return list(self.w.parameters())

    def opt(self, cls=torch.optim.AdamW, params=None, **kw):
        params = self.params() if params is None else params
        kw = {"lr": 1e-2, **kw}
        if self.kind == "zero":
            return wb.ZeroRedundancyOptimizer(params, cls, self.mesh, **kw)
        if self.kind in ("zero_tp", "zero2_tp"):
            return wb.ZeroRedundancyOptimizer(params, cls, self.mesh, "dp", partition="chunks",
                                              overlap_comm=self.kind == "zero2_tp", **kw)
        return cls(params, **kw)

    def inp(self, x):
        if self.kind == "tp":
            return wb.shard_tensor(x, self.mesh, [wb.Replicate()])
        if self.kind in OVER_TP:
            return wb.shard_tensor(x, self.mesh, [wb.Shard(0), wb.Replicate()])
        return x

    def out(self, x):
        o = self.w(self.inp(x))
        return o.full() if isinstance(o, wb.DistTensor) else o

    def no_sync(self):
        w = self.w
        if hasattr(w, "set_requires_gradient_sync"):
            @contextlib.contextmanager
            def off():
                w.set_requires_gradient_sync(False)
                try:
                    yield
                finally:
                    w.set_requires_gradient_sync(True)
            return off()
        if hasattr(w, "no_sync"):
            return w.no_sync()
        return contextlib.nullcontext()

    def fresh(self, seed):
        return type(self)(self.kind, lambda: self.make(seed), self.plan)


def mse(ctx, x, y):
    return ((ctx.out(x) - y) ** 2).mean()


# ---- records ------------------------------------------------------------------------------------
class Rec(list):
    def add(self, label, v):
        if isinstance(v, (list, tuple)):
            for i, e in enumerate(v):
                self.add(f"{label}[{i}]", e)
        elif isinstance(v, dict):
            for k, e in v.items():
                self.add(f"{label}.{k}", e)
        else:
            self.append((label, full(v)))

    def grads(self, ctx, label="grad", unreadable=("zero2_tp",)):
        if ctx.kind in unreadable:      # ZeRO-2 reduce-scatters in backward (ZeRO-1 in
            return                      # unscale_ / clip): p.grad raises naming
        #                                 opt.grad_norm (habits18), read nothing
        self.add(label, [p.grad for p in ctx.params()])

    def weights(self, ctx, label="w"):
        self.add(label, [p for p in ctx.params()])

    def state(self, ctx, label="state"):
        sd = ctx.m.state_dict()
        self.add(label, {k.removeprefix("module."): v for k, v in sd.items()})


def opt_state(opt, params=None):
    """The optimizer's state as its ``state_dict()`` holds it (what a checkpoint saves)."""
    sd = opt.state_dict()
    return [{k: v for k, v in sorted(sd["state"][i].items())} for i in sorted(sd["state"])]


def opt_state_reads(opt, params):
    """The optimizer's per-parameter state read directly, ``opt.state[p]`` (a user logging
    Adam's moments): one device's values."""
    return [{k: v for k, v in sorted(opt.state[p].items())} if p in opt.state else {}
            for p in params]


def steps(ctx, opt, data, rec, loss=mse):
    for x, y in data:
        opt.zero_grad()
        ls = loss(ctx, x, y)
        ls.backward()
        rec.add("loss", ls)
        rec.grads(ctx)
        opt.step()
    rec.weights(ctx)


# ---- the idioms --------------------------------------------------------------------------------
IDIOMS = {}


TOL = {}


def idiom(name, make=mlp, eval_mode=True, tol=None):
    def reg(f):
        IDIOMS[name] = (f, make, eval_mode)
        if tol:
            TOL[name] = tol
        return f
    return reg


@idiom("add_param_group")
def _(ctx, rec):
    ps = ctx.params()
    opt = ctx.opt(torch.optim.SGD, ps[:2], lr=0.1, momentum=0.9)
    data = batches(3)
    steps(ctx, opt, data[:1], rec)
    opt.add_param_group({"params": ps[2:], "lr": 0.05})
    rec.add("groups", [len(g["params"]) for g in opt.param_groups])
    steps(ctx, opt, data[1:], rec)
    rec.add("mom", opt_state(opt))


def _sched(which):
    def run(ctx, rec):
        opt = ctx.opt(torch.optim.SGD, lr=0.1, momentum=0.9)
        S = torch.optim.lr_scheduler
        mk = {"StepLR": lambda o: S.StepLR(o, step_size=2, gamma=0.5),
              "OneCycleLR": lambda o: S.OneCycleLR(o, max_lr=0.2, total_steps=6),
              "LambdaLR": lambda o: S.LambdaLR(o, lambda s: 1.0 / (1 + s))}[which]
        sch = mk(opt)
        data = batches(4)
        for x, y in data[:2]:
            steps(ctx, opt, [(x, y)], rec)
            sch.step()
            rec.add("lr", [g["lr"] for g in opt.param_groups])
        sd = copy.deepcopy(sch.state_dict())
        osd = copy.deepcopy(opt.state_dict())
        opt2 = ctx.opt(torch.optim.SGD, lr=0.1, momentum=0.9)
        opt2.load_state_dict(osd)
        sch2 = mk(opt2)
        sch2.load_state_dict(sd)
        rec.add("sched_last_lr", sch2.get_last_lr())
        for x, y in data[2:]:
            steps(ctx, opt2, [(x, y)], rec)
            sch2.step()
            rec.add("lr", [g["lr"] for g in opt2.param_groups])
    return run


for _w in ("StepLR", "OneCycleLR", "LambdaLR"):
    idiom(f"lr_scheduler_{_w}")(_sched(_w))


@idiom("optimizer_state_dict_round_trip")
def _(ctx, rec):
    opt = ctx.opt(torch.optim.AdamW, weight_decay=0.1)
    data = batches(4)
    steps(ctx, opt, data[:2], rec)
    rec.add("opt_state", opt_state(opt, ctx.params()))
    sd = copy.deepcopy(opt.state_dict())
    opt2 = ctx.opt(torch.optim.AdamW, weight_decay=0.1)
    opt2.load_state_dict(sd)
    rec.add("opt2_state", opt_state(opt2, ctx.params()))
    steps(ctx, opt2, data[2:], rec)
    rec.add("opt2_state_after", opt_state(opt2, ctx.params()))


@idiom("torch_save_load_bytesio")
def _(ctx, rec):
    opt = ctx.opt(torch.optim.Adam)
    data = batches(4)
    steps(ctx, opt, data[:2], rec)
    buf = io.BytesIO()
    torch.save({"model": ctx.w.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    ck = torch.load(buf, weights_only=False)
    new = ctx.fresh(seed=7)
    new.w.eval()
    new.w.load_state_dict(ck["model"])
    opt2 = new.opt(torch.optim.Adam)
    opt2.load_state_dict(ck["opt"])
    rec.state(new, "loaded")
    steps(new, opt2, data[2:], rec)
    rec.add("opt2_state", opt_state(opt2, new.params()))


@idiom("freeze_submodule")
def _(ctx, rec):
    opt = ctx.opt(torch.optim.AdamW, weight_decay=0.1)
    data = batches(4)
    steps(ctx, opt, data[:1], rec)
    ctx.m[0].requires_grad_(False)
    rec.add("requires_grad", [p.requires_grad for p in ctx.params()])
    steps(ctx, opt, data[1:], rec)


@idiom("train_eval_dropout", make=dropout_mlp, eval_mode=False)
def _(ctx, rec):
    opt = ctx.opt(torch.optim.SGD, lr=0.1)
    data = batches(3)
    for i, (x, y) in enumerate(data):
        torch.manual_seed(100 + i)
        ctx.w.train()
        steps(ctx, opt, [(x, y)], rec)
        ctx.w.eval()
        with torch.no_grad():
            rec.add("eval_out", ctx.out(x))
    rec.add("training", [m.training for m in ctx.m.modules()])


@idiom("train_eval_batchnorm", make=bn_mlp, eval_mode=False)
def _(ctx, rec):
    """BatchNorm in training mode, held to one device's global-batch statistics (the
    simulated DDP's; FSDP refuses naming eval / SyncBatchNorm)."""
    opt = ctx.opt(torch.optim.SGD, lr=0.1)
    data = batches(3)
    for x, y in data:
        ctx.w.train()
        steps(ctx, opt, [(x, y)], rec)
        rec.add("running", [b for _, b in ctx.m.named_buffers()])
        ctx.w.eval()
        with torch.no_grad():
            rec.add("eval_out", ctx.out(x))


@idiom("grad_accumulation")
def _(ctx, rec):
    opt = ctx.opt(torch.optim.AdamW)
    data, k = batches(6), 3
    for s in range(2):
        opt.zero_grad()
        for i in range(k):
            x, y = data[s * k + i]
            (mse(ctx, x, y) / k).backward()
        rec.grads(ctx)
        opt.step()
    rec.weights(ctx)


@idiom("grad_accumulation_no_sync")
def _(ctx, rec):
    opt = ctx.opt(torch.optim.AdamW)
    data, k = batches(6), 3
    for s in range(2):
        opt.zero_grad()
        for i in range(k):
            x, y = data[s * k + i]
            cm = ctx.no_sync() if i < k - 1 else contextlib.nullcontext()
            with cm:
                (mse(ctx, x, y) / k).backward()
        rec.grads(ctx)
        opt.step()
    rec.weights(ctx)


@idiom("grad_scaler_fp16", tol=2e-3)       # float16 matmuls: rounding per split
def _(ctx, rec):
    opt = ctx.opt(torch.optim.SGD, lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1)
    data = batches(4)
    for i, (x, y) in enumerate(data):
        if i == 2:
            x = x.clone()
            x[0, 0] = float("inf")               # an overflow: the step is skipped
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = ctx.out(x)
        loss = ((out.float() - y) ** 2).mean()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        rec.grads(ctx, unreadable=("zero_tp", "zero2_tp"))
        scaler.step(opt)
        scaler.update()
        rec.add("scale", scaler.get_scale())
        rec.weights(ctx)


@idiom("zero_grad_set_to_none_false")
def _(ctx, rec):
    opt = ctx.opt(torch.optim.SGD, lr=0.1, momentum=0.9)
    for x, y in batches(3):
        opt.zero_grad(set_to_none=False)
        rec.add("zeroed", [p.grad for p in ctx.params()])
        mse(ctx, x, y).backward()
        rec.grads(ctx)
        opt.step()
    ctx.m.zero_grad(set_to_none=False)
    rec.add("module_zeroed", [p.grad for p in ctx.params()])
    rec.weights(ctx)


@idiom("weight_tying", make=TiedLM)
def _(ctx, rec):
    rec.add("n_params", len(ctx.params()))
    rec.add("tied", ctx.m.lm_head.weight is ctx.m.emb.weight)
    opt = ctx.opt(torch.optim.AdamW)

    def ce(c, x, y):
        return F.cross_entropy(c.out(x), y)
    steps(ctx, opt, tokens(3), rec, loss=ce)
    rec.state(ctx)


@idiom("register_buffer_named_buffers", make=buffer_mlp)
def _(ctx, rec):
    rec.add("names", sorted(n for n, _ in ctx.m.named_buffers()))
    opt = ctx.opt(torch.optim.SGD, lr=0.1)
    steps(ctx, opt, batches(2), rec)
    rec.add("buffers", {n: b for n, b in ctx.m.named_buffers()})
    rec.add("state_keys", sorted(k.removeprefix("module.") for k in ctx.w.state_dict()))
    with torch.no_grad():
        ctx.m[3].scale.mul_(2.0)                   # a user's write to a buffer
    steps(ctx, opt, batches(1, seed=3), rec)


@idiom("model_apply_init")
def _(ctx, rec):
    def init(mod):
        if isinstance(mod, nn.Linear):
            nn.init.constant_(mod.weight, 0.05)
            nn.init.zeros_(mod.bias)
    with torch.no_grad():
        ctx.w.apply(init)
    rec.weights(ctx, "init")
    steps(ctx, ctx.opt(torch.optim.SGD, lr=0.1), batches(2), rec)


@idiom("param_added_after_wrapping")
def _(ctx, rec):
    opt = ctx.opt(torch.optim.SGD, lr=0.1)
    data = batches(3)
    steps(ctx, opt, data[:1], rec)
    ps = ctx.params()
    torch.manual_seed(3)
    extra = nn.Linear(3, 3)
    ctx.m.append(extra)
    opt.add_param_group({"params": list(extra.parameters())})
    for x, y in data[1:]:
        opt.zero_grad()
        ls = mse(ctx, x, y)
        ls.backward()
        rec.add("loss", ls)
        rec.add("extra_grad", [extra.weight.grad, extra.bias.grad])
        opt.step()
    rec.add("w", ps)
    rec.add("extra", [extra.weight, extra.bias])


@idiom("parameters_to_vector")
def _(ctx, rec):
    from torch.nn.utils import parameters_to_vector, vector_to_parameters
    opt = ctx.opt(torch.optim.SGD, lr=0.1)
    steps(ctx, opt, batches(1), rec)
    v = parameters_to_vector(ctx.params())
    rec.add("vec", v)
    vector_to_parameters(v * 0.5 + 0.01, ctx.params())
    rec.weights(ctx, "halved")
    steps(ctx, opt, batches(2, seed=4), rec)


def _ema(ctx, rec, module):
    """An exponential moving average of ``module`` over three SGD steps (AveragedModel)."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
    ema = AveragedModel(module, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    opt = ctx.opt(torch.optim.SGD, lr=0.1)
    for x, y in batches(3):
        steps(ctx, opt, [(x, y)], rec)
        ema.update_parameters(module)
    rec.add("ema", list(ema.parameters()))
    return ema


@idiom("ema_averaged_model")
def _(ctx, rec):
    ema = _ema(ctx, rec, ctx.w)
    x = batches(1, seed=5)[0][0]
    with torch.no_grad():
        o = ema(ctx.inp(x))
    rec.add("ema_out", o.full() if isinstance(o, wb.DistTensor) else o)


@idiom("ema_of_the_module")
def _(ctx, rec):
    """``AveragedModel(model.module)`` (torch DDP's advice: average the module)."""
    _ema(ctx, rec, ctx.m)


@idiom("resume_a_one_device_checkpoint")
def _(ctx, rec):
    """A checkpoint saved on one device (model and Adam states, torch.save) resumed on
    the wrapper (a fresh one, other weights)."""
    one = OneDevice(ctx.make)
    one.m.eval()
    opt1 = one.opt(torch.optim.Adam)
    data = batches(4)
    steps(one, opt1, data[:2], Rec())
    buf = io.BytesIO()
    torch.save({"model": one.m.state_dict(), "opt": opt1.state_dict()}, buf)
    buf.seek(0)
    ck = torch.load(buf)
    new = ctx.fresh(seed=7)
    new.w.eval()
    (new.m if hasattr(new.w, "module") else new.w).load_state_dict(ck["model"])
    opt = new.opt(torch.optim.Adam)
    opt.load_state_dict(ck["opt"])
    steps(new, opt, data[2:], rec)
    rec.add("opt_state", opt_state(opt))


@idiom("manual_lr_change")
def _(ctx, rec):
    opt = ctx.opt(torch.optim.SGD, lr=0.1, momentum=0.9)
    data = batches(4)
    for i, (x, y) in enumerate(data):
        for g in opt.param_groups:
            g["lr"] = 0.1 * (0.5 ** i)
        steps(ctx, opt, [(x, y)], rec)


@idiom("reduce_lr_on_plateau")
def _(ctx, rec):
    opt = ctx.opt(torch.optim.SGD, lr=0.1)
    sch = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
    x, y = batches(1)[0]
    for i in range(4):
        opt.zero_grad()
        loss = mse(ctx, x, y * (1 + i))          # a loss that grows: the lr halves
        loss.backward()
        opt.step()
        sch.step(loss)
        rec.add("lr", [g["lr"] for g in opt.param_groups])
    rec.weights(ctx)


@idiom("checkpoint_inside", make=ckpt_mlp)
def _(ctx, rec):
    steps(ctx, ctx.opt(torch.optim.AdamW), batches(3), rec)


@idiom("zero_grad_after_backward_then_step")
def _(ctx, rec):
    opt = ctx.opt(torch.optim.AdamW, weight_decay=0.1)
    data = batches(3)
    steps(ctx, opt, data[:1], rec)
    mse(ctx, *data[1]).backward()
    opt.zero_grad()                         # the gradients are None: the step skips them
    opt.step()
    rec.weights(ctx, "after_noop")
    steps(ctx, opt, data[2:], rec)


def _optim(cls, **kw):
    def run(ctx, rec):
        opt = ctx.opt(cls, **kw)
        steps(ctx, opt, batches(3), rec)
        rec.add("opt_state", opt_state(opt, ctx.params()))
    return run


@idiom("optimizer_state_reads")
def _(ctx, rec):
    opt = ctx.opt(torch.optim.Adam)
    steps(ctx, opt, batches(2), rec)
    rec.add("state", opt_state_reads(opt, ctx.params()))
    rec.add("exp_avg_norms", [opt.state[p]["exp_avg"].norm() for p in ctx.params()])


for _n, _c, _kw in [("SGD_nesterov", torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True,
                                                           weight_decay=0.01)),
                    ("Adam_amsgrad", torch.optim.Adam, dict(amsgrad=True)),
                    ("AdamW_foreach_False", torch.optim.AdamW, dict(foreach=False)),
                    ("AdamW_fused_False", torch.optim.AdamW, dict(fused=False, foreach=True)),
                    ("Adagrad", torch.optim.Adagrad, dict(lr=0.1)),
                    ("RMSprop", torch.optim.RMSprop, dict(momentum=0.5, centered=True))]:
    idiom(f"optim_{_n}")(_optim(_c, **_kw))


# ---- compare ----------------------------------------------------------------------------------
def compare(want, got, tol=1e-5):
    """(ok, bitwise, first difference)."""
    if [k for k, _ in want] != [k for k, _ in got]:
        a, b = [k for k, _ in want], [k for k, _ in got]
        i = next((i for i, (p, q) in enumerate(zip(a, b)) if p != q), min(len(a), len(b)))
        return False, False, f"records differ at {i}: {a[i:i + 2]} vs {b[i:i + 2]}"
    bitwise = True
    for (k, a), (_, b) in zip(want, got):
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
                return False, False, f"{k}: {type(a).__name__} vs {type(b).__name__}"
            if a.shape != b.shape or a.dtype != b.dtype:
                return False, False, f"{k}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
            if a.is_floating_point():
                if not torch.allclose(a.double(), b.double(), rtol=tol, atol=tol / 10,
                                      equal_nan=True):
                    d = (a.double() - b.double()).abs().max()
                    return False, False, f"{k}: max diff {float(d):.3g}"
                bitwise &= torch.equal(a, b) or bool((a.isnan() == b.isnan()).all() and
                                                     torch.equal(a.nan_to_num(), b.nan_to_num()))
            elif not torch.equal(a, b):
                return False, False, f"{k}: {a.tolist()} vs {b.tolist()}"
        elif isinstance(a, float) and isinstance(b, float):
            if not math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9):
                return False, False, f"{k}: {a} vs {b}"
            bitwise &= a == b
        elif a != b:
            return False, False, f"{k}: {a!r} vs {b!r}"
    return True, bitwise, ""


def run_one(name, kind):
    """('equal' | 'raised' | 'wrong', bitwise, detail)."""
    f, make, eval_mode = IDIOMS[name]
    ref = OneDevice(make)
    want = Rec()
    if eval_mode:
        ref.m.eval()
    f(ref, want)
    try:
        ctx = Wrapped(kind, make, {"body.0": wb.ColwiseParallel(), "body.2": wb.RowwiseParallel()}
                      if make is TiedLM else None)
        if eval_mode:
            ctx.w.eval()
        got = Rec()
        f(ctx, got)
    except Exception as e:                                   # noqa: BLE001
        frames = traceback.extract_tb(e.__traceback__)
        tb = frames[-1]
        # a wrapper's own refusal (its message names the call and the fix), or torch's
        ours = any("/workbench/" in f.filename for f in frames)
        return "raised" if ours else "torch_raised", False, \
            f"{type(e).__name__}: {str(e)[:300]} [{tb.filename.split('/')[-1]}:{tb.lineno}]"
    if kind == "zero2_tp" or (kind == "zero_tp" and name == "grad_scaler_fp16"):
        want = Rec(r for r in want if not r[0].startswith("grad["))
    ok, bitwise, why = compare(want, got, TOL.get(name, 1e-5))
    return ("equal" if ok else "wrong"), bitwise, why


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("-v", action="store_true")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--idioms", default=",".join(IDIOMS))
    a = ap.parse_args(argv)
    kinds, names = a.kinds.split(","), a.idioms.split(",")
    total = {"equal": 0, "raised": 0, "torch_raised": 0, "wrong": 0}
    bitwise = 0
    for name in names:
        row = []
        for kind in kinds:
            res, bw, why = run_one(name, kind)
            total[res] += 1
            bitwise += bw
            row.append({"equal": "=" if bw else "~", "raised": "R", "torch_raised": "r",
                        "wrong": "X"}[res])
            if a.v and res != "equal":
                print(f"  {res:6s} {name} / {kind}: {why}")
        print(f"{name:36s} {' '.join(row)}", flush=True)
    print(f"kinds: {' '.join(kinds)}   (= bitwise, ~ within 1e-5 (float16: 2e-3), R the "
          "wrapper raised, r torch raised, X wrong)")
    print(f"habits probe: {total['equal']} equal ({bitwise} bitwise), "
          f"{total['raised'] + total['torch_raised']} raised ({total['torch_raised']} by torch), "
          f"{total['wrong']} wrong of {sum(total.values())}")


if __name__ == "__main__":
    main(sys.argv[1:])
