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


# ---- torch 1.8 DDP's buckets (plan.ddp_buckets) -----------------------------------

def test_ddp_assign_closes_at_the_limit_first_1mib_then_25mib():
    from workbench.plan.ddp_buckets import CAP_BYTES, FIRST_BYTES, assign
    assert (FIRST_BYTES, CAP_BYTES) == (1 << 20, 25 << 20)
    mib = 1 << 20
    # 0.5 + 0.6 MiB reach 1 MiB: the first bucket; then 25 MiB buckets, a tensor never split
    assert assign([0.5 * mib, 0.6 * mib, 10 * mib, 20 * mib, 30 * mib, 1]) == \
        [[0, 1], [2, 3], [4], [5]]
    with pytest.raises(ValueError, match="sizes"):
        assign([-1])


def test_ddp_buckets_of_the_narayanan_1_7b_row():
    from workbench.models.config import get_config
    from workbench.plan import Cluster, Layout
    from workbench.plan import ddp_buckets as DB
    from workbench.plan.zero_cost import Block
    cfg = get_config("gpt3-175b", n_layer=24, d_model=2304, n_head=24, seq_len=2048,
                     vocab_size=51200)
    lay = Layout(dp=32, micro_batch=16, global_batch=512, recompute="full")
    assert DB.applies(cfg, lay, 0, True, False, False)
    assert not DB.applies(cfg, lay, 0, True, True, False)        # later Megatron-LM
    h = 2304
    layer = 12 * h * h + 13 * h
    blocks = [Block(51200 * h + 2048 * h, 1.0, 2.0)] + \
        [Block(layer, 1.0, 2.0) for _ in range(24)] + [Block(2 * h, 0.1, 0.2)]
    bk = DB.buckets(cfg, lay, 0, blocks)
    assert sum(b.numel for b in bk) == pytest.approx(sum(b.numel for b in blocks))
    assert sum(b.bwd for b in bk) == pytest.approx(sum(b.bwd for b in blocks))
    # backward order: the 1 MiB bucket takes the final norm and the last layer's fc2
    # (its 4h x h weight alone is 42 MB); the last bucket ends with the word embedding
    last_first = bk[-1]
    assert last_first.numel == pytest.approx(2 * h + h + 4 * h * h)
    assert bk[0].numel >= 51200 * h + 2048 * h
    # every bucket but the last (in backward order) holds >= 25 MiB of fp16 gradients
    assert all(2 * b.numel >= DB.CAP_BYTES for b in bk[1:-1])
    assert DB.count(cfg, lay, 0, blocks) == len(bk)
