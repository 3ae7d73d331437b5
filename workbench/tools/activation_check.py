"""The activation bytes ONE rank keeps for backward in the GPT layer of Korthikanti et
al. 2022, under tensor parallelism and under sequence parallelism, counted exactly (on
torch.distributed each process holds only its own shards), against their Table 2:

    torchrun --nproc-per-node 2 -m workbench.tools.activation_check

Prints one line per case: counted, formula, the explained extra, and whether
counted == formula + extra.  The last case is sequence parallelism with
``regather=False``: the column-parallel linears keep their all-gathered input instead
of its shard (Megatron-LM keeps the shard and gathers it again in backward).  A last
line checks sequence parallelism under bf16 autocast over an fp32 layer: the linears keep
the shard and gather it again, with the fp32 run's collectives, and x's gradient is one
device's under the same autocast."""
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


def _autocast_run(autocast):
    """The SP layer in fp32, with or without bf16 autocast: what the QKV and fc1 linears
    keep, the collectives traced, and x's gradient (this rank's shard)."""
    torch.manual_seed(0)
    layer = GPTLayer(32, 4, dropout=0.0, dtype=torch.float32)
    wb.parallelize(layer, mesh, TP_PLAN)
    for m in (layer.attn, layer.mlp):
        tensor_parallel_region(m, mesh, "tp", True, seq_dim=0)
    X = torch.randn(16, 2, 32, generator=torch.Generator().manual_seed(0))
    x = wb.shard_tensor(X, mesh, [wb.Shard(0)]).requires_grad_()
    on, kept = [False], []
    for n in ("attn.qkv", "mlp.fc1"):
        m = layer.get_submodule(n)
        m.register_forward_pre_hook(lambda *a: on.__setitem__(0, True))
        m.register_forward_hook(lambda *a: on.__setitem__(0, False))
    with wb.trace() as tr:
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t: (kept.append((tuple(t.shape), t.dtype)) if on[0] else None) or t,
                lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = layer(x)
        (y.float() ** 2).sum().backward()
    colls = sorted((e.name, e.label) for e in tr.events
                   if e.name in ("all_gather", "all_reduce", "reduce_scatter"))
    inputs = [s for s, _ in kept if s == tuple(x._local.shape)]
    # one device, plain torch, the same autocast: this rank's rows of x's gradient
    torch.manual_seed(0)
    ref = GPTLayer(32, 4, dropout=0.0, dtype=torch.float32)
    Xr = X.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        yr = ref(Xr)
    (yr.float() ** 2).sum().backward()
    mine = Xr.grad.chunk(t, 0)[wb.distributed.rank()]
    close = torch.allclose(x.grad.to_local(), mine, rtol=2e-2, atol=2e-2)
    return inputs, colls, close


# bf16 autocast over an fp32 SP layer keeps the shard and re-gathers, as fp32 does
fp32, bf16 = _autocast_run(False), _autocast_run(True)
autocast_ok = (len(bf16[0]) == 2 and bf16[0] == fp32[0] and bf16[1] == fp32[1]
               and fp32[2] and bf16[2])
if wb.distributed.rank() == 0:
    for case, (counted, formula, extra) in results.items():
        print(f"{case} counted {counted} formula {formula:.0f} extra {extra} "
              f"equal {counted == formula + extra}", flush=True)
    print(f"tp+sp under bf16 autocast: linears keep {len(bf16[0])} shards (fp32 {len(fp32[0])}), "
          f"collectives as fp32 {bf16[1] == fp32[1]} ({sum(1 for c in bf16[1] if c[1] == 'f: re-gather')} "
          f"re-gathers), x grad as one device {bf16[2]}, ok {autocast_ok}", flush=True)
torch.distributed.barrier()
wb.distributed.shutdown()
