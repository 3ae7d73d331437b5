"""``python -m workbench serve``: generate text from a trained checkpoint on any layout.

    python -m workbench train --steps 200 --dp 2 --tp 2 --save ckpt       # train, save
    python -m workbench serve --checkpoint ckpt --tp 2 --prompt "The fox" --max-new-tokens 40
    python -m workbench serve --preset tiny --prompt "The fox" --max-new-tokens 20  # untrained
    python -m workbench serve --preset llama2-7b --profile a100 --requests trace.jsonl  # benchmark

Prints the prompt and its continuation: greedy unless ``--temperature`` > 0 (then
``--top-k`` / ``--top-p`` filter and ``--seed`` seeds the draws).  The text is the same
on every layout (``--dp``, ``--tp``; ``--backend torch`` under torchrun, one rank per
process): the model is laid out by the hybrid recipe and the checkpoint read into that
layout by ``wb.checkpoint.load``, each rank reading only its shards.

``--checkpoint`` reads the ``model`` entry of a ``train --save`` checkpoint (or of any
``wb.checkpoint.save(path, {"model": model.state_dict()})``); the model's shape is
``--preset``'s (the one it was trained with; a mixture of experts also takes train's
``--moe-*`` flags, served dropless).  Without ``--checkpoint`` the model is
``--preset`` initialised from ``--seed``, untrained (for testing).

``--requests FILE`` runs a serving benchmark instead (:mod:`.bench_cli`: the file's
format, continuous against static batching on the modeled clock, the latency table).
"""
from __future__ import annotations

import sys

__all__ = ["add_serve_arguments", "main_serve", "load_served", "servable_presets"]


