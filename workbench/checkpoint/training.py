"""The training state of a ``train`` run, saved and resumed on any layout.

    python -m workbench train --steps 3 --dp 2 --tp 2 --save ckpt      # steps 0-2, then save
    python -m workbench train --steps 5 --tp 2 --resume ckpt           # steps 3-4

What a run needs to go on as if it had not stopped (torchtitan's ``CheckpointManager``
keeps the same: model, optimizer, train state with the step, and the RNG):

* ``model``: the model's ``state_dict()`` (DistTensors in the layout trained on), loaded
  with ``model.load_state_dict`` after the checkpoint fills it (as
  ``torch.distributed.checkpoint.state_dict.set_state_dict`` does; ZeRO-3 cuts the values
  into its shards there);
* ``optim``: AdamW's ``exp_avg`` / ``exp_avg_sq`` / ``step`` keyed by the parameter's
  name (``get_optimizer_state_dict``'s FQN keys), each state a tensor of the parameter's
  global shape and layout, whatever the optimizer keeps: one copy per data-parallel
  replica (ZeRO 0), a flat chunk per dp rank (ZeRO 1-2, ZeRO-3: gathered here and cut
  again on load, :mod:`workbench.parallel.strategies.flat_shards`).  So the states load
  into any other layout as the parameters do;
* ``train``: the next step (the data position: batch ``step`` is drawn from
  ``(seed, step)``, :func:`workbench.models.data.get_batch`), the seed, the batch size,
  torch's RNG state (the dropout keys are drawn from it each step), and the optimizer's
  ``lr`` and ``weight_decay``.  A resume that gives other values raises, as Megatron-LM's
  ``OptimizerParamScheduler.load_state_dict`` asserts that the class value and the
  checkpoint's agree (``_check_and_set``, megatron/core/optimizer_param_scheduler.py):
  torch's ``optimizer.load_state_dict`` would silently keep the saved lr, a fresh
  optimizer silently the new one; a run that means to change them starts a new
  checkpoint.  Checkpoints saved before these keys existed resume unchecked.

Under torchrun (``--backend torch``) each process saves and loads its own pipeline
stage's DistTensors (another stage's parameters are plain, unused tensors there) and
its own shards; the checkpoint is the same, so a run saved on processes resumes on
simulated ranks and back.
"""
from __future__ import annotations

import torch

from ..parallel.dist_tensor import DistTensor
from ..parallel.module import dist_parameters
from . import format as F
from .reader import load
from .writer import save

__all__ = ["save_training", "resume_training", "optimizer_states"]

STATES = ("exp_avg", "exp_avg_sq")

# ModelConfig fields that change what the weights compute but not their shapes, so
# ``model_mismatch`` cannot see them: a checkpoint read into a model with other values
# serves (or resumes) another function of the same weights, silently.  The MoE ones are
# recorded only for a model with experts.
FORWARD_FIELDS = ("n_head", "norm_eps", "rope_theta", "tie_embeddings", "moe_topk",
                  "moe_gating", "moe_norm_topk")
# ... and those that change only the training steps (a resume must keep them too)
TRAIN_FIELDS = ("dropout", "dtype", "moe_capacity_factor", "moe_aux_loss_coef")


def config_record(cfg) -> dict:
    """The fields of ``cfg`` a checkpoint keeps (:data:`FORWARD_FIELDS`, :data:`TRAIN_FIELDS`)
    as plain data, in the metadata (``md.workbench["info"]["config"]``)."""
    return {k: getattr(cfg, k) for k in FORWARD_FIELDS + TRAIN_FIELDS
            if hasattr(cfg, k) and (getattr(cfg, "moe_experts", 0) or not k.startswith("moe_"))}


