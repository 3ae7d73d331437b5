"""Training the course's Llama: a loop, a strategy seam, and the ``train`` command.

    from workbench.train import train
    records = train("tiny", steps=50, seed=0)          # [{"step": 0, "loss": 4.33, ...}, ...]

    python -m workbench train --preset tiny --steps 5 --seed 0   # one JSON line per step

The loop is deliberately plain: draw batch ``step`` (workbench.models.data),
forward + backward, optimizer step, record.  Everything that depends on how the
work is spread over devices goes through a :class:`Strategy`:

    strategy.build_model(cfg, seed)              where the parameters live (sharded or not)
    strategy.build_optimizer(model, lr, wd)      which optimizer state each rank keeps (ZeRO)
    strategy.forward_backward(model, x, y)       micro-batches, pipeline schedule, gradient
                                                 reduction (DP); returns the global mean loss
    strategy.optimizer_step(optimizer)           step and zero the gradients

:class:`SingleDevice` runs everything on one device; the ``--dp --tp --pp --sp
--zero --schedule`` flags select the :class:`~workbench.recipes.hybrid.
Hybrid` recipe, and :func:`check_args` refuses values no run can take.
The global batch and the loss are the same for every strategy, so a
parallel run can be checked against the single-device run step by step; dropout
masks are keyed by (step, call) (:mod:`workbench.sim_mesh.rng`), so they are too.
"""
from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from typing import Callable

import torch
from torch import nn

from . import ops
from .models.config import PRESETS, RECOMPUTE, ModelConfig, build_model, get_config
from .models.data import get_batch
from . import train_checks as _checks
from .sim_mesh import rng

__all__ = ["train", "Strategy", "SingleDevice", "add_train_arguments", "main_train",
           "DEFAULT_LR"]

DEFAULT_LR = 3e-3       # AdamW learning rate that makes "tiny" learn in ~50 steps


class Strategy:
    """How a training step is spread over devices.  This base class is the
    single-device strategy; parallel strategies override the four methods."""

    name = "single"

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = torch.device(device)

    def build_model(self, cfg: ModelConfig, seed: int) -> nn.Module:
        """The model, initialised from ``seed`` (every rank draws the same full model,
        then keeps its shard), placed on the device(s), in training mode."""
        return build_model(cfg, seed=seed).to(self.device).train()   # Llama or GPT (cfg.arch)

    def build_optimizer(self, model: nn.Module, lr: float, weight_decay: float):
        return ops.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)

    def forward_backward(self, model: nn.Module, inputs: torch.Tensor,
                         targets: torch.Tensor) -> torch.Tensor:
        """Run forward and backward on the global batch (B, S); return the mean loss,
        detached.  Gradients are left in ``.grad`` for :meth:`optimizer_step`."""
        _, loss = model(inputs.to(self.device), targets.to(self.device))
        loss.backward()
        return loss.detach()

    def optimizer_step(self, optimizer) -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


class SingleDevice(Strategy):
    """The whole model and the whole batch on one device."""


