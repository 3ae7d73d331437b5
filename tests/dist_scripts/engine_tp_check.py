"""Run under torchrun (2 processes): the serving engine on the tiny Llama and GPT
(vocabulary 76) laid out with tensor parallelism over the two processes, a pool small
enough to preempt; rank 0 prints every request's tokens (greedy, and seeded sampling)
and the pool's bytes per rank as one JSON line (tests/test_serve_engine_tp.py holds them
to the simulation)."""
import json

import torch

import workbench as wb
from workbench.serve import serve_model
from workbench.serve.engine import Engine

wb.distributed.init(timeout_s=60)
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(0, 75, (n,), generator=g).tolist() for n in (1, 3, 4, 5, 11, 2)]
news = [9, 8, 9, 3, 8, 5]
out = {}
for preset in ("tiny", "gpt-tiny"):
    s = serve_model(wb.models.get_config(preset, vocab_size=76), tp=2, seed=0, distributed=True)
    e = Engine(s.model, num_blocks=5, block_size=4, max_batch=3, token_budget=6)
    out[preset] = e.generate_all(prompts, news)
    out[preset + "/preempted"] = sum(len(r.preempted) for r in e.log)
    out[preset + "/bytes_per_block"] = e.memory().bytes_per_block
    e = Engine(s.model, num_blocks=5, block_size=4, max_batch=3, token_budget=6)
    for i, (p, n) in enumerate(zip(prompts, news)):
        e.add_request(i, p, n, temperature=0.8, top_k=20, top_p=0.95, seed=10 + i)
    out[preset + "/sampled"] = [e.run()[i] for i in range(len(prompts))]
if wb.distributed.rank() == 0:
    print(json.dumps(out), flush=True)
torch.distributed.barrier()
wb.distributed.shutdown()
