"""Run under torchrun (gloo): ``wb.fully_shard`` on the default process group (mesh=None),
blocks then root, trains as one device, with and without gradient accumulation
(``set_requires_gradient_sync``).  Rank 0 prints one JSON line per case: the largest
difference to one device's parameters, and the reduce-scatters per step."""
import json

import torch
import torch.distributed as dist

import workbench as wb
from tests.test_fully_shard import batches, loss_of, make


def train(micro, sharded):
    m = make()
    if sharded:
        for b in m.blocks:
            wb.fully_shard(b)
        wb.fully_shard(m)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    n, k = (dist.get_world_size(), dist.get_rank()) if sharded else (1, 0)
    data, reduces = batches(2 * micro), []
    for s in range(2):
        opt.zero_grad()
        with wb.trace() as tr:
            for i in range(micro):
                ids, y = data[s * micro + i]
                if sharded:
                    m.set_requires_gradient_sync(i == micro - 1)
                    ids, y = ids.chunk(n)[k], y.chunk(n)[k]
                (loss_of(m(ids), y) / micro).backward()
        reduces.append(sum(e.name == "reduce_scatter" for e in tr.collectives()))
        opt.step()
    sd = m.state_dict()
    return {name: v.full() if isinstance(v, wb.DistTensor) else v for name, v in sd.items()}, \
        reduces


def main():
    wb.distributed.init(timeout_s=60)
    for micro in (1, 3):
        got, reduces = train(micro, True)
        ref, _ = train(micro, False)
        d = max((got[name] - ref[name]).abs().max().item() for name in ref)
        if dist.get_rank() == 0:
            print(json.dumps({"micro": micro, "one_device": d, "reduce_scatters": reduces}),
                  flush=True)
    wb.distributed.shutdown()


if __name__ == "__main__":
    main()
