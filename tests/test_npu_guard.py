"""The float64-on-NPU guard: warns clearly, once per call site, and only when it should."""
import uuid
import warnings
from types import SimpleNamespace

import pytest
import torch

import workbench.npu as npu


def on(kind, dtype):
    """Something that looks like a tensor to the guard (it reads .dtype and .device.type)."""
    return SimpleNamespace(dtype=dtype, device=SimpleNamespace(type=kind))


def site():
    return f"test-site-{uuid.uuid4().hex[:8]}"    # a fresh site: no state shared across tests


def test_float64_on_npu_warns_once_per_call_site():
    name, t = site(), on("npu", torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert npu.check_dtype(t, name)          # one line, three calls: one warning
        assert npu.check_dtype(t, name)              # another line: another warning
        assert npu.check_dtype(t, site())            # another site: another warning
    assert len(caught) == 3
    first = caught[0]
    assert issubclass(first.category, npu.NpuDtypeWarning)
    assert first.filename == __file__                # points at the user's line
    message = str(first.message)
    assert message.startswith(name) and "AI CPU" in message and "float32" in message
    assert "Fix:" in message


@pytest.mark.parametrize("kind, dtype", [("npu", torch.float32), ("npu", torch.bfloat16),
                                         ("cpu", torch.float64), ("cuda", torch.float64)])
def test_no_warning_where_there_is_no_problem(kind, dtype):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not npu.check_dtype(on(kind, dtype), site())
    assert npu.dtype_problem(dtype, kind) is None


def test_a_real_cpu_tensor_passes_silently():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not npu.check_dtype(torch.zeros(2, dtype=torch.float64), site())


def test_complex128_is_flagged_too():
    assert "complex128" in npu.dtype_problem(torch.complex128, "npu")
