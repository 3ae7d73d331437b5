"""Sharded checkpoints that reshard on load: ``wb.checkpoint.save`` / ``wb.checkpoint.load``.

    import workbench as wb
    wb.checkpoint.save("ckpt/step3", {"model": model.state_dict(), "step": 3})
    state = {"model": other_layout_model.state_dict(), "step": 0}
    report = wb.checkpoint.load("ckpt/step3", state)     # fills the DistTensors in place
    state["step"]                                        # 3 (Python values are replaced)

The API and the on-disk format are ``torch.distributed.checkpoint``'s (DCP): a state
dict in, the same state dict filled in place on load; one ``.metadata`` file plus one
data file per rank that holds pieces (:mod:`.format`).  A checkpoint written here loads
with ``torch.distributed.checkpoint.load`` and one written by DCP loads here.

* :func:`save` (:mod:`.writer`): each rank writes its own shards, a replicated chunk
  once; the save is atomic (a crash leaves the previous checkpoint whole) and every
  file and piece carries a sha256.
* :func:`load` (:mod:`.reader`): into ANY mesh and placements; each rank reads only the
  saved chunks that overlap its shard (:class:`LoadReport` lists them); a missing,
  truncated or changed file is a :class:`CheckpointError` naming the file, raised
  before the target changes.
* :func:`verify`: every file's sha256, read whole.
* :mod:`.state_dict`: ``torch.distributed.checkpoint.state_dict``'s helpers
  (``get_state_dict`` / ``set_state_dict``...: one device's FQNs, full or sharded values)
  on workbench's wrappers too.
* :mod:`.training`: the training state (model, optimizer, step, RNG) of a ``train`` run,
  for ``python -m workbench train --save DIR`` / ``--resume DIR``.
"""
from __future__ import annotations

import os

from .format import CheckpointError, read_metadata
from .reader import LoadReport, Read, load
from .writer import save
from .state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                         get_state_dict, set_model_state_dict, set_optimizer_state_dict,
                         set_state_dict)

__all__ = ["save", "load", "verify", "CheckpointError", "LoadReport", "Read", "read_metadata",
           "StateDictOptions", "get_model_state_dict", "get_optimizer_state_dict",
           "get_state_dict", "set_model_state_dict", "set_optimizer_state_dict",
           "set_state_dict"]


def verify(path) -> dict:
    """Check every file of the checkpoint at ``path`` against its recorded size and
    sha256 (reading each whole); returns {file: bytes}.  Raises CheckpointError naming
    the first file that does not match."""
    import hashlib
    path = os.fspath(path)
    md = read_metadata(path)
    files = (getattr(md, "workbench", None) or {}).get("files")
    if files is None:
        raise CheckpointError(f"{path}: no checksums recorded (written by torch DCP?)")
    out = {}
    for name, info in sorted(files.items()):
        p = os.path.join(path, name)
        if not os.path.exists(p):
            raise CheckpointError(f"{p}: missing (the checkpoint's metadata names it)")
        h = hashlib.sha256()
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        if os.path.getsize(p) != info["bytes"] or h.hexdigest() != info["sha256"]:
            raise CheckpointError(f"{p}: checksum mismatch (truncated or changed)")
        out[name] = info["bytes"]
    return out
