"""Hierarchical all-reduce with its phases pipelined in chunks, exact and on the clock.

The algorithm (p = m nodes x k ranks per node, n bytes per rank):

1. intra-node reduce-scatter over the fast link (NVLink / HCCS, copied by the devices'
   DMA engines: "SDMA" in CANN): each of the k ranks of a node ends with the node's sum
   of one k-th of the buffer;
2. inter-node all-reduce of that k-th among the m ranks with the same local index, each
   on its own NIC (RDMA over InfiniBand / RoCE), k such all-reduces at once;
3. intra-node all-gather: every rank gets the whole sum.

The CANN 7.0 article the course follows names it (issue 18: "hierarchical all-reduce
whose intra-node (SDMA) and inter-node (RDMA) phases run in a pipeline").  It moves the
bytes of a flat ring (``cost.hierarchical_time``), but puts only n / k of
them on each NIC.  Done once, the phases run one after another and the NICs idle while
the fast links work and the reverse.  HCCL's "pipeline" algorithm (CANN HCCL user guide,
"Pipeline", hcclug_000124: "when transferring data between servers, the intra-server
links remain idle ... HCCL adopts a fine-grained hierarchical pipeline algorithm"; the
HCCL_ALGO reference: "pipeline ... uses intra-server and inter-server links
concurrently, for large messages with several devices per server") cuts the buffer into
c chunks and lets chunk i's inter-node phase run while chunk i + 1's intra-node phases
use the fast links.  NCCL has no such algorithm for all_reduce (NCCL_ALGO lists Ring,
Tree, CollNet, NVLS; its ring and tree pipeline each step over chunks of
NCCL_BUFFSIZE / channels instead); the same phases there are Horovod's hierarchical
all-reduce.

With per-chunk phase times x (reduce-scatter), y (inter all-reduce) and z (all-gather),
x and z on the same links, chunk i runs its reduce-scatter at i T, its inter-node
all-reduce at i T + x and its all-gather right after chunk i + 1's reduce-scatter, where
T = max(x + z, y) is the bottleneck stage; the last chunk's all-gather starts when its
all-reduce and the previous chunk's all-gather (same links) have both ended:

    time = (x + y + z) + (c - 1) max(x + z, y)       when y >= z (or c = 1)
         = fill/drain (one chunk through every phase) + (c - 1) x the slowest stage,
    plus z - y when z > y and c >= 2 (``topology.pipelined_seconds``)

the price ``cost.price(kind, n, ranks, profile, "pipelined")`` gives for the c it picks
(the fastest of ``topology.PIPELINE_CHUNKS``).  ``plan_pipelined_all_reduce`` returns
those numbers, the timeline, and the flat ring beside them; ``hierarchical_all_reduce``
runs the three phases on the simulated mesh chunk by chunk (exact: it is still an
all-reduce) and records the pipelined timeline in the trace.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from . import backends as _B
from . import collectives as _C
from . import cost as _cost
from . import topology as _topo
from .mesh import Mesh
from .profiles import get_profile
from .trace import current_trace, suspend

__all__ = ["PipelinePhase", "PipelinedAllReduce", "plan_pipelined_all_reduce",
           "hierarchical_all_reduce"]


@dataclass(frozen=True)
class PipelinePhase:
    """One phase of one chunk on the pipelined timeline (seconds from the start)."""
    chunk: int
    name: str          # "reduce_scatter" | "all_reduce" | "all_gather"
    link: str          # "intra" (NVLink / HCCS) | "inter" (the NICs)
    start: float
    end: float


@dataclass(frozen=True)
class PipelinedAllReduce:
    """The pipelined hierarchical all-reduce of ``nbytes`` over ``nodes`` x ``local`` ranks,
    priced by the clock (module docstring), beside the flat ring."""
    nbytes: float
    profile: str
    nodes: int                 # m
    local: int                 # k, ranks per node
    chunks: int                # c
    reduce_scatter: float      # x: one chunk's intra-node reduce-scatter, seconds
    all_reduce: float          # y: one chunk's inter-node all-reduce of n / (c k)
    all_gather: float          # z: one chunk's intra-node all-gather
    hierarchical: float        # the same phases once, unchunked (c = 1)
    flat_ring: float           # the flat ring over all p ranks (the clock's "ring")

    @property
    def bottleneck(self) -> float:
        """T = max(x + z, y): the slowest stage, what each further chunk adds."""
        return max(self.reduce_scatter + self.all_gather, self.all_reduce)

    @property
    def fill_drain(self) -> float:
        """x + y + z: one chunk through every phase (the pipeline filling and draining)."""
        return self.reduce_scatter + self.all_reduce + self.all_gather

    @property
    def seconds(self) -> float:
        """fill/drain + (c - 1) x bottleneck (+ z - y for the last all-gather's wait when
        z > y; module docstring): ``topology.pipelined_seconds``."""
        return _topo.pipelined_seconds(self.reduce_scatter, self.all_reduce, self.all_gather,
                                       self.chunks)

    @property
    def _wait(self) -> float:
        """z - y when the last all-gather waits for the previous one (z > y, c >= 2)."""
        return max(0.0, self.all_gather - self.all_reduce) if self.chunks > 1 else 0.0

    @property
    def speedup(self) -> float:
        """flat ring time / pipelined time."""
        return self.flat_ring / self.seconds if self.seconds else 1.0

    def timeline(self) -> list[PipelinePhase]:
        """Every phase of every chunk, as scheduled (module docstring): the intra-node
        link never runs two phases at once, nor do the NICs, and the last all-gather
        ends at ``seconds``."""
        x, y, z, c, T = (self.reduce_scatter, self.all_reduce, self.all_gather, self.chunks,
                         self.bottleneck)
        out = []
        for i in range(c):
            t = i * T
            # the last all-gather also waits for the previous one (the same links)
            ag = (i + 1) * T + x if i < c - 1 else max(t + x + y, t + x + z if c > 1 else 0.0)
            out += [PipelinePhase(i, "reduce_scatter", "intra", t, t + x),
                    PipelinePhase(i, "all_reduce", "inter", t + x, t + x + y),
                    PipelinePhase(i, "all_gather", "intra", ag, ag + z)]
        return sorted(out, key=lambda ph: (ph.start, ph.chunk))

    def __str__(self) -> str:
        us = 1e6
        return (f"pipelined all_reduce of {self.nbytes:.4g} B over {self.nodes} nodes x "
                f"{self.local} ranks ({self.profile}), {self.chunks} chunks: "
                f"{self.seconds * us:.1f} us = fill/drain {self.fill_drain * us:.1f} + "
                f"{self.chunks - 1} x max(x+z, y) {self.bottleneck * us:.1f}"
                + (f" + last all-gather's wait {self._wait * us:.1f} " if self._wait else " ")
                + f"(x {self.reduce_scatter * us:.1f}, y {self.all_reduce * us:.1f}, "
                f"z {self.all_gather * us:.1f}); unchunked {self.hierarchical * us:.1f} us, "
                f"flat ring {self.flat_ring * us:.1f} us ({self.speedup:.2f}x)")


def _check_chunks(chunks):
    if chunks is not None and (isinstance(chunks, bool) or not isinstance(chunks, int)
                               or chunks < 1):
        raise ValueError(f"chunks={chunks!r} must be an int >= 1, or None for the count the "
                         f"clock picks from {list(_topo.PIPELINE_CHUNKS)}")


def plan_pipelined_all_reduce(nbytes: float, ranks, profile=None,
                              chunks: int | None = None) -> PipelinedAllReduce:
    """Price the pipelined hierarchical all-reduce of ``nbytes`` per rank over ``ranks``.

    ``chunks=None`` takes the count the clock's "pipelined" price picks (the fastest of
    ``topology.PIPELINE_CHUNKS``, the first on a tie), so ``.seconds`` equals
    ``cost.price("all_reduce", nbytes, ranks, profile, "pipelined")``."""
    profile = get_profile(profile)
    _check_chunks(chunks)
    g = _topo.group_of(ranks, profile)
    _cost._check("all_reduce", nbytes, g.p)
    if not g.even:
        raise ValueError(f"ranks={list(ranks)!r:.80} put {list(g.per_node)} ranks on their "
                         f"nodes; the hierarchical all-reduce needs the same number on every "
                         f"node (use cost.price(..., 'ring') for this group)")
    if chunks is None:
        best = None
        for c in _topo.PIPELINE_CHUNKS:
            t = _topo.pipelined_seconds(*_topo.phase_times("all_reduce", nbytes, g, profile,
                                                           c), c)
            if best is None or t < best[0]:
                best = (t, c)
        chunks = best[1]
    x, y, z = _topo.phase_times("all_reduce", nbytes, g, profile, chunks)
    return PipelinedAllReduce(
        float(nbytes), profile.name, g.nodes, g.local, chunks, x, y, z,
        sum(_topo.phase_times("all_reduce", nbytes, g, profile, 1)),
        _cost.price("all_reduce", nbytes, list(ranks), profile, "ring"))


def _node_view(mesh: Mesh, axis: int, profile):
    """The mesh with ``axis`` split in (nodes, local), or a ValueError naming the fix."""
    groups = mesh.groups(axis)
    layouts = set()
    for g in groups:
        nodes = [profile.node_of(r) for r in g]
        if nodes != sorted(nodes):
            raise ValueError(f"hierarchical_all_reduce: the group {list(g)} along mesh dim "
                             f"{mesh.dim_names[axis]!r} is not ordered node by node "
                             f"({profile.devices_per_node} ranks per node on "
                             f"{profile.name!r}); order the mesh's ranks so each node's ranks "
                             f"are contiguous along that dim")
        layouts.add(_topo.group_of(g, profile))
    if len(layouts) != 1 or not next(iter(layouts)).even:
        raise ValueError(f"hierarchical_all_reduce: groups along mesh dim "
                         f"{mesh.dim_names[axis]!r} put {sorted(l.per_node for l in layouts)} "
                         f"ranks on their nodes; every group needs the same number of ranks on "
                         f"each of its nodes (use collectives.all_reduce)")
    g = next(iter(layouts))
    m, k = g.nodes, g.local
    ranks = np.array(mesh.ranks).reshape(mesh.shape)
    shape = mesh.shape[:axis] + (m, k) + mesh.shape[axis + 1:]
    name = mesh.dim_names[axis]
    names = mesh.dim_names[:axis] + (f"{name}_node", f"{name}_local") + \
        mesh.dim_names[axis + 1:]
    return Mesh(ranks.reshape(shape).tolist(), names), g


def hierarchical_all_reduce(x: torch.Tensor, mesh: Mesh, axis, *, chunks: int | None = None,
                            op: str = "sum", profile=None, label: str = "") -> torch.Tensor:
    """All-reduce stacked ``x`` along mesh ``axis`` by the pipelined hierarchical algorithm:
    per chunk, reduce-scatter inside each node, all-reduce across nodes, all-gather inside.

    The result is the all-reduce (``collectives.all_reduce``'s compact replicated form),
    summed in the algorithm's order (node-local partial sums first, as HCCL and NCCL do).
    In a ``wb.trace`` the phases are recorded per chunk on the pipelined timeline of
    :func:`plan_pipelined_all_reduce` (intra-node groups and inter-node groups on their
    own streams), and the ranks' compute waits for the last all-gather.  ``profile``
    (default: the trace's, else "a100") says which ranks share a node."""
    _C._check_op(op)
    _check_chunks(chunks)
    if _B.is_distributed(mesh):
        raise NotImplementedError("hierarchical_all_reduce runs on the simulator; on "
                                  "torch.distributed the library picks its own algorithm "
                                  "(HCCL_ALGO='level0:NA;level1:pipeline' asks HCCL for it)")
    tr = current_trace()
    profile = get_profile(profile if profile is not None else
                          (tr.profile if tr is not None else None))
    F, axis = _C._check(x, mesh, axis, "all_reduce")
    if not isinstance(x, torch.Tensor):
        raise ValueError("hierarchical_all_reduce: uneven shards (Cells) are not supported; "
                         "use collectives.all_reduce")
    nd = mesh.ndim
    view, g = _node_view(mesh, axis, profile)
    lead, local = tuple(x.shape[:nd]), tuple(x.shape[nd:])
    plan = plan_pipelined_all_reduce(math.prod(local) * x.element_size(),
                                     list(mesh.groups(axis)[0]), profile, chunks)
    c, m, k = plan.chunks, g.nodes, g.local
    flat = x.reshape(lead + (-1,))
    N = flat.shape[-1]
    per = math.ceil(N / (c * k)) * k if N else k          # elements per chunk, k | per
    if per * c != N:
        flat = torch.nn.functional.pad(flat, (0, per * c - N))
    flat = flat.reshape(lead[:axis] + (m, k) + lead[axis + 1:] + (per * c,))
    na, la = axis, axis + 1                                 # node and local axes of the view
    outs = []
    with suspend():                                         # recorded below, pipelined
        for i in range(c):
            piece = flat[..., i * per:(i + 1) * per]
            part = _C.reduce_scatter(piece, view, la, -1, op)       # (.., m, k, .., per / k)
            part = _C.all_reduce(part, view, na, op) if m > 1 else part
            outs.append(_C.all_gather(part, view, la, -1) if k > 1 else part)
    y = torch.cat(outs, -1)[..., :N]
    y = y.reshape(y.shape[:na] + (y.shape[na] * y.shape[la],) + y.shape[la + 1:])
    if y.shape[na] != 1:                    # both view axes compact: one replicated copy
        y = y[(slice(None),) * na + (slice(0, 1),)]
    y = y.reshape(y.shape[:nd] + local)
    if tr is not None:
        _record(tr, view, na, la, plan, x.element_size() * per, label)
    return y


def _record(tr, view: Mesh, na: int, la: int, plan: PipelinedAllReduce, chunk_bytes: int,
            label: str) -> None:
    """Record the pipelined timeline: each phase on every group of its mesh axis."""
    intra, inter = view.groups(la), view.groups(na)
    every = sorted(r for grp in intra for r in grp)
    t0 = max(tr.now(r) for r in every)
    k, m = plan.local, plan.nodes
    handles = []
    for ph in plan.timeline():
        groups, p = (intra, k) if ph.link == "intra" else (inter, m)
        nb = chunk_bytes if ph.link == "intra" else chunk_bytes // k
        if p == 1 or ph.end == ph.start:
            continue
        for grp in groups:
            handles.append(tr.record_collective(
                grp, ph.name, ph.end - ph.start, bytes=_cost.wire_bytes(ph.name, nb, p),
                label=label or f"pipelined all_reduce chunk {ph.chunk}",
                args={"algorithm": "pipelined", "chunk": ph.chunk, "link": ph.link,
                      "buffer_bytes": int(nb)},
                overlap=True, ready=t0 + ph.start))
    for h in handles:
        tr.wait(h)
