"""Run under torchrun (gloo, 2 processes): FullyShardedDataParallel with the root kept
gathered, a write through ``.data`` into ``2.weight`` between forward and backward, on
every rank (``all``) or on rank 0's chunk alone (``rank0``); each rank prints one JSON
row per case: the largest difference of its gradient chunks from one device's and the
re-gathers recorded (tests/test_fsdpdata17.py)."""
import json

import torch
import torch.distributed as dist

import workbench as wb
from tests.test_fsdpdata17 import _mlp, _xy


def chunk_diff(f, ref, n, k) -> float:
    """The largest difference of rank ``k``'s gradient chunks (flat, padded to ``n``
    equal chunks, as FSDP holds them) of wrapper ``f`` from one device's ``ref``."""
    diff = 0.0
    for (_, p), w in zip(f.named_parameters(), ref.parameters()):
        flat = w.grad.reshape(-1)
        flat = torch.cat([flat, flat.new_zeros(-flat.numel() % n)]).view(n, -1)[k]
        g = p.grad.detach().as_subclass(torch.Tensor).reshape(-1)
        diff = max(diff, (g - flat).abs().max().item())
    return diff


def main():
    wb.distributed.init(timeout_s=60)
    n, k = dist.get_world_size(), dist.get_rank()
    x, y = _xy()
    for case in ("all", "rank0"):
        ref = _mlp()
        loss = ((ref(x) - y) ** 2).mean()
        numel = ref[2].weight.numel()
        chunk = -(-numel // n)
        # one device: the same elements written through .data (no version bump)
        ref[2].weight.data.view(-1)[:numel if case == "all" else chunk].mul_(2)
        loss.backward()
        m = _mlp()
        f = wb.FullyShardedDataParallel(m)
        with wb.trace() as tr:
            out = f(x.chunk(n)[k])
            loss = ((out - y.chunk(n)[k]) ** 2).mean()
            if case == "all" or k == 0:
                m[2].weight.data.mul_(2)
            loss.backward()
        diff = chunk_diff(f, ref, n, k)
        regather = sum(e.label == "fsdp re-gather root" for e in tr.collectives())
        print(json.dumps({"rank": k, "case": case, "diff": diff, "regather": regather}),
              flush=True)
    wb.distributed.shutdown()


if __name__ == "__main__":
    main()
