"""Device memory the communication library holds on a rank: NCCL's buffers per channel
and per peer, HCCL's per communicator (``comm_buffers`` in ``memory.stage_memory``).

Counted from the libraries' own sources and documentation, never fitted to end-to-end
memory readings (``benchmarks/published_memory.py`` is the held-out check).

NCCL (NVIDIA/nccl 2.30.7, 5067397c26; the same defaults since 2.12):

- Buffers of one connection, one per protocol (``src/init.cc``, ``computeBuffSizes``):
  LL 8 lines x 512 threads x NCCL_STEPS 8 x 16 B = 512 KiB, LL128 120 x 640 x 8 x 8 B =
  4,915,200 B, Simple 4 MiB (``DEFAULT_BUFFSIZE``, ``NCCL_BUFFSIZE``; the constants are
  ``src/include/device.h``'s).  Over NVLink (``src/transport/p2p.cc``) the receiver
  allocates all three in one buffer (``p2pRecvSetup``; with P2P read, the A100's, the
  Simple one moves to the sender: the same total) and the sender its ``ncclSendMem``;
  each allocation is rounded up to ``CUDA_IPC_MIN`` = 2 MiB (``src/include/comm.h``,
  cuMem granularity): 10 MiB + 2 MiB per channel a rank receives on and sends on.  NCCL
  issue #1685 (an all-to-all on 8 H100s) logs exactly these, 10,485,760 and 2,097,152 B
  allocations per channel and peer, and 3.3 GB more device memory after it, where this
  model counts 7 peers x 32 channels x 12 MiB = 2.8 GB.
- A collective communicator connects its rings: per channel one receive and one send
  connection (12 MiB); a tree (``ncclTransportTreeConnect``) adds the downward link that
  is no ring edge, about one more pair per channel.  NVLink SHARP on Hopper with
  NVSwitch (``src/transport/nvls.cc``, ``ncclNvlsBufferSetup``): 16 channels
  (``NVLS_NCHANNELS_SM90``) x 2 x NCCL_STEPS x 128 KiB (``NCCL_NVLS_CHUNKSIZE``) = 32 MiB
  per head, one head per GPU of the communicator on the node (2.22+; 2.21 added a 2 MiB
  slot per buffer, 96 MiB; 2.17-2.20 used the 4 MiB Simple buffer, 192 MiB a head:
  1.5 GiB for 8 GPUs, why NeMo's launcher sets NCCL_NVLS_ENABLE=0 "for memory saving").
- Since 2.22 (``NCCL_RUNTIME_CONNECT``, default 1, ``docs/userguide/source/env.rst``)
  only the algorithms a call uses are connected (``src/group.cc``); before, rings,
  trees and NVLS at init (``src/init.cc``).
- Point-to-point (pipeline neighbours, context-parallel ring, expert all-to-all): a peer
  over NVLink gets ``p2pnChannelsPerPeer`` channels of the same buffers
  (``src/graph/paths.cc``: 2 x NVLink bandwidth / one link's, rounded up to a power of
  2 and capped by the p2p channels: 32 on an H100 or A100 node, the 32 of #1685);
  network peers share buffers of 2 (send, receive) x p2p channels x 16 steps
  (``NCCL_SHARED_STEPS``) x 128 KiB (``NCCL_P2P_NET_CHUNKSIZE``), in device memory with
  GPUDirect RDMA (``src/transport/net.cc``, ``sharedNetBuffersInit``).

A cluster whose own NCCL log is read (``_CLUSTERS``): Jean Zay (profile ``a100-jeanzay``,
BLOOM-176B's), bigscience-workshop/bigscience 9e64edec2a experiments/bandwidth/
all_reduce_bench-a100-n4.txt, 32 ranks on 4 nodes: "NCCL version 2.10.3+cuda11.3"
(line 121), "Channel 00/02" (260) and "2 coll channels, 2 p2p channels, 1 p2p channels
per peer" (581): 2 channels across nodes; "Connected all rings" (397) then "Connected
all trees" (579) during init: NCCL 2.10.3 connects both algorithms of every
communicator when it is created (``src/init.cc`` v2.10.3 7e51592129, lines 771-790),
not lazily; every network connection "via NET/IB/<n>" with no "/GDRDMA" (e.g. line
312): without GPUDirect RDMA ``src/transport/net.cc`` (v2.10.3, lines 96 and 171)
places a network connection's send and receive buffers in host memory
(``ncclCudaHostCalloc``), and the network peers' shared p2p buffers too
(``ncclProxySharedBuffersInit``, ``src/proxy.cc`` line 487): on that cluster only the
NVLink (P2P) edges of a ring or tree hold device memory, 12 MiB per channel with P2P
read ("via P2P/IPC/read": ``src/transport/p2p.cc`` lines 156-159 and 204-207, the sender's
ncclSendMem + Simple 4 MiB and the receiver's LL + LL128, each rounded to CUDA_IPC_MIN),
(members on the node - 1) / members of a rank's ring and tree edges on average.  The 2
channels are ASSUMED for that cluster's communicators with fewer GPUs per node too (the
log is of 8 a node); its in-node communicators keep the A100 node's figures (ASSUMED).

DeepSpeed's pipeline engine (``framework="deepspeed"``, pp > 1; microsoft/DeepSpeed
56c522386 ``runtime/pipe/topology.py`` ``PipelineParallelGrid``, ``p2p.py``) uses groups
of its own beside Megatron's tensor-parallel one: the data-parallel group (gradient
all-reduce), the "slice" group (the same ranks as tensor parallelism, a communicator of
its own: ``PartitionedTensor.full()``'s all-gather of each stage's 1/t outputs,
``runtime/utils.py``), the pipe group (``_aggregate_total_loss``' loss broadcast), the
model-parallel group of t x p ranks (``get_global_norm_of_tensors``' all-reduce), the
tied modules' group (``ReduceTiedGrads``); activations go through ``dist.send`` /
``dist.recv`` (torch >= 1.8, ``p2p.can_send_recv``), for which torch's
ProcessGroupNCCL makes a 2-rank communicator per peer pair (``pointToPoint``:
``getKeySendRecv(rank_, peer)``, torch v1.11.0 ``torch/csrc/distributed/c10d/
ProcessGroupNCCL.cpp``): one per pipeline neighbour, each with its own p2p buffers.

HCCL (Ascend): "each communicator occupies 2 x HCCL_BUFFSIZE memory, used for receiving
and sending", HCCL_BUFFSIZE 200 MB by default (Huawei CANN, environment variables,
``HCCL_BUFFSIZE``; the MB are 1024 x 1024 bytes, as its own sizing rule divides by).

ASSUMPTIONS (with their range, ``comm_buffer_bytes``'s ``low`` .. ``high``):
- Ring channels per communicator (NCCL's topology search, not reproduced here): an H100
  node's communicators 32 (the upper bound: #1685's 32 p2p channels are the ring
  channels rounded up to a power of 2, so 17..32) and 16 across nodes (NCCL issues
  #1453 and #1357: "Channel 00/16" with 3 and 2 nodes of 8 H100s); an A100 node 24
  (nccl-tests issue #100: "Channel 23/24" on an HGX A100), across nodes taken the same
  (16 .. 24); one GPU per node with one NIC: the search's 1 channel, doubled by
  ``ncclTopoPostset`` (and, at the H100's 48 GB/s, by ``ncclTopoDupChannels``): 4 on an
  H100, 2 on an A100 (high: twice that).  Point-to-point across nodes: 4 (H100, 400 Gb/s NIC) / 2
  (A100, 200 Gb/s) channels per peer (``NCCL_P2P_PER_CHANNEL_NET_BW`` 14 GB/s).
- Algorithms connected (2.22+ lazily): rings for every collective communicator, trees
  where it spans nodes (small all-reduces across nodes pick Tree), NVLS where two or
  more of its GPUs share an H100 node (NCCL picks it for large all-reduce, all-gather,
  reduce-scatter there); a group that runs only small all-reduces (the world's
  barriers, Megatron-LM's gradient norm) one algorithm's rings.  low: rings only, no
  NVLS, the fewest channels, no world communicator; high: NCCL before 2.22 (everything
  connected at init, trees on every communicator) with 2.17-2.20's NVLS buffers and the
  most channels.
- The communicators: one per process group the framework creates and uses (tensor,
  data (x context) parallel, context, pipeline, expert and expert-data parallel, the
  tied embedding's first-last pair, Megatron-LM's model-parallel group for its
  gradient norm, and the world's default group, used at least by barriers), each a
  communicator of its own (``new_group``; FSDP's 1-D mesh is the default group itself).
  Network-crossing ring channels counted as NVLink ones (the sender's LL128 and Simple
  buffers with GPUDirect RDMA add up to 10 MiB on a node's boundary ranks), but on a
  cluster whose log shows no GPUDirect RDMA (``_CLUSTERS``), where they hold none.
"""
from __future__ import annotations

