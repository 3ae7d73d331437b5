"""fsdpdata18: FSDP's ``.data`` habits as torch's.  ``p.data = t`` between forward and
backward (torch's assignment: the parameter takes ``t``'s storage; a saved view keeps the
old one, the parameter saved itself reads ``t``) gives one device's gradients and values
under FSDP / fully_shard (it raised a version error); the root's check of its kept copies
is ONE recorded all-reduce per backward on torch.distributed (it was one unrecorded
all-reduce per saved weight); errors' hints name the fix for the case at hand (the
"On DistTensors" hint was added to plain-module FSDP's own error)."""
import math

import pytest
import torch
from torch import nn

import workbench as wb


class Mix(nn.Module):
    """Saved weights of both kinds: ``F.linear`` saves a view of its weight (``w.t()``),
    ``h @ self.w`` and LayerNorm save the parameter itself."""

    def __init__(self):
        super().__init__()
        self.lin1 = nn.Linear(6, 8)
        self.w = nn.Parameter(torch.randn(8, 8) / 3)
        self.ln = nn.LayerNorm(8)
        self.lin2 = nn.Linear(8, 5)

    def forward(self, x):
        h = torch.tanh(self.lin1(x)) @ self.w
        return self.lin2(self.ln(h))


def _mix():
    torch.manual_seed(0)
    return Mix()


def _xy():
    g = torch.Generator().manual_seed(1)
    return torch.randn(6, 6, generator=g), torch.randn(6, 5, generator=g)


def _blocks(m, mesh):
    for sub in (m.lin1, m.ln, m.lin2):
        wb.fully_shard(sub, mesh=mesh)
    return wb.fully_shard(m, mesh=mesh)


WRAPS = {
    "fsdp-root": lambda m, mesh: wb.FullyShardedDataParallel(m, mesh),
    "fsdp-units": lambda m, mesh: wb.FullyShardedDataParallel(m, mesh,
                                                               units=[m.lin1, m.ln, m.lin2]),
    "fsdp-root-bf16": lambda m, mesh: wb.FullyShardedDataParallel(
        m, mesh, compute_dtype=torch.bfloat16),
    "fully_shard-root": lambda m, mesh: wb.fully_shard(m, mesh=mesh),
    "fully_shard-blocks": _blocks,
    "ddp": lambda m, mesh: wb.DistributedDataParallel(m, mesh),
}


SHAPES = {n: tuple(p.shape) for n, p in Mix().named_parameters()}     # the module's


def _new(name):
    """A new value for parameter ``name`` (of the module's shape)."""
    return torch.linspace(-0.5, 0.5, math.prod(SHAPES[name])).view(SHAPES[name])


ACTS = {
    "assign": lambda p, n: setattr(p, "data", _new(n)),
    # a view saved in forward reads the old storage with the write, the parameter t
    "write-then-assign": lambda p, n: (p.data.mul_(2), setattr(p, "data", _new(n))),
    # the new storage written: the parameter saved itself reads it, a view does not
    "assign-then-write": lambda p, n: (setattr(p, "data", _new(n)), p.data.mul_(2)),
}


def _loss(m, mesh=None):
    x, y = _xy()
    if mesh is not None:
        x, y = (wb.shard_tensor(t, mesh, [wb.Shard(0)]) for t in (x, y))
    return ((m(x) - y) ** 2).mean()


def _grad(p):
    g = p.grad
    return g.full_tensor() if hasattr(g, "full_tensor") else g


def _one_device(target, act):
    ref = _mix()
    loss = _loss(ref)
    ACTS[act](dict(ref.named_parameters())[target], target)
    loss.backward()
    return ref


@pytest.mark.parametrize("act", sorted(ACTS))
@pytest.mark.parametrize("target", ["lin2.weight", "w", "ln.weight"])
@pytest.mark.parametrize("wrap", sorted(WRAPS))
def test_data_assignment_between_forward_and_backward_is_one_devices(wrap, target, act):
    """``p.data = t`` after forward: one device's gradients (a weight ``F.linear`` saved
    as a view: the old values; ``h @ w`` / LayerNorm's weight: the new ones) and, after
    backward, the parameter holds ``t`` (it raised "modified by an inplace operation")."""
    ref = _one_device(target, act)
    mesh = wb.Mesh.grid(3, ["dp"])
    m = _mix()
    w = WRAPS[wrap](m, mesh)
    loss = _loss(w, mesh)
    ACTS[act](dict(m.named_parameters())[target], target)
    loss.backward()
    want = dict(ref.named_parameters())
    tol = dict(rtol=2e-2, atol=2e-2) if "bf16" in wrap else dict(rtol=1e-5, atol=1e-6)
    for name, p in w.named_parameters():
        name = name.removeprefix("module.")         # DDP's names
        torch.testing.assert_close(_grad(p), want[name].grad, msg=name, **tol)
        torch.testing.assert_close(p.full_tensor(), want[name].detach(), msg=name)
    loss = _loss(w, mesh)           # the next step runs on the assigned values
    loss.backward()


