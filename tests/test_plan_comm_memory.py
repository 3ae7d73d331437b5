"""The communication library's buffers (plan.comm_memory) against the figures they are
counted from: NCCL's buffer defaults (src/init.cc, src/include/device.h), its 2 MiB
allocation granularity (CUDA_IPC_MIN), the allocations NCCL issue #1685 logged, NVLS's
buffer formula (src/transport/nvls.cc), HCCL's 2 x HCCL_BUFFSIZE per communicator."""
import dataclasses

import pytest

import workbench as wb
from workbench.plan import comm_memory as CM
from workbench.plan.layout import Cluster, Layout
from workbench.plan.memory import stage_memory
from workbench.plan.presets import get_config
from workbench.sim_mesh.profiles import get_profile

MiB = 2 ** 20
H100, A100, NPU = (get_profile(p) for p in ("h100", "a100", "ascend-910b"))
GPT = get_config("gpt-22b")


def test_nccl_buffer_defaults_are_its_sources():
    # LL: 8 lines x 512 threads x 8 steps x 16 B; LL128: 120 x 640 x 8 x 8 B; Simple 4 MiB
    assert CM.LL_BYTES == 524_288 and CM.LL128_BYTES == 4_915_200
    assert CM.SIMPLE_BYTES == 4 * MiB
    # the receiver's three buffers round up to 10 MiB, the sender's ncclSendMem to 2 MiB:
    # NCCL issue #1685's 10,485,760 and 2,097,152 B allocations per channel and peer
    assert CM.LL_BYTES + CM.LL128_BYTES + CM.SIMPLE_BYTES == 9_633_792
    assert CM.NCCL_CONNECTION_BYTES == 10_485_760 + 2_097_152
    # NVLS (2.22+): 16 channels x 2 x 8 steps x 128 KiB per head
    assert CM.NCCL_NVLS_HEAD_BYTES == 32 * MiB
    # HCCL: 2 x 200 MB (MiB) per communicator
    assert CM.HCCL_COMM_BYTES == 400 * MiB


def test_one_tensor_parallel_node():
    """tp 8 on one node: the TP communicator and Megatron's world group, 8 GPUs each; an
    A100 node's 24 ring channels x 12 MiB; an H100's 32 channels and 8 NVLS heads (not
    for the world's barriers: one algorithm's rings); a 910B's 2 x 200 MiB each."""
    lay = Layout(dp=1, tp=8, sp=True, global_batch=8)
    a = CM.comm_buffer_bytes(GPT, lay, 0, A100)
    assert a["comms"] == [("TP", 8, 24 * 12 * MiB), ("world", 8, 24 * 12 * MiB)]
    assert a["point"] == 2 * 24 * 12 * MiB and a["library"] == "NCCL"
    h = CM.comm_buffer_bytes(GPT, lay, 0, H100)
    assert h["comms"] == [("TP", 8, 32 * 12 * MiB + 8 * 32 * MiB), ("world", 8, 32 * 12 * MiB)]
    # low: NCCL 2.22+ with rings only, no NVLS, no world group; high: everything
    # connected at init (rings and trees) with 2.17-2.20's 6 MiB NVLS slots, both groups
    assert h["low"] == 16 * 12 * MiB
    assert h["high"] == 2 * (32 * 12 * MiB * 2 + 8 * 16 * 2 * 6 * MiB)
    n = CM.comm_buffer_bytes(GPT, lay, 0, NPU)
    assert n["library"] == "HCCL" and n["point"] == 2 * 400 * MiB and n["low"] == 400 * MiB


def test_an_expert_all_to_all_counts_what_issue_1685_measured():
    """8 H100s, an all-to-all over 8 ranks: 7 peers x 32 channels x 12 MiB = 2.8 GB, of
    the 3.3 GB more device memory #1685's user saw after the first all_to_all_single."""
    c = dict(name="EP", ranks=8, kind="p2p", local=8, nodes=1, peers_local=7,
             peers_remote=0)
    got = CM._nccl_bytes(c, CM._NCCL["NVLink 4 via NVSwitch"], "point")
    assert got == 7 * 32 * 12 * MiB
    assert 0.8 * 3.28e9 < got < 3.28e9


