"""Loading into any mesh and placements: each rank reads only the pieces it needs.

For every target (a DistTensor, a tensor or a Python value in a state dict, filled in
place as ``torch.distributed.checkpoint.load`` does), the plan is DCP's
(``create_default_local_load_plan`` / ``create_read_items_for_chunk_list``): the box a
rank holds in the global tensor (:func:`workbench.parallel.layout.shard_bounds`) is
intersected with every saved chunk; each overlapping chunk is one read of its bytes
from its file.  :class:`LoadReport` records, per rank, the file, offset and length of
every read, so that "only the pieces needed" can be counted.

Checks, before anything in the target changes: every file the metadata names exists
with the size it was written with (missing and truncated files are named), each
piece read matches its sha256, every target key is in the checkpoint with the saved
global shape.  Only then are the targets written, so a failed load leaves them as
they were.  A wrapper's state-dict value that is not the model's storage (simulated DDP's
row of rank 0, FSDP's and ZeRO-3's gathered copies, DualPipe's second copy) is then
written back into it (:mod:`workbench.parallel.load_back`), so a load in place changes
the model as DCP's does in torch; a target on the meta device is an error (a copy into
it would do nothing).
"""
from __future__ import annotations

import io
import os
from dataclasses import dataclass, field

import torch

from ..parallel.dist_tensor import DistTensor
from ..parallel import storage
from ..parallel.load_back import loading, write_back
from ..parallel.layout import shard_bounds
from ..sim_mesh import backends as _B
from . import format as F

__all__ = ["load", "LoadReport", "Read"]


@dataclass(frozen=True)
class Read:
    """One piece a rank needed: ``length`` bytes at ``offset`` of ``file``."""
    rank: int | None          # None: a plain tensor or value in a simulated run
    key: str
    file: str
    offset: int
    length: int


@dataclass
class LoadReport:
    """What a load read (plain data)."""
    reads: list = field(default_factory=list)

    def files(self, rank=...) -> set:
        """The files ``rank`` read from (every rank's when left out)."""
        return {r.file for r in self.reads if rank is ... or r.rank == rank}

    def bytes(self, rank=...) -> int:
        return sum(r.length for r in self.reads if rank is ... or r.rank == rank)

    def pieces(self, rank=..., key=None) -> list:
        """(file, offset) of the pieces ``rank`` read, of ``key`` when given."""
        return sorted((r.file, r.offset) for r in self.reads
                      if (rank is ... or r.rank == rank) and (key is None or r.key == key))


class _Files:
    """Reads pieces, each once per load, checked against the metadata's sha256."""

    def __init__(self, path, md):
        self.path, self.md = path, md
        wb = getattr(md, "workbench", None) or {}
        self.sizes = {k: v["bytes"] for k, v in wb.get("files", {}).items()}
        self.sums = wb.get("pieces", {})
        self.cache = {}
        self.chunk_sizes = {(key, tuple(c.offsets)): tuple(c.sizes)
                            for key, meta in md.state_dict_metadata.items()
                            if isinstance(meta, F.TensorStorageMetadata) for c in meta.chunks}
        self._check_files()

    def _check_files(self):
        ends = {}
        for info in (self.md.storage_data or {}).values():
            ends[info.relative_path] = max(ends.get(info.relative_path, 0),
                                           info.offset + info.length)
        for name, end in sorted(ends.items()):
            p = os.path.join(self.path, name)
            if not os.path.exists(p):
                raise F.CheckpointError(f"{p}: missing (the checkpoint's metadata names it)")
            size = os.path.getsize(p)
            want = self.sizes.get(name)
            if (want is not None and size != want) or size < end:
                raise F.CheckpointError(f"{p}: {size} bytes, written with "
                                        f"{want if want is not None else f'at least {end}'}: "
                                        "truncated or changed")

    def get(self, info, weights_only: bool = True):
        """The piece ``info`` names, deserialized: a tensor with ``weights_only=True``; a
        Python value with ``weights_only=False``, as DCP's ``DefaultLoadPlanner.load_bytes``
        reads one (torch 2.13, ``torch/distributed/checkpoint/default_planner.py``): what
        ``save`` pickled (a numpy RNG state, a config object) loads back, so load only
        checkpoints you trust, as with DCP."""
        k = (info.relative_path, info.offset)
        if k in self.cache:
            return self.cache[k]
        p = os.path.join(self.path, info.relative_path)
        with open(p, "rb") as f:
            f.seek(info.offset)
            raw = f.read(info.length)
        if len(raw) != info.length:
            raise F.CheckpointError(f"{p}: truncated (piece at byte {info.offset})")
        want = self.sums.get(k)
        if want is not None and F.sha256(raw) != want:
            raise F.CheckpointError(f"{p}: checksum mismatch in the piece at byte "
                                    f"{info.offset} ({info.length} bytes): the file changed "
                                    "after it was written")
        try:
            obj = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=weights_only)
        except Exception as e:          # noqa: BLE001 - any deserialization failure
            raise F.CheckpointError(f"{p}: the piece at byte {info.offset} does not "
                                    f"deserialize ({e})") from e
        self.cache[k] = obj
        return obj


