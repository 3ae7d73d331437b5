"""Mesh: construction, coordinates, process groups, sub-meshes, errors."""
import pytest
import torch

from workbench import Mesh


def test_grid_and_facts():
    m = Mesh.grid((2, 4), ("dp", "tp"))
    assert m.shape == (2, 4) and m.ndim == 2 and m.size == 8
    assert m.ranks == tuple(range(8))
    assert m.coordinate(6) == (1, 2)
    assert m.rank_at((1, 2)) == 6
    assert m.groups("tp") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert m.groups("dp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert m.group_of(5, "dp") == (1, 5)


def test_nested_list_and_submesh():
    m = Mesh([[4, 5], [6, 7]], dim_names=["dp", "tp"])
    assert m.coordinate(7) == (1, 1)
    assert m["tp"] == Mesh([4, 5], dim_names=["tp"])
    assert m.submesh("dp", rank=5) == Mesh([5, 7], dim_names=["dp"])
    assert m[1] == Mesh([6, 7], dim_names=["tp"])
    assert m[0:1].shape == (1, 2)
    assert Mesh(torch.arange(4).reshape(2, 2)).ranks == (0, 1, 2, 3)


def test_disjoint_meshes_coexist():
    a = Mesh([[0, 1], [2, 3]], ["dp", "tp"])
    b = Mesh([[4, 5], [6, 7]], ["dp", "tp"])
    assert not a.overlaps(b) and a != b and a.shape == b.shape


def test_three_d_groups_cover_every_rank_once():
    m = Mesh.grid((2, 3, 2), ("pp", "dp", "tp"))
    for d in range(3):
        gs = m.groups(d)
        assert sorted(r for g in gs for r in g) == list(range(12))
        assert all(len(g) == m.shape[d] for g in gs)


@pytest.mark.parametrize("ranks,match", [
    ([[0, 1], [2]], "not rectangular"),
    ([0, 1, 1], "repeat"),
    ([], "non-empty"),
    ([0, -1], "non-negative"),
])
def test_bad_ranks(ranks, match):
    with pytest.raises(ValueError, match=match):
        Mesh(ranks)


def test_bad_names_and_dims():
    with pytest.raises(ValueError, match="one name per dimension"):
        Mesh([[0, 1]], dim_names=["x"])
    with pytest.raises(ValueError, match="repeats"):
        Mesh([[0, 1]], dim_names=["x", "x"])
    m = Mesh.grid(4, ["tp"])
    with pytest.raises(ValueError, match="not in dim_names"):
        m.groups("dp")
    with pytest.raises(ValueError, match="not in this mesh"):
        m.coordinate(9)


def test_indexing_errors_name_the_range():
    m = Mesh.grid((2, 3), ("dp", "tp"))
    with pytest.raises(IndexError, match=r"mesh\[5\].*'dp' has size 2.*\[-2, 1\]"):
        m[5]
    assert m[-1] == Mesh([3, 4, 5], dim_names=["tp"])
    with pytest.raises(TypeError, match=r"mesh\[True\]"):
        m[True]
    with pytest.raises(ValueError, match="out of range"):
        m.dim(True)
    with pytest.raises(ValueError, match="positive int"):
        Mesh.grid((2, True))
