"""NCCL's collective channels for groups with few ranks per node (sim_mesh.nccl_channels):
the figures NCCL's graph search gives at each release read (NVIDIA/nccl src/graph/search.cc,
connect.cc, init.cc; the module docstring walks them), against the logged full-node figure."""
import pytest

from workbench.sim_mesh import nccl_channels as NC
from workbench.sim_mesh import nccl_tuning as N
from workbench.sim_mesh.kernel_cost import collective_sms, overlap_rate
from workbench.sim_mesh.profiles import get_profile

RELEASES = ("2.8.3", "2.10.3", "2.12.7", "2.20.5", "2.21.5")


def _chan(name, version, ppn):
    sm, pcie, nic, nvl, _ = NC.HOSTS[name]
    return NC.channels(version, sm, ppn, pcie, nic, nvl)


@pytest.mark.parametrize("version", RELEASES)
def test_dgx_a100_channels_by_ranks_per_node(version):
    # Gen4 x16 = 24 GB/s (< 25: never duplicated), one channel per GPU at speed 24, x2 by
    # ncclTopoPostset: 2 / 4 / 8 / 16
    assert [_chan("a100", version, k) for k in (1, 2, 4, 8)] == [2, 4, 8, 16]


@pytest.mark.parametrize("version", ("2.20.5", "2.21.5"))
def test_dgx_h100_channels_by_ranks_per_node(version):
    # Gen5 x16 = 48 GB/s: 1 channel at 48 per GPU, ncclTopoDupChannels doubles it (at most
    # 4 channels at under 50 GB/s), x2 by ncclTopoPostset: 4 / 8 / 16; 8 GPUs: 8 at 48,
    # not duplicated (more than 4), x2 = 16
    assert [_chan("h100", version, k) for k in (1, 2, 4, 8)] == [4, 8, 16, 16]


@pytest.mark.parametrize("name", ("a100", "h100"))
def test_full_node_matches_the_logged_channels(name):
    # the profiles' collective_sms: 16 channels in NCCL's logs across 8-NIC DGX nodes
    version = "2.21.5" if name == "h100" else "2.12.7"
    assert _chan(name, version, 8) == get_profile(name).topology.collective_sms == 16


def test_data_parallel_group_sms_follow_ranks_per_node():
    h = N.with_nccl("h100", "2.21.5")
    assert [collective_sms(h, [i * tp for i in range(48)]) for tp in (1, 2, 4, 8)] == \
        [16, 16, 8, 4]
    assert overlap_rate(h, [8 * i for i in range(48)]) == pytest.approx((132 - 4) / 132)
    a = N.with_nccl("a100", "2.8.3")
    assert collective_sms(a, [8 * i for i in range(32)]) == 2
    assert collective_sms(a, [4 * i for i in range(32)]) == 4
    assert collective_sms(a, list(range(8))) == 24          # inside a node: unchanged
    # uneven groups: NCCL keeps the fewest (min over ranks, init.cc allGather3)
    assert collective_sms(a, [0, 1, 8]) == 2


def test_unread_profiles_and_releases_keep_the_profile_figure():
    assert collective_sms("h100", [8 * i for i in range(4)]) == 16     # master: not read
    jz = N.with_nccl("a100-jeanzay", "2.10.3")                         # Omni-Path: its log
    assert collective_sms(jz, [8 * i for i in range(4)]) == 2


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="nccl_version"):
        NC.channels("2.7.8", 80, 1, 24.0, 25.0, 240.0)
    with pytest.raises(ValueError, match="ppn"):
        NC.channels("2.21.5", 80, 0, 24.0, 25.0, 240.0)
    with pytest.raises(ValueError, match="Hopper"):
        NC.channels("2.12.7", 90, 1, 48.0, 50.0, 370.8)
