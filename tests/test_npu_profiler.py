"""wb.npu.profile on CPU: a Chrome trace the course can open, and a quiet stderr."""
import json
import subprocess
import sys
import textwrap

import pytest
import torch

import workbench.npu as npu


def test_cpu_profile_writes_a_chrome_trace(tmp_path):
    path = tmp_path / "sub" / "trace.json"
    a = torch.randn(32, 32)
    with npu.profile(path, device="cpu", record_shapes=True) as prof:
        (a @ a).relu()
    assert prof.backend == "torch.profiler" and prof.activities == ("CPU",)
    names = {e.get("name") for e in json.loads(path.read_text())["traceEvents"]}
    assert {"aten::mm", "aten::relu"} <= names
    table = prof.summary(row_limit=3)
    assert "aten::" in table and "Self CPU" in table
    narrow = prof.summary(row_limit=3, max_name_column_width=6)    # fits a notebook's width
    assert narrow.splitlines()[0].split()[0] == "-" * 6 and "..." in narrow
    with pytest.raises(ValueError, match="max_name_column_width=0"):
        prof.summary(max_name_column_width=0)


def test_profile_path_must_be_json(tmp_path):
    with pytest.raises(ValueError, match=r"give a path ending in .json, e.g. trace.json"):
        with npu.profile(tmp_path / "trace.txt"):
            pass


def test_an_error_in_the_block_propagates_and_writes_no_trace(tmp_path):
    path = tmp_path / "t.json"
    with pytest.raises(ZeroDivisionError):
        with npu.profile(path, device="cpu"):
            1 / 0
    assert not path.exists()


def test_profiling_prints_nothing_on_stderr(tmp_path):
    code = textwrap.dedent(f'''
        import torch, workbench.npu as npu
        with npu.profile({str(tmp_path / "q.json")!r}) as prof:
            torch.randn(8, 8).sum()
        print("ok")
    ''')
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and result.stdout == "ok\n"
    assert result.stderr == ""