def config_mismatch(md, cfg, fields=FORWARD_FIELDS) -> str | None:
    """Why ``cfg`` is not the config the checkpoint (its metadata ``md``) was saved with,
    in one of ``fields``, or None (also for a checkpoint that recorded none)."""
    saved = ((getattr(md, "workbench", None) or {}).get("info") or {}).get("config") or {}
    for k in fields:
        if k in saved and hasattr(cfg, k) and getattr(cfg, k) != saved[k]:
            v = saved[k]
            flag = {"moe_topk": f"--moe-topk {v}", "moe_gating": f"--moe-gating {v}",
                    "moe_norm_topk": "--moe-no-norm-topk" if v is False
                    else "no --moe-no-norm-topk",
                    "moe_capacity_factor": f"--moe-capacity-factor {v}",
                    "moe_aux_loss_coef": f"--moe-aux-loss-coef {v}"}.get(k)
            how = f"give {flag}, or " if flag else ""
            return (f"the checkpoint was saved from a model with {k}={v!r}, this one has "
                    f"{k}={getattr(cfg, k)!r} (the weights' shapes are the same, what they "
                    f"compute is not): {how}build the model with {k}={v!r} "
                    f"(get_config(preset, {k}={v!r}))")
    return None


def _distributed(strategy) -> bool:
    return bool(getattr(strategy, "distributed", False))


def _model_state(strategy, model) -> dict:
    """The model's state dict; on torch.distributed only this process's DistTensors (a
    pipeline stage of another process stays a plain, unused tensor here)."""
    sd = model.state_dict()
    if not _distributed(strategy):
        return sd
    from ..sim_mesh import backends as _B
    me = _B.rank()
    return {k: v for k, v in sd.items() if isinstance(v, DistTensor) and me in v.mesh}


def _entries(strategy, model, optimizer):
    """[(fqn, param-layout template, inner optimizer, the leaf it steps, to_global,
    from_global)] for every parameter: how each optimizer holds a parameter's states."""
    out = []
    if not hasattr(strategy, "stage_layers"):          # one device: ops.AdamW over params
        for name, p in model.named_parameters():
            out.append((name, p, optimizer, p, lambda s: s, lambda g, leaf: g))
        return out
    names = {id(p): n for n, p in dist_parameters(model)}
    # this process's stages that have an optimizer (a middle stage of 0 layers has none:
    # counted, it took the next stage's optimizer, ZeRO-3 an IndexError on its modules)
    holds = getattr(strategy, "_stage_holds_params", lambda model, s: True)
    stages = [s for s in range(len(strategy.stage_layers))
              if strategy._own(strategy.meshes[s % strategy.pp]) and holds(model, s)]
    for s, opt in _stage_optimizers(stages, optimizer):
        if hasattr(opt, "entries"):                    # Zero3: the shards are the leaves
            mods = strategy.stages[s]["modules"]       # its module: a list of these
            for qname, (_, _, tmpl, shard) in zip(opt.names, opt.entries):
                i, rest = qname.split(".", 1)
                out.append((f"{mods[int(i)]}.{rest}", tmpl, opt.optimizer, shard,
                            _zero3_gather(opt, tmpl), _zero3_cut(opt)))
        elif opt.zero:                                 # ZeRO 1-2: flat chunks per dp rank
            inner = opt.optimizer
            for p, shard in zip(opt.params, inner.shards):
                out.append((names[id(p)], p, inner.optimizer, shard,
                            _chunks_gather(inner, p), _chunks_cut(inner)))
        else:                                          # ZeRO 0: one copy per replica
            for p in opt.params:
                out.append((names[id(p)], p, opt.optimizer, p._local,
                            _as_dist(p), lambda g, leaf: _replica_copies(g, leaf)))
    return out


def _stage_optimizers(stages, optimizer):
    """(stage, optimizer) for this process's stages: each stage's optimizer, and beside it
    the optimizer of its experts where expert parallelism gives them their own (on the
    expert mesh, reduced over "edp": ``recipes/hybrid.py``); what follows (DualPipe's
    twins) is not the stages'."""
    i = 0
    for s in stages:
        if i >= len(optimizer):
            return
        yield s, optimizer[i]
        i += 1
        if i < len(optimizer) and "edp" in getattr(getattr(optimizer[i], "mesh", None),
                                                   "dim_names", ()):
            yield s, optimizer[i]
            i += 1


def _as_dist(p):
    def f(s):
        return DistTensor(s, p.mesh, p.placements, p.shape, s.dtype)
    return f


def _replica_copies(g: DistTensor, leaf):
    return g._local.expand_as(leaf).clone()