def train(preset: str | ModelConfig = "tiny", steps: int = 5, seed: int = 0,
          batch_size: int = 8, lr: float = DEFAULT_LR, weight_decay: float = 0.01,
          recompute: str | None = None, strategy: Strategy | None = None,
          ops_backend: str | None = None, timing: bool = True,
          on_step: Callable[[dict], None] | None = None, save: str | None = None,
          resume: str | None = None, **overrides) -> list[dict]:
    """Train ``preset`` (a name from PRESETS or a ModelConfig) for ``steps`` steps.

    Returns one record per step: ``{"step", "loss", "tokens", "lr"}`` plus ``"ms"``
    (wall time of the step) when ``timing``; "tokens" counts tokens trained on so far; a
    mixture-of-experts model adds "moe_aux_loss" and "moe_dropped" of the whole batch, every
    pipeline micro-batch counted (recipes/moe.py; left out on torch.distributed with pp > 1).
    The losses are a pure function of the arguments: same seed, same losses.
    ``recompute`` ("none" | "full" | "selective" | "op") and ``overrides`` (e.g. n_layer=4)
    change the model config; ``ops_backend`` forces a wb.ops backend ("reference",
    "unfused", "native", "npu") for the run; ``on_step`` sees each record as it is made.
    ``resume``: a checkpoint directory to continue from (its step up to ``steps``, on any
    layout); ``save``: where to save the training state after the last step
    (:mod:`workbench.checkpoint.training`).
    """
    cfg = preset if isinstance(preset, ModelConfig) else get_config(preset)
    if recompute is not None:
        overrides["recompute"] = recompute
    cfg = cfg.replace(**overrides) if overrides else cfg
    _checks.check_seed(seed, "train: seed=")
    for name, v in (("steps", steps), ("batch_size", batch_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "steps" else 1):
            raise ValueError(f"train: {name}={v!r} must be an int >= {int(name != 'steps')}")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 < lr < math.inf:
        raise ValueError(f"train: lr={lr!r} must be a finite number > 0 (e.g. {DEFAULT_LR})")
    if isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float)) or \
            not 0 <= weight_decay < math.inf:
        raise ValueError(f"train: weight_decay={weight_decay!r} must be a finite number >= 0 "
                         "(e.g. 0.01)")
    strategy = strategy or SingleDevice()
    if not all(callable(getattr(strategy, m, None)) for m in
               ("build_model", "build_optimizer", "forward_backward", "optimizer_step")):
        raise TypeError(f"train(strategy={strategy!r:.60}): give a Strategy, e.g. "
                        "SingleDevice() or Hybrid(dp=2), or None for one device")
    if on_step is not None and not callable(on_step):
        raise TypeError(f"train(on_step={on_step!r:.60}): give a function of one record, or "
                        "None")
    world = getattr(strategy, "dp", 1) * getattr(strategy, "tp", 1) * getattr(strategy, "pp", 1) \
        * getattr(strategy, "cp", 1) if getattr(strategy, "distributed", False) else 1
    given = ", ".join([repr(preset) if isinstance(preset, str) else "<ModelConfig>",
                       f"batch_size={batch_size}", *(f"{k}={v!r}" for k, v in overrides.items())])
    _checks.check_memory(cfg, batch_size, world, f"train({given})",
                         "use a smaller batch_size or model")
    check = getattr(strategy, "check", None)
    if check is not None:
        check(cfg, batch_size)          # a layout that does not fit: error before anything runs
    if save is not None:                # not after the last step, with the run's work lost
        from .checkpoint.training import save_path_problem
        bad = save_path_problem(save)
        if bad:
            raise ValueError(f"train(save={save!r}): {bad}")
    records = []
    # dropout draws from torch's RNG: seed it, and give the caller's state back afterwards
    with ops.use(ops_backend or ops.current_backend()), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = strategy.build_model(cfg, seed)
        optimizer = strategy.build_optimizer(model, lr, weight_decay)
        start = 0
        if resume is not None:          # model, optimizer, step and RNG of the saved run
            from .checkpoint.training import resume_training
            start = resume_training(resume, strategy, model, optimizer, seed, batch_size,
                                    lr, weight_decay, cfg=cfg)
            if steps < start:           # steps counts from 0, the checkpoint's steps included
                raise ValueError(f"train(steps={steps}, resume={resume!r}): the checkpoint has "
                                 f"run {start} steps already; give steps >= {start} (the total "
                                 "to reach, not the steps to add; equal runs no step)")
        for step in range(start, steps):
            t0 = time.perf_counter()
            inputs, targets = get_batch(cfg, batch_size, seed, step)         # (B, S) each
            # dropout masks keyed by (this step, the call): the same for every layout
            key = int(torch.randint(0, 2**62, ()))
            with _step_trace(strategy) as tr, rng.keyed(key), _measuring(strategy):
                loss = strategy.forward_backward(model, inputs, targets)
                strategy.optimizer_step(optimizer)
            rec = {"step": step, "loss": float(loss), "tokens": (step + 1) * inputs.numel(),
                   "lr": lr}
            if tr is not None:
                rec.update(strategy.step_report(tr, optimizer))
            if timing:
                rec["ms"] = round((time.perf_counter() - t0) * 1e3, 3)
            if cfg.moe_experts:                  # aux loss and drops (recipes/moe.py)
                from .recipes.moe import moe_record
                rec.update(moe_record(model, strategy))
            records.append(rec)
            if on_step is not None:
                on_step(rec)
        if save is not None:
            from .checkpoint.training import save_training
            save_training(save, strategy, model, optimizer, max(steps, start), seed, batch_size,
                          lr, weight_decay, cfg=cfg)
    return records


def _dist_rank() -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_initialized() else 0


class _NoTrace:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _measuring(strategy):
    """The activations a step keeps, counted for its record (``Hybrid.measure_activations``;
    off outside ``train``: the count costs about a third of a step on the simulator).

    Counted on every step, not once per layout: that the count is a function of shapes
    and layouts alone is not proven (task simperf3).  Values reach Python where the
    counter's dispatch mode cannot see them (expert routing's ``tolist()`` in
    ``parallel/strategies/expert_parallel.py`` sizes each expert's tensors), and a
    process's first counted forward of a layout runs ops later ones do not (gpt-tiny
    Hybrid(dp=2, tp=2): 170 storages, then 166; the same bytes)."""
    measure = getattr(strategy, "measure_activations", None)
    return measure() if measure is not None else contextlib.nullcontext()


