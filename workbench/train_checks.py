"""What no ``train`` run can take, refused before anything is built.

``python -m workbench train`` calls :func:`check_args` first; every refusal is a
ValueError whose message names the flag, its value and the fix, printed as
``error: ...`` with exit status 2 (:func:`workbench.train.main_train`).  The checks
take microseconds (the memory bound is a closed form), so a typo such as ``--dp
1000000000`` fails at once instead of building a billion-rank mesh.

Bounds and why:

* ``--seed``: 0 <= seed < 2**32.  torch's CPU generator (mt19937) keeps the low 32
  bits of a seed (``torch.manual_seed(2**32)`` draws what ``manual_seed(0)`` draws, and
  -1 what 2**32 - 1 does), so a larger seed would silently repeat a smaller one's
  initialisation.
* ``--dp``, ``--tp``, ``--pp``: every data-parallel rank takes at least one sequence of
  the global batch, tensor parallelism splits the heads, pipeline parallelism the
  layers; so dp <= batch size, tp <= heads, pp <= layers (the exact divisibility is
  checked by the recipe, ``Hybrid.check``, once the sizes are sane); and dp x tp x pp
  at most ``sim_mesh.mesh.MAX_RANKS`` ranks.  The ``Hybrid`` recipe runs the same
  checks (:func:`check_world` when built, :func:`check_sizes` in ``Hybrid.check``).
* ``--batch-size`` and ``--preset``: at least what the run must hold (parameters,
  gradients and AdamW's two moments, 4 copies; per token, each layer's input kept for
  the backward and the logits) against this machine's RAM: the simulator holds every
  rank in this process; under ``--backend torch`` a process holds at least 1/world.
* ``--device``: the device must exist here (CUDA present, torch_npu importable).
* ``--timeout``: (0, MAX_TIMEOUT_S] seconds, ``--backend torch`` only.
* a flag the run would not use is refused rather than ignored: ``--ep-chunks`` without
  ``--ep``, ``--schedule`` without ``--pp``, ``--save`` / ``--resume`` / ``--device`` with
  ``--dry-run``.
"""
from __future__ import annotations

import math
import os

__all__ = ["check_args", "check_seed", "check_device", "check_memory", "check_sizes",
           "check_world", "min_bytes", "SEED_LIMIT"]

SEED_LIMIT = 2 ** 32
"""Seeds are 0 .. 2**32 - 1: torch's CPU generator (mt19937) keeps 32 bits of a seed."""

# The parallelism flags and their defaults (one device, the simulator).
PARALLEL_FLAGS = (("dp", 1), ("tp", 1), ("pp", 1), ("sp", False), ("zero", 0),
                  ("schedule", "1f1b"), ("backend", "sim"))


