"""``mesh["dp"]`` under torchrun is the sub-mesh through this process's rank (DeviceMesh's
``__getitem__``), with the parent's process groups: it was the one through rank 0 on
every process, so ranks 2 and 3 of a 2 x 2 mesh got ranks [0, 1] for "tp" and a
collective over a group they are not in.  On simulated ranks it stays the sub-mesh
through the first rank (there is no current rank)."""
import pytest

import workbench as wb
from tests.torchrun_support import four_proc, json_rows


def test_sub_mesh_by_name_on_simulated_ranks_is_through_the_first_rank():
    mesh = wb.init_device_mesh("cpu", (2, 3), mesh_dim_names=("dp", "tp"))
    assert list(mesh["tp"].ranks) == [0, 1, 2]
    assert list(mesh["dp"].ranks) == [0, 3]
    assert mesh["dp", "tp"] == mesh


@pytest.mark.slow
def test_sub_mesh_by_name_under_torchrun_is_through_this_process_as_device_mesh(
        tmp_path_factory):
    # one launch: every 4-process part (torchrun_support.FOUR_PROC)
    out, text = four_proc(tmp_path_factory, "device_mesh_slice_check.py")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = sorted(json_rows(text), key=lambda r: r["rank"])
    assert [r["rank"] for r in rows] == [0, 1, 2, 3], text
    for r in rows:
        for name in ("dp", "tp"):
            assert r[name] == r["torch_" + name], r            # DeviceMesh's sub-mesh
            assert r["rank"] in r[name], r
            assert r["sum_" + name] == [float(sum(r[name]))] * 2, r
        assert r["both"] == [0, 1, 2, 3], r
