"""The dispatch table, backend selection, and __torch_function__ interception."""
import pytest
import torch
from torch.overrides import TorchFunctionMode

import workbench.ops as ops
from workbench.ops import registry

OPS = ("adamw", "flash_attention", "linear", "paged_attention", "rms_norm", "rotary_embedding",
       "swiglu")


def example_args(name):
    """Valid arguments for each public op."""
    x = torch.randn(2, 3, 8)
    cos, sin = ops.rope_cos_sin(3, 8)
    p = [torch.randn(4)]
    return {
        "flash_attention": ((torch.randn(1, 2, 5, 4),) * 3, dict(causal=True)),
        "rms_norm": ((x, torch.ones(8)), dict(eps=1e-5)),
        "swiglu": ((x,), dict(dim=-1)),
        "rotary_embedding": ((x, cos, sin), dict(mode="interleave")),
        "adamw": ((p, [torch.randn(4)], [torch.zeros(4)], [torch.zeros(4)], 1), dict(lr=0.1)),
        "linear": ((x, torch.randn(5, 8), torch.randn(5)), {}),
        "paged_attention": ((torch.randn(1, 2, 1, 4), torch.randn(3, 2, 4, 4),
                             torch.randn(3, 2, 4, 4), torch.tensor([[2, 0]]), torch.tensor([5])),
                            dict(scale=0.5)),
    }[name]


def test_every_op_has_every_backend():
    assert ops.op_names() == OPS
    for name in OPS:
        assert ops.backends(name) == ops.BACKENDS == ("reference", "unfused", "native", "npu")


def test_auto_picks_native_on_cpu(monkeypatch):
    seen = []
    native = registry.implementation("rms_norm", "native")
    monkeypatch.setitem(registry._TABLE, ("rms_norm", "native"),
                        lambda *a: seen.append("native") or native(*a))
    assert ops.current_backend() == "auto"
    ops.rms_norm(torch.randn(2, 4), torch.ones(4))
    assert seen == ["native"]


def test_use_as_context_manager_and_as_setting(monkeypatch):
    calls = []
    for backend in ops.BACKENDS:
        monkeypatch.setitem(registry._TABLE, ("swiglu", backend),
                            lambda x, dim, b=backend: calls.append(b))
    x = torch.randn(2, 4)
    with ops.use("reference"):
        ops.swiglu(x)
        with ops.use("unfused"):
            ops.swiglu(x)
        ops.swiglu(x)
    ops.swiglu(x)
    try:
        ops.use("npu")                     # a setting: stays until changed
        ops.swiglu(x)
        assert ops.current_backend() == "npu"
    finally:
        ops.use("auto")
    assert calls == ["reference", "unfused", "reference", "native", "npu"]
    assert ops.current_backend() == "auto"


def test_use_restores_after_an_exception():
    with pytest.raises(RuntimeError):
        with ops.use("reference"):
            raise RuntimeError
    assert ops.current_backend() == "auto"


def test_unknown_names_are_clear_errors():
    with pytest.raises(ValueError, match=r"wb.ops.use\('cuda'\): unknown backend; use one of"):
        ops.use("cuda")
    with pytest.raises(KeyError, match="unknown op 'softmax'; known ops: adamw"):
        ops.implementation("softmax", "native")
    with pytest.raises(ValueError, match="already registered"):
        registry.register("rms_norm", "native")(lambda *a: None)
    with pytest.raises(ValueError, match="unknown backend"):
        registry.register("rms_norm", "tpu")


def test_npu_backend_without_torch_npu_says_why():
    with ops.use("npu"), pytest.raises(RuntimeError, match="torch_npu is not installed"):
        ops.rms_norm(torch.randn(2, 4), torch.ones(4))


class Intercepting(torch.Tensor):
    """A tensor subclass that takes over every workbench op (what DistTensor does)."""
    seen = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in ops.PUBLIC_OPS:
            cls.seen.append((func.__name__, args, kwargs))
            return "intercepted"
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", OPS)
def test_every_public_op_can_be_intercepted_by_a_subclass(name):
    args, kwargs = example_args(name)
    # make the first tensor argument (or the first parameter) the subclass
    if name == "adamw":
        args = ([args[0][0].as_subclass(Intercepting)], *args[1:])
    else:
        args = (args[0].as_subclass(Intercepting), *args[1:])
    Intercepting.seen.clear()
    assert getattr(ops, name)(*args, **kwargs) == "intercepted"
    (fname, got_args, got_kwargs), = Intercepting.seen
    assert fname == name and len(got_args) == len(args)
    for key, value in kwargs.items():        # keyword arguments arrive unchanged
        assert got_kwargs[key] == value


class TensorLike:
    """Not a torch.Tensor, but has __torch_function__ (the SPMD layer's DistTensor is so)."""

    def __init__(self, local):
        self.local = local

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return ("tensor-like", func.__name__)


@pytest.mark.parametrize("name, position", [(n, p) for n in OPS for p in (0, 1)
                                            if (n, p) != ("swiglu", 1)])    # swiglu: one tensor
def test_every_public_op_dispatches_on_a_tensor_like_in_any_tensor_position(name, position):
    args, kwargs = example_args(name)
    args = list(args)
    if name == "adamw":
        args[position] = [TensorLike(args[position][0])]
    elif name == "flash_attention" and position == 1:
        kwargs = dict(kwargs, mask=TensorLike(torch.ones(5, 5, dtype=torch.bool)))
    else:
        args[position] = TensorLike(args[position])
    assert getattr(ops, name)(*args, **kwargs) == ("tensor-like", name)


@pytest.mark.parametrize("name", OPS)
def test_every_public_op_can_be_intercepted_by_a_mode(name):
    seen = []

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in ops.PUBLIC_OPS:
                seen.append(func.__name__)
                return "mode"
            return func(*args, **(kwargs or {}))
    args, kwargs = example_args(name)
    with Mode():
        assert getattr(ops, name)(*args, **kwargs) == "mode"
    assert seen == [name]


def test_parameters_are_not_intercepted():
    w = torch.nn.Parameter(torch.ones(4))
    y = ops.rms_norm(torch.randn(3, 4), w)
    assert isinstance(y, torch.Tensor) and y.grad_fn is not None
