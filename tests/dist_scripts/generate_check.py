"""Run under torchrun (2 processes): the tiny Llama and GPT (vocabulary 76) served with
tensor parallelism over the two processes; rank 0 prints the generated tokens, greedy
and sampled, as one JSON line (tests/test_generate.py holds them to one device)."""
import json

import torch

import workbench as wb
from workbench.serve import generate, serve_model

wb.distributed.init(timeout_s=60)
prompt = torch.randint(0, 75, (2, 5), generator=torch.Generator().manual_seed(1))
greedy = {}
for preset in ("tiny", "gpt-tiny"):
    s = serve_model(wb.models.get_config(preset, vocab_size=76), tp=2, seed=0, distributed=True)
    greedy[preset] = generate(s.model, s.place(prompt), 6).full().tolist()
s = serve_model(wb.models.get_config("tiny", vocab_size=76), tp=2, seed=0, distributed=True)
sampled = generate(s.model, s.place(prompt), 6, generator=torch.Generator().manual_seed(7),
                   temperature=0.9, top_k=30, top_p=0.9).full().tolist()
if wb.distributed.rank() == 0:
    print(json.dumps({"greedy": greedy, "sampled": sampled}), flush=True)
torch.distributed.barrier()
wb.distributed.shutdown()
