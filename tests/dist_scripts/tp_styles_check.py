"""torchtitan's tensor-parallel plan through wb.parallelize_module on torch.distributed
(torchrun, gloo, one process per tp rank): loss and gradients against one device; a plain
tensor given to a SequenceParallel norm is this process's shard, as torch's from_local."""
import copy
import json

import torch
import torch.nn.functional as F
from torch import nn

import workbench as wb
from tests.tp_llama import D, OURS, apply_plan, make


def main():
    wb.distributed.init(timeout_s=60)
    n, k = torch.distributed.get_world_size(), torch.distributed.get_rank()
    mesh = wb.distributed.mesh(n, ["tp"])
    ref, tokens, labels = make()
    loss_ref = F.cross_entropy(ref(tokens).flatten(0, 1), labels.flatten(0, 1))
    loss_ref.backward()
    model = copy.deepcopy(ref)
    model.zero_grad(set_to_none=True)
    apply_plan(OURS, model, mesh)
    with wb.loss_parallel():
        loss = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten(0, 1))
        loss.backward()
    grads = max((p.grad.full() - q.grad).abs().max().item()
                for p, q in zip(model.parameters(), ref.parameters()))
    torch.manual_seed(1)
    norm = nn.RMSNorm(D)
    x = torch.randn(2, 4 * n, D)
    sp = wb.parallelize_module(copy.deepcopy(norm), mesh, wb.SequenceParallel())
    y = sp(x.chunk(n, 1)[k])                       # this process's slice of the sequence
    print(json.dumps({"rank": k, "loss": [loss.full().item(), loss_ref.item()],
                      "grads": grads, "sp_shape": list(y.shape),
                      "sp": (y.full() - norm(x)).abs().max().item()}), flush=True)
    wb.distributed.shutdown()


if __name__ == "__main__":
    main()
