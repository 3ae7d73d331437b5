"""Checks for the exercises of notebook 13 (your own model under DDP, FSDP and ZeRO).

As in :mod:`.checks`: a right answer prints one "Correct: ..." line; a wrong one raises
:class:`~.checks.CheckError` saying what is wrong.  Expected values are counted
by hand (exercise 1) or come from one device's training run with plain torch.optim
(exercise 2), never from the student's code.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..parallel.dist_tensor import DistTensor, shard_tensor
from ..parallel.strategies.ddp import DistributedDataParallel
from ..parallel.strategies.fsdp import FullyShardedDataParallel
from ..sim_mesh.mesh import Mesh
from .checks import CheckError, _hint, _number, _ok
from .feedback import exercise

__all__ = ["check_ddp_bytes", "check_like_one_device"]


def _ids(vocab, batch, context, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, context), generator=g)


def _build(make_model) -> nn.Module:
    """``make_model()``, or a CheckError saying what was passed instead of that function."""
    if isinstance(make_model, nn.Module):
        raise CheckError(f"pass the function that builds the model (make_model, not "
                         f"make_model()); got a {type(make_model).__name__} instance")
    if not callable(make_model):
        raise CheckError(f"pass the function that builds the model, got {make_model!r}")
    try:
        model = make_model()
    except Exception as e:                                  # the student's code
        raise CheckError(f"make_model() raised {type(e).__name__}: {e}") from None
    if not isinstance(model, nn.Module):
        raise CheckError(f"make_model() returned a {type(model).__name__}, not an nn.Module"
                         + (": return an instance (Mine()), not the class"
                            if isinstance(model, type) else ""))
    return model


@exercise
def check_ddp_bytes(answer, make_model=None, ranks: int = 4, vocab: int = 32,
                    context: int = 16):
    """Exercise 1: the bytes of gradients DDP all-reduces per step (buffer bytes, fp32).

    The expected value is counted by hand from the module's parameters (4 bytes per
    value of every distinct parameter that requires a gradient), not from the library;
    ``tests/test_exercises_own_model.py`` holds it to what DDP's trace records."""
    if make_model is None:                      # not a TypeError through the checker
        raise CheckError("pass the model too: check_ddp_bytes(grad_bytes, Counted), the "
                         "class (or a function that builds it) whose gradients you counted")
    got = _number("answer", answer)
    with torch.random.fork_rng(devices=[]):
        model = _build(make_model)
    seen, want, every, unique, trainable, frozen = set(), 0, 0, 0, [], []
    for name, p in model.named_parameters(remove_duplicate=False):
        every += 4 * p.numel()                      # tied weights counted each time they appear
        if id(p) in seen:
            continue
        seen.add(id(p))
        unique += 4 * p.numel()                     # frozen ones too
        if p.requires_grad:
            want += 4 * p.numel()
            trainable.append((name, 4 * p.numel()))
        else:
            frozen.append(name)
    if got == want:
        _ok(f"{want:,} B of fp32 gradients all-reduced per step (every distinct parameter "
            "that requires a gradient, once)")
        return
    tied_twice = every - (unique - want)             # tied counted twice, frozen left out
    # as given: 15.552 must not read "15.55 B", nor 15552.0001 "1.555e+04 B"
    shown = f"{got:,.0f}" if got == int(got) else f"{got:,}"
    raise CheckError(f"your answer is {shown} B; " + _hint(got, want, [
        (unique, f"that counts the frozen {', '.join(frozen)} too: "
                 + ("it has no gradient, DDP skips it" if len(frozen) == 1 else
                    "they have no gradient, DDP skips them")),
        (every, f"that counts the tied weight twice (and the frozen {', '.join(frozen)}): a "
                "tied weight is one parameter, reduced once"),
        (tied_twice, "that counts the tied weight twice: a tied weight is one parameter, "
                     "reduced once"),
        (want / 4, "that is the number of values: each fp32 gradient value is 4 bytes"),
        (want / 2, "the gradients are fp32: 4 bytes per value, not 2"),
        (2 * want, "that is twice the gradients: each gradient travels once, in one "
                   "all-reduce buffer (that the all-reduce runs as a reduce-scatter and an "
                   "all-gather does not change its buffer)"),
        *((want + 4 * (len(trainable) + 1) + 4 * nb,
           "that adds the bucket rebuild's two broadcasts (int32 bucket indices, once, "
           "before step 2): they carry no gradient") for nb in range(1, len(trainable) + 1)),
        (ranks * want, f"that is the sum over the {ranks} ranks: every rank all-reduces a "
                       "buffer of the same size; count one"),
        (2 * (ranks - 1) / ranks * want,
         f"that is what a ring all-reduce SENDS per rank, 2(N-1)/N of the buffer (N = "
         f"{ranks}); the question asks for the buffers' bytes"),
        *((want + b, f"that counts {name} twice: a weight used in two places (a table "
                     "and the head tied to it) is one parameter with one gradient, "
                     "reduced once") for name, b in trainable)], rel=1e-9,
        fallback="count 4 bytes per value of each distinct parameter (a tied one once) "
                 "that requires a gradient: model.parameters() yields each once"),
        expected=f"{want:,} B")


