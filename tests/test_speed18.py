"""speed18: torch.optim (and the references and decompositions that run as meta kernels)
run in eager mode without importing ``torch._dynamo``
(workbench/parallel/lazy_dynamo.py), with torch's own numbers; once ``torch._dynamo`` is
imported every call goes through torch's guards again.  And tests/torch_references.py
runs the fresh-python torch references once a session."""
import json
import os
import subprocess
import sys

import pytest
import torch

import workbench as wb
from workbench.parallel import lazy_dynamo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A fresh process (the test session imports torch._dynamo itself): a simulated training
# run through the library's paths that imported torch._dynamo before (an optimizer's
# constructor, step, zero_grad, state_dict and load_state_dict; the dispatcher's shape
# checks on meta tensors, whose kernels are torch's Python references; rms_norm), then
# the same steps again after ``import torch._dynamo``.
_PROBE = r"""
import json, sys
import torch
import workbench as wb

def run():
    torch.manual_seed(0)
    mesh = wb.Mesh.grid((2,), ["dp"])
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    dp = wb.DistributedDataParallel(model, mesh)
    opt = torch.optim.AdamW(dp.parameters(), lr=0.05)
    x = torch.randn(8, 6)
    w = torch.ones(4)
    for _ in range(2):
        y = dp(x)
        loss = wb.ops.rms_norm(y, w).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    sd = opt.state_dict()
    opt.load_state_dict(sd)
    keys = sorted(wb.checkpoint.get_model_state_dict(dp))      # its prefixes' check
    meta = torch.rsqrt(torch.ones(3, 4, device="meta") + 1)
    # dispatch modes: torch's FlopCounterMode (made before workbench), one made after
    from torch.utils.flop_counter import FlopCounterMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))
    with FlopCounterMode(display=False) as fc, Count():
        torch.nn.Linear(4, 3)(torch.ones(2, 4)).sum().backward()
    return [p.detach().full().tolist() if hasattr(p, "full") else p.detach().tolist()
            for p in dp.parameters()], list(meta.shape), torch.is_grad_enabled(), \
        fc.get_total_flops(), Count.n > 0, keys

first = run()
before = "torch._dynamo" in sys.modules
import torch._dynamo
second = run()
print(json.dumps({"dynamo_before": before, "same": first == second,
                  "grad_mode": [first[2], second[2]], "meta": first[1],
                  "flops": first[3], "counted": first[4], "keys": first[5]}))
"""


def test_a_simulated_training_run_imports_no_dynamo_and_is_the_same_after():
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                         cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["dynamo_before"] is False     # before: imported by the optimizer's constructor
    assert got["same"] is True               # the same numbers through torch's guards
    assert got["grad_mode"] == [True, True] and got["meta"] == [3, 4]
    # the forward mm and the weight's gradient mm, 2*m*k*n FLOPs each (the input needs none)
    assert got["flops"] == 2 * (2 * 2 * 4 * 3) and got["counted"]
    assert got["keys"] == ["0.bias", "0.weight", "2.bias", "2.weight"]


def test_a_compiled_modules_state_dict_keys_are_still_its_modules():
    """workbench.checkpoint drops torch.compile's ``_orig_mod.`` (the check no longer
    imports torch._dynamo itself: a compiled module exists only once it is imported)."""
    m = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1))
    c = torch.compile(m)
    assert "_orig_mod.0.weight" in c.state_dict()
    assert sorted(wb.checkpoint.get_model_state_dict(c)) == sorted(m.state_dict())


_OPTIMIZERS = [(torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
               (torch.optim.Adam, dict(lr=0.01, amsgrad=True)),
               (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1)),
               (torch.optim.RMSprop, dict(lr=0.01, momentum=0.5)),
               (torch.optim.Adagrad, dict(lr=0.1)),
               (torch.optim.NAdam, dict(lr=0.01)),
               (torch.optim.RAdam, dict(lr=0.01)),
               (torch.optim.Adamax, dict(lr=0.01)),
               (torch.optim.Adadelta, dict(lr=1.0)),
               (torch.optim.ASGD, dict(lr=0.01)),
               (torch.optim.Rprop, dict(lr=0.01))]


