"""tests/spmd_harness.check_op builds each input's DistTensor for a placement once a call
(task speed17b), and builds it again where the op changed it in place."""
import torch

import workbench as wb
from tests import spmd_harness as H

MESH2 = wb.Mesh.grid(2, ["a"])


def _counting(monkeypatch):
    built = []
    orig = H.distribute

    def distribute(x, mesh, ps, seed=0):
        built.append((seed, tuple(str(p) for p in ps)))
        return orig(x, mesh, ps, seed=seed)
    monkeypatch.setattr(H, "distribute", distribute)
    return built


def test_each_input_placement_is_built_once_a_call(monkeypatch):
    built = _counting(monkeypatch)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(5, 6, generator=g), torch.randn(5, 6, generator=g)
    n = H.check_op(torch.add, [x, y], meshes=[MESH2])
    # R, S(0), S(1), P(sum) for each input: 16 combinations, 4 + 4 tensors
    assert n == 16
    assert sorted(built) == sorted({(i, (str(p),)) for i in (0, 1)
                                    for p in H.placement_options(2)})


def test_an_input_changed_in_place_is_built_again(monkeypatch):
    built = _counting(monkeypatch)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(5, 6, generator=g), torch.randn(5, 6, generator=g)

    def fn(a, b):
        # on DistTensors: doubles a in place, then gives its value from before; a stale
        # (doubled) a met by the next combination would give twice one device's sum
        if isinstance(a, wb.DistTensor):
            return a.mul_(2).div(2) + b
        return a + b
    assert H.check_op(fn, [x, y], meshes=[MESH2]) == 16
    assert len(built) == 16 + 4          # every combination's a anew, b once a placement