def test_communicators_of_a_megatron_layout():
    lay = Layout(dp=4, tp=8, pp=4, global_batch=64)
    names = {s: [(c["name"], c["ranks"]) for c in CM.communicators(GPT, lay, s, 8)]
             for s in (0, 1, 3)}
    assert names[1] == [("TP", 8), ("DP", 4), ("PP", 4), ("model parallel", 32),
                        ("world", 128)]
    assert ("embedding", 2) in names[0] and ("embedding", 2) in names[3]
    first = CM.communicators(GPT, lay, 0, 8)
    pp = next(c for c in first if c["name"] == "PP")
    assert (pp["peers_local"], pp["peers_remote"]) == (0, 1)       # the next stage only
    dp = next(c for c in first if c["name"] == "DP")
    assert (dp["local"], dp["nodes"]) == (1, 4)                    # stride tp = a node
    # the pipeline's neighbour is a network peer: shared buffers, 2 x p2p channels x 16
    # steps x 128 KiB, the p2p channels the power of 2 above the comm's ring channels
    one = CM.comm_buffer_bytes(GPT, lay, 1, A100)
    assert dict((n, b) for n, _, b in one["comms"])["PP"] == 2 * 2 * 16 * 128 * 1024


def test_fsdp_one_dimensional_mesh_is_the_world_group():
    lay = Layout(dp=8, zero=3, framework="fsdp", global_batch=8)
    assert [c["name"] for c in CM.communicators(GPT, lay, 0, 8)] == ["DP"]
    meg = Layout(dp=8, zero=1, global_batch=8)                  # Megatron: new_group + world
    assert [c["name"] for c in CM.communicators(GPT, meg, 0, 8)] == ["DP", "world"]


def test_comm_buffers_are_their_own_key_and_in_the_total():
    cl = Cluster("h100", 64)
    lay = Layout(dp=8, tp=8, sp=True, recompute="selective", global_batch=16)
    est = wb.plan.estimate(GPT, lay, cl)
    mem = est.memory
    want = CM.comm_buffer_bytes(GPT, lay, 0, cl.profile)
    assert mem["comm_buffers"] == want["point"] > 0
    assert mem["total"] == pytest.approx(sum(v for k, v in mem.items() if k != "total"))
    # ZeRO's partitioned states untouched (Table 1), the buffers beside them
    assert mem["params"] == stage_memory(GPT, lay, 0)["params"]
    bare = stage_memory(GPT, lay, 0)                 # no profile: no communicator buffers
    assert "comm_buffers" not in bare
    assert mem["total"] - bare["total"] == pytest.approx(want["point"])
    assert "NCCL buffers" in est.explain()
    assert any(a.startswith("communication buffers") for a in est.assumptions())
    r = wb.plan.estimate_range(GPT, lay, cl)
    lo, hi = r.memory
    assert lo == pytest.approx(mem["total"] - want["point"] + want["low"])
    assert hi == pytest.approx(mem["total"] - want["point"] + want["high"])
    assert lo < mem["total"] < hi and "memory" in str(r)


def test_an_unknown_interconnect_is_said():
    odd = dataclasses.replace(A100, name="my-gpu", intra_node=dataclasses.replace(
        A100.intra_node, name="PCIe 4"))
    est = wb.plan.estimate(GPT, Layout(dp=8, tp=8, global_batch=16), Cluster(odd, 64))
    line = next(a for a in est.assumptions() if a.startswith("communication buffers"))
    assert "'PCIe 4' is not one comm_memory knows: A100 figures taken" in line


def test_the_assumption_names_each_librarys_own_range():
    """HCCL's buffer per communicator is fixed: its range is the world's communicator,
    not NCCL's lazy connection (the 910B's explain() said NCCL 2.22+ before)."""
    lay = Layout(dp=1, tp=8, sp=True, global_batch=8)
    npu = CM.assumption(CM.comm_buffer_bytes(GPT, lay, 0, NPU), NPU)
    assert "without .. with the world's communicator" in npu and "NCCL" not in npu
    gpu = CM.assumption(CM.comm_buffer_bytes(GPT, lay, 0, A100), A100)
    assert "NCCL 2.22+'s lazy connection" in gpu and "HCCL" not in gpu


