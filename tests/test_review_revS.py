"""Review of the fixlist4 / habits4 merges (revS): each test holds a result to plain
PyTorch (one device, or torch's own wrapper) and failed before its fix."""
import torch
from torch import nn

import workbench as wb


# ---- 1. DDP over DistTensors: parameters(recurse=False) is torch DDP's (none) ------------

class _Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.fc = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(self.lin(x))


def test_ddp_over_disttensors_parameters_recurse_false_is_empty_as_torch_ddps():
    """torch DDP holds no parameter of its own, so ``ddp.parameters(recurse=False)`` and
    ``named_parameters(recurse=False)`` are both empty (``nn.Module``'s, the module a
    child).  DDP over DistTensors gave every replica for ``parameters(recurse=False)``
    (4 here) while ``named_parameters(recurse=False)`` gave none; recurse=True unchanged."""
    torch.manual_seed(0)
    ref = _Two()
    want = (len(list(ref.parameters(recurse=False))), len(list(ref.parameters())))
    assert want == (0, 4)
    torch.manual_seed(0)
    m = _Two()
    mesh = wb.Mesh.grid((2, 2), ["dp", "tp"])
    wb.parallelize(m, mesh, {"lin": "colwise", "fc": "rowwise"}, mesh_dim="tp")
    ddp = wb.DistributedDataParallel(m, mesh, "dp")
    assert type(ddp).__name__ == "DistTensorDDP"
    assert list(ddp.parameters(recurse=False)) == []                 # was 4 replicas
    assert list(ddp.named_parameters(recurse=False)) == []
    assert len(list(ddp.parameters())) == want[1]
    assert [id(p) for p in ddp.parameters()] == [id(p) for _, p in ddp.named_parameters()]