def _refuse_per_process_draws(make_model, ids, ranks: int) -> None:
    """A CheckError where the forward draws from torch's global generator and the
    processes of a torchrun job would draw other numbers than one device.

    On simulated ranks the ranks' forwards draw one after another from the one generator
    (``strategies/ranks.py``: ``run_per_rank``), so ``torch.randn(ids.shape[0], ...)`` of
    rank 0 then rank 1 are together one device's draw of the whole batch, bit for bit.
    Under torchrun each process draws from its own generator, seeded alike (the seed in
    ``make_model``), so the ranks (even shards) draw the same numbers for their rows.
    This replays that: one forward on the whole batch, then each rank's rows from the same
    generator state, as each process starts.  A forward that draws nothing, raises, or
    returns no tensor with the batch's rows is left to the training comparison.

    Not DTensor's refusal of a plain tensor met by a DistTensor (mix17): DDP and FSDP run
    the module on each rank's plain rows, so no DistTensor reaches this forward (a dispatch
    that raised on every non-scalar plain operand still passed the model: measured)."""
    m = make_model()
    start = torch.get_rng_state()
    try:
        with torch.no_grad():
            whole = m(ids)
            if torch.equal(torch.get_rng_state(), start) or \
                    not isinstance(whole, torch.Tensor) or whole.ndim == 0 or \
                    whole.shape[0] != ids.shape[0]:
                return
            parts = []
            for rows in ids.chunk(ranks):           # torch.chunk: each process's rows
                torch.set_rng_state(start)          # every process seeded alike
                parts.append(m(rows))
            joined = torch.cat(parts)
    except Exception:                               # the training comparison names it
        return
    if joined.shape != whole.shape or joined.dtype != whole.dtype:
        return
    for k, (got, rows) in enumerate(zip(parts, whole.split([len(p) for p in parts]))):
        if not torch.allclose(got.float(), rows.float(), rtol=1e-5, atol=1e-6):
            gap = (got.float() - rows.float()).abs().max().item()
            raise CheckError(
                "your forward draws random numbers from torch's generator (torch.randn, "
                "torch.rand, dropout in training mode, ...), and that is not one device's "
                f"run under torchrun: each of the {ranks} processes draws from its own "
                "generator, seeded alike (make_model's seed): starting from the same "
                "state, every rank draws the same numbers for its rows, where one device "
                "draws other numbers for each row. Measured on the "
                f"check's first batch: rank {k}'s rows of the output differ from one "
                f"device's by up to {gap:.3g}. (The simulated ranks draw one after another "
                "from one generator, so together they draw one device's numbers: the "
                "simulation alone would not show it.) Draw such numbers once in __init__ "
                "and keep them, indexed by what a row holds (a buffer read as "
                "self.noise[ids]), not by its place in the batch; or leave them out "
                "(dropout: model.eval(), or p=0)")


