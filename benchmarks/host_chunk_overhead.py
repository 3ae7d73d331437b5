"""Host cost of the per-rank chunk loops in DeepSpeed v0.3.x ZeRO-3's list collectives.

    python benchmarks/host_chunk_overhead.py          # on a CUDA machine, ~10 s

DeepSpeed v0.3.13-0.3.16 (``partition_parameters.py``: ``_allgather_param`` and
``_reduce_scatter_gradient``) builds a Python list of ``world_size`` chunk views of one
parameter (``narrow`` per rank; the gather's loop also calls
``torch.distributed.get_rank(group=...)`` per rank) and passes it to
``torch.distributed.all_gather`` / ``reduce_scatter``; PyTorch's ProcessGroupNCCL
(``allgather``'s post hook / ``reduce_scatter``'s pre hook) then runs, per chunk,
``recordStream`` and ``copy_(..., non_blocking=True)`` between its flat buffer and the
list, on the NCCL stream.  A released parameter gets ``torch.ones(1).half().to(device)``
(``_partition_param``), a blocking copy.  This times those loops on one GPU (a
world-size-1 gloo group stands for the data-parallel group in ``get_rank``): host
seconds per chunk, best of several repetitions; the copies' GPU time is launch-bound
(each chunk is small), so it follows the host's.  It prints one JSON line;
``plan.zero3_2021`` cites the figures it printed on the H100 machine lent to this
project (torch 2.11.0+cu130, 2026-11-26):

    ds_allgather_loop 7.13e-06 (p 384) 6.62e-06 (p 1536); ds_reduce_scatter_loop 7.59e-06,
    7.36e-06; get_rank 2.16e-06, 2.09e-06; release_ones_to 2.10e-05 (one machine);
    record_copy (recordStream + copy_, from Python) 1.04e-05, 1.08e-05 (151 M elements,
    p 384, 1536), 1.39e-05, 1.05e-05 (604 M); copy_ alone 9.2e-06, 6.2e-06, 1.28e-05,
    9.6e-06; synchronize 9.6e-06 (another); on a third: record_copy 6.73e-06, 6.51e-06,
    9.34e-06, 6.43e-06; record_stream alone 4.3e-07, 4.0e-07, 4.3e-07, 4.3e-07; copy_ in a
    TorchScript loop (``script_copy``: no Python per call, as c10d's C++ loop)
    5.60e-06, 5.21e-06, 8.81e-06, 5.69e-06; copy_ from Python 6.34e-06, 5.92e-06,
    8.94e-06, 5.76e-06.  On this project's 2-core CPU machine (CPU tensors, the dispatch
    without CUDA): narrow 2.33e-06, view(-1) 1.11e-06 (ratio 0.48).
"""
import json
import os
import time
from typing import List

import torch
import torch.distributed as dist


@torch.jit.script
def _copies(views: List[torch.Tensor], srcs: List[torch.Tensor]):
    for i in range(len(views)):
        views[i].copy_(srcs[i], True)


def best(fn, reps=7):
    out = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t)
    torch.cuda.synchronize()
    return out


def main():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    dist.init_process_group("gloo", rank=0, world_size=1)
    group = dist.new_group([0])
    dev, stream = torch.device("cuda"), torch.cuda.Stream()
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    for numel in (151_000_000, 604_000_000):
        for p in (384, 1536):
            k = -(-numel // p)
            flat = torch.zeros(k * p, dtype=torch.float16, device=dev)
            other, src = torch.zeros_like(flat), torch.zeros(k, dtype=torch.float16, device=dev)
            views = [flat.narrow(0, i * k, k) for i in range(p)]
            srcs = [other.narrow(0, i * k, k) for i in range(p)]

            def ds_allgather_loop():          # _allgather_param's loop
                parts = []
                for i in range(p):
                    parts.append(flat.narrow(0, k * i, k))
                    if i == dist.get_rank(group=group):
                        parts[i].data.copy_(src.data, non_blocking=True)

            def ds_reduce_scatter_loop():     # _reduce_scatter_gradient's loop
                inputs = []
                for i in range(p):
                    start, end = i * k, i * k + k
                    if start < flat.numel() and end <= flat.numel():
                        x = flat.view(-1).narrow(0, start, k)
                    inputs.append(x)

            def script_copy():                # the copies without Python per call
                with torch.cuda.stream(stream):
                    _copies(views, srcs)

            def record_copy():                # ProcessGroupNCCL's per-chunk loop
                with torch.cuda.stream(stream):
                    for v, w in zip(views, srcs):
                        v.record_stream(stream)
                        v.copy_(w, non_blocking=True)

            out[f"{numel}/{p}"] = {
                "ds_allgather_loop": best(ds_allgather_loop) / p,
                "ds_reduce_scatter_loop": best(ds_reduce_scatter_loop) / p,
                "get_rank": best(lambda: [dist.get_rank(group=group) for _ in range(p)]) / p,
                "record_copy": best(record_copy) / p,
                "record_stream": best(lambda: [v.record_stream(stream) for v in views]) / p,
                "script_copy": best(script_copy) / p}
            del flat, other, src, views, srcs
            torch.cuda.empty_cache()

    def release():
        for _ in range(200):
            torch.ones(1).half().to(dev)
    out["release_ones_to"] = best(release) / 200
    out["synchronize"] = best(lambda: [torch.cuda.synchronize() for _ in range(2000)]) / 2000
    print(json.dumps(out))


if __name__ == "__main__":
    main()
