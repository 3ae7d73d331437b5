"""Detection, the doctor's report, and importing with a broken torch_npu installed."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import workbench.npu as npu


def test_this_machine_without_torch_npu():
    found = npu.probe(refresh=True)
    if found.imported:
        pytest.skip("torch_npu is installed here")
    assert not npu.is_available() and npu.device_count() == 0
    assert npu.device() == (torch.device("cuda", torch.cuda.current_device())
                            if torch.cuda.is_available() else torch.device("cpu"))
    with pytest.raises(RuntimeError, match="torch_npu is not installed"):
        npu.torch_npu_module()


@pytest.mark.parametrize("device, backend", [("cpu", "gloo"), ("cuda:1", "nccl"), ("npu", "hccl"),
                                             ("npu:3", "hccl"), (torch.device("cpu"), "gloo")])
def test_dist_backend(device, backend):
    assert npu.dist_backend(device) == backend


def test_dist_backend_default_and_unknown():
    assert npu.dist_backend() == npu.dist_backend(npu.device())
    with pytest.raises(ValueError, match="no torch.distributed backend .* device type 'mps'"):
        npu.dist_backend("mps")


def test_report_is_plain_data_and_readable(capsys):
    report = npu.report()
    data = report.as_dict()
    assert data["torch"] == torch.__version__ and data["device"] == str(npu.device())
    assert data["dist_backend"] == npu.dist_backend() and data["dist_backends"]["gloo"]
    text = str(report)
    for label in ("torch_npu", "CANN environment", "Ascend NPU", "CUDA", "device", "distributed"):
        assert label in text
    assert npu.main_doctor() == 0
    assert capsys.readouterr().out.strip() == text


def test_a_failing_import_is_reported_with_its_cause():
    previous = sys.modules.get("torch_npu")

    class Finder:                                   # import torch_npu -> ImportError with a cause
        def find_spec(self, name, path=None, target=None):
            if name != "torch_npu":
                return None
            raise RuntimeError("Failed to load the backend extension: torch_npu") from \
                ImportError("libhccl.so: cannot open shared object file")
    sys.modules.pop("torch_npu", None)
    sys.meta_path.insert(0, Finder())
    try:
        found = npu.probe(refresh=True)
        assert found.installed and not found.imported
        assert found.error == "RuntimeError: Failed to load the backend extension: torch_npu"
        assert found.cause == "ImportError: libhccl.so: cannot open shared object file"
        assert not npu.is_available()
        with pytest.raises(RuntimeError, match="installed but failed to import .*libhccl"):
            npu.torch_npu_module()
        report = npu.report()
        assert report.torch_npu == "import failed" and "libhccl" in str(report)
        assert any("set_env.sh" in note for note in report.notes)
    finally:
        sys.meta_path.pop(0)
        if previous is not None:
            sys.modules["torch_npu"] = previous
        npu.probe(refresh=True)


@pytest.fixture
def broken_torch_npu(tmp_path):
    """A torch_npu that fails like one installed without CANN, registered for auto-load."""
    pkg = tmp_path / "torch_npu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent('''
        raise ImportError("libhccl.so: cannot open shared object file: No such file or directory")

        def _autoload():
            pass
    '''))
    info = tmp_path / "torch_npu-2.13.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch_npu\nVersion: 2.13.0\n")
    (info / "entry_points.txt").write_text("[torch.backends]\ntorch_npu = torch_npu:_autoload\n")
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DEVICE_BACKEND_AUTOLOAD"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    return env


def run_python(code, env):
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)


def test_broken_torch_npu_breaks_plain_import_torch(broken_torch_npu):
    """The control: this stand-in fails `import torch` the way a real one without CANN does."""
    result = run_python("import torch", broken_torch_npu)
    assert result.returncode != 0
    assert "Failed to load the backend extension: torch_npu" in result.stderr


def test_importing_workbench_survives_a_broken_torch_npu_and_says_why(broken_torch_npu):
    code = textwrap.dedent('''
        import workbench
        import workbench.npu as npu
        import workbench.ops as ops
        import torch
        x = torch.randn(2, 8)
        assert ops.rms_norm(x, torch.ones(8)).shape == (2, 8)
        r = npu.report()
        print(r.torch_npu, "|", r.torch_npu_error, "|", npu.device(), npu.dist_backend())
        print(r)
    ''')
    result = run_python(code, broken_torch_npu)
    assert result.returncode == 0, result.stderr
    first = result.stdout.splitlines()[0]
    assert first == ("import failed | ImportError: libhccl.so: cannot open shared object file: "
                     "No such file or directory | cpu gloo")
    assert "set_env.sh" in result.stdout
    assert result.stderr == ""