def check_seed(seed, where: str = "--seed ") -> None:
    """``seed`` an int in [0, 2**32); ``where`` prefixes the message (flag or argument)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"{where}{seed!r}: give an int in [0, 2**32 - 1]; torch's CPU "
                         "generator keeps only the low 32 bits of a seed, so a larger or "
                         "negative one would repeat another seed's initialisation")


def check_args(args, lr_default: float) -> None:
    """Refuse flag values no run can take, before anything is built (``error:``, exit 2)."""
    dry = getattr(args, "dry_run", False)
    for flag, lo in (("steps", 0), ("batch_size", 1), ("dp", 1), ("tp", 1), ("pp", 1)):
        v = getattr(args, flag, lo)
        if v < lo:
            raise ValueError(f"--{flag.replace('_', '-')} {v}: must be >= {lo}")
    check_seed(getattr(args, "seed", 0))
    lr = getattr(args, "lr", lr_default)
    if not 0 < lr < math.inf:
        raise ValueError(f"--lr {lr}: must be a finite number > 0 (e.g. {lr_default})")
    wd = getattr(args, "weight_decay", 0.01)
    if not 0 <= wd < math.inf:
        raise ValueError(f"--weight-decay {wd}: must be a finite number >= 0 (e.g. 0.01)")
    from .models.config import get_config
    cfg = get_config(getattr(args, "preset", "tiny"))
    _check_sizes(args, cfg)
    _check_timeout(args)
    _check_unused(args)
    if dry:
        return                          # meta tensors on no device: nothing to allocate
    parallel = any(getattr(args, n, d) != d for n, d in PARALLEL_FLAGS)
    if parallel and getattr(args, "device", "cpu") != "cpu":
        raise ValueError(f"--device {args.device} with parallel flags: simulated ranks run on "
                         "the CPU, and under --backend torch each process uses its backend's "
                         "device; leave --device at cpu")
    check_device(getattr(args, "device", "cpu"))
    _check_memory(args, cfg)


def _check_unused(args) -> None:
    """A flag that this run would not use is refused, not ignored: the user meant it."""
    ep_chunks = getattr(args, "ep_chunks", 1)
    if ep_chunks != 1 and getattr(args, "ep", 1) == 1:
        raise ValueError(f"--ep-chunks {ep_chunks}: the all-to-all it splits runs with expert "
                         "parallelism only; add --ep 2 (and --moe-experts E) or leave it out")
    cp_comm = getattr(args, "cp_comm", "p2p")
    if cp_comm != "p2p" and getattr(args, "cp", 1) == 1:
        raise ValueError(f"--cp-comm {cp_comm} with --cp 1: it chooses how the context-"
                         "parallel ranks attend, and there are none; add --cp 2 or leave "
                         "--cp-comm out")
    schedule = getattr(args, "schedule", "1f1b")
    if schedule != "1f1b" and getattr(args, "pp", 1) == 1:
        raise ValueError(f"--schedule {schedule} with --pp 1: a schedule orders the pipeline "
                         "stages' micro-batches, and one stage has no pipeline; add --pp 2 "
                         "or leave --schedule out")
    if getattr(args, "dry_run", False):
        for flag in ("save", "resume"):
            if getattr(args, flag, None) is not None:
                raise ValueError(f"--{flag} {getattr(args, flag)} with --dry-run: the dry run "
                                 "trains nothing (meta tensors), so there is no state to "
                                 f"{'save' if flag == 'save' else 'resume from'}; leave out "
                                 f"--{flag} or --dry-run")
        device = getattr(args, "device", "cpu")
        if device != "cpu":
            raise ValueError(f"--device {device} with --dry-run: the dry run computes on the "
                             "meta device and prices the step on --profile's hardware; give "
                             "--profile (e.g. a100, h100, ascend-910b) instead of --device")


def _flag(name: str, value=None) -> str:
    """``name`` spelled as a command-line flag: ``--batch-size`` or ``--batch-size 8``."""
    flag = "--" + name.replace("_", "-")
    return flag if value is None else f"{flag} {value}"


def _check_sizes(args, cfg) -> None:
    check_sizes(getattr(args, "dp", 1), getattr(args, "tp", 1), getattr(args, "pp", 1),
                getattr(args, "batch_size", 1), cfg,
                f"--preset {getattr(args, 'preset', 'tiny')}", _flag)


def check_world(dp: int, tp: int, pp: int, given: str | None = None) -> None:
    """dp x tp x pp at most :data:`~workbench.sim_mesh.mesh.MAX_RANKS` ranks: the meshes
    keep every rank in Python tables (``Hybrid(dp=10**9)`` hung building them).
    ``given`` names the values in the message (default: the flags)."""
    from .sim_mesh.mesh import MAX_RANKS
    if dp * tp * pp > MAX_RANKS:
        given = given or f"--dp {dp} --tp {tp} --pp {pp}"
        raise ValueError(f"{given}: "
                         f"{dp * tp * pp:,} ranks, over the limit of {MAX_RANKS:,} (a mesh keeps "
                         "every rank in tables in this one process; the largest published runs "
                         "use about 16,384 devices, Llama 3 405B); lower them")


def check_sizes(dp: int, tp: int, pp: int, batch: int, cfg, model: str, spell=_flag,
                stage_sizes=None) -> None:
    """dp <= batch size, tp <= heads, pp <= layers (see the module docstring), and at most
    :data:`~workbench.sim_mesh.mesh.MAX_RANKS` ranks.  ``model`` names the model in the
    message; ``spell(name, value)`` writes an argument (a flag for the command line,
    ``name=value`` for the ``Hybrid`` recipe).  With ``stage_sizes`` (``Hybrid``'s uneven
    stages, whose middle ones may hold no layer: tests/test_plan8.py) pp is not bounded by
    the layers: the list itself says where each layer goes (``Hybrid._check_layers``)."""
    for name, v, most, why, fix in (
            ("dp", dp, batch, f"{spell('batch_size', batch)}: every data-parallel rank takes at "
                              "least one sequence",
             f"raise {spell('batch_size')} or lower {spell('dp')}"),
            ("tp", tp, cfg.n_head, f"{cfg.n_head} heads in {model}: tensor parallelism splits "
                                   "the heads", f"lower {spell('tp')}"),
            ("pp", pp, cfg.n_layer, f"{cfg.n_layer} layers in {model}: every pipeline stage "
                                    "holds at least one layer", f"lower {spell('pp')}")):
        if v > most and not (name == "pp" and stage_sizes is not None):
            raise ValueError(f"{spell(name, v)}: at most {most} ({why}); {fix}")
    check_world(dp, tp, pp, None if spell is _flag else
                ", ".join(spell(n, v) for n, v in (("dp", dp), ("tp", tp), ("pp", pp))))


def _check_timeout(args) -> None:
    t = getattr(args, "timeout", None)
    if t is None:
        return
    from .sim_mesh.backends import MAX_TIMEOUT_S
    if getattr(args, "backend", "sim") != "torch":
        raise ValueError(f"--timeout {t}: the collectives' timeout applies to --backend torch "
                         "only (simulated ranks never wait); add --backend torch or leave it "
                         "out")
    if not 0 < t <= MAX_TIMEOUT_S:
        raise ValueError(f"--timeout {t}: give seconds in (0, {MAX_TIMEOUT_S:g}] (a week: a "
                         "hung collective should end the job, not hold the machines), e.g. "
                         "--timeout 600")


def check_device(device) -> None:
    """``cpu``, ``auto``, or a ``cuda`` / ``npu`` device that exists here."""
    import torch
    if device in ("cpu", "auto"):
        return
    kind, _, idx = str(device).partition(":")
    if kind not in ("cuda", "npu") or (idx and not idx.isdigit()):
        raise ValueError(f"--device {device}: unknown device; use cpu, cuda, cuda:N, npu, "
                         "npu:N, or auto (the best one found)")
    if kind == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        why = "torch.cuda.is_available() is False: no CUDA device, or torch built without CUDA"
    else:
        from .npu.device import device_count, probe
        n = device_count()
        found = probe()
        why = ("torch_npu is not installed" if not found.installed else
               f"torch_npu failed to import ({found.error})" if found.module is None else
               "torch_npu sees no Ascend device")
    if n == 0:
        raise ValueError(f"--device {device}: {why}; use --device cpu, or --device auto for "
                         "the best device found (python -m workbench doctor says why)")
    if idx and int(idx) >= n:
        raise ValueError(f"--device {device}: this machine has {n} {kind} device(s), "
                         f"{kind}:0 .. {kind}:{n - 1}; pick one of those")


def _ram_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):      # not a POSIX system: no bound
        return None


def min_bytes(cfg, batch_size: int) -> int:
    """A lower bound on what one step holds on one device, in closed form (microseconds,
    whatever the sizes): parameters, gradients and AdamW's two moments (4 copies), and per
    token each layer's input (kept for the backward even with full recompute) and the
    logits.  Parameters are counted low: per layer the h x h query and output projections
    and two h x d_ff MLP matrices (Llama has three, GPT two: models/llama.py, gpt.py), plus
    the V x h embedding; norms, biases, k/v and the head are left out."""
    import torch
    item = torch.empty((), dtype=cfg.torch_dtype).element_size()
    h, L = cfg.d_model, cfg.n_layer
    params = L * (2 * h * h + 2 * h * cfg.d_ff) + cfg.vocab_size * h
    tokens = batch_size * cfg.seq_len
    return item * (4 * params + tokens * (L * h + cfg.vocab_size))


def _check_memory(args, cfg) -> None:
    world = 1
    if getattr(args, "backend", "sim") == "torch":       # each process at least 1/world
        world = args.dp * args.tp * args.pp
    check_memory(cfg, args.batch_size, world,
                 f"--preset {args.preset} --batch-size {args.batch_size}",
                 "use a smaller --batch-size or --preset, or --dry-run to price it without "
                 "memory")


def check_memory(cfg, batch_size: int, world: int, given: str, fix: str) -> None:
    """Refuse a step that cannot fit this machine's RAM: at least :func:`min_bytes`, of
    which each of ``world`` processes holds at least 1/world (the simulator: all)."""
    ram = _ram_bytes()
    if ram is None:
        return
    need = min_bytes(cfg, batch_size) / world
    if need > ram:
        where = "this process" if world == 1 else f"each of the {world} processes"
        raise ValueError(f"{given}: one step needs at least {need / 1e9:.3g} GB in {where}, "
                         f"more than this machine's {ram / 1e9:.3g} GB of RAM (parameters, "
                         f"gradients and AdamW state, each layer's input and the logits); "
                         f"{fix}")
