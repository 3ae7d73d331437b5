"""Hardware profiles: what the modeled clock prices work on.

A profile holds a device's dense peak FLOP/s per dtype, its memory bandwidth and
size, how many devices share a node, two links (between devices of a node:
NVLink, HCCS; between nodes: InfiniBand, RoCE), how kernels really run (launch
cost, efficiency per op class) and the node's topology (``Topology``: which
collective library, a switch or a full mesh inside the node, NICs per node). The
built-in profiles are JSON data files in ``profiles/`` beside this module; each
number there names its source in ``citations`` (key = the number's path)::

    >>> p = get_profile("a100")
    >>> p.peak("bfloat16") / 1e12, p.intra_node.bandwidth / 1e9
    (312.0, 300.0)

Conventions (used by ``cost.py`` and ``topology.py``):

- ``peak_flops``: dense (no structured sparsity) FLOP/s, keyed by dtype name
  ("float64", "float32", "tf32" where the hardware has it, "bfloat16", "float16").
- ``efficiency[op_class]``: the fraction of peak FLOP/s a kernel of that class
  reaches when compute-bound; ``memory_efficiency``: the fraction of memory
  bandwidth a memory-bound kernel reaches; ``launch_overhead``: seconds each
  kernel adds. Defaults (1.0, 1.0, 0.0) give the ideal roofline.
  ``gemm_tile``: the thread-block tile a large GEMM runs in, ``{"m", "n", "per_sm"}``
  (output rows x columns per tile, tiles resident per SM), for wave and tile
  quantization (``cost.gemm_efficiency``; without ``topology.sm_count`` or with an
  empty ``gemm_tile``, not modeled). ``kernel_bandwidth[name]``: a named kernel's
  measured bytes/s (bytes counted as its measurement counts them), used instead of
  the memory term's bandwidth x memory_efficiency when ``compute_time`` is given
  ``kernel=name``.
- ``measured``: ``{"file", "attention_backend"}``, the device's component measurements
  (``benchmarks/gpu_components.py``'s output, ``sim_mesh.measured``): 16-bit and FP8
  GEMMs and fused attention are priced at the rates measured for their shapes instead
  of peak x efficiency (which then prices only what was not measured).  A sibling part
  of the measured card (the same chip at another clock, power limit or memory) may
  reuse its file with ``"compute_scale"`` (the GEMM and attention rates times it) and
  ``"memory_scale"`` (the measured loss's rate, a memory-bound kernel, times it),
  each cited as the assumption it is (``sim_mesh.measured.scales``).
- ``attention_table``: the name of a published per-shape table of the fused attention
  kernel's rates (``sim_mesh.fa2_a100``: FlashAttention-2 on the A100, Dao 2023 Fig. 4),
  used for 16-bit attention of a known shape where ``measured`` does not price it.
- ``slow_paths[dtype]``: a dtype the main compute units cannot run, priced on
  another engine (the 910B runs float64 on its AI CPU): ``{"engine", "peak_flops",
  "memory_bandwidth", "launch_overhead"}``.
- ``Link.bandwidth``: bytes/s one device can send in one direction over that
  level (NVIDIA's "600 GB/s NVLink" is 300 GB/s each way), all of its links
  together: the line rate, 1/bandwidth the beta of the textbook alpha-beta
  model (``cost.collective_time``); ``Link.latency`` is its alpha, in seconds;
  ``Link.efficiency`` the share of the line rate the vendor library reaches
  (protocol overhead), applied by ``topology.py``. A full mesh splits ``intra_node.bandwidth`` over
  ``topology.intra_links`` links.
- Node of a rank: ``rank // devices_per_node``.

Your own hardware: copy one of the JSON files, edit it, ``load_profile(path)``.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Mapping, Optional

from .dtypes import INTEGER_DTYPES as _INTEGER
from .dtypes import dtype_name, is_integer_dtype

__all__ = ["Link", "Topology", "Profile", "get_profile", "list_profiles", "load_profile",
           "dtype_name", "is_integer_dtype", "OP_CLASSES", "DEFAULT_PROFILE"]

DEFAULT_PROFILE = "a100"
REQUIRED_DTYPES = ("float32", "bfloat16", "float16")
# optional factors on a measured file's rates (``measured.scales``): a sibling card's
MEASURED_SCALES = ("compute_scale", "memory_scale")
# Kinds of kernel the clock prices differently (compute_time's op_class).
OP_CLASSES = ("matmul", "attention", "elementwise", "norm", "reduction", "data_movement")
LIBRARIES = ("nccl", "hccl")
FABRICS = ("switch", "full_mesh")
PROTOCOL_KEYS = ("base_latency", "step_latency", "bandwidth_factor",
                 "all_reduce_bandwidth_factor")
# NCCL's tuning model across nodes, per protocol (``topology.py``; src/graph/tuning.cc):
# a ring's step latency inside a node and across one (with one rank per node: its own
# figure), its bus-bandwidth factor (one rank per node: its own), a cap on the bus
# bandwidth in bytes/s (0: none), and the double binary tree's base, intra-node and
# inter-node step latencies and bandwidth factor
NET_PROTOCOL_KEYS = ("intra_step_latency", "inter_step_latency",
                     "inter_step_latency_one_per_node", "bandwidth_factor",
                     "bandwidth_factor_one_per_node", "max_bandwidth", "tree_base_latency",
                     "tree_intra_latency", "tree_inter_latency", "tree_bandwidth_factor")
_NET_SECONDS = ("intra_step_latency", "inter_step_latency", "inter_step_latency_one_per_node",
                "tree_base_latency", "tree_intra_latency", "tree_inter_latency")

def _positive(owner: str, name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{owner}: {name}={value!r} must be a finite number > 0")


def _fraction(owner: str, name: str, value) -> None:
    _positive(owner, name, value)
    if value > 1:
        raise ValueError(f"{owner}: {name}={value!r} is a fraction of peak, in (0, 1]")


def _count(owner: str, name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}: {name}={value!r} must be an int >= 1")


@dataclass(frozen=True)
class Link:
    """One level of interconnect, as the alpha-beta model sees it."""
    name: str          # e.g. "NVLink 3 via NVSwitch"
    bandwidth: float   # bytes/s, one direction, per device: the line rate
    latency: float     # seconds per message (alpha)
    efficiency: float = 1.0  # share of the line rate a collective library reaches

    @property
    def effective_bandwidth(self) -> float:
        """bandwidth x efficiency: what ``topology.py`` prices collectives at."""
        return self.bandwidth * self.efficiency

    def __post_init__(self):
        _positive(f"Link {self.name!r}", "bandwidth", self.bandwidth)
        _fraction(f"Link {self.name!r}", "efficiency", self.efficiency)
        if isinstance(self.latency, bool) or not isinstance(self.latency, (int, float)) \
                or not math.isfinite(self.latency) or self.latency < 0:
            raise ValueError(f"Link {self.name!r}: latency={self.latency!r} must be "
                             f"a finite number of seconds >= 0")

    def __str__(self):
        eff = f" (x{self.efficiency:g})" if self.efficiency != 1 else ""
        return f"{self.name}: {self.bandwidth / 1e9:g} GB/s{eff}, {self.latency * 1e6:g} us"


@dataclass(frozen=True)
class Topology:
    """How the devices of a node are wired and which library drives them
    (``topology.py`` turns this into collective algorithms)."""
    library: str = "nccl"          # "nccl" (NVIDIA) or "hccl" (Ascend)
    intra_fabric: str = "switch"   # "switch" (NVSwitch) or "full_mesh" (HCCS)
    intra_links: int = 1           # links per device inside the node (full mesh: d - 1)
    nics_per_node: Optional[int] = None  # NICs per node, one per device when None
    # the library's protocols for rings inside a node (``topology.py``): name ->
    # {"base_latency", "step_latency" (s), "bandwidth_factor",
    #  "all_reduce_bandwidth_factor"}; empty: one alpha-beta link (intra_node.latency)
    protocols: Mapping[str, Mapping[str, float]] = field(default_factory=dict, hash=False)
    sm_count: int = 0         # streaming multiprocessors per device (0: not modeled)
    # SMs a collective kernel holds while it runs (NCCL: one CTA per channel): for a group
    # spanning nodes, and for any collective whose group the caller does not give
    collective_sms: int = 0
    # NCCL's protocols for rings and trees across nodes (``NET_PROTOCOL_KEYS``; the same
    # protocol names as ``protocols``, whose base_latency the ring shares); empty: the
    # alpha-beta ring and tree on the inter-node link
    net_protocols: Mapping[str, Mapping[str, float]] = field(default_factory=dict, hash=False)
    # NICs of a node that one communicator's rings cross the node boundary on, each
    # direction (``topology.py``'s flat link); None: one per rank of the group on the node
    ring_nics: Optional[int] = None
    # the NCCL release whose tuning model the two tables follow ("": not stated;
    # ``nccl_tuning.with_nccl`` derives them for another release)
    nccl_version: str = ""
    # SMs it holds for a group inside one node (NCCL's channels on NVSwitch outnumber those
    # across nodes; ``kernel_cost.collective_sms``); 0: collective_sms for every group
    collective_sms_intra: int = 0
    # HBM bytes a collective moves per byte on its link (NCCL: a received byte is stored,
    # then read back, 2; with the user buffer read or written too, 3): the share of the
    # memory bandwidth it takes from the kernels beside it (``kernel_cost.hbm_share``);
    # 0: that contention not modeled
    collective_hbm_factor: float = 0.0

    def __post_init__(self):
        if not isinstance(self.nccl_version, str):
            raise ValueError(f"Topology: nccl_version={self.nccl_version!r} must be a "
                             f"release string such as '2.12.7' (or '')")
        if self.library not in LIBRARIES:
            raise ValueError(f"Topology: library={self.library!r}: use one of {list(LIBRARIES)}")
        if self.intra_fabric not in FABRICS:
            raise ValueError(f"Topology: intra_fabric={self.intra_fabric!r}: use one of "
                             f"{list(FABRICS)}")
        _count("Topology", "intra_links", self.intra_links)
        if self.nics_per_node is not None:
            _count("Topology", "nics_per_node", self.nics_per_node)
        if self.ring_nics is not None:
            _count("Topology", "ring_nics", self.ring_nics)
        protos = {}
        for name, v in dict(self.protocols).items():
            if not isinstance(v, Mapping) or set(v) != set(PROTOCOL_KEYS):
                raise ValueError(f"Topology: protocols[{name!r}] must hold exactly "
                                 f"{list(PROTOCOL_KEYS)}; got {v!r}")
            for k in ("base_latency", "step_latency"):
                if isinstance(v[k], bool) or not isinstance(v[k], (int, float)) \
                        or not 0 <= v[k] < 1:
                    raise ValueError(f"Topology: protocols[{name!r}][{k!r}]={v[k]!r} must "
                                     f"be seconds in [0, 1)")
            for k in ("bandwidth_factor", "all_reduce_bandwidth_factor"):
                _fraction("Topology", f"protocols[{name!r}][{k!r}]", v[k])
            protos[name] = MappingProxyType(dict(v))
        object.__setattr__(self, "protocols", MappingProxyType(protos))
        net = {}
        for name, v in dict(self.net_protocols).items():
            if name not in protos:
                raise ValueError(f"Topology: net_protocols[{name!r}] names a protocol that "
                                 f"protocols lacks; give both (the ring's base latency is "
                                 f"protocols[{name!r}]['base_latency'])")
            if not isinstance(v, Mapping) or set(v) != set(NET_PROTOCOL_KEYS):
                raise ValueError(f"Topology: net_protocols[{name!r}] must hold exactly "
                                 f"{list(NET_PROTOCOL_KEYS)}; got {v!r}")
            for k in _NET_SECONDS:
                if isinstance(v[k], bool) or not isinstance(v[k], (int, float)) \
                        or not 0 <= v[k] < 1:
                    raise ValueError(f"Topology: net_protocols[{name!r}][{k!r}]={v[k]!r} "
                                     f"must be seconds in [0, 1)")
            for k in ("bandwidth_factor", "bandwidth_factor_one_per_node",
                      "tree_bandwidth_factor"):
                _fraction("Topology", f"net_protocols[{name!r}][{k!r}]", v[k])
            cap = v["max_bandwidth"]
            if isinstance(cap, bool) or not isinstance(cap, (int, float)) \
                    or not math.isfinite(cap) or cap < 0:
                raise ValueError(f"Topology: net_protocols[{name!r}]['max_bandwidth']={cap!r} "
                                 f"must be bytes/s >= 0 (0: no cap)")
            net[name] = MappingProxyType(dict(v))
        object.__setattr__(self, "net_protocols", MappingProxyType(net))
        for k in ("sm_count", "collective_sms", "collective_sms_intra"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"Topology: {k}={v!r} must be an int >= 0")
        v = self.collective_hbm_factor
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                or v < 0:
            raise ValueError(f"Topology: collective_hbm_factor={v!r} must be a number >= 0 "
                             f"(HBM bytes per link byte; 0: not modeled)")
        for k in ("collective_sms", "collective_sms_intra"):
            v = getattr(self, k)
            if v and not v < self.sm_count:
                raise ValueError(f"Topology: {k}={v} must be fewer than "
                                 f"sm_count={self.sm_count} (give the device's SM count)")


@dataclass(frozen=True)
class Profile:
    """A device type and how its devices are connected (see the module docstring)."""
    name: str
    description: str
    peak_flops: Mapping[str, float] = field(hash=False)  # dtype -> dense FLOP/s
    memory_bandwidth: float           # bytes/s, device memory (HBM)
    # Device memory capacity AS THE DEVICE'S RUNTIME REPORTS IT (CUDA: cudaMemGetInfo's total,
    # torch.cuda.get_device_properties().total_memory, the 'total capacity' of PyTorch's
    # out-of-memory message): what the caching allocator can ever hold, before the context and
    # fragmentation (usable_memory). Not the datasheet's marketing figure ('80 GB'), which
    # profiles keep in their notes: an A100 80GB reports 79.25 GiB = 85.1e9 B, 6% above 80e9,
    # so the datasheet figure would call runs that fit out of memory. A profile without a
    # device-reported figure says so (UNCERTAIN) in citations['memory_bytes'].
    memory_bytes: int
    devices_per_node: int             # ranks r and q share a node iff r // d == q // d
    intra_node: Link                  # between devices of one node
    inter_node: Link                  # between nodes, per device
    sources: tuple[str, ...] = ()     # datasheets / papers the numbers come from
    notes: str = ""                   # assumptions and uncertainties
    launch_overhead: float = 0.0      # seconds per kernel
    efficiency: Mapping[str, float] = field(default_factory=dict, hash=False)
    memory_efficiency: float = 1.0
    slow_paths: Mapping[str, Mapping] = field(default_factory=dict, hash=False)
    topology: Topology = field(default_factory=Topology)
    citations: Mapping[str, str] = field(default_factory=dict, hash=False)
    # measured bytes/s of named kernels (``compute_time(..., kernel=name)``), bytes
    # counted as the measurement counts them; replaces bandwidth x memory_efficiency
    kernel_bandwidth: Mapping[str, float] = field(default_factory=dict, hash=False)
    # the tile large GEMMs run in (``cost.gemm_efficiency``): {"m", "n", "per_sm"}
    gemm_tile: Mapping[str, int] = field(default_factory=dict, hash=False)
    # device memory a training process cannot use for tensors (``usable_memory``):
    # {"context_bytes": the runtime's context (CUDA / CANN), "fragmentation": the share
    # of device memory the allocator loses}; empty: none
    runtime_memory: Mapping[str, float] = field(default_factory=dict, hash=False)
    # component measurements of this device (``sim_mesh.measured``): {"file": a file in
    # sim_mesh/measurements/ or a path, "attention_backend": "cudnn" | "flash"}; GEMMs,
    # FP8 GEMMs and fused attention are then priced at their measured rates;
    # optional "compute_scale" / "memory_scale" (numbers): a sibling card's factors
    measured: Mapping[str, "str | float"] = field(default_factory=dict, hash=False)
    # a published per-shape table of the fused attention kernel's rates
    # (``sim_mesh.fa2_a100.NAME``), used where ``measured`` does not price it; "": none
    attention_table: str = ""

    def __post_init__(self):
        owner = f"Profile {self.name!r}"
        flops = {dtype_name(k): float(v) for k, v in dict(self.peak_flops).items()}
        missing = [d for d in REQUIRED_DTYPES if d not in flops]
        if missing:
            raise ValueError(f"{owner}: peak_flops lacks {missing}; give dense FLOP/s "
                             f"for each of {list(REQUIRED_DTYPES)}")
        for k, v in flops.items():
            _positive(owner, f"peak_flops[{k!r}]", v)
        _positive(owner, "memory_bandwidth", self.memory_bandwidth)
        _positive(owner, "memory_bytes", self.memory_bytes)
        _count(owner, "devices_per_node", self.devices_per_node)
        for attr in ("intra_node", "inter_node"):
            if not isinstance(getattr(self, attr), Link):
                raise ValueError(f"{owner}: {attr} must be a Link, "
                                 f"got {type(getattr(self, attr)).__name__}")
        if isinstance(self.launch_overhead, bool) or not isinstance(
                self.launch_overhead, (int, float)) or not 0 <= self.launch_overhead < 1:
            raise ValueError(f"{owner}: launch_overhead={self.launch_overhead!r} must be "
                             f"seconds per kernel, >= 0 (e.g. 1e-6)")
        eff = dict(self.efficiency)
        for k, v in eff.items():
            if k not in OP_CLASSES:
                raise ValueError(f"{owner}: efficiency has op class {k!r}; the classes "
                                 f"are {list(OP_CLASSES)}")
            _fraction(owner, f"efficiency[{k!r}]", v)
        _fraction(owner, "memory_efficiency", self.memory_efficiency)
        kbw = {}
        for k, v in dict(self.kernel_bandwidth).items():
            if not isinstance(k, str) or not k:
                raise ValueError(f"{owner}: kernel_bandwidth key {k!r} must be a kernel name")
            _positive(owner, f"kernel_bandwidth[{k!r}]", v)
            if v > self.memory_bandwidth:
                raise ValueError(f"{owner}: kernel_bandwidth[{k!r}]={v!r} exceeds "
                                 f"memory_bandwidth={self.memory_bandwidth!r}")
            kbw[k] = float(v)
        object.__setattr__(self, "kernel_bandwidth", MappingProxyType(kbw))
        tile = dict(self.gemm_tile)
        if tile:
            if set(tile) != {"m", "n", "per_sm"}:
                raise ValueError(f"{owner}: gemm_tile needs exactly m, n, per_sm (the tile's "
                                 f"rows, columns and tiles per SM); got {sorted(tile)}")
            for k, v in tile.items():
                _count(owner, f"gemm_tile[{k!r}]", v)
        object.__setattr__(self, "gemm_tile", MappingProxyType(tile))
        rt = dict(self.runtime_memory)
        if rt:
            if set(rt) != {"context_bytes", "fragmentation"}:
                raise ValueError(f"{owner}: runtime_memory needs exactly context_bytes and "
                                 f"fragmentation; got {sorted(rt)}")
            c, f = rt["context_bytes"], rt["fragmentation"]
            if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 <= c \
                    < self.memory_bytes:
                raise ValueError(f"{owner}: runtime_memory['context_bytes']={c!r} must be "
                                 f"bytes in [0, memory_bytes)")
            if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f < 1:
                raise ValueError(f"{owner}: runtime_memory['fragmentation']={f!r} must be "
                                 f"a share of device memory in [0, 1)")
        object.__setattr__(self, "runtime_memory", MappingProxyType(rt))
        ms = dict(self.measured)
        if ms:
            if not {"file", "attention_backend"} <= set(ms) <= {
                    "file", "attention_backend", *MEASURED_SCALES}:
                raise ValueError(f"{owner}: measured needs exactly file and "
                                 f"attention_backend, optionally {list(MEASURED_SCALES)}; "
                                 f"got {sorted(ms)}")
            for k in MEASURED_SCALES:
                if k in ms:
                    _positive(owner, f"measured[{k!r}]", ms[k])
            from . import measured as _measured
            tables = _measured.load(ms["file"])
            have = sorted({b for b, _ in tables.attention})
            if ms["attention_backend"] not in have:
                raise ValueError(f"{owner}: measured['attention_backend']="
                                 f"{ms['attention_backend']!r} was not measured in "
                                 f"{ms['file']!r}; use one of {have}")
        object.__setattr__(self, "measured", MappingProxyType(ms))
        from . import fa2_a100 as _fa2
        if self.attention_table not in ("", _fa2.NAME):
            raise ValueError(f"{owner}: attention_table={self.attention_table!r} is not a "
                             f"table the clock has; use {_fa2.NAME!r} or \"\" (none)")
        slow = {dtype_name(k): dict(v) for k, v in dict(self.slow_paths).items()}
        for k, v in slow.items():
            if set(v) != {"engine", "peak_flops", "memory_bandwidth", "launch_overhead"}:
                raise ValueError(f"{owner}: slow_paths[{k!r}] needs exactly engine, "
                                 f"peak_flops, memory_bandwidth, launch_overhead; got {sorted(v)}")
            _positive(owner, f"slow_paths[{k!r}].peak_flops", v["peak_flops"])
            _positive(owner, f"slow_paths[{k!r}].memory_bandwidth", v["memory_bandwidth"])
            _positive(owner, f"slow_paths[{k!r}].launch_overhead", v["launch_overhead"])
        if not isinstance(self.topology, Topology):
            raise ValueError(f"{owner}: topology must be a Topology, "
                             f"got {type(self.topology).__name__}")
        t = self.topology
        if t.intra_fabric == "full_mesh" and t.intra_links != self.devices_per_node - 1:
            raise ValueError(f"{owner}: a full mesh of {self.devices_per_node} devices has "
                             f"{self.devices_per_node - 1} links per device, not "
                             f"intra_links={t.intra_links}")
        if t.ring_nics is not None and t.ring_nics > (t.nics_per_node or self.devices_per_node):
            raise ValueError(f"{owner}: topology.ring_nics={t.ring_nics} exceeds the node's "
                             f"{t.nics_per_node or self.devices_per_node} NICs; give at most "
                             f"nics_per_node, or None (one per rank of the group)")
        if t.nics_per_node is None:
            object.__setattr__(self, "topology", Topology(
                t.library, t.intra_fabric, t.intra_links, self.devices_per_node,
                t.protocols, t.sm_count, t.collective_sms, t.net_protocols, t.ring_nics,
                t.nccl_version, t.collective_sms_intra, t.collective_hbm_factor))
        object.__setattr__(self, "peak_flops", MappingProxyType(flops))
        object.__setattr__(self, "efficiency", MappingProxyType(eff))
        object.__setattr__(self, "slow_paths", MappingProxyType(
            {k: MappingProxyType(v) for k, v in slow.items()}))
        object.__setattr__(self, "citations", MappingProxyType(dict(self.citations)))
        object.__setattr__(self, "sources", tuple(self.sources))

    def peak(self, dtype) -> float:
        """Dense peak FLOP/s for ``dtype`` (torch dtype or string) on the main
        compute units; raises when the profile gives none."""
        key = dtype_name(dtype)
        if key not in self.peak_flops:
            raise ValueError(f"profile {self.name!r} has no peak for dtype={key!r}; "
                             f"it knows {sorted(self.peak_flops)}")
        return self.peak_flops[key]

    def compute_path(self, dtype) -> tuple[str, float, float, float]:
        """(engine, FLOP/s, bytes/s, seconds per launch) that ``dtype`` runs at:
        its slow path if it has one, else the main units. Integer and bool work
        runs on the vector units at the float32 rate (A100 whitepaper: INT32
        19.5 TOPS = FP32 19.5 TFLOP/s); it is bandwidth-bound in practice."""
        key = dtype_name(dtype)
        if key in self.slow_paths:
            s = self.slow_paths[key]
            return s["engine"], s["peak_flops"], s["memory_bandwidth"], s["launch_overhead"]
        if key in _INTEGER and key not in self.peak_flops:
            key = "float32"
        if key not in self.peak_flops:
            raise ValueError(f"profile {self.name!r} cannot price dtype={key!r}: add "
                             f"peak_flops[{key!r}] or slow_paths[{key!r}] to the profile")
        return "main", self.peak_flops[key], self.memory_bandwidth, self.launch_overhead

    def usable_memory(self) -> float:
        """Bytes of device memory a training process can hold tensors in: memory_bytes
        x (1 - fragmentation) - context_bytes (``runtime_memory``; both stated in the
        profile's citations, assumptions where unmeasured)."""
        rt = self.runtime_memory
        if not rt:
            return float(self.memory_bytes)
        return self.memory_bytes * (1 - rt["fragmentation"]) - rt["context_bytes"]

    def node_of(self, rank: int) -> int:
        """The node holding ``rank`` (ranks are packed node by node)."""
        return rank // self.devices_per_node

    def to_dict(self) -> dict:
        """Plain data, the layout of the JSON files (``from_dict`` reads it back)."""
        def link(l):
            return {"name": l.name, "bandwidth": l.bandwidth, "latency": l.latency,
                    "efficiency": l.efficiency}
        t = self.topology
        return {"name": self.name, "description": self.description,
                "peak_flops": dict(self.peak_flops),
                "memory_bandwidth": self.memory_bandwidth, "memory_bytes": self.memory_bytes,
                "devices_per_node": self.devices_per_node,
                "intra_node": link(self.intra_node), "inter_node": link(self.inter_node),
                "launch_overhead": self.launch_overhead, "efficiency": dict(self.efficiency),
                "memory_efficiency": self.memory_efficiency,
                "slow_paths": {k: dict(v) for k, v in self.slow_paths.items()},
                "topology": {"library": t.library, "intra_fabric": t.intra_fabric,
                             "intra_links": t.intra_links, "nics_per_node": t.nics_per_node,
                             "protocols": {k: dict(v) for k, v in t.protocols.items()},
                             "sm_count": t.sm_count, "collective_sms": t.collective_sms,
                             **({"collective_sms_intra": t.collective_sms_intra}
                                if t.collective_sms_intra else {}),
                             **({"collective_hbm_factor": t.collective_hbm_factor}
                                if t.collective_hbm_factor else {}),
                             "net_protocols": {k: dict(v)
                                               for k, v in t.net_protocols.items()},
                             **({} if t.ring_nics is None else {"ring_nics": t.ring_nics}),
                             "nccl_version": t.nccl_version},
                "sources": list(self.sources), "notes": self.notes,
                "kernel_bandwidth": dict(self.kernel_bandwidth),
                "gemm_tile": dict(self.gemm_tile),
                "runtime_memory": dict(self.runtime_memory),
                "measured": dict(self.measured),
                "attention_table": self.attention_table,
                "citations": dict(self.citations)}

    @classmethod
    def from_dict(cls, data: Mapping) -> "Profile":
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"profile data has unknown keys {unknown}; "
                             f"the keys are {sorted(known)}")
        kw = dict(data)
        for attr in ("intra_node", "inter_node"):
            if attr not in kw:
                raise ValueError(f"profile data lacks {attr!r}: give "
                                 f'{{"name": ..., "bandwidth": B/s, "latency": s}}')
            kw[attr] = Link(**kw[attr])
        optional = {"sources", "notes", "launch_overhead", "efficiency", "memory_efficiency",
                    "kernel_bandwidth", "gemm_tile", "runtime_memory", "measured",
                    "attention_table", "slow_paths", "topology", "citations"}
        missing = sorted(known - set(kw) - optional)
        if missing:
            raise ValueError(f"profile data lacks keys {missing}")
        if "topology" in kw:
            kw["topology"] = Topology(**kw["topology"])
        if isinstance(kw["memory_bytes"], float) and kw["memory_bytes"].is_integer():
            kw["memory_bytes"] = int(kw["memory_bytes"])
        kw["sources"] = tuple(kw.get("sources", ()))
        return cls(**kw)

    def __str__(self):
        return (f"{self.name}: {self.peak('bfloat16') / 1e12:g} TFLOP/s bf16, "
                f"{self.memory_bandwidth / 1e12:g} TB/s, {self.memory_bytes / 1e9:g} GB, "
                f"{self.devices_per_node}/node ({self.topology.library}, "
                f"{self.topology.intra_fabric}), intra {self.intra_node}, "
                f"inter {self.inter_node}")