def _gather_chunks(mesh, axis, tmpl, gather=None):
    """ZeRO 1-3 keep a flat chunk per dp rank: all-gathered over dp (not traced: not the
    step's traffic), unpadded, a DistTensor in ``tmpl``'s (the parameter's) layout.
    ``gather``: the all-gather to use (ZeRO 1-2 over dp x cp: its merged group's)."""
    from ..parallel.strategies.flat_shards import unflat
    from ..sim_mesh import collectives as C
    from ..sim_mesh.trace import suspend
    nd = mesh.ndim
    gather = gather or (lambda s: C.all_gather(s, mesh, axis, 0))

    def f(s):                                   # s: (lead, chunk)
        with suspend():
            full = gather(s.detach())           # (lead, dp one copy, n * c)
        loc = unflat(full, tuple(tmpl._local.shape[nd:]), nd).clone()
        return DistTensor(loc, mesh, tmpl.placements, tmpl.shape, s.dtype)
    return f


def _chunks_gather(inner, p):
    return _gather_chunks(inner.mesh, inner.axis, p,
                          lambda s: inner._all_gather(s, expanded=False))


def _chunks_cut(inner):
    def f(g: DistTensor, leaf):
        loc = g._local
        if not inner.distributed:               # every dp rank's copy, each takes its chunk
            lead = list(loc.shape)
            for a in inner.axes:                # (dp x cp: a copy on each of their ranks)
                lead[a] = inner.mesh.shape[a]
            loc = loc.expand(lead)
        return inner._my_chunk(loc)
    return f


def _zero3_gather(z, tmpl):
    return _gather_chunks(z.mesh, z.axis, tmpl, z.gather_compact)


def _zero3_cut(z):
    def f(g: DistTensor, leaf):
        return z.chunk_of(g._local)
    return f


def optimizer_states(strategy, model, optimizer) -> dict:
    """{fqn: {"exp_avg", "exp_avg_sq": the state in the parameter's global layout,
    "step": int}} for every parameter the optimizer has stepped."""
    out = {}
    for name, _, opt, leaf, to_global, _ in _entries(strategy, model, optimizer):
        st = opt.state.get(leaf)
        if not st:
            continue
        out[name] = {k: to_global(st[k].detach()) for k in STATES}
        out[name]["step"] = int(st["step"])
    return out


def _targets(strategy, model, optimizer, names) -> tuple[dict, list]:
    """The state dict ``load`` fills for the optimizer, and how to put each back."""
    tgt, back = {}, []
    for name, tmpl, opt, leaf, to_global, from_global in _entries(strategy, model, optimizer):
        if name not in names:
            continue
        zeros = to_global(torch.zeros_like(leaf.detach()))
        tgt[name] = {k: (zeros if k == STATES[0] else _copy(zeros)) for k in STATES}
        tgt[name]["step"] = 0
        back.append((name, opt, leaf, from_global))
    return tgt, back


def _copy(t):
    if isinstance(t, DistTensor):
        return DistTensor(t._local.clone(), t.mesh, t.placements, t.shape, t.dtype)
    return t.clone()


def save_training(path, strategy, model, optimizer, step: int, seed: int,
                  batch_size: int, lr: float | None = None,
                  weight_decay: float | None = None, cfg=None) -> None:
    """Save the state a run needs to continue at ``step`` (the next step to run);
    ``cfg``: the model's config, whose fields the weights' shapes do not show are kept in
    the metadata (:func:`config_record`) and checked on resume and on serving."""
    hyper = {k: float(v) for k, v in (("lr", lr), ("weight_decay", weight_decay))
             if v is not None}
    with torch.no_grad():
        state = {"model": _model_state(strategy, model),
                 "optim": optimizer_states(strategy, model, optimizer),
                 "train": {"step": step, "seed": seed, "batch_size": batch_size,
                           "rng": torch.get_rng_state(), **hyper}}
    save(path, state, _info=None if cfg is None else {"config": config_record(cfg)})


