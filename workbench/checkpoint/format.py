"""The on-disk format: ``torch.distributed.checkpoint`` (DCP)'s own, plus checksums.

A checkpoint is a directory holding

* ``.metadata``: a pickled :class:`torch.distributed.checkpoint.metadata.Metadata`, as
  DCP's ``FileSystemWriter.finish`` writes it (torch 2.13,
  ``torch/distributed/checkpoint/filesystem.py``): for each flattened key, its global
  size, dtype and chunks (``TensorStorageMetadata``: offsets and sizes of every saved
  piece) or ``BytesStorageMetadata`` for a Python object; ``storage_data`` maps each
  piece (``MetadataIndex(fqn, offset)``) to ``_StorageInfo(file, offset, length)``;
  ``planner_data`` maps each flattened key to its path in the nested state dict (DCP's
  ``flatten_state_dict``).  So ``torch.distributed.checkpoint.load`` reads a workbench
  checkpoint, and a DCP checkpoint loads here.
* ``__<rank>_g<generation>.distcp``: one data file per rank that wrote pieces, each
  piece a ``torch.save`` of the chunk (DCP's ``SerializationFormat.TORCH_SAVE``).

What DCP does not record, the workbench adds where DCP's reader does not look: an
attribute ``workbench`` on the Metadata object (plain data: the generation, each
data file's size and sha256, each piece's sha256, and each DistTensor's mesh and
placements as saved), and after the pickle a trailer line ``WBSHA256 <hex>`` with
the sha256 of the pickle itself (``pickle.load`` stops at the pickle's STOP opcode, so
DCP's reader never sees it).
"""
from __future__ import annotations

import hashlib
import io
import os
import pickle
from collections.abc import Mapping

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
                                                   Metadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)

from ..parallel.dist_tensor import DistTensor
from ..parallel.strategies.laid_out import module_shaped

__all__ = ["CheckpointError", "METADATA", "TRAILER", "flatten", "set_element", "sha256",
           "is_stateful", "stateful_to_state_dict", "check_path",
           "dump_metadata", "read_metadata", "BytesStorageMetadata", "ChunkStorageMetadata",
           "Metadata", "MetadataIndex", "TensorProperties", "TensorStorageMetadata",
           "_StorageInfo", "data_file", "is_data_file"]

METADATA = ".metadata"          # DCP's _metadata_fn
TRAILER = b"\nWBSHA256 "        # then 64 hex digits and a newline


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read as written: a missing, truncated or changed file,
    or a target that does not match what was saved.  The message names the file or key."""


def sha256(data) -> str:
    return hashlib.sha256(data).hexdigest()


def data_file(rank: int, generation: int) -> str:
    """The data file of ``rank`` in save number ``generation``."""
    return f"__{rank}_g{generation}.distcp"


def is_data_file(name: str) -> bool:
    """A file this module writes (and may delete once no metadata refers to it)."""
    return name.startswith("__") and (name.endswith(".distcp") or name.endswith(".distcp.tmp"))


# ---- nested state dicts: DCP's flattening ------------------------------------------------

def _tensorlike(v) -> bool:
    return isinstance(v, (torch.Tensor, DistTensor))


def _terminal(v) -> bool:
    """DCP's ``traverse_state_dict``: a mapping is traversed; a list only when it holds
    a tensor (here: or a DistTensor) or a non-terminal container."""
    if isinstance(v, Mapping):
        return False
    if not isinstance(v, list):
        return True
    for e in v:
        if isinstance(e, (Mapping, list)) and not _terminal(e):
            return False
        if _tensorlike(e):
            return False
    return True


def check_path(op: str, path, state) -> str:
    """``path`` as a string; the arguments in torch DCP's order (``dcp.save(state_dict,
    checkpoint_id=path)``) are a TypeError naming workbench's (directory first)."""
    if isinstance(path, Mapping):
        raise TypeError(f"wb.checkpoint.{op}(path, state): the first argument is a "
                        f"{type(path).__name__}, the second a {type(state).__name__}; the "
                        f"directory comes first here: wb.checkpoint.{op}(path, state) (torch's "
                        f"order is dcp.{op}(state_dict, checkpoint_id=path))")
    try:
        return os.fspath(path)
    except TypeError:
        raise TypeError(f"wb.checkpoint.{op}(path={path!r:.60}): give the checkpoint's "
                        "directory, a str or os.PathLike") from None


def is_stateful(v) -> bool:
    """DCP's ``Stateful`` (``torch.distributed.checkpoint.stateful``: an object with
    ``state_dict`` and ``load_state_dict``, e.g. an ``nn.Module``, an optimizer, an LR
    scheduler), other than a mapping (a dict is traversed as one: a module's
    ``state_dict()`` holding DistTensors, :class:`~workbench.parallel.dcp_interop.
    DistStateDict`, keeps its shards) and a class."""
    return not isinstance(v, (Mapping, type)) and not _tensorlike(v) and \
        callable(getattr(v, "state_dict", None)) and callable(getattr(v, "load_state_dict", None))