def _data_dir():
    return resources.files(__package__).joinpath("profiles")


def list_profiles() -> list[str]:
    """Names of the built-in profiles, sorted."""
    return sorted(p.name[:-len(".json")] for p in _data_dir().iterdir()
                  if p.name.endswith(".json"))


def read_json(path, what: str, missing: str):
    """The JSON data at ``path`` (a Path or a package resource); a missing file or bad
    JSON raises ValueError starting with ``what``, the first followed by ``missing``."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{what} {missing}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} is not valid JSON: {e}") from None


def load_profile(path) -> Profile:
    """Read a profile from a JSON file laid out like the built-in ones."""
    path = Path(path)
    data = read_json(path, f"load_profile: {str(path)!r}",
                     "does not exist; give the path of a JSON file (see "
                     "workbench/sim_mesh/profiles/)")
    return Profile.from_dict(data)


@lru_cache(maxsize=None)
def _builtin(name: str) -> Profile:
    return Profile.from_dict(json.loads(
        _data_dir().joinpath(f"{name}.json").read_text(encoding="utf-8")))


def get_profile(p: "str | Profile | None" = None) -> Profile:
    """A profile by name (case-insensitive), a Profile as is, or None for the
    default ("a100")."""
    if isinstance(p, Profile):
        return p
    if p is None:
        p = DEFAULT_PROFILE
    if not isinstance(p, str):
        raise TypeError(f"profile={p!r}: give a profile name, a Profile or None")
    name = p.strip().lower()
    hit = _BY_NAME.get(name)
    if hit is not None:
        return hit
    known = list_profiles()
    if name not in known:
        raise ValueError(f"profile={p!r} is not known; the built-in profiles are {known} "
                         f"(or load your own with load_profile(path))")
    _BY_NAME[name] = prof = _builtin(name)
    return prof


_BY_NAME: dict = {}


# ---- memo tables per profile ------------------------------------------------------------
# A Profile is immutable (frozen, its mappings read-only copies), so a price is a pure
# function of the profile and plain data, and the clock asks the same prices every step.
# Hashing a Profile walks its fields (about 1.5 us), so a table is found by the profile's
# identity; the entry holds the profile, so that its id is not reused while it lives.
_MEMOS: dict = {}               # (table name, id(profile)) -> (profile, table)
_MEMOS_MAX = 64                 # tables remembered (names x profiles); then it starts again


def clear_memos() -> None:
    """Forget every per-profile memo (``profile_memo``): what the clock priced is kept
    per profile object, so code that changes a module-level constant the pricing reads
    (a test's ``monkeypatch.setattr``) must call this before and after."""
    _MEMOS.clear()


def profile_memo(name: str, profile: Profile) -> dict:
    """The memo table ``name`` of ``profile`` (a plain dict the caller fills and bounds)."""
    got = _MEMOS.get((name, id(profile)))
    if got is not None and got[0] is profile:
        return got[1]
    if len(_MEMOS) >= _MEMOS_MAX:
        _MEMOS.clear()
    table: dict = {}
    _MEMOS[(name, id(profile))] = (profile, table)
    return table
