"""tests/rewrite_cache.py: the assertion rewrite it caches is the one pytest reads (under
PYTHONDONTWRITEBYTECODE, as this project's machines run), with pytest's introspected
failure message, and a module edited since is rewritten again, never run stale."""
import os
import subprocess
import sys
from pathlib import Path

from tests import rewrite_cache

ROOT = Path(__file__).resolve().parent.parent


def _pytest(path: Path, debug: Path):
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "no:xdist", f"--debug={debug}", "--rootdir", str(path.parent),
                           str(path)], capture_output=True, text=True, env=env,
                          cwd=path.parent, timeout=120)


def test_the_cached_rewrite_is_read_by_pytest_and_an_edit_is_rewritten(tmp_path):
    src = tmp_path / "test_cached.py"
    src.write_text("def test_it():\n    a = [1, 2]\n    assert a == [1, 3]\n")
    assert rewrite_cache.main([str(src)]) == 0
    cached = list((tmp_path / "__pycache__").glob("test_cached.*pytest*.pyc"))
    assert len(cached) == 1

    out = _pytest(src, tmp_path / "one.log")
    log = (tmp_path / "one.log").read_text()
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert f"found cached rewritten pyc for {src}" in log
    assert f"rewriting {src!r}" not in log
    assert "assert [1, 2] == [1, 3]" in out.stdout              # the rewritten message

    # an edit: the cached rewrite no longer matches the source's hash
    src.write_text("def test_it():\n    a = [1, 2]\n    assert a == [1, 2]\n")
    out = _pytest(src, tmp_path / "two.log")
    log = (tmp_path / "two.log").read_text()
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert f"_read_pyc({src}): out of date" in log and f"rewriting {src!r}" in log
    assert f"found cached rewritten pyc for {src}" not in log


def test_a_file_it_cannot_rewrite_is_named_and_the_others_are_cached(tmp_path, capsys):
    bad, good = tmp_path / "test_bad.py", tmp_path / "test_good.py"
    bad.write_text("def test_it(:\n")                          # a syntax error
    good.write_text("def test_it():\n    assert 1\n")
    assert rewrite_cache.main([str(bad), str(good)]) == 0
    assert f"rewrite_cache: {bad} not cached (SyntaxError" in capsys.readouterr().out
    names = sorted(p.name.split(".")[0] for p in (tmp_path / "__pycache__").glob("*.pyc"))
    assert names == ["test_good"]