def _steps(cls, kw, step_of, foreach):
    torch.manual_seed(0)
    m = torch.nn.Linear(5, 3)
    opt = cls(m.parameters(), foreach=foreach, **kw)
    x = torch.randn(7, 5)
    for _ in range(3):
        m(x).pow(2).sum().backward()
        with torch.no_grad():              # step restores the caller's grad mode
            step_of(opt)
            assert not torch.is_grad_enabled()
        assert torch.is_grad_enabled()
        opt.zero_grad()
    return [p.detach().clone() for p in m.parameters()], opt.state_dict()


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("cls,kw", _OPTIMIZERS, ids=[c.__name__ for c, _ in _OPTIMIZERS])
def test_each_optimizers_step_is_torchs_guarded_step(cls, kw, foreach):
    """The installed step (cls.step: the stand-in) against torch's own (the guarded
    ``_use_grad`` step it wraps, kept as ``_wb_eager``): the same parameters and
    states, bit for bit, and the grad mode restored."""
    mine = cls.step if "step" in vars(cls) else next(
        vars(k)["step"] for k in cls.__mro__ if "step" in vars(k))
    assert hasattr(mine, "_wb_eager"), f"{cls.__name__}.step was not installed"
    torchs = mine._wb_eager
    a, sa = _steps(cls, kw, lambda o: o.step(), foreach)
    b, sb = _steps(cls, kw, lambda o: torchs(o), foreach)
    for p, q in zip(a, b):
        assert torch.equal(p, q), cls.__name__
    assert repr(sa) == repr(sb)


def test_a_step_with_differentiable_true_keeps_the_grad_mode_on_inside():
    """``_use_grad`` runs the step with grad mode set to the ``differentiable`` default:
    the stand-in does too (the step's in-place update of a non-leaf parameter is
    recorded, so the result has a grad_fn)."""
    seen = {}
    for name, step in (("mine", torch.optim.SGD.step),
                       ("torch's", torch.optim.SGD.step._wb_eager)):
        w0 = torch.ones(3, requires_grad=True)
        w = w0.clone()                         # a non-leaf "parameter", as torch's tests
        opt = torch.optim.SGD([w], lr=0.5, differentiable=True)
        w.grad = torch.full((3,), 2.0)
        with torch.no_grad():
            step(opt)
        seen[name] = (w.grad_fn is not None, w.detach().tolist())
    assert seen["mine"] == seen["torch's"] == (True, [0.0, 0.0, 0.0])


def test_the_guarded_methods_call_torchs_function_and_hand_over_to_dynamo():
    """A ``torch._disable_dynamo`` method (Optimizer.zero_grad) holds the stand-in in
    torch's cache; called with torch._dynamo imported (this session imports it), the
    stand-in removes itself and torch builds its own ``disable``."""
    import torch._dynamo  # noqa: F401
    guarded = torch.optim.Optimizer.zero_grad
    fn = guarded.__wrapped__
    lazy_dynamo.install()                      # idempotent: seeds only an empty cache
    m = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m(torch.ones(1, 2)).sum().backward()
    opt.zero_grad()
    assert all(p.grad is None for p in m.parameters())
    cached = fn.__dict__.get("__dynamo_disable")
    assert cached is not None and cached.__name__ != "stand_in"


@pytest.mark.parametrize("form", ["plain", "recursive=False"])
def test_a_function_guarded_later_is_seeded_then_handed_to_torchs_guard(form):
    """torch._disable_dynamo is the seeding one (a dispatch mode made after workbench, a
    custom op): its result calls the function, and with torch._dynamo imported (here)
    the first call hands over to torch's own ``disable``."""
    import torch._dynamo  # noqa: F401

    def f(x):
        return x + 1
    g = torch._disable_dynamo(f) if form == "plain" else \
        torch._disable_dynamo(recursive=False)(f)
    assert f.__dict__["__dynamo_disable"].__name__ == "stand_in"
    assert g(1) == 2 and g(2) == 3
    assert f.__dict__["__dynamo_disable"].__name__ != "stand_in"


def test_install_seeds_the_references_that_run_as_meta_kernels():
    guarded = lazy_dynamo._guarded_functions(lazy_dynamo._code_of_disable())
    modules = {f.__wrapped__.__module__ for f in guarded}
    assert {"torch._refs", "torch._refs.nn.functional", "torch.optim.optimizer"} <= modules
    assert len(guarded) > 100


def test_torch_references_name_an_unknown_script(tmp_path_factory):
    from tests.torch_references import reference
    with pytest.raises(ValueError, match="'nope' is not in tests/torch_references.py"):
        reference("nope", tmp_path_factory)


def test_torch_references_report_a_failing_scripts_own_error(monkeypatch, tmp_path_factory):
    """A script that raises fails its own test with its traceback; the others still
    run in the same process (a fresh key: not the session's shared run)."""
    import tests.torch_references as R
    monkeypatch.setattr(R, "SCRIPTS", {"bad": "raise KeyError('boom')\n",
                                       "good": "print(6 * 7)\n"})
    assert R.reference("good", tmp_path_factory).strip() == "42"
    with pytest.raises(AssertionError, match="KeyError: 'boom'"):
        R.reference("bad", tmp_path_factory)
