"""Audit of eager DistTensor dispatch against plain PyTorch: a user's custom
``torch.autograd.Function`` on DistTensors, ``torch.autocast``, and ``wb.parallelize``'s
plan argument.  Every value and gradient is held to one device's."""
import pytest
import torch
from torch import nn

import workbench as wb
from workbench import Partial, Replicate, Shard


# ---- wb.parallelize(model, mesh, "colwise") --------------------------------------------

def test_parallelize_style_string_on_a_sequential_names_the_fix():
    # was: "dictionary update sequence element #0 has length 1; 2 is required"
    mesh = wb.Mesh.grid((2,))
    m = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"plan='colwise'.*no parameters of its own.*'0'"):
        wb.parallelize(m, mesh, "colwise")
    assert type(m[0].weight) is nn.Parameter          # nothing changed


@pytest.mark.parametrize("plan", [3, ["colwise"], "col"])
def test_parallelize_plan_of_the_wrong_type_names_the_argument(plan):
    with pytest.raises(TypeError, match=r"parallelize\(plan=.*expected a dict"):
        wb.parallelize(nn.Linear(4, 4), wb.Mesh.grid((2,)), plan)


def test_parallelize_given_a_parallel_style_points_to_parallelize_module():
    with pytest.raises(TypeError, match="wb.parallelize_module"):
        wb.parallelize(nn.Linear(4, 4), wb.Mesh.grid((2,)), wb.ColwiseParallel())


def test_parallelize_style_string_applies_to_the_module_itself():
    # as torch's parallelize_module(linear, mesh, ColwiseParallel())
    torch.manual_seed(0)
    lin, ref = nn.Linear(4, 6), nn.Linear(4, 6)
    ref.load_state_dict(lin.state_dict())
    mesh = wb.Mesh.grid((2,))
    wb.parallelize(lin, mesh, "colwise")
    assert lin.weight.placements == (Shard(0),) and lin.bias.placements == (Shard(0),)
    x = torch.randn(3, 4)
    torch.testing.assert_close(lin(wb.shard_tensor(x, mesh, [Replicate()])).full(), ref(x))
