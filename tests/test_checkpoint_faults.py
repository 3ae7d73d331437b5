"""wb.checkpoint under faults: a writer killed mid-save (a real SIGKILL of a subprocess,
and an exception between two files) leaves the previous checkpoint whole; a truncated,
deleted or changed file is a CheckpointError naming the file, never a wrong tensor, and
the target is left as it was."""
import os
import signal
import subprocess
import sys

import pytest
import torch

import workbench as wb
from workbench.checkpoint import CheckpointError, load, save, verify
from workbench.checkpoint import writer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESH = wb.Mesh.grid(4, ["x"])


def state(seed):
    g = torch.Generator().manual_seed(seed)
    return {"w": wb.shard_tensor(torch.randn(8, 3, generator=g), MESH, [wb.Shard(0)]),
            "b": torch.randn(5, generator=g), "step": seed}


def target():
    return {"w": wb.shard_tensor(torch.zeros(8, 3), MESH, [wb.Shard(0)]),
            "b": torch.zeros(5), "step": -1}


def same(got, want):
    return torch.equal(got["w"].full(), want["w"].full()) and \
        torch.equal(got["b"], want["b"]) and got["step"] == want["step"]


KILLER = """
import os, signal, sys, torch
import workbench as wb
from workbench.checkpoint import save, writer
real = writer._write_file
calls = []
def dying(*a, **k):
    out = real(*a, **k)
    calls.append(1)
    if len(calls) == 2:                  # two of four files written: die, no cleanup
        os.kill(os.getpid(), signal.SIGKILL)
    return out
writer._write_file = dying
mesh = wb.Mesh.grid(4, ["x"])
g = torch.Generator().manual_seed(1)
save(sys.argv[1], {"w": wb.shard_tensor(torch.randn(8, 3, generator=g), mesh, [wb.Shard(0)]),
                   "b": torch.randn(5, generator=g), "step": 1})
"""


def test_a_writer_killed_mid_save_leaves_the_previous_checkpoint(tmp_path):
    old = state(0)
    save(tmp_path, old)
    before = sorted(os.listdir(tmp_path))
    out = subprocess.run([sys.executable, "-c", KILLER, str(tmp_path)], cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    assert len(os.listdir(tmp_path)) > len(before)      # the new files it did write
    got = target()
    load(tmp_path, got)
    assert same(got, old)
    verify(tmp_path)
    # the next save succeeds and removes the orphans
    new = state(2)
    save(tmp_path, new)
    got = target()
    load(tmp_path, got)
    assert same(got, new)
    assert sorted(os.listdir(tmp_path)) == [".metadata"] + \
        [f"__{r}_g2.distcp" for r in range(4)]


def test_an_exception_between_files_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    old = state(0)
    save(tmp_path, old)
    real, calls = writer._write_file, []

    def failing(*a, **k):
        if calls:
            raise OSError("disk full")
        calls.append(1)
        return real(*a, **k)
    monkeypatch.setattr(writer, "_write_file", failing)
    with pytest.raises(OSError, match="disk full"):
        save(tmp_path, state(1))
    got = target()
    load(tmp_path, got)
    assert same(got, old)


def shard_file(path, rank=1):
    return os.path.join(path, f"__{rank}_g0.distcp")


@pytest.mark.parametrize("fault", ["truncate", "delete", "flip"])
def test_a_damaged_shard_is_an_error_naming_the_file(tmp_path, fault):
    save(tmp_path, state(0))
    f = shard_file(tmp_path)
    if fault == "truncate":
        with open(f, "r+b") as fh:
            fh.truncate(os.path.getsize(f) - 7)
    elif fault == "delete":
        os.remove(f)
    else:
        data = bytearray(open(f, "rb").read())
        data[len(data) // 2] ^= 0x01
        open(f, "wb").write(bytes(data))
    got = target()
    with pytest.raises(CheckpointError, match=r"__1_g0\.distcp"):
        load(tmp_path, got)
    assert got["w"].full().abs().sum() == 0 and got["step"] == -1    # untouched
    with pytest.raises(CheckpointError, match=r"__1_g0\.distcp"):
        verify(tmp_path)


def test_a_changed_piece_that_a_rank_does_not_read_does_not_stop_the_others(tmp_path):
    # a flipped byte in rank 3's rows: a load that needs only rows 0-3 does not read it
    save(tmp_path, state(0))
    f = shard_file(tmp_path, 3)
    data = bytearray(open(f, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(f, "wb").write(bytes(data))
    small = wb.Mesh.grid(2, ["x"])
    t = wb.shard_tensor(torch.zeros(8, 3), small, [wb.Shard(0)])
    with pytest.raises(CheckpointError, match=r"__3_g0\.distcp"):
        load(tmp_path, {"w": t})          # rank 1 needs rows 4-7: rank 3's piece
    assert t.full().abs().sum() == 0


def test_a_changed_metadata_file_is_an_error(tmp_path):
    save(tmp_path, state(0))
    f = os.path.join(tmp_path, ".metadata")
    data = bytearray(open(f, "rb").read())
    data[40] ^= 0x01
    open(f, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match=r"\.metadata: checksum mismatch"):
        load(tmp_path, target())
    open(f, "wb").write(bytes(data[:len(data) // 2]))
    with pytest.raises(CheckpointError, match=r"\.metadata"):
        load(tmp_path, target())