def _storage_index(md):
    """fqn -> [(chunk offsets, _StorageInfo)]."""
    out = {}
    for idx, info in (md.storage_data or {}).items():
        out.setdefault(idx.fqn, []).append((idx.offset, info))
    return out


def _fill(box, dtype, key, pieces, files, report, rank):
    """The tensor of global region ``box`` ((start, size) per dim) from the saved chunks."""
    sizes = [n for _, n in box]
    out = torch.empty(sizes, dtype=dtype)
    covered = 0
    for offs, info in pieces:
        offs = tuple(offs) if offs is not None else (0,) * len(box)
        lo = [max(b0, o) for (b0, _), o in zip(box, offs)]
        chunk_sizes = files.chunk_sizes.get((key, offs))
        if chunk_sizes is None:
            raise F.CheckpointError(f"{key!r}: the metadata stores a piece at {list(offs)} "
                                    "that no chunk of the tensor describes")
        hi = [min(b0 + bn, o + cn) for (b0, bn), o, cn in zip(box, offs, chunk_sizes)]
        if any(h <= lw for h, lw in zip(hi, lo)) and len(box):
            continue
        src = files.get(info)
        report.reads.append(Read(rank, key, info.relative_path, info.offset, info.length))
        if not isinstance(src, torch.Tensor) or tuple(src.shape) != tuple(chunk_sizes):
            raise F.CheckpointError(f"{os.path.join(files.path, info.relative_path)}: the piece "
                                    f"of {key!r} at {list(offs)} is not a tensor of shape "
                                    f"{list(chunk_sizes)}")
        s, d = src, out
        for dim, (a, b) in enumerate(zip(lo, hi)):
            s = s.narrow(dim, a - offs[dim], b - a)
            d = d.narrow(dim, a - box[dim][0], b - a)
        d.copy_(s)
        n = 1
        for a, b in zip(lo, hi):
            n *= b - a
        covered += n
    total = 1
    for n in sizes:
        total *= n
    if covered != total:
        raise F.CheckpointError(f"{key!r}: the checkpoint's chunks cover {covered} of the "
                                f"{total} elements this rank needs")
    return out