def stateful_to_state_dict(state: Mapping) -> dict:
    """A shallow copy of ``state`` where each top-level :func:`is_stateful` value is its
    ``state_dict()`` (DCP's ``_stateful_to_state_dict`` on save, and the targets its
    ``load`` fills before it calls their ``load_state_dict``)."""
    if not isinstance(state, Mapping):
        raise TypeError(f"state={type(state).__name__}: give a dict (a state dict: "
                        "{name: tensor, DistTensor, nested dict or Python value})")
    return {k: v.state_dict() if is_stateful(v) else v for k, v in state.items()}


def flatten(state: Mapping) -> tuple[dict, dict]:
    """(``{"a.b.0": leaf}``, ``{"a.b.0": ("a", "b", 0)}``): DCP's ``flatten_state_dict``
    keys and mapping (torch 2.13 ``_nested_dict.py`` / ``_traverse.py``), with DistTensors
    as leaves as DTensors are there."""
    if not isinstance(state, Mapping):
        raise TypeError(f"state={type(state).__name__}: give a dict (a state dict: "
                        "{name: tensor, DistTensor, nested dict or Python value})")
    flat, paths = {}, {}

    def visit(path, v):
        if isinstance(v, Mapping):
            for k, x in v.items():
                visit(path + (str(k),), x)
        elif _terminal(v):
            key = ".".join(map(str, path))
            if is_stateful(v):
                # pickled whole, a load would put a new object in the container and
                # leave this one as it was: silently not restored
                raise CheckpointError(
                    f"state: {key!r} is a {type(v).__name__} (it has state_dict and "
                    "load_state_dict); only a top-level entry is read through them, as "
                    "torch.distributed.checkpoint does: put it at the top of the dict, "
                    f"or give its state_dict() here")
            if key in flat:
                raise ValueError(f"state: two entries flatten to the key {key!r}; rename one")
            # a wrapper's parameter itself (ddp.state_dict(keep_vars=True), as torch's):
            # its module-shaped value, loaded back into every rank's row or chunk
            flat[key], paths[key] = module_shaped(v), path
        else:                                   # a list or tuple holding tensors
            for i, x in enumerate(v):
                visit(path + (i,), x)

    for k, v in state.items():
        visit((str(k),), v)
    return flat, paths


def set_element(root, path, value) -> None:
    """Put ``value`` at ``path`` in the nested ``root`` (an existing container)."""
    cur = root
    for p in path[:-1]:
        cur = cur[p] if not isinstance(cur, Mapping) else _get(cur, p)
    last = path[-1]
    if isinstance(cur, Mapping):
        key = next((k for k in cur if str(k) == last), last)
        cur[key] = value
    else:
        cur[last] = value


def _get(m, key):
    if key in m:
        return m[key]
    for k in m:                 # e.g. optimizer states keyed by int, flattened as "0"
        if str(k) == key:
            return m[k]
    raise KeyError(key)


# ---- the metadata file ---------------------------------------------------------------------

def dump_metadata(md: Metadata, directory: str, fsync: bool = True) -> None:
    """Write ``.metadata`` atomically: a temporary name, fsync, rename, fsync the
    directory (the commit point of a save)."""
    body = pickle.dumps(md)
    tmp = os.path.join(directory, METADATA + ".tmp")
    with open(tmp, "wb") as f:
        f.write(body + TRAILER + sha256(body).encode() + b"\n")
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, METADATA))
    if fsync:
        fsync_dir(directory)


def fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_metadata(directory: str) -> Metadata:
    """The checkpoint's Metadata, its checksum checked when it carries one (a DCP
    checkpoint written by torch has none: there only sizes can be checked)."""
    path = os.path.join(os.fspath(directory), METADATA)
    if not os.path.isdir(directory):
        raise CheckpointError(f"no checkpoint at {directory!r}: not a directory")
    if not os.path.exists(path):
        raise CheckpointError(f"no checkpoint at {directory!r}: {METADATA} is missing (a save "
                              "that did not finish leaves none; the previous one stays)")
    with open(path, "rb") as f:
        raw = f.read()
    cut = raw.rfind(TRAILER)
    if cut != -1:
        body, digest = raw[:cut], raw[cut + len(TRAILER):].strip().decode("ascii", "replace")
        if sha256(body) != digest:
            raise CheckpointError(f"{path}: checksum mismatch (the file was changed or "
                                  "truncated after it was written)")
    else:
        body = raw
    try:
        md = pickle.load(io.BytesIO(body))
    except Exception as e:                      # noqa: BLE001 - any unpickling failure
        raise CheckpointError(f"{path}: not a readable checkpoint metadata file ({e})") from e
    if not isinstance(md, Metadata):
        raise CheckpointError(f"{path}: holds a {type(md).__name__}, not DCP Metadata")
    if cut == -1 and getattr(md, "workbench", None) is not None:
        raise CheckpointError(f"{path}: its checksum line is missing (the file was truncated)")
    return md