def _step_trace(strategy):
    """Parallel strategies run each step in a trace (modeled time, bytes); one device doesn't."""
    if hasattr(strategy, "step_report"):
        from .sim_mesh.trace import trace
        return trace(getattr(strategy, "profile", None))
    return _NoTrace()


# ---- command line -------------------------------------------------------------------------

_PARALLEL_FLAGS = _checks.PARALLEL_FLAGS       # the parallelism flags and their defaults


def add_train_arguments(parser) -> None:
    """Declare the ``train`` subcommand's flags on an argparse parser."""
    p = parser
    p.add_argument("--preset", default="tiny", choices=list(PRESETS), help="model preset")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the init and the batches, 0 .. 2**32 - 1")
    p.add_argument("--batch-size", type=int, default=8, help="global batch, in sequences")
    p.add_argument("--lr", type=float, default=DEFAULT_LR, help="AdamW learning rate")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    p.add_argument("--recompute", default="none", choices=list(RECOMPUTE),
                   help="activation recompute per block: none | full | selective | op "
                        "(op: torchtitan's op-level selective checkpointing, a Llama)")
    p.add_argument("--device", default="cpu",
                   help="cpu, cuda, npu (torch_npu), or auto: the best one found")
    p.add_argument("--ops", default="auto", choices=["auto", *ops.BACKENDS],
                   help="wb.ops backend for the fused operators")
    p.add_argument("--save", default=None, metavar="DIR",
                   help="save the training state (model, optimizer, step, RNG) to DIR after "
                        "the last step (wb.checkpoint; DCP's format)")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="continue the run saved in DIR, on this run's layout, up to --steps")
    g = p.add_argument_group("parallelism (simulated ranks, or torch.distributed with --backend torch)")
    g.add_argument("--dp", type=int, default=1, help="data-parallel size")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    g.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    g.add_argument("--sp", action="store_true", help="sequence parallelism (with --tp)")
    g.add_argument("--cp", type=int, default=1,
                   help="context-parallel size: the sequence sharded over cp ranks, ring "
                        "attention (workbench.recipes.context_parallel)")
    g.add_argument("--cp-comm", default="p2p", choices=["p2p", "a2a"],
                   help="with --cp: p2p (ring attention) or a2a (DeepSpeed-Ulysses' "
                        "all-to-all over heads), Megatron-LM's --cp-comm-type")
    g.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3], help="ZeRO stage")
    g.add_argument("--schedule", default="1f1b",
                   choices=["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipe"],
                   help="pipeline schedule (with --pp; zb-v: two V-placed chunks per rank; "
                        "dualpipe: two copies of every stage, fed from both ends)")
    g.add_argument("--dry-run", action="store_true",
                   help="run one step of the real code on meta tensors (no data) and print "
                        "its modeled time and peak memory per rank (workbench.plan.dryrun)")
    g.add_argument("--profile", default=None,
                   help="--dry-run: hardware profile (a100 by default; h100, ascend-910b)")
    g.add_argument("--micro-batch", type=int, default=None,
                   help="--dry-run: sequences per micro-batch per dp rank")
    g.add_argument("--backend", default="sim", choices=["sim", "torch"],
                   help="sim: all ranks in this process; torch: one rank per process on "
                        "torch.distributed (launch with torchrun; gloo/hccl/nccl)")
    g.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="--backend torch: a collective that waits this long fails, and a "
                        "stopped rank is ended by its peers (default 60; "
                        "wb.distributed.init's timeout_s)")
    from .recipes.moe import add_moe_arguments
    add_moe_arguments(p)                      # --moe-experts ... --ep (recipes/moe.py)