def load(path, state, *, strict: bool = True) -> LoadReport:
    """Fill ``state`` in place from the checkpoint at ``path`` (``dcp.load``'s contract):
    tensors and DistTensors are copied into (any mesh and placements: each rank reads
    only the chunks that overlap its shard), Python values are replaced in the dict.
    ``strict``: every key of ``state`` must be in the checkpoint.  A top-level value with
    ``state_dict`` and ``load_state_dict`` (a module, an optimizer: DCP's ``Stateful``) is
    read into its ``state_dict()``, then given to its ``load_state_dict``, as ``dcp.load``
    does.  Returns what was read."""
    path = F.check_path("load", path, state)
    md = F.read_metadata(path)
    given, state = state, F.stateful_to_state_dict(state)   # a module: its state_dict()
    flat, paths = F.flatten(state)
    if strict:
        _check_empty(state, md, path)
    files = _Files(path, md)
    index = _storage_index(md)
    me = _B.rank() if _distributed() else None
    report, writes, objects = LoadReport(), [], []
    for key, target in flat.items():
        meta = md.state_dict_metadata.get(key)
        if meta is None:
            if not strict:
                continue
            near = [k for k in md.state_dict_metadata if k.split(".")[-1] == key.split(".")[-1]]
            raise F.CheckpointError(f"load: key {key!r} is not in the checkpoint at {path!r}"
                                    + (f" (it holds e.g. {near[:3]})" if near else "")
                                    + "; pass strict=False to leave it as it is")
        pieces = index.get(key, [])
        if isinstance(meta, F.BytesStorageMetadata):
            if _tensorlike(target):
                raise F.CheckpointError(f"load: {key!r} was saved as a Python value, the "
                                        f"target is a {type(target).__name__}")
            if not pieces:
                raise F.CheckpointError(f"load: {key!r}: no stored bytes in {path!r}")
            info = pieces[0][1]
            report.reads.append(Read(me, key, info.relative_path, info.offset, info.length))
            objects.append((paths[key], files.get(info, weights_only=False)))
            continue
        if not _tensorlike(target):
            raise F.CheckpointError(f"load: {key!r} was saved as a tensor of shape "
                                    f"{list(meta.size)}; the target holds a "
                                    f"{type(target).__name__} (give a tensor or DistTensor)")
        if tuple(target.shape) != tuple(meta.size):
            raise F.CheckpointError(f"load: size mismatch for {key!r}: the checkpoint holds "
                                    f"{list(meta.size)}, the target {list(target.shape)}")
        if target.device.type == "meta":
            # a copy into a meta tensor does nothing: the load would leave no value anywhere
            raise F.CheckpointError(f"load: {key!r}: the target is on the meta device (no "
                                    "storage to load into); materialize it first, e.g. "
                                    "model.to_empty(device='cpu'), then load")
        dtype = meta.properties.dtype
        if isinstance(target, DistTensor):
            if any(p.is_partial() for p in target.placements):
                raise F.CheckpointError(f"load: {key!r}: the target's placements "
                                        f"{[str(p) for p in target.placements]} hold partial "
                                        "sums; load into Replicate or Shard placements")
            own = storage.holds_own(target.mesh)
            ranks = ([me] if me in target.mesh else []) if own else list(target.mesh.ranks)
            for r in ranks:
                box = shard_bounds(target.shape, target.mesh, target.placements, r)
                writes.append((target, None if own else r,
                               _fill(box, dtype, key, pieces, files, report, r)))
        else:
            box = tuple((0, n) for n in target.shape)
            writes.append((target, None, _fill(box, dtype, key, pieces, files, report, me)))
    # every piece read and checked: now write into the targets
    # (a tied weight's two keys: one the storage itself, one a copy of it: ``loading``)
    with torch.no_grad(), loading(t for t, _, _ in writes):
        for target, r, value in writes:
            dest = target.local(r) if isinstance(target, DistTensor) else target
            dest.copy_(value)
    # a wrapper's state-dict value that is a copy or one replica's view: into the module
    done = set()
    for target, _, _ in writes:
        if id(target) not in done:
            done.add(id(target))
            write_back(target)
    for p, obj in objects:
        F.set_element(state, p, obj)
    for k, v in given.items():          # DCP's load: a Stateful loads what its dict got
        if F.is_stateful(v):
            v.load_state_dict(state[k])
        else:
            given[k] = state[k]
    return report


def _check_empty(state, md, path) -> None:
    """An empty dict in the target where the checkpoint holds entries: load fills only the
    entries a target holds (DCP's contract), so a fresh optimizer's ``state_dict()``
    (``"state": {}`` until its first step) would load nothing, silently, and training
    would go on from zero moments.  Raised before anything changes."""
    from collections.abc import Mapping

    def visit(prefix, v):
        if not isinstance(v, Mapping):
            return
        if not v and prefix:
            key = ".".join(prefix)
            saved = sorted(k for k in md.state_dict_metadata if k.startswith(key + "."))
            if saved:
                raise F.CheckpointError(
                    f"load: the target's {key!r} is empty, the checkpoint holds {len(saved)} "
                    f"entries under it (e.g. {saved[0]!r}); load fills only the entries the "
                    "target holds. A fresh torch.optim optimizer has no state before its first "
                    "step: build it first (each state as zeros of the saved shape and dtype, "
                    "e.g. {'exp_avg': torch.zeros_like(p), 'exp_avg_sq': ..., 'step': "
                    "torch.tensor(0.)}), or pass strict=False to leave it empty")
        for k, x in v.items():
            visit(prefix + (str(k),), x)

    visit((), state)


def _tensorlike(v) -> bool:
    return isinstance(v, (torch.Tensor, DistTensor))


def _distributed() -> bool:
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized()