def test_communicators_of_deepspeeds_pipeline():
    """DeepSpeed 56c522386's PipelineParallelGrid and p2p.py: one 2-rank communicator
    per pipeline neighbour (torch's send / recv), the slice group beside Megatron's TP
    one (PartitionedTensor.full's all-gather), the pipe group's loss broadcast and the
    grid's model-parallel group; Megatron's layout keeps one pipeline communicator."""
    ds = Layout(dp=4, tp=8, pp=4, zero=1, global_batch=64, framework="deepspeed")
    names = {s: [(c["name"], c["ranks"]) for c in CM.communicators(GPT, ds, s, 8)]
             for s in (0, 1, 3)}
    assert names[1] == [("TP", 8), ("DP", 4), ("PP pair", 2), ("PP pair", 2),
                        ("slice (TP ranks)", 8), ("pipe", 4), ("model parallel", 32),
                        ("world", 128)]
    assert names[0].count(("PP pair", 2)) == 1 and ("embedding", 2) in names[0]
    pipe = next(c for c in CM.communicators(GPT, ds, 1, 8) if c["name"] == "pipe")
    assert pipe["small"]                     # a loss broadcast: one algorithm at point
    # on the A100 profile: the slice group holds what the TP group does; each pair its
    # own network p2p buffers (2 x 2 channels x 16 steps x 128 KiB, as the one PP comm)
    got = dict(((n, i), b) for i, (n, _, b) in enumerate(
        CM.comm_buffer_bytes(GPT, ds, 1, A100)["comms"]))
    assert got[("slice (TP ranks)", 4)] == got[("TP", 0)] == 24 * 12 * MiB
    assert got[("PP pair", 2)] == got[("PP pair", 3)] == 2 * 2 * 16 * 128 * 1024
    meg = [c["name"] for c in CM.communicators(GPT, ds.replace(framework="megatron"), 1, 8)]
    assert meg == ["TP", "DP", "PP", "model parallel", "world"]


def test_jean_zay_counts_its_own_nccl_log():
    """bigscience all_reduce_bench-a100-n4.txt (NCCL 2.10.3): 2 channels across nodes,
    rings and trees connected at init, network connections without GDRDMA (host
    memory, net.cc): on BLOOM's stage 0 only NVLink edges hold device memory: TP and
    the slice group 24 channels x (ring + tree) x 12 MiB each; DP (2 of its 8 ranks on
    the node) 2 x 12 MiB x 1/2 x 2; the world (8 a node) 2 x 12 MiB x 7/8 x 2; the
    model-parallel group (4 a node) 2 x 12 MiB x 3/4 x 2; pipeline pairs, the pipe
    group and the tied embedding's pair cross nodes only: nothing on the device."""
    jz = get_profile("a100-jeanzay")
    cfg = get_config("gpt3-175b", n_layer=70, d_model=14336, n_head=112,
                     vocab_size=250880, dtype="bfloat16")
    lay = Layout(dp=8, tp=4, pp=12, zero=1, recompute="full", micro_batch=2,
                 global_batch=2048, framework="deepspeed",
                 stages=(5,) + (6,) * 10 + (5,))
    got = CM.comm_buffer_bytes(cfg, lay, 0, jz)
    b = {n: v for n, _, v in got["comms"]}
    assert b["TP"] == b["slice (TP ranks)"] == 24 * 2 * 12 * MiB
    assert b["DP"] == 2 * 12 * MiB * 2 // 2
    assert b["world"] == 2 * 12 * MiB * 7 / 8 * 2
    assert b["model parallel"] == 2 * 12 * MiB * 3 / 4 * 2
    assert b["PP pair"] == b["pipe"] == b["embedding"] == 0.0
    assert got["point"] == sum(b.values())
    assert "all_reduce_bench-a100-n4" in CM.assumption(got, jz)
    # the same layout on the a100 profile (GPUDirect RDMA, lazily connected) differs
    a = {n: v for n, _, v in CM.comm_buffer_bytes(cfg, lay, 0, A100)["comms"]}
    assert a["PP pair"] > 0 and a["TP"] == 24 * 12 * MiB