def resume_training(path, strategy, model, optimizer, seed: int, batch_size: int,
                    lr: float | None = None, weight_decay: float | None = None,
                    cfg=None) -> int:
    """Load a :func:`save_training` checkpoint into this run's model and optimizer (any
    layout); restores torch's RNG; returns the step to continue from.  ``lr`` and
    ``weight_decay``, when given, must be the saved run's (module docstring), and so
    must ``cfg``'s fields the checkpoint recorded (:func:`config_mismatch`)."""
    md = F.read_metadata(path)
    keys = md.state_dict_metadata
    train = {"step": 0, "seed": 0, "batch_size": 0, "rng": torch.get_rng_state()}
    hyper = {k: v for k, v in (("lr", lr), ("weight_decay", weight_decay))
             if v is not None and f"train.{k}" in keys}
    train.update({k: 0.0 for k in hyper})
    load(path, {"train": train})
    for k, v in (("seed", seed), ("batch_size", batch_size)):
        if train[k] != v:
            raise ValueError(f"--resume {path}: the run was saved with {k}={train[k]}, this "
                             f"one has {k}={v}; the batches after step {train['step']} would "
                             f"differ: give --{k.replace('_', '-')} {train[k]}")
    for k, v in hyper.items():
        if float(train[k]) != float(v):
            raise ValueError(f"--resume {path}: the run was saved with {k}={train[k]!r}, "
                             f"this one has {k}={v!r}; the optimizer would go on with another "
                             f"{k} than the checkpoint's steps were taken with: give "
                             f"{k}={train[k]!r}" + (f" (--lr {train[k]!r})" if k == "lr" else "")
                             + ", or start a new run (without resume) to change it")
    # "optim.<fqn>.exp_avg": the fqn itself holds dots
    names = {k[len("optim."):k.rfind(".")] for k in keys if k.startswith("optim.")}
    bad = model_mismatch(keys, {k: v.shape for k, v in
                                _model_state(strategy, model).items()},
                         every=not _distributed(strategy))
    # the shapes first (another model is named as such), then what they do not show
    if not bad and cfg is not None:
        bad = config_mismatch(md, cfg, FORWARD_FIELDS + TRAIN_FIELDS)
    if bad:
        raise ValueError(f"resume={path!r}: {bad}")
    _load_copy(path, strategy, model, optimizer, names)
    twin = getattr(strategy, "_twin", None)
    if twin is not None and getattr(strategy, "schedule_name", None) == "dualpipe":
        # DualPipe's copy 1 of every stage (recipes/dualpipe.py) holds the same weights and
        # states on the reversed stage meshes: read the checkpoint into it too (left at its
        # init, it ran half the micro-batches on the untrained model)
        twin_strategy, model1 = twin
        own1 = {id(p) for _, p in dist_parameters(model1)}
        twin_opts = [o for o in optimizer if not hasattr(o, "entries")
                     and all(id(p) in own1 for p in o.params)]
        _load_copy(path, twin_strategy, model1, twin_opts, names)
    for o in (optimizer if isinstance(optimizer, list) else []):
        if hasattr(o, "step_count"):
            o.step_count = train["step"]
    torch.set_rng_state(train["rng"])
    return train["step"]


def _load_copy(path, strategy, model, optimizer, names) -> None:
    """The checkpoint's model and optimizer states into ``model`` and ``optimizer`` (laid
    out by ``strategy``)."""
    opt_tgt, back = _targets(strategy, model, optimizer, names)
    sd = _model_state(strategy, model)
    load(path, {"model": sd, "optim": opt_tgt})
    with torch.no_grad():
        model.load_state_dict(sd, strict=not _distributed(strategy))
        for name, opt, leaf, from_global in back:
            st = opt_tgt[name]
            opt.state[leaf] = {"step": st["step"],
                               **{k: from_global(st[k], leaf).to(leaf.dtype).reshape(leaf.shape)
                                  for k in STATES}}