__all__ = ["NCCL_CONNECTION_BYTES", "NCCL_NVLS_HEAD_BYTES", "HCCL_COMM_BYTES",
           "comm_buffer_bytes", "communicators", "library", "assumption"]

MiB = 1 << 20
_GRANULE = 2 * MiB                      # CUDA_IPC_MIN (src/include/comm.h)
NCCL_STEPS = 8                          # src/include/device.h
LL_BYTES = 8 * 512 * NCCL_STEPS * 16    # NCCL_LL_LINES_PER_THREAD x NCCL_LL_MAX_NTHREADS x 16 B
LL128_BYTES = 120 * 640 * NCCL_STEPS * 8   # NCCL_LL128_ELEMS_PER_THREAD x _MAX_NTHREADS x 8 B
SIMPLE_BYTES = 1 << 22                  # DEFAULT_BUFFSIZE (src/init.cc)


def _granules(n: int) -> int:
    return -(-n // _GRANULE) * _GRANULE


# one channel's receive buffer (all protocols, rounded) and send-side allocation
NCCL_CONNECTION_BYTES = _granules(LL_BYTES + LL128_BYTES + SIMPLE_BYTES) + _GRANULE  # 12 MiB
_NVLS_CHANNELS, _NVLS_CHUNK = 16, 128 * 1024           # NVLS_NCHANNELS_SM90, NVLS_CHUNKSIZE
NCCL_NVLS_HEAD_BYTES = _NVLS_CHANNELS * 2 * NCCL_STEPS * _NVLS_CHUNK         # 32 MiB (2.22+)
_NVLS_HEAD_BYTES_2_19 = _NVLS_CHANNELS * 2 * (SIMPLE_BYTES + _GRANULE)      # 192 MiB (2.17-2.20)
_P2P_NET_BYTES_PER_CHANNEL = 2 * 16 * 128 * 1024    # send + receive x NCCL_SHARED_STEPS x chunk
_P2P_NODE_CHANNELS = 32                 # p2pnChannelsPerPeer over NVSwitch (paths.cc; #1685)
HCCL_COMM_BYTES = 2 * 200 * MiB         # 2 x HCCL_BUFFSIZE (CANN docs)

# interconnect (Profile.intra_node.name) -> NCCL's figures there (module docstring):
# ring channels (low, point, high) on one node / across nodes / one GPU a node,
# p2p channels per network peer, NVLS
_NCCL = {
    "NVLink 4 via NVSwitch": dict(gpu="H100", node=(16, 32, 32), nodes=(16, 16, 32),
                                  one=(4, 4, 8), net_peer=4, nvls=True),
    "NVLink 3 via NVSwitch": dict(gpu="A100", node=(24, 24, 24), nodes=(16, 24, 24),
                                  one=(2, 2, 4), net_peer=2, nvls=False),
}
_HCCL = ("HCCS",)
# clusters whose own NCCL log gives these (module docstring): ring channels (low, point,
# high) across nodes, GPUDirect RDMA, both algorithms connected at init
_CLUSTERS = {
    "a100-jeanzay": dict(nodes=(2, 2, 2), one=(2, 2, 2), gdr=False, init_trees=True,
                         log="bigscience experiments/bandwidth/all_reduce_bench-a100-n4."
                             "txt (NCCL 2.10.3: 2 channels across nodes, no GDRDMA, "
                             "rings and trees connected at init)"),
}


def library(profile) -> tuple[str, dict | None, bool]:
    """("NCCL" | "HCCL", NCCL's figures or None, whether the interconnect is known)."""
    link = profile.intra_node.name
    if any(link.startswith(h) for h in _HCCL) or profile.name.startswith("ascend"):
        return "HCCL", None, True
    if link in _NCCL:
        return "NCCL", {**_NCCL[link], **_CLUSTERS.get(profile.name, {})}, True
    return "NCCL", _NCCL["NVLink 3 via NVSwitch"], False


def _span(start: int, stride: int, n: int, per_node: int) -> tuple[int, int]:
    """(members on ``start``'s node, nodes spanned) of the ranks start + stride i, i < n,
    nodes of ``per_node`` consecutive ranks (``layout``'s packing)."""
    if n == 1 or stride >= per_node:
        return 1, n
    local = min(n, -(-(per_node - start % per_node) // stride))
    return local, (start + stride * (n - 1)) // per_node - start // per_node + 1


def communicators(cfg, lay, stage: int, per_node: int) -> list[dict]:
    """The communicators a rank of pipeline ``stage`` (t = d = c = 0) is a member of and
    uses (module docstring): {"name", "ranks", "kind": "collective" | "p2p", "local"
    (members on the rank's node), "nodes", and for "p2p" "peers_local",
    "peers_remote"}."""
    me = lay.rank(0, 0, stage, 0)
    out = []

    def add(name, kind, start, stride, n, peers=()):
        if n < 2:
            return
        local, nodes = _span(start, stride, n, per_node)
        c = dict(name=name, ranks=n, kind=kind, local=local, nodes=nodes)
        if kind == "p2p":
            near = sum(1 for p in peers if p // per_node == me // per_node)
            c.update(peers_local=near, peers_remote=len(peers) - near)
        out.append(c)

    tp, cp, dp, pp, ep = lay.tp, lay.cp, lay.dp, lay.pp, lay.ep
    add("TP", "collective", me, 1, tp)
    add("DP x CP" if cp > 1 else "DP", "collective", me, tp, dp * cp)
    if cp > 1:                                  # ring attention: the next and previous rank
        add("CP", "p2p", me, tp, cp,
            sorted({lay.rank(0, 0, stage, 1), lay.rank(0, 0, stage, cp - 1)}))
    if ep > 1:                                  # all-to-all: every other rank of the group
        add("EP", "p2p", me, tp * cp, ep, [lay.rank(0, d, stage, 0) for d in range(1, ep)])
        add("expert DP", "collective", me, tp * cp * ep, dp * cp // ep)
    if pp > 1:
        near = {s for s in (stage - 1, stage + 1) if 0 <= s < pp}
        if lay.schedule == "interleaved_1f1b":  # the last stage feeds the first's next chunk
            near |= {(stage - 1) % pp, (stage + 1) % pp}
        near.discard(stage)
        step = tp * cp * dp
        if lay.engine == "deepspeed":
            # DeepSpeed's pipeline (module docstring): dist.send / recv, one 2-rank
            # communicator per neighbour pair; the slice group's all-gather of the 1/t
            # outputs; the pipe group's loss broadcast
            for s in sorted(near):
                peer = lay.rank(0, 0, s, 0)
                lo, hi = sorted((me, peer))
                add("PP pair", "p2p", lo, hi - lo, 2, [peer])
            add("slice (TP ranks)", "collective", me, 1, tp)
            add("pipe", "collective", lay.rank(0, 0, 0, 0), step, pp)
            if out and out[-1]["name"] == "pipe":
                out[-1]["small"] = True
        else:
            add("PP", "p2p", lay.rank(0, 0, 0, 0), step, pp,
                sorted(lay.rank(0, 0, s, 0) for s in near))
        if cfg.tie_embeddings and stage in (0, pp - 1):
            add("embedding", "collective", lay.rank(0, 0, 0, 0), step * (pp - 1), 2)
        if lay.engine in ("megatron", "deepspeed"):
            # Megatron-LM's clip_grad_norm all-reduce and found_inf; DeepSpeed's grid's
            # model-parallel group, get_global_norm_of_tensors' all-reduce
            local = sum(1 for s in range(pp)
                        if lay.rank(0, 0, s, 0) // per_node == me // per_node)
            t_local, _ = _span(me, 1, tp, per_node)
            nodes = len({lay.rank(0, 0, s, 0) // per_node for s in range(pp)})
            out.append(dict(name="model parallel", ranks=tp * pp, kind="collective",
                            local=local * t_local, nodes=nodes, small=True))
    world = lay.world
    if world > 1 and not (lay.engine == "fsdp" and any(c["ranks"] == world for c in out)):
        # FSDP's 1-D mesh group is the default group itself
        out.append(dict(name="world", ranks=world, kind="collective", world=True, small=True,
                        local=min(world, per_node), nodes=-(-world // per_node)))
    return out


def _nccl_bytes(c: dict, fig: dict, end: str) -> float:
    """Bytes one NCCL communicator ``c`` holds on the rank at ``end``: "low", "point",
    "high" (module docstring)."""
    k = ("low", "point", "high").index(end)
    local, nodes = c["local"], c["nodes"]
    gdr = fig.get("gdr", True)
    ring = (fig["one"] if local == 1 and nodes > 1 else
            fig["nodes"] if nodes > 1 else fig["node"])[k]
    if c["kind"] == "p2p":
        per_peer = _P2P_NODE_CHANNELS if nodes == 1 else fig["net_peer"]
        out = c["peers_local"] * per_peer * NCCL_CONNECTION_BYTES
        if c["peers_remote"] and gdr:       # without GDR the shared buffers are host memory
            p2p_channels = 1 << (ring - 1).bit_length()       # pow2Up (paths.cc)
            out += p2p_channels * _P2P_NET_BYTES_PER_CHANNEL
        return float(out)
    # a group of small all-reduces only (the world's barrier, the gradient norm) connects
    # the one algorithm they run at point; a release that connects everything at init
    # (the cluster's log) has its trees whatever it runs
    small = c.get("small", False)
    trees = 1 if fig.get("init_trees") else \
        0 if end == "low" else (1 if end == "high" or (nodes > 1 and not small) else 0)
    per_channel = NCCL_CONNECTION_BYTES
    if not gdr and nodes > 1:               # only the NVLink edges hold device memory
        per_channel *= (local - 1) / local
    out = ring * per_channel * (1 + trees)
    if fig["nvls"] and local >= 2 and end != "low" and not (small and end == "point"):
        out += local * (NCCL_NVLS_HEAD_BYTES if end == "point" else _NVLS_HEAD_BYTES_2_19)
    return float(out)


# comm_buffer_bytes's answers by what they depend on (search asks it for every candidate,
# most of which share their groups): cfg.tie_embeddings; the layout's tp, cp, dp, pp, ep,
# schedule, v, engine; the stage; the profile's name, node size and intra-node link
# (``library``, ``communicators``: nothing else is read)
_MEMO: dict = {}


def comm_buffer_bytes(cfg, lay, stage: int, profile) -> dict:
    """{"point", "low", "high": bytes on a rank of ``stage``, "library", "comms": [(name,
    ranks, point bytes)], "known": whether the profile's interconnect is one the figures
    are for} (module docstring)."""
    key = (cfg.tie_embeddings, lay.tp, lay.cp, lay.dp, lay.pp, lay.ep, lay.schedule, lay.v,
           lay.engine, stage, profile.name, profile.devices_per_node, profile.intra_node.name)
    got = _MEMO.get(key)
    if got is None:
        if len(_MEMO) >= 1 << 16:
            _MEMO.clear()
        got = _MEMO[key] = _comm_buffer_bytes(cfg, lay, stage, profile)
    return dict(got, comms=list(got["comms"]))      # a copy: callers keep what they get


def _comm_buffer_bytes(cfg, lay, stage: int, profile) -> dict:
    lib, fig, known = library(profile)
    comms = communicators(cfg, lay, stage, profile.devices_per_node)
    ends = {}
    rows = []
    for end in ("low", "point", "high"):
        tot = 0.0
        for c in comms:
            if lib == "HCCL":
                b = 0.0 if (end == "low" and c.get("world")) else float(HCCL_COMM_BYTES)
            else:
                b = 0.0 if (end == "low" and c.get("world")) else _nccl_bytes(c, fig, end)
            tot += b
            if end == "point":
                rows.append((c["name"], c["ranks"], b))
        ends[end] = tot
    return dict(ends, library=lib, comms=rows, known=known,
                gpu=None if fig is None else fig["gpu"],
                cluster=None if fig is None else fig.get("log"))


def assumption(detail: dict, profile) -> str:
    """The line ``Estimate.assumptions`` lists for the communicator buffers."""
    gb = 1e9
    parts = ", ".join(f"{n} ({r}) {b / gb:.2f}" for n, r, b in detail["comms"]) or "none"
    spread = ("NCCL 2.22+'s lazy connection and NVLS .. all connected at init as before "
              "2.22")
    if detail["library"] == "HCCL":
        # comm_buffer_bytes: HCCL's buffer per communicator is fixed; only the world's moves
        spread = "without .. with the world's communicator"
        how = "HCCL: 2 x HCCL_BUFFSIZE (200 MB) per communicator (CANN docs)"
    else:
        how = (f"NCCL: 12 MiB per ring channel and per p2p channel and peer, NVLS "
               f"32 MiB per GPU of the node, channels as on an {detail['gpu']} node "
               f"(ASSUMED, plan/comm_memory.py)")
        if detail.get("cluster"):
            how += f"; this cluster's own NCCL log: {detail['cluster']}"
        if not detail["known"]:
            how += (f"; profile {profile.name}'s interconnect "
                    f"{profile.intra_node.name!r} is not one comm_memory knows: "
                    f"A100 figures taken")
    return (f"communication buffers {detail['point'] / gb:.2f} GB "
            f"(range {detail['low'] / gb:.2f} .. {detail['high'] / gb:.2f}: {spread}) "
            f"on the busiest rank: {parts}; {how}")
