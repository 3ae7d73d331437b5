"""The activation bytes ONE rank keeps for backward in the GPT layer of Korthikanti et
al. 2022, under tensor parallelism and under sequence parallelism, counted exactly (on
torch.distributed each process holds only its own shards), against their Table 2:

    torchrun --nproc-per-node 2 -m workbench.tools.activation_check

Prints one line per case: counted, formula, the explained extra, and whether
counted == formula + extra.  The last case is sequence parallelism with
``regather=False``: the column-parallel linears keep their all-gathered input instead
of its shard (Megatron-LM keeps the shard and gathers it again in backward)."""
import torch

import workbench as wb
from workbench.models.gpt import GPTLayer, TP_PLAN
from workbench.parallel.strategies.memory import saved_activation_bytes
from workbench.parallel.strategies.tensor_parallel import tensor_parallel_region
from workbench.sim_mesh.estimates import activation_bytes_per_layer

wb.distributed.init()
t = wb.distributed.world_size()
mesh = wb.distributed.mesh((t,), ("tp",))
s, b, h, a = 64, 2, 64, 4
results = {}
for sp, regather in ((False, True), (True, True), (True, False)):
    layer = GPTLayer(h, a)
    wb.parallelize(layer, mesh, TP_PLAN)

    for m in (layer.attn, layer.mlp):  # Megatron's f and g (sequence-first: the sequence is dim 0)
        tensor_parallel_region(m, mesh, "tp", sp, seq_dim=0, regather=regather)
    X = torch.randn(s, b, h, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    x = wb.shard_tensor(X, mesh, [wb.Shard(0) if sp else wb.Replicate()]).requires_grad_()
    params = [p for _, p in wb.dist_parameters(layer)] + [x]
    out, rep = saved_activation_bytes(layer, x, params=params)   # one process = one rank
    case = "tp+sp" if sp else "tp"
    formula = activation_bytes_per_layer(s, b, h, a, tp=t, case=case)
    case += "" if regather else " (regather=False)"
    split = t if sp else 1                          # what lives between the blocks
    # the layer's input is a model input here (not saved by the layer), but Table 2
    # counts the first LayerNorm's input: add it back (2 sbh, split under SP)
    counted = rep.bytes + 2 * s * b * h // split
    # dropout keeps a one-byte mask (ops_table/dropout.py, as ATen's native_dropout), exactly
    # Table 2's "dropout mask" terms: nothing extra
    stats = 2 * 2 * s * b * 2 // split                       # LayerNorm mean and 1/std
    # Megatron-SP keeps the SHARD of each column-parallel linear's input and all-gathers it
    # again in backward, as f does; with regather=False the two gathered inputs
    # (2 sbh each) are kept instead of their shards
    gathered = 2 * (2 * s * b * h - 2 * s * b * h // t) if sp and not regather else 0
    results[case] = (counted, formula, stats + gathered)
if wb.distributed.rank() == 0:
    for case, (counted, formula, extra) in results.items():
        print(f"{case} counted {counted} formula {formula:.0f} extra {extra} "
              f"equal {counted == formula + extra}", flush=True)
torch.distributed.barrier()
wb.distributed.shutdown()
