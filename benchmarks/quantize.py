"""What int8 and int4 weights cost in accuracy on the trained tiny model, and buy in memory
and decode time on the roofline.

    python benchmarks/quantize.py [--steps 300] [--seed 0] [--profile h100]

Trains the course's tiny Llama on the fables (AdamW, the defaults of ``train``), then
quantizes its linear layers (``workbench.serve.quantize``: int8 per output channel,
int4 in groups of 32) and measures, on held-out batches: loss, perplexity, the largest
logit error and how often the greedy token agrees; and the linear weights' bytes as the
tensors hold them.  Then the decode step of llama2-7b after a 512-token prompt on the
profile's roofline (``workbench.serve.roofline.step_cost``) at bf16, int8 and int4.
Every number is measured or computed here, none is typed in.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import workbench as wb  # noqa: E402
from workbench.serve.quantize import quantization_error, quantize_model, weight_bytes  # noqa: E402
from workbench.serve.roofline import step_cost  # noqa: E402


def trained_tiny(steps: int, seed: int):
    cfg = wb.models.get_config("tiny")
    model = wb.models.build_model(cfg, seed=seed).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    for x, y in wb.models.batches(cfg, 16, seed=seed, steps=steps):
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return cfg, model.eval()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", default="h100")
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    cfg, model = trained_tiny(args.steps, args.seed)
    x, y = wb.models.get_batch(cfg, 64, seed=args.seed + 1, split="val")
    base = weight_bytes(model)["linear"]
    print(f"tiny Llama after {args.steps} steps; 64 held-out sequences of {cfg.seq_len}")
    print(f"{'weights':<8}{'loss':>8}{'ppl':>8}{'d loss':>9}{'max |dz|':>10}{'argmax =':>10}"
          f"{'linear bytes':>14}")
    print(f"{'fp32':<8}{quantization_error(model, model, x, y)['loss']:>8.4f}"
          f"{'':>26}{'':>10}{base:>14,}")
    for bits in (8, 4):
        q = quantize_model(model, bits)
        e = quantization_error(model, q, x, y)
        print(f"{'int' + str(bits):<8}{e['loss_quantized']:>8.4f}{e['perplexity_quantized']:>8.3f}"
              f"{e['loss_delta']:>+9.4f}{e['logits_max_abs_error']:>10.4f}"
              f"{e['argmax_agreement']:>10.2%}{weight_bytes(q)['linear']:>14,}")
    print(f"\nllama2-7b, one decode step after 512 tokens, batch 1, on {args.profile} "
          "(weights + KV cache read; activations and launches not counted):")
    base = None
    for bits in (16, 8, 4):
        r = step_cost("llama2-7b", batch=1, new_tokens=1, context=512, weight_bits=bits,
                      profile=args.profile)
        base = base or r.seconds
        print(f"  {'bf16' if bits == 16 else 'int' + str(bits):<5} weights {r.weight_bytes / 1e9:6.2f} GB"
              f"  step {r.seconds * 1e3:6.2f} ms  ({base / r.seconds:.2f}x)  {r.bound}-bound, "
              f"{r.intensity:.2f} FLOP/B")


if __name__ == "__main__":
    main()
