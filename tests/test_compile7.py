"""Adversarial user trial of ``wb.compile`` (helper compile7): each compiled result is held
to the same program run eagerly on plain tensors (one device); where the graph would
silently hold a value eager reads afresh, the call must be refused with the fix."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import workbench as wb

R, S = wb.Replicate, wb.Shard
PROFILE = "a100"


def _x(shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ---- what a helper function the program calls reads --------------------------------
_K = 2.0


def _times_k(y):
    return y * _K


def _calls_helper(x):
    return _times_k(x) + 1


def test_a_global_read_by_a_helper_the_program_calls_is_checked(monkeypatch):
    # the guard read only the names of fn's own code: _K, read by the helper it calls,
    # changed from 2.0 to 5.0 and the graph still multiplied by 2.0 (4.45 off)
    mesh = wb.Mesh.grid((2,))
    a = wb.shard_tensor(_x((4, 6)), mesh, [R()])
    prog = wb.compile(_calls_helper, a, profile=PROFILE)
    torch.testing.assert_close(prog(a).full(), _calls_helper(a.full()))
    monkeypatch.setitem(globals(), "_K", 5.0)
    with pytest.raises(ValueError, match="global _K was 2.0 at capture and is now 5.0"):
        prog(a)


def test_a_closure_read_by_a_closure_the_program_calls_is_checked():
    scales = [2.0]

    def scale(y):
        return y * scales[0]

    def fn(x):
        return scale(x) - 1
    mesh = wb.Mesh.grid((2,))
    a = wb.shard_tensor(_x((4, 6)), mesh, [S(0)])
    prog = wb.compile(fn, a, profile=PROFILE)
    torch.testing.assert_close(prog(a).full(), fn(a.full()))
    scales[0] = 7.0
    with pytest.raises(ValueError, match="closure variable scales changed"):
        prog(a)


def _scaled(module, y):
    return y * module.eps


class _HelperReadsAttr(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(6, 6)
        self.eps = 2.0

    def forward(self, x):
        return _scaled(self, self.lin(x))


def test_a_module_attribute_read_by_a_helper_function_is_checked():
    # forward passes self to a module-level helper that reads self.eps: the guard saw
    # only the names the class's methods spell, so eps = 5.0 ran with 2.0 (3.66 off)
    m = _HelperReadsAttr()
    mesh = wb.Mesh.grid((2,))
    a = wb.shard_tensor(_x((4, 6)), mesh, [R()])
    prog = wb.compile(m, a, profile=PROFILE)
    torch.testing.assert_close(prog(a).full(), m(a.full()))
    m.eps = 5.0
    with pytest.raises(ValueError, match="module attribute eps was 2.0 at capture and is "
                                         "now 5.0"):
        prog(a)
    m.eps = 2.0                                 # set back: runs again
    torch.testing.assert_close(prog(a).full(), m(a.full()))


def test_a_torch_modules_own_attribute_is_still_checked():
    # nn.LayerNorm.forward reads self.eps (torch's code, the module's own method)
    m = nn.LayerNorm(6)
    mesh = wb.Mesh.grid((2,))
    a = wb.shard_tensor(_x((4, 6)), mesh, [S(0)])
    prog = wb.compile(m, a, profile=PROFILE)
    m.eps = 1.0
    with pytest.raises(ValueError, match="module attribute eps was 1e-05"):
        prog(a)


class _Holder(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = 2.0


class _ReadsChild(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.sub, self.lin = _Holder(), nn.Linear(6, 6)
        self._gain, self.act, self.shift = 3.0, torch.relu, 1.0

    @property
    def gain(self):
        return self._gain

    def forward(self, x):
        y = self.act(self.lin(x)) * self.sub.scale * self.gain
        return y + getattr(self, "shift")


@pytest.mark.parametrize("change, match", [
    (lambda m: setattr(m.sub, "scale", 5.0), "sub.scale was 2.0"),       # 4.42 off
    (lambda m: setattr(m, "_gain", 5.0), "_gain was 3.0"),               # a property: 3.61
    (lambda m: setattr(m, "shift", 5.0), "shift was 1.0"),               # getattr: 4.0
    (lambda m: setattr(m, "act", torch.tanh), "attribute act changed"),  # 0.82
])
def test_module_attributes_read_another_way_are_checked(change, match):
    # each ran silently with its value at capture
    _refused_after(_ReadsChild(), change, match)


def _refused_after(m, change, match):
    """``m`` compiled on a replicated input equals eager; after ``change(m)`` the call
    raises, its message matching ``match``."""
    mesh = wb.Mesh.grid((2,))
    a = wb.shard_tensor(_x((4, 6)), mesh, [R()])
    prog = wb.compile(m, a, profile=PROFILE)
    torch.testing.assert_close(prog(a).full(), m(a.full()))
    change(m)
    with pytest.raises(ValueError, match=match):
        prog(a)


def test_a_parameter_added_since_capture_is_refused():
    # bias=False, then m.bias = Parameter(ones): the graph has no add, 1.0 off
    torch.manual_seed(0)
    m = nn.Linear(6, 6, bias=False)
    mesh = wb.Mesh.grid((2,))
    a = wb.shard_tensor(_x((4, 6)), mesh, [R()])
    prog = wb.compile(m, a, profile=PROFILE)
    m.bias = nn.Parameter(torch.ones(6))
    with pytest.raises(ValueError, match="parameter 'bias' added to the module since capture"):
        prog(a)
    m.bias = None                               # (the module's own None entry: as captured)
    torch.testing.assert_close(prog(a).full(), m(a.full()))


class _ClassScale(nn.Module):
    scale = 2.0                                  # a class attribute

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        y = self.lin(x) * self.scale
        if hasattr(self, "extra"):              # one the code asks for by its name
            y = y + self.extra
        return y


@pytest.mark.parametrize("change, match", [
    (lambda m: setattr(type(m), "scale", 5.0), "scale was 2.0 at capture and is now 5.0"),
    (lambda m: setattr(m, "scale", 5.0), "scale was 2.0 at capture and is now 5.0"),
    (lambda m: setattr(m, "extra", 1.0), "extra was absent at capture and is now 1.0"),
])
def test_class_attributes_and_attributes_added_later_are_checked(change, match):
    # each ran silently with the graph of the capture (5.56, 3.58 and 1.0 off eager)
    try:
        _refused_after(_ClassScale(), change, match)
    finally:
        _ClassScale.scale = 2.0


class _Scaler:
    def __init__(self):
        self.k = 2.0

    def apply(self, x):
        return x * self.k

    def __call__(self, x):
        return x * self.k - 1


@pytest.mark.parametrize("bound", [True, False], ids=["bound method", "callable object"])
def test_the_attributes_of_the_object_a_program_is_bound_to_are_checked(bound):
    # wb.compile(scaler.apply, x) or wb.compile(scaler, x), then scaler.k = 5.0: the graph
    # kept multiplying by 2.0 (5.65 off eager)
    sc = _Scaler()
    fn = sc.apply if bound else sc
    mesh = wb.Mesh.grid((2,))
    a = wb.shard_tensor(_x((4, 6)), mesh, [S(0)])
    prog = wb.compile(fn, a, profile=PROFILE)
    torch.testing.assert_close(prog(a).full(), fn(a.full()))
    sc.k = 5.0
    with pytest.raises(ValueError, match="the object _Scaler the program is bound to changed"):
        prog(a)
    sc.k = 2.0
    torch.testing.assert_close(prog(a).full(), fn(a.full()))


_ACT = torch.relu


def _calls_global_act(x):
    return _ACT(x) * 2


def test_a_global_function_rebound_since_capture_is_refused():
    # act = torch.tanh after capturing relu: the graph kept relu (2.37 off); a function,
    # a class or a module a global names is compared by identity
    mesh = wb.Mesh.grid((2,))
    a = wb.shard_tensor(_x((4, 6)), mesh, [R()])
    prog = wb.compile(_calls_global_act, a, profile=PROFILE)
    torch.testing.assert_close(prog(a).full(), _calls_global_act(a.full()))
    global _ACT
    try:
        _ACT = torch.tanh
        with pytest.raises(ValueError, match="global _ACT changed since capture"):
            prog(a)
    finally:
        _ACT = torch.relu