def check_cli(args, strategy) -> str | None:
    """``train --save / --resume``: what stops the run before it starts, as a message
    (None: nothing)."""
    save_dir, resume_dir = getattr(args, "save", None), getattr(args, "resume", None)
    if save_dir is not None:
        bad = save_path_problem(save_dir)
        if bad:                         # found after the last step, the run would be lost
            return f"--save {save_dir}: {bad}"
    if resume_dir is None:
        return None
    try:
        train = {"step": 0, "seed": 0, "batch_size": 0}
        md = F.read_metadata(resume_dir)
        keys = md.state_dict_metadata
        train.update({k: 0.0 for k in ("lr", "weight_decay") if f"train.{k}" in keys})
        load(resume_dir, {"train": train})
    except (F.CheckpointError, OSError) as e:
        return f"--resume {resume_dir}: {e}"
    lr = getattr(args, "lr", None)
    if "lr" in train and lr is not None and float(train["lr"]) != float(lr):
        return (f"--resume {resume_dir}: the run was saved with --lr {train['lr']!r}, this one "
                f"has {lr!r}; its steps were taken with the saved lr: give --lr "
                f"{train['lr']!r}, or start a new run (without --resume) to change it")
    wd = getattr(args, "weight_decay", None)
    if "weight_decay" in train and wd is not None and float(train["weight_decay"]) != float(wd):
        return (f"--resume {resume_dir}: the run was saved with --weight-decay "
                f"{train['weight_decay']!r}, this one has {wd!r}; its steps were taken with the "
                f"saved one: give --weight-decay {train['weight_decay']!r}, or start a new run "
                "(without --resume) to change it")
    for k in ("seed", "batch_size"):
        if train[k] != getattr(args, k):
            return (f"--resume {resume_dir}: the run was saved with --{k.replace('_', '-')} "
                    f"{train[k]}, this one has {getattr(args, k)}; the batches after step "
                    f"{train['step']} would differ: give --{k.replace('_', '-')} {train[k]}")
    bad = _cli_model_mismatch(args, md)
    if bad:
        return f"--resume {resume_dir}: {bad}"
    steps = getattr(args, "steps", None)
    if isinstance(steps, int) and steps < train["step"]:
        return (f"--resume {resume_dir}: the checkpoint has run {train['step']} steps already, "
                f"--steps {steps} is fewer; --steps is the total to reach: give --steps >= "
                f"{train['step']} (equal runs no step)")
    return None


def save_path_problem(path) -> str | None:
    """Why a checkpoint cannot be written at ``path`` (a folder made if missing), or None."""
    import os
    if os.path.exists(path) and not os.path.isdir(path):
        return "a file is there, and a checkpoint is a folder; give a folder's path"
    up = os.path.abspath(path)
    while not os.path.exists(up):
        up = os.path.dirname(up)
    if not os.path.isdir(up) or not os.access(up, os.W_OK | os.X_OK):
        return f"{up!r} is not a folder this process may write to; give another path"
    return None


def model_mismatch(keys, shapes: dict, every: bool = True) -> str | None:
    """Why a model whose state dict has ``shapes`` ({name: global shape}) cannot take the
    checkpoint's ``model.*`` entries (``keys``: its metadata), or None.  ``every``: the
    checkpoint's parameters must all be in ``shapes`` too (False under torch.distributed,
    where a process holds its own stages only)."""
    saved = {k[len("model."):]: md for k, md in keys.items() if k.startswith("model.")}
    for name, shape in shapes.items():
        md = saved.get(name)
        if md is None:
            return (f"this model's {name!r} is not in the checkpoint (it holds e.g. "
                    f"{sorted(saved)[:3]}): it was saved from another model; give the saved "
                    "run's --preset and --moe-* flags")
        size = tuple(getattr(md, "size", ()))
        if size != tuple(shape):
            return (f"{name!r} has shape {tuple(shape)} here and {size} in the checkpoint: it "
                    "was saved from another model; give the saved run's --preset and "
                    "--moe-* flags")
    extra = sorted(set(saved) - set(shapes)) if every else []
    if extra:
        return (f"the checkpoint holds {extra[0]!r}, which this model has not: it was saved "
                "from another model; give the saved run's --preset and --moe-* flags")
    return None


def _cli_model_mismatch(args, md) -> str | None:
    """The model the flags build (on the meta device: shapes only) against the checkpoint
    (its metadata ``md``): the weights' shapes first, then the config fields they do not
    show (:func:`config_mismatch`)."""
    from ..models.config import build_model, get_config
    from ..recipes.moe import moe_overrides
    cfg = get_config(getattr(args, "preset", "tiny"), **moe_overrides(args))
    with torch.device("meta"):
        model = build_model(cfg, seed=0)
    return model_mismatch(md.state_dict_metadata,
                          {k: v.shape for k, v in model.state_dict().items()}) or \
        config_mismatch(md, cfg, FORWARD_FIELDS + TRAIN_FIELDS)
