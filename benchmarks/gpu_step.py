"""One GPU, one whole training step of a Megatron-shaped GPT in plain PyTorch, timed, and
the same step as the planner prices it on the measured profile.

    python benchmarks/gpu_step.py --out step.json                 # a CUDA GPU, ~1 min
    python benchmarks/gpu_step.py --smoke --out /tmp/s.json       # CPU, tiny
    python benchmarks/gpu_step.py --compare step.json --profile h100   # here: the planner

What it times (bf16 weights, AdamW fused, fp32 loss): ``micro_batches`` forward and
backward passes of micro-batch 1, then the optimizer step; embedding, pre-LN blocks
(``gpu_components.GPTLayer``: causal SDPA, GeLU MLP, hidden dropout 0.1), final
LayerNorm, an untied head over the vocabulary and the cross-entropy on fp32 logits.
There is no communication: it checks the compute half of the planner on one device
(layers, head, loss, optimizer) against the card, not any published run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_components import GPTLayer, environment  # noqa: E402

CASES = {"gpt-1.7b": dict(h=2048, heads=16, layers=24, vocab=131072, seq=4096),
         "smoke": dict(h=32, heads=2, layers=2, vocab=64, seq=16)}


class GPT(torch.nn.Module):
    def __init__(self, h, heads, layers, vocab, seq):
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(vocab, h), torch.nn.Embedding(seq, h)
        self.blocks = torch.nn.ModuleList(GPTLayer(h, heads) for _ in range(layers))
        self.ln = torch.nn.LayerNorm(h)
        self.head = torch.nn.Linear(h, vocab, bias=False)

    def forward(self, ids, targets):
        x = F.dropout(self.tok(ids) + self.pos.weight[: ids.shape[1]], 0.1)
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def run(case, micro_batches, steps, device):
    torch.manual_seed(0)
    c = CASES[case]
    model = GPT(**c).to(device, torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    ids = torch.randint(0, c["vocab"], (micro_batches, 1, c["seq"]), device=device)
    tgt = torch.randint(0, c["vocab"], (micro_batches, 1, c["seq"]), device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step():
        for i in range(micro_batches):
            (model(ids[i], tgt[i]) / micro_batches).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    times = []
    for _ in range(steps + 2):              # two warm-ups
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    times = sorted(times[2:])
    params = sum(p.numel() for p in model.parameters())
    return {**c, "case": case, "micro_batches": micro_batches, "params": params,
            "step_s": times[len(times) // 2], "steps_s": times,
            "max_memory_bytes": (torch.cuda.max_memory_allocated() if device.type == "cuda"
                                 else None)}


def compare(path, profile):
    """The planner's estimate of the timed step (dp1 tp1 pp1, ``profile``) beside it."""
    import workbench as wb
    data = json.load(open(path))
    r = data["step"] if "step" in data else data["steps"][0]
    cfg = wb.models.ModelConfig(arch="gpt", vocab_size=r["vocab"], seq_len=r["seq"],
                                n_layer=r["layers"], n_head=r["heads"], d_model=r["h"],
                                tie_embeddings=False, dropout=0.1, dtype="bfloat16")
    lay = wb.plan.Layout(dp=1, micro_batch=1, global_batch=r["micro_batches"])
    e = wb.plan.estimate(cfg, lay, wb.plan.Cluster(profile, 1), attention="flash")
    return {"measured_s": r["step_s"], "estimated_s": e.step_time,
            "estimated_over_measured": e.step_time / r["step_s"],
            "breakdown": e.breakdown, "explain": e.explain()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--compare", metavar="JSON")
    ap.add_argument("--profile", default="h100")
    args = ap.parse_args(argv)
    if args.compare:
        res = compare(args.compare, args.profile)
        print(res["explain"])
        print(f"measured {res['measured_s']:.4f} s, estimated {res['estimated_s']:.4f} s: "
              f"estimate / measured {res['estimated_over_measured']:.3f}")
        return res
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    res = {"environment": environment(device),
           "step": run("smoke" if args.smoke else "gpt-1.7b", args.micro_batches,
                       2 if args.smoke else args.steps, device)}
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res["step"]))
    return res


if __name__ == "__main__":
    main()
