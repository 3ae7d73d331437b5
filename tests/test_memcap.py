"""Device memory as the device's runtime reports it (profiles' ``memory_bytes``)."""
import json
import os

import pytest

from workbench.sim_mesh.profiles import get_profile

MEAS = os.path.join(os.path.dirname(__file__), "..", "workbench", "sim_mesh", "measurements")


def test_h100_capacity_is_the_measured_total_memory():
    # the H100 SXM 80GB HBM3 measured here: torch.cuda.get_device_properties().total_memory
    with open(os.path.join(MEAS, "h100-sxm-80gb.json")) as fh:
        measured = json.load(fh)["environment"]["memory_bytes"]
    h100 = get_profile("h100")
    assert h100.memory_bytes == measured
    assert "MEASURED" in h100.citations["memory_bytes"]


@pytest.mark.parametrize("name", ["a100", "a100-jeanzay"])
def test_a100_capacity_is_pytorchs_total_capacity(name):
    # PyTorch's out-of-memory message on an A100 80GB: '79.25 GiB' total capacity
    p = get_profile(name)
    assert p.memory_bytes == round(79.25 * 2 ** 30)
    assert "79.25 GiB" in p.citations["memory_bytes"]
    assert "80 GB" in p.notes                    # the datasheet's figure kept in the notes
    # the capacity the planner counts usable is what CUDA reports less the margins
    rt = p.runtime_memory
    assert p.usable_memory() == pytest.approx(
        79.25 * 2 ** 30 * (1 - rt["fragmentation"]) - rt["context_bytes"])


def test_ascend_capacity_is_marked_uncertain():
    p = get_profile("ascend-910b")
    assert p.memory_bytes == 64e9
    assert "UNCERTAIN" in p.citations["memory_bytes"]
