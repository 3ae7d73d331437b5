"""Saving: every rank writes its own pieces, then one metadata file commits the save.

The steps (DCP's, ``torch/distributed/checkpoint/state_dict_saver.py``: plan, write,
finish), made atomic for the whole directory:

1. plan: flatten the state dict (DCP's keys); for each DistTensor, the chunk each rank
   holds (:func:`workbench.parallel.layout.shard_bounds`), a replicated chunk written
   once, by the first rank that holds it (what DCP does with
   ``dedup_save_to_lowest_rank=True``; by default DCP gives each replicated chunk to
   the rank with the fewest bytes to write so far, ``_dedup_save_plans``: the same
   bytes saved, spread differently over the files); plain tensors and
   Python objects by rank 0 (DCP's coordinator);
2. write: each rank writes its pieces into ``__<rank>_g<generation>.distcp`` under a
   temporary name, fsyncs it and renames it.  A new generation number per save, so the
   previous checkpoint's files are never touched;
3. commit: rank 0 writes ``.metadata`` (temporary name, fsync, rename: the one atomic
   step).  A crash before it leaves the previous ``.metadata``, which names only the
   previous files: the previous checkpoint is whole.  After it, the files no metadata
   names any more are deleted.
"""
from __future__ import annotations

import io
import os
import re

import torch

from ..parallel.dist_tensor import DistTensor
from ..parallel.layout import shard_bounds
from ..parallel.placement import Replicate
from ..sim_mesh import backends as _B
from . import format as F

__all__ = ["save"]

_GEN = re.compile(r"^__\d+_g(\d+)\.distcp(\.tmp)?$")


def _distributed() -> bool:
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized()


def _pieces(key, value, me, writer=0):
    """(writer rank, offsets, tensor) of every piece of ``value`` this process writes,
    and its DCP storage metadata.  ``me``: this process's rank (None: simulated, all);
    ``writer``: the rank that writes a plain tensor or value (the lowest that holds it)."""
    if isinstance(value, DistTensor):
        dt = value
        if any(p.is_partial() for p in dt.placements):      # save the reduced value
            from ..parallel.reshard import reshard
            from ..sim_mesh.trace import suspend
            with suspend():
                dt = reshard(dt, dt.mesh, [Replicate() if p.is_partial() else p
                                           for p in dt.placements])
        chunks, out, seen = [], [], set()
        for r in dt.mesh.ranks:
            bounds = shard_bounds(dt.shape, dt.mesh, dt.placements, r)
            offs = tuple(s for s, _ in bounds)
            sizes = tuple(n for _, n in bounds)
            if offs in seen or 0 in sizes:
                continue                    # a replica's copy, or an empty shard
            seen.add(offs)
            chunks.append(F.ChunkStorageMetadata(torch.Size(offs), torch.Size(sizes)))
            if me is None or r == me:
                out.append((r, offs, dt.local(r if me is None else None)))
        props = F.TensorProperties(dtype=dt.dtype)
        return out, F.TensorStorageMetadata(props, torch.Size(dt.shape), chunks)
    if isinstance(value, torch.Tensor):
        offs = (0,) * value.dim()
        props = F.TensorProperties(dtype=value.dtype)
        chunks = [F.ChunkStorageMetadata(torch.Size(offs), torch.Size(value.shape))]
        mine = [(writer, offs, value)] if me in (None, writer) else []
        return mine, F.TensorStorageMetadata(props, torch.Size(value.shape), chunks)
    return ([(writer, None, value)] if me in (None, writer) else []), F.BytesStorageMetadata()


def _layout(value) -> dict | None:
    if not isinstance(value, DistTensor):
        return None
    m = value.mesh
    return {"mesh_shape": list(m.shape), "ranks": list(m.ranks), "dim_names": list(m.dim_names),
            "placements": [str(p) for p in value.placements]}


def _blob(obj) -> bytes:
    buf = io.BytesIO()
    if isinstance(obj, torch.Tensor):
        # a contiguous copy of only this piece (torch.save of a view saves its whole storage)
        obj = obj.detach().to("cpu", copy=True).contiguous()
    torch.save(obj, buf)
    return buf.getvalue()


def _generation(directory: str) -> int:
    """One more than any generation the directory holds (orphans of a crashed save too)."""
    gens = [int(m.group(1)) for n in os.listdir(directory) if (m := _GEN.match(n))]
    return max(gens, default=-1) + 1


def _write_file(directory: str, name: str, blobs: list[bytes], fsync: bool) -> dict:
    """Write one rank's pieces under a temporary name, fsync, rename; returns the file's
    size, sha256 and each piece's (offset, length, sha256)."""
    import hashlib
    tmp = os.path.join(directory, name + ".tmp")
    whole, pieces, off = hashlib.sha256(), [], 0
    with open(tmp, "wb") as f:
        for b in blobs:
            f.write(b)
            whole.update(b)
            pieces.append((off, len(b), F.sha256(b)))
            off += len(b)
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, name))
    return {"bytes": off, "sha256": whole.hexdigest(), "pieces": pieces}