def add_serve_arguments(p) -> None:
    """Declare the ``serve`` subcommand's flags on an argparse parser."""
    p.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="a checkpoint with the model's weights (train --save DIR); without "
                        "it, --preset untrained, initialised from --seed")
    p.add_argument("--preset", default="tiny", choices=_PresetChoices(servable_presets()),
                   help="the model's shape (the preset the checkpoint was trained with); the "
                        "presets over the course's 75-character alphabet (the --requests "
                        "benchmark prices any preset, e.g. llama2-7b)")
    p.add_argument("--prompt", default=None,
                   help="the text to continue (required unless --requests)")
    p.add_argument("--max-new-tokens", type=int, default=40, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy (default); > 0: sample from softmax(logits / T)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely")
    p.add_argument("--top-p", type=float, default=None,
                   help="sample among the most likely tokens holding this probability")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the sampling draws (and of the init without --checkpoint)")
    g = p.add_argument_group("layout (simulated ranks, or torch.distributed with --backend torch)")
    g.add_argument("--dp", type=int, default=1, help="data-parallel size")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    g.add_argument("--backend", default="sim", choices=["sim", "torch"],
                   help="sim: all ranks in this process; torch: one rank per process "
                        "(torchrun --nproc-per-node dp x tp)")
    m = p.add_argument_group("mixture of experts: the model the checkpoint was trained with "
                             "(train's --moe-* flags; served dropless)")
    m.add_argument("--moe-experts", type=int, default=0,
                   help="routed experts per block (0: dense MLP)")
    m.add_argument("--moe-topk", type=int, default=2, help="experts per token")
    m.add_argument("--moe-shared-experts", type=int, default=0, help="always-on experts")
    m.add_argument("--moe-gating", default="softmax", choices=["softmax", "sigmoid"],
                   help="router gating: softmax (Mixtral) or sigmoid (DeepSeek-V3)")
    m.add_argument("--moe-no-norm-topk", dest="moe_norm_topk", action="store_false",
                   help="the k gates are the router's own probabilities (train's flag)")
    from .bench_cli import add_bench_arguments
    add_bench_arguments(p)


class _PresetChoices(list):
    """argparse's ``choices`` for ``--preset``: lists (in ``--help``) the presets text is
    served with, and lets every preset through, since the ``--requests`` benchmark prices
    any model's shape; :func:`main_serve` refuses the others for text."""

    def __contains__(self, name) -> bool:
        from ..models.config import PRESETS
        return name in PRESETS


def _invalid_preset(preset: str) -> None:
    """The text mode's answer to a preset outside the alphabet: argparse's own (exit 2)."""
    print(f"python -m workbench serve: error: argument --preset: invalid choice: {preset!r} "
          f"(choose from {', '.join(map(repr, servable_presets()))}: the presets over the "
          "character alphabet serve text; any preset prices the --requests benchmark)",
          file=sys.stderr)
    raise SystemExit(2)


def servable_presets() -> list[str]:
    """The presets whose vocabulary is the character tokenizer's (the text a prompt and
    the output are written in); the large ones are shapes for estimates, not models to
    build on a CPU."""
    from ..models.config import PRESETS
    from ..models.data import TOKENIZER
    return [n for n, kw in PRESETS.items() if kw.get("vocab_size") == TOKENIZER.vocab_size]


def load_served(preset, checkpoint=None, *, dp: int = 1, tp: int = 1, seed: int = 0,
                distributed: bool = False):
    """The served model (:class:`~.generate.Served`): ``preset``'s shape on a dp x tp
    layout, with the ``model`` weights of ``checkpoint`` read into that layout."""
    from .generate import serve_model
    served = serve_model(preset, dp=dp, tp=tp, seed=seed, distributed=distributed)
    if checkpoint is not None:
        import torch

        from ..checkpoint import load, read_metadata
        from ..checkpoint.training import config_mismatch, model_mismatch
        sd = served.model.state_dict()
        # another model's checkpoint (e.g. trained with --moe-experts): named before the
        # load, whose own message would suggest strict=False (weights left at their init);
        # or one of the same shapes that computes otherwise (--moe-topk, --moe-gating...)
        md = read_metadata(checkpoint)
        bad = model_mismatch(md.state_dict_metadata,
                             {k: v.shape for k, v in sd.items()}, every=not distributed) \
            or config_mismatch(md, served.model.cfg)
        if bad:
            raise ValueError(f"--checkpoint {checkpoint}: {bad} (in Python: load_served("
                             "get_config(preset, moe_experts=...), checkpoint))")
        load(checkpoint, {"model": sd})
        with torch.no_grad():
            served.model.load_state_dict(sd)
    return served


def _check(args) -> str | None:
    for flag in ("dp", "tp"):
        v = getattr(args, flag)
        if v < 1:
            return f"--{flag} {v}: give an int >= 1"
    if args.max_new_tokens < 0:
        return f"--max-new-tokens {args.max_new_tokens}: give an int >= 0"
    if not args.prompt:
        return "--prompt '': give at least one character to continue"
    if args.temperature == 0 and (args.top_k is not None or args.top_p is not None):
        return "--top-k / --top-p filter the sampled tokens: add --temperature > 0 (e.g. 0.8)"
    return None


# the flags only one mode reads, with their defaults (a flag the mode ignores is an error)
_TEXT_FLAGS = {"checkpoint": None, "max_new_tokens": 40, "temperature": 0.0, "top_k": None,
               "top_p": None, "seed": 0, "dp": 1, "tp": 1, "backend": "sim",
               "moe_experts": 0, "moe_topk": 2, "moe_shared_experts": 0,
               "moe_gating": "softmax", "moe_norm_topk": True}
_BENCH_FLAGS = {"profile": "a100", "max_batch": 32, "token_budget": 512}


def main_serve(args) -> int:
    import os
    bench = args.requests is not None
    other = _TEXT_FLAGS if bench else _BENCH_FLAGS         # the flags this mode does not read
    ignored = [f"--{k.replace('_', '-')}" for k, default in other.items()
               if getattr(args, k, default) != default]
    if ignored:
        what = "the --requests benchmark" if bench else "text generation (--prompt)"
        print(f"error: {' '.join(ignored)}: {what} does not read "
              f"{'it' if len(ignored) == 1 else 'them'}; drop "
              f"{'it' if len(ignored) == 1 else 'them'}, or "
              f"{'give --prompt TEXT instead of --requests' if bench else 'add --requests FILE'}",
              file=sys.stderr)
        return 2
    if args.requests is not None:           # the serving benchmark (bench_cli.py)
        from .bench_cli import main_bench
        if args.prompt is not None:
            print("error: --prompt with --requests: give one (text, or the benchmark's "
                  "requests file)", file=sys.stderr)
            return 2
        return main_bench(args)
    if args.prompt is None:
        print("error: give --prompt TEXT (the text to continue), or --requests FILE for a "
              "serving benchmark", file=sys.stderr)
        return 2
    if args.preset not in servable_presets():
        _invalid_preset(args.preset)

    import torch

    from ..models.data import TOKENIZER
    from .generate import generate
    bad = _check(args)
    if bad is None and args.checkpoint is not None and not os.path.isdir(args.checkpoint):
        bad = f"--checkpoint {args.checkpoint}: no such folder; give a checkpoint saved by " \
              "`python -m workbench train ... --save DIR`"
    if bad:
        print(f"error: {bad}", file=sys.stderr)
        return 2
    distributed = args.backend == "torch"
    try:
        if distributed:
            from ..sim_mesh import backends
            backends.init()
        prompt = TOKENIZER.encode(args.prompt)[None]                       # (1, S)
        from ..models.config import get_config
        from ..recipes.moe import moe_overrides
        cfg = get_config(args.preset, **moe_overrides(args))
        served = load_served(cfg, args.checkpoint, dp=args.dp, tp=args.tp,
                             seed=args.seed, distributed=distributed)
        # one prompt: every dp replica serves a copy of it (rows are split over dp)
        idx = prompt.expand(args.dp, -1).contiguous() if args.dp > 1 else prompt
        # one generator per copy, seeded alike: each draws one device's tokens
        gen = [torch.Generator().manual_seed(args.seed) for _ in range(idx.shape[0])]
        out = generate(served.model, served.place(idx), args.max_new_tokens,
                       temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                       generator=gen).full()
    except (ValueError, TypeError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not distributed:
        print(TOKENIZER.decode(out[0]))
        return 0
    from ..sim_mesh import backends
    if backends.rank() == 0:
        print(TOKENIZER.decode(out[0]), flush=True)
    backends.shutdown()
    return 0