def test_one_device_oracle_tells_the_two_kinds_apart():
    """The oracle above is not the no-assignment run: a view's gradient keeps the old
    weight (``lin1.weight`` under ``lin2.weight``'s assignment), the parameter saved
    itself does not (``w``)."""
    plain = _one_device("lin1.weight", "assign")     # lin1's own assignment: its grad
    base = _mix()
    _loss(base).backward()
    lin2 = _one_device("lin2.weight", "assign")
    own = _one_device("w", "assign")
    torch.testing.assert_close(lin2.lin1.weight.grad, base.lin1.weight.grad)
    assert not torch.allclose(own.lin1.weight.grad, base.lin1.weight.grad)
    assert not torch.allclose(plain.lin1.weight, base.lin1.weight)


@pytest.mark.parametrize("wrap", ["fsdp-root", "fully_shard-root"])
def test_assignment_then_second_backward(wrap):
    """``retain_graph=True``; ``p.data = t``; a second backward: one device's."""
    def run(m, loss):
        loss.backward(retain_graph=True)
        m.w.data = _new("w")
        m.lin2.weight.data = _new("lin2.weight")
        for p in m.parameters():
            p.grad = None
        loss.backward()
    ref = _mix()
    run(ref, _loss(ref))
    mesh = wb.Mesh.grid(3, ["dp"])
    m = _mix()
    w = WRAPS[wrap](m, mesh)
    run(m, _loss(w, mesh))
    for (name, p), q in zip(w.named_parameters(), ref.parameters()):
        torch.testing.assert_close(_grad(p), q.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_simulated_kept_check_records_no_collective():
    """Simulated ranks hold every chunk: the root's check compares them here, nothing is
    sent, so nothing is recorded; a written weight adds one re-gather of the root."""
    for write, want in ((False, 0), (True, 1)):
        mesh = wb.Mesh.grid(3, ["dp"])
        m = _mix()
        w = wb.FullyShardedDataParallel(m, mesh)
        with wb.trace() as tr:
            loss = _loss(w, mesh)
            if write:
                m.w.data = _new("w")
                m.lin2.weight.data.mul_(2)
            loss.backward()
        labels = [e.label for e in tr.collectives()]
        assert not [x for x in labels if "kept-check" in x], labels
        assert labels.count("fsdp re-gather root") == want, labels


@pytest.mark.parametrize("wrap", ["fsdp-root", "fsdp-units", "fully_shard-root"])
def test_write_under_no_grad_hint_names_the_fsdp_fix(wrap):
    """FSDP's own version error (a write into a parameter between forward and backward):
    torch's words and type, its own hint, and no DistTensor hint (plain module)."""
    mesh = wb.Mesh.grid(3, ["dp"])
    m = _mix()
    w = WRAPS[wrap](m, mesh)
    loss = _loss(w, mesh)
    with torch.no_grad():
        m.lin2.weight.mul_(2)
    with pytest.raises(RuntimeError) as e:
        loss.backward()
    msg = str(e.value)
    assert type(e.value) is RuntimeError
    assert msg.startswith("one of the variables needed for gradient computation has been "
                          "modified by an inplace operation")
    assert "write after backward" in msg and "On DistTensors" not in msg, msg


@pytest.mark.parametrize("write", ["no_grad-mul_", "detach-zero_"])
def test_ddp_parameter_write_hint_names_the_parameter_fix(write):
    """DDP on simulated ranks: torch's own version error (autograd saved a view of the
    rows), with the hint for a parameter written between forward and backward, not the
    DistTensor one (it said "an in-place write into a DistTensor")."""
    ref = _mix()
    loss = _loss(ref)
    with torch.no_grad():
        ref.lin2.weight.mul_(2)
    with pytest.raises(RuntimeError) as one:
        loss.backward()
    mesh = wb.Mesh.grid(3, ["dp"])
    m = _mix()
    w = wb.DistributedDataParallel(m, mesh)
    loss = _loss(w, mesh)
    if write == "no_grad-mul_":
        with torch.no_grad():
            m.lin2.weight.mul_(2)
    else:
        m.lin2.weight.detach().zero_()
    with pytest.raises(RuntimeError) as e:
        loss.backward()
    msg = str(e.value)
    assert type(e.value) is type(one.value)
    assert str(one.value).split(":")[0] in msg
    assert "On DistTensors" not in msg, msg
    assert "written in place since forward" in msg and "(5, 8)" in msg, msg
    assert "write after backward" in msg, msg


class WritesSaved(nn.Module):
    """Writes a value ``sigmoid`` saved (its output) in place: torch raises at backward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 5)

    def forward(self, x):
        h = torch.sigmoid(self.lin(x))
        h.mul_(2)
        return h


@pytest.mark.parametrize("wrap", ["ddp", "fsdp-root", "fully_shard-root"])
def test_plain_tensor_write_in_the_module_gets_torchs_fix(wrap):
    """A write into a saved plain tensor inside the wrapped module (one device raises the
    same): torch's words, type and fix (clone / out-of-place), no DistTensor hint."""
    torch.manual_seed(0)
    ref = WritesSaved()
    x, y = _xy()
    with pytest.raises(RuntimeError) as one:
        ((ref(x) - y) ** 2).mean().backward()
    mesh = wb.Mesh.grid(3, ["dp"])
    torch.manual_seed(0)
    m = WritesSaved()
    w = WRAPS[wrap](m, mesh)
    with pytest.raises(RuntimeError) as e:
        _loss(w, mesh).backward()
    msg = str(e.value)
    assert type(e.value) is type(one.value)
    assert str(one.value).split(":")[0] in msg
    assert "On DistTensors" not in msg and "clone() before writing" in msg, msg


@pytest.mark.parametrize("target", ["lin2.weight", "w"])
def test_disttensor_data_assignment_keeps_the_gradient(target):
    """``d.data = wb.shard_tensor(t, ...)`` between forward and backward on a module over
    DistTensors (``wb.parallelize``): the parameter keeps its gradient (its local tensors
    were replaced by new leaves: ``lin2.weight`` got none, the total norm 0.43 off), as one
    device's."""
    ref = _mix()
    loss = _loss(ref)
    dict(ref.named_parameters())[target].data = _new(target)
    loss.backward()
    mesh = wb.Mesh.grid((2,), ["tp"])
    m = _mix()
    wb.parallelize(m, mesh)
    x, y = (wb.shard_tensor(t, mesh, ["R"]) for t in _xy())
    loss = ((m(x) - y) ** 2).mean()
    p = dict(m.named_parameters())[target]
    p.data = wb.shard_tensor(_new(target), p.mesh, p.placements)
    loss.backward()
    for name, q in m.named_parameters():
        r = dict(ref.named_parameters())[name]
        torch.testing.assert_close(q.grad.full(), r.grad, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(q.full().detach(), r.detach(), msg=name)


def _ddp_over_tp():
    mesh = wb.Mesh.grid((3, 1), ["dp", "tp"])
    m = _mix()
    wb.parallelize(m, mesh)
    return m, wb.DistributedDataParallel(m, mesh, "dp"), mesh


def _tp_loss(w, mesh):
    x, y = (wb.shard_tensor(t, mesh, ["S(0)", "R"]) for t in _xy())
    return ((w(x) - y) ** 2).mean()


def test_ddp_over_disttensors_data_assignment_raises_naming_the_copy():
    """DDP over DistTensors holds each parameter in its replica storage: ``p.data = d``
    gave the module new local tensors that storage never saw (gradient norm 4.33 for one
    device's 1.68, silently); it raises naming the copy, nothing changed, and the copy it
    names gives one device's norm."""
    ref = _mix()
    ref.lin2.weight.data = _new("lin2.weight")
    _loss(ref).backward()
    m, w, mesh = _ddp_over_tp()
    p = m.lin2.weight
    before = p.full().detach().clone()
    value = wb.shard_tensor(_new("lin2.weight"), p.mesh, p.placements)
    with pytest.raises(RuntimeError, match=r"p\.data\.copy_\(value\)"):
        p.data = value
    torch.testing.assert_close(p.full().detach(), before, rtol=0, atol=0)
    p.data.copy_(value)
    _tp_loss(w, mesh).backward()
    w.finish_gradient_synchronization()
    torch.testing.assert_close(torch.nn.utils.clip_grad_norm_(w.parameters(), 1e9),
                               torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9))


@pytest.mark.slow
def test_on_torch_distributed_processes(tmp_path_factory):
    """gloo, 2 processes (tests/dist_scripts/fsdpdata18_check.py): each backward of the
    kept root runs ONE flag all-reduce, recorded (4 bytes a saved weight), whatever was
    written; written weights come back in one re-gather; gradients one device's."""
    from tests.torchrun_support import json_rows, two_proc
    out, text = two_proc(tmp_path_factory, "fsdpdata18_check.py")   # one launch
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {(r["rank"], r["case"]): r for r in json_rows(text)}
    want = {"none": (1, 0), "write-two": (1, 1), "assign": (1, 1), "retain": (2, 1),
            "fully_shard-assign-own": (1, 1)}
    assert {c for _, c in rows} == set(want) and len(rows) == 2 * len(want)
    for (rank, case), row in rows.items():
        checks, regathers = want[case]
        assert row["diff"] < 1e-6, row
        assert row["checks"] == checks, row
        assert row["check_bytes"] == [4 * row["kept"]] * checks, row
        assert row["kept"] >= 2, row         # several kept weights, one all-reduce
        assert row["regather"] == regathers, row
