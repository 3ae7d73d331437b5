"""Run under torchrun (gloo, 2 processes): tests/test_fixlist11.py's torchrun case; every
process prints one JSON line per case (with its rank).  Each case is a function of
``distributed``, so the test runs the same program on simulated ranks.

* ``zero3_clip``: fixlist9_check's ``zero_clip`` at zero 3: tiny, ``Hybrid(dp=2, zero=3)``,
  one step with ``strategy.clip_grad_norm_``: the norm, the parameters' checksum, the modeled
  step and the collectives the step's trace recorded (name, label, ranks; torchrun: this
  process's groups).
* ``split_gather`` / ``whole_gather``: two micro-batches of one stage on a tp 2 mesh whose
  matmuls gather an activation (``h = x * a``, read by two matmuls: one meeting point,
  ``gather_backward_dist._Meet`` on torch.distributed) and a weight (``v``) themselves;
  backward split as a zero-bubble schedule's (``B`` of both micro-batches into the stage
  inputs, then ``W`` of both into the weights) or whole (one backward per micro-batch):
  the gradients against plain PyTorch and the collectives each rank recorded.
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import workbench as wb  # noqa: E402
from workbench.sim_mesh.backward_pass import micro_batch, weight_pass  # noqa: E402
from workbench.sim_mesh.trace import trace  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fixlist9_check import zero_clip  # noqa: E402


def zero3_clip(distributed):
    """fixlist9's ZeRO clip program (one step, ``clip_grad_norm_``) at zero=3."""
    return zero_clip(distributed, 3)


def split_backward(mesh, split, mbs=2):
    """The program of ``split_gather`` (``split``) / ``whole_gather`` (module docstring)."""
    g = torch.Generator().manual_seed(0)
    Xs = [torch.randn(4, 6, generator=g) for _ in range(mbs)]
    A, W1, W2, V = (torch.randn(*s, generator=g).requires_grad_()
                    for s in ((4, 6), (6, 8), (6, 8), (6, 2)))
    a = wb.shard_tensor(A, mesh, [wb.Shard(0)])
    w1, w2, v = (wb.shard_tensor(t, mesh, [wb.Shard(1)]) for t in (W1, W2, V))
    seeds, xs = [], []
    with trace() as tr:
        for X in Xs:                                 # the forwards
            xl = X.clone().requires_grad_()
            h = wb.shard_tensor(xl, mesh, [wb.Shard(0)]) * a
            out = ((h @ w1) * (h @ w2)).sum() + (h @ v).sum()   # each matmul gathers h
            seeds.append(out._seed(torch.ones(()), "backward"))
            xs.append(xl)
        # each micro-batch's B and W under its key, as the pipeline executors run them
        # (sim_mesh.backward_pass.micro_batch: a node the micro-batches share is recorded
        # once per micro-batch, on both executors: recorded_by_b)
        for k, ((o, gr), xl) in enumerate(zip(seeds, xs)):     # B (or the whole backward)
            with micro_batch(k):
                torch.autograd.backward(o, gr, retain_graph=split,
                                        inputs=[xl] if split else None)
        if split:
            for k, (o, gr) in enumerate(seeds):                # W
                with micro_batch(k), weight_pass():
                    torch.autograd.backward(o, gr, inputs=[A, W1, W2, V])
    refs = [t.detach().clone().requires_grad_() for t in (A, W1, W2, V)]
    rx = [X.clone().requires_grad_() for X in Xs]
    for X in rx:
        h = X * refs[0]
        (((h @ refs[1]) * (h @ refs[2])).sum() + (h @ refs[3]).sum()).backward()
    diff = max(float((p.grad - r.grad).abs().max())
               for p, r in zip([A, W1, W2, V] + xs, refs + rx))
    own = wb.distributed.rank() if torch.distributed.is_initialized() else None
    comm = sorted([e.name, e.label, int(e.bytes), list(e.ranks)] for e in tr.events
                  if e.stream == "comm" and (own is None or own in e.ranks))
    return {"diff": diff, "collectives": comm}


if __name__ == "__main__":
    wb.distributed.init(timeout_s=60)
    rank = wb.distributed.rank()
    rows = [{"case": "zero3_clip", **zero3_clip(True)}]
    tp = wb.distributed.mesh((2,), ("tp",))
    rows += [{"case": f"{k}_gather", **split_backward(tp, k == "split")}
             for k in ("whole", "split")]
    for r in rows:
        print(json.dumps({"rank": rank, **r}), flush=True)
    torch.distributed.barrier()
    wb.distributed.shutdown()