def check_like_one_device(make_model, steps: int = 3, ranks: int = 2, vocab: int = 32,
                          context: int = 16):
    """Exercise 2: your model, under DDP and FSDP on ``ranks`` simulated ranks, gives one
    device's loss at every step and one device's parameters after ``steps`` AdamW steps."""
    with torch.random.fork_rng(devices=[]):
        model = _build(make_model)
        again = make_model().state_dict()
        differ = [n for n, t in model.state_dict().items()
                  if n in again and not torch.equal(t, again[n])]
        if differ:
            raise CheckError(f"two calls of make_model() build different weights ({differ[0]} "
                             "differs): seed it inside (torch.manual_seed(0) before building "
                             "the model), so that one device, DDP and FSDP start from the "
                             "same parameters")
        frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
        if not frozen:
            raise CheckError("give your model a frozen parameter (requires_grad=False)")
        if not any(p.requires_grad for p in model.parameters()):
            raise CheckError("every parameter of your model is frozen: give it one that "
                             "trains (requires_grad=True), or there is nothing to train")
        batches = [_ids(vocab, 2 * ranks, context, s) for s in range(steps)]
        _refuse_per_process_draws(make_model, batches[0], ranks)
        results, losses, unused = {}, {}, []
        for kind in ("one device", "DDP", "FSDP"):
            m = make_model()
            mesh = Mesh.grid(ranks, ["dp"])
            # torch's DDP raises at the second step for a parameter that got no gradient
            # unless find_unused_parameters=True (Reducer::ensure_prior_reduction_finished):
            # pass it, as a torchrun script must, when one device left one without a gradient
            if kind == "one device":
                w = m
            elif kind == "DDP":
                w = DistributedDataParallel(m, mesh, find_unused_parameters=bool(unused))
            else:
                w = FullyShardedDataParallel(m, mesh)
            opt = torch.optim.AdamW(w.parameters(), lr=1e-2)
            for ids in batches:
                opt.zero_grad()
                x = ids if kind == "one device" else shard_tensor(ids, mesh, ["S(0)"])
                try:
                    out = w(x)
                    if isinstance(out, (torch.Tensor, DistTensor)):   # else named below
                        loss = (out.float() ** 2).mean()
                        loss.backward()
                except Exception as e:                  # the student's model, or a refusal
                    if kind != "one device":            # it runs alone: the wrapper refused
                        raise CheckError(f"under {kind}, training your model raised "
                                         f"{type(e).__name__}: {e}") from None
                    raise CheckError(
                        f"on one device, training your model raised {type(e).__name__}: {e} "
                        f"(the check calls model(ids) with ids an int64 tensor ({2 * ranks}, "
                        f"{context}) of token ids in [0, {vocab}), as TinyLM takes them, and "
                        "minimizes the mean of the squared output, a tensor)") from None
                if not isinstance(out, (torch.Tensor, DistTensor)):
                    raise CheckError(f"your forward returned a {type(out).__name__}, not a "
                                     "tensor: return the output tensor itself (as TinyLM "
                                     "returns its logits (B, T, V))")
                losses.setdefault(kind, []).append(
                    (loss.full() if isinstance(loss, DistTensor) else loss).item())
                if kind == "one device":            # trainable, no gradient this step
                    unused += [n for n, p in m.named_parameters()
                               if p.requires_grad and p.grad is None and n not in unused]
                opt.step()
            results[kind] = {n: t.detach().clone() for n, t in m.state_dict().items()} \
                if kind == "one device" else w.full_state_dict()
    ref = results["one device"]
    for kind in ("DDP", "FSDP"):
        # the losses first: AdamW's first steps move each value by about lr times the sign of
        # its gradient, so the parameters alone let a forward that sums the batch's rows pass
        for step, (got, want) in enumerate(zip(losses[kind], losses["one device"]), 1):
            if not math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-7):
                raise CheckError(f"under {kind}, the loss of step {step} differs from one "
                                 f"device's ({got:.6g} against {want:.6g}): each rank sees "
                                 "only its own rows of the batch; does your forward mix rows "
                                 "(a sum, a mean, a norm or a softmax over dim 0), or draw "
                                 "random numbers?")
        for name, want in ref.items():
            if not torch.allclose(results[kind][name], want, rtol=1e-5, atol=1e-6):
                raise CheckError(f"under {kind}, {name} differs from one device's after "
                                 f"{steps} steps: each rank sees only its own rows of the "
                                 "batch; does your forward mix rows (a mean, a norm or a "
                                 "softmax over dim 0), or draw random numbers?")
    _ok(f"{type(model).__name__} under DDP and FSDP on {ranks} ranks: one device's "
        f"parameters after {steps} AdamW steps; frozen {frozen} unchanged"
        + (f"; unused {unused}: DDP wrapped with find_unused_parameters=True, which torch's "
           "DDP needs for them (without it, it raises at the second step)" if unused else ""))