def save(path, state, *, fsync: bool = True, _info: dict | None = None) -> None:
    """Save ``state`` (a state dict: tensors, DistTensors, nested dicts and lists,
    Python values) to the directory ``path`` in DCP's format, atomically.  A top-level
    value with ``state_dict`` and ``load_state_dict`` (a module, an optimizer: DCP's
    ``Stateful``) is saved as its ``state_dict()``, as ``dcp.save`` does.

    Each rank writes its own pieces; one ``.metadata`` file records global shapes,
    dtypes, chunk offsets, the meshes and placements, and a sha256 of every file.  On
    torch.distributed every process calls it with its own state (a collective).
    ``_info``: plain data kept in the metadata beside them (``md.workbench["info"]``; no
    state-dict key: :mod:`.training` records the model config a resume is checked
    against)."""
    path = F.check_path("save", path, state)
    flat, paths = F.flatten(F.stateful_to_state_dict(state))
    for key, value in flat.items():
        if isinstance(value, (torch.Tensor, DistTensor)) and value.device.type == "meta":
            raise F.CheckpointError(f"save: {key!r} is on the meta device (a shape, no "
                                    "values); materialize and initialize it first, e.g. "
                                    "model.to_empty(device='cpu') then its init, or leave it "
                                    "out of the state")
    dist = _distributed()
    me = _B.rank() if dist else None
    lead = me in (None, 0)
    if lead:
        os.makedirs(path, exist_ok=True)
    gen = _generation(path) if lead else None
    if dist:
        import torch.distributed as tdist
        box = [gen]
        tdist.broadcast_object_list(box, src=0)
        gen = box[0]
    writers = {}                    # plain tensors and values: the lowest rank holding them
    if dist:
        import torch.distributed as tdist
        held = [None] * tdist.get_world_size()
        tdist.all_gather_object(held, sorted(k for k, v in flat.items()
                                             if not isinstance(v, DistTensor)))
        for r, keys in enumerate(held):
            for k in keys:
                writers.setdefault(k, r)
    sd_md, per_rank, layouts = {}, {}, {}
    for key, value in flat.items():
        mine, sd_md[key] = _pieces(key, value, me, writers.get(key, 0))
        if (lay := _layout(value)) is not None:
            layouts[key] = lay
        for r, offs, v in mine:
            per_rank.setdefault(r, []).append((key, offs, _blob(v)))
    results = []                    # (fqn, offsets, file, offset, length, sha256), files
    files = {}
    for r in sorted(per_rank):
        name = F.data_file(r, gen)
        info = _write_file(path, name, [b for _, _, b in per_rank[r]], fsync)
        files[name] = {"bytes": info["bytes"], "sha256": info["sha256"]}
        for (key, offs, _), (off, n, h) in zip(per_rank[r], info["pieces"]):
            results.append((key, offs, name, off, n, h))
    if dist:
        import torch.distributed as tdist
        parts = [None] * tdist.get_world_size()
        tdist.all_gather_object(parts, (results, files, sd_md, paths, layouts))
        results, files = [], {}
        for res, fs, md_, paths_, lay in parts:     # pipeline stages: keys on some ranks
            results += res
            files.update(fs)
            for k, v in md_.items():
                sd_md.setdefault(k, v)
            for k, v in paths_.items():
                paths.setdefault(k, v)
            for k, v in lay.items():
                layouts.setdefault(k, v)
    if lead:
        _commit(path, gen, sd_md, paths, results, files, layouts, fsync, _info)
    if dist:
        import torch.distributed as tdist
        tdist.barrier()             # every rank returns once the checkpoint is committed


def _commit(path, gen, sd_md, paths, results, files, layouts, fsync, info=None) -> None:
    storage, checks = {}, {}
    for key, offs, name, off, n, h in results:
        idx = F.MetadataIndex(key, None if offs is None else torch.Size(offs))
        storage[idx] = F._StorageInfo(name, off, n)
        checks[(name, off)] = h
    md = F.Metadata(state_dict_metadata=sd_md, planner_data=paths, storage_data=storage,
                    version="1.0.0")
    from torch.distributed.checkpoint.metadata import StorageMeta
    md.storage_meta = StorageMeta(checkpoint_id=path, save_id=f"g{gen}")
    md.workbench = {"format": 1, "generation": gen, "files": files, "pieces": checks,
                    "layouts": layouts}
    if info:
        md.workbench["info"] = dict(info)
    F.dump_metadata(md, path, fsync)
    for n in os.listdir(path):          # what no metadata names any more
        if F.is_data_file(n) and n not in files:
            try:
                os.remove(os.path.join(path, n))
            except FileNotFoundError:
                pass