def strategy_from_args(args) -> Strategy:
    """The strategy the flags ask for; a clear error for what is not built yet."""
    distributed = getattr(args, "backend", "sim") == "torch"
    parallel = {n: getattr(args, n, d) for n, d in _PARALLEL_FLAGS if n != "backend"}
    cp = getattr(args, "cp", 1)
    ep, ep_chunks = getattr(args, "ep", 1), getattr(args, "ep_chunks", 1)
    if distributed or cp != 1 or ep != 1 or any(parallel[n] != d for n, d in _PARALLEL_FLAGS
                                     if n != "backend"):
        from .recipes.hybrid import Hybrid
        if distributed:
            from .sim_mesh import backends
            timeout = getattr(args, "timeout", None)
            backends.init(**({} if timeout is None else {"timeout_s": timeout}))
        if cp != 1:                     # context parallelism: recipes/context_parallel.py
            from .recipes.context_parallel import ContextParallel
            from .recipes.moe import moe_overrides
            moe_overrides(args)         # MoE flags checked; the layers: recipes/moe.py
            if ep != 1:
                raise ValueError("--cp with --ep (experts split over ranks) is not built yet: "
                                 "leave out --ep (the experts then stay whole on every rank) "
                                 "or --cp")
            if getattr(args, "device", "cpu") != "cpu":
                raise ValueError(f"--device {args.device} with --cp: simulated ranks run on "
                                 "the CPU, and under --backend torch each process uses its "
                                 "backend's device; leave --device at cpu")
            return ContextParallel(cp=cp, dp=parallel["dp"], tp=parallel["tp"],
                                   pp=parallel["pp"], sp=parallel["sp"], zero=parallel["zero"],
                                   distributed=distributed,
                                   cp_comm=getattr(args, "cp_comm", "p2p"))
        return Hybrid(dp=parallel["dp"], tp=parallel["tp"], pp=parallel["pp"], sp=parallel["sp"],
                      zero=parallel["zero"], schedule=parallel["schedule"],
                      distributed=distributed, ep=ep, ep_chunks=ep_chunks)
    device = getattr(args, "device", "cpu")
    if device == "auto":
        from .npu.device import device as best_device
        device = best_device()
    return SingleDevice(device)


def check_args(args) -> None:
    """Refuse flag values no run can take, before anything is built (``error:``, exit 2);
    the checks and their reasons are in :mod:`workbench.train_checks`."""
    _checks.check_args(args, DEFAULT_LR)


def main_train(args) -> int:
    """``python -m workbench train ...``: one JSON line per step on stdout; a progress
    bar on stderr when stderr is a terminal.  Returns the exit status."""
    if getattr(args, "dry_run", False):
        try:
            check_args(args)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        from .plan.dryrun_cli import main_dry_run
        return main_dry_run(args)
    for flag in ("profile", "micro_batch"):
        if getattr(args, flag, None) is not None:
            print(f"error: --{flag.replace('_', '-')} applies to --dry-run only; add --dry-run "
                  f"or leave it out", file=sys.stderr)
            return 2
    try:
        check_args(args)
        from .recipes.moe import moe_overrides
        moe = moe_overrides(args)                # ModelConfig's moe_* fields (recipes/moe.py)
        cfg = get_config(args.preset, **moe)
        if getattr(args, "recompute", None) is not None:     # what train() will build
            cfg = cfg.replace(recompute=args.recompute)
        strategy = strategy_from_args(args)
        check = getattr(strategy, "check", None)
        if check is not None:
            check(cfg, args.batch_size)
        if getattr(args, "save", None) or getattr(args, "resume", None):
            from .checkpoint.training import check_cli
            msg = check_cli(args, strategy)      # a checkpoint that cannot be resumed
            if msg:
                raise ValueError(msg)
    except (NotImplementedError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    bar = _ProgressBar(args.steps) if sys.stderr.isatty() else None
    leader = not getattr(strategy, "distributed", False) or _dist_rank() == 0

    def emit(rec):
        if not leader:                         # on torch.distributed, rank 0 prints
            return
        if bar is not None:
            bar.clear()                        # stdout may be the same terminal
        print(json.dumps(rec), flush=True)
        if bar is not None:
            bar.update(rec)

    try:
        train(args.preset, steps=args.steps, seed=args.seed, batch_size=args.batch_size,
              lr=args.lr, weight_decay=getattr(args, "weight_decay", 0.01),
              recompute=getattr(args, "recompute", "none"), strategy=strategy,
              ops_backend=getattr(args, "ops", "auto"), on_step=emit,
              save=getattr(args, "save", None), resume=getattr(args, "resume", None), **moe)
    finally:
        if getattr(strategy, "distributed", False):
            from .sim_mesh import backends
            import torch.distributed as dist
            dist.barrier()            # every rank done before the groups go away
            backends.shutdown()
    if bar is not None:
        bar.close()
    return 0


class _ProgressBar:
    """``step 3/5 [#########.........] loss 3.2104`` rewritten in place on stderr."""

    def __init__(self, total: int, width: int = 24):
        self.total, self.width = max(total, 1), width

    def update(self, rec: dict) -> None:
        done = rec["step"] + 1
        fill = self.width * done // self.total
        sys.stderr.write(f"\rstep {done}/{self.total} [{'#' * fill}{'.' * (self.width - fill)}] "
                         f"loss {rec['loss']:.4f}")
        sys.stderr.flush()

    def clear(self) -> None:
        sys.stderr.write("\r\x1b[K")
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")
        sys.stderr.flush()
