"""revO: review of this session's merges (fixlist2, auditck3, ovl10, nbr0304c), each defect
held to plain PyTorch."""
import pytest
import torch

import workbench as wb
from workbench.parallel.strategies.laid_out_whole import storage  # the replicas (habits13)


def _x(*shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(0))


# ---- strides.py: a dim every shard holds one element of has lost its place -----------------
@pytest.mark.parametrize("mesh_n,shape,pl,f", [
    (3, (3, 2), 1, lambda t: t.t()),                 # uneven (1, 1, 0), transposed: read (3, 1)
    (3, (3, 2), 0, lambda t: t.t().exp()),           # even (1, 1, 1): exp's shard (1, 1)
    (3, (3, 4, 2), 2, lambda t: t.permute(2, 0, 1)),
    (4, (3, 4, 2), 0, lambda t: t.permute(1, 0, 2)),
])
def test_stride_kept_where_the_shards_lost_a_dims_place(mesh_n, shape, pl, f):
    """Was: the transposed tensor read as contiguous ((3, 1) for torch's (1, 2)): a wrong
    stride and a wrong is_contiguous().  revO made it raise; sweep9 keeps the strides
    beside the shards (strides.py): torch's."""
    x = _x(*shape)
    d = f(wb.shard_tensor(x, wb.Mesh.grid((mesh_n,), ["a"]), [wb.Shard(pl)]))
    want = f(x)
    assert d.is_contiguous() == want.is_contiguous()
    assert all(d.stride(k) == want.stride(k) for k in range(want.ndim) if want.shape[k] > 1)


@pytest.mark.parametrize("shape,pl,f", [
    ((5, 2), 0, lambda t: t.t()), ((5, 2), 0, lambda t: t.t().exp()),
    ((2, 7, 3), 1, lambda t: t.permute(2, 0, 1).neg()), ((6,), 0, lambda t: t.exp()),
    ((3, 1), 0, lambda t: t.t().exp()),              # one dim of more than one: no order
])
def test_stride_still_given_where_a_shard_holds_more(shape, pl, f):
    x = _x(*shape)
    d = f(wb.shard_tensor(x, wb.Mesh.grid((3,), ["a"]), [wb.Shard(pl)]))
    want = f(x)
    assert d.is_contiguous() == want.is_contiguous()
    assert all(d.stride(k) == want.stride(k) for k in range(want.ndim) if want.shape[k] > 1)


# ---- spmd.infer: a negative dim counts from the end, an out-of-range one raises ------------
def _spec_s1():
    return wb.shard_tensor(_x(4, 6), wb.Mesh.grid((2,), ["a"]), [wb.Shard(1)]).spec


def _idx_spec(shape):
    return wb.shard_tensor(torch.zeros(shape, dtype=torch.long), wb.Mesh.grid((2,), ["a"]),
                           [wb.Replicate()]).spec


@pytest.mark.parametrize("op,args,kw,dimkey", [
    ("sum", (), {}, "dim"), ("amax", (), {}, "dim"), ("softmax", (), {}, "dim"),
    ("flip", (), {}, "dims"), ("roll", (), {"shifts": (1,)}, "dims"),
    ("index_select", (lambda: _idx_spec((3,)),), {}, "dim"),
    ("gather", (lambda: _idx_spec((4, 6)),), {}, "dim"),
    ("argmax", (), {}, "dim"), ("topk", (), {"k": 2}, "dim"), ("cumsum", (), {}, "dim"),
])
def test_spmd_infer_negative_dim_is_the_dim_from_the_end(op, args, kw, dimkey):
    """Was (sum, amax, flip, roll, index_select, gather): dim -1 of a [S(1)] (4, 6) input
    taken as no dim at all: sum gave [S(0)] ('kept dim 1 sharded passes') for torch's
    reduction over the sharded dim (P(sum)); flip / index_select let the sharded dim pass.
    argmax / topk: 'no reshard plan to [S(-1)]'.  Out of range: wrapped (dim 2 of a 2-d
    input read as dim 0) where torch raises IndexError."""
    s = _spec_s1()
    a = tuple(f() for f in args)
    wrap = (lambda d: (d,)) if dimkey == "dims" else (lambda d: d)
    neg = wb.spmd.infer(op, s, *a, **kw, **{dimkey: wrap(-1)})
    pos = wb.spmd.infer(op, s, *a, **kw, **{dimkey: wrap(1)})
    assert str(neg) == str(pos)
    assert "dim 1 sharded passes" not in str(neg).splitlines()[0]
    if op == "sum":
        assert "output [P(sum)]" in str(neg).splitlines()[0]
    for bad in (2, -3):
        with pytest.raises(IndexError, match=rf"Dimension out of range.*got {bad}"):
            wb.spmd.infer(op, s, *a, **kw, **{dimkey: wrap(bad)})


# ---- DDP: torch's "Expected to have finished reduction" stays raised ------------------------
class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(4, 4).double(), torch.nn.Linear(4, 2).double()

    def forward(self, x, skip_b=False):
        y = torch.tanh(self.a(x))
        return y[:, :2] if skip_b else self.b(y)


@pytest.mark.parametrize("mode", ["plain", "disttensor"])
def test_ddp_unfinished_reduction_raises_at_every_later_forward(mode):
    """torch's reducer stays unfinished: every later forward with grad raises again
    (measured: torch 2.13 DDP on a 1-process gloo group raises at forwards 1, 2, 3).
    Was: raised once, then the next forward trained on as if nothing had happened.
    A no_sync step that skips b leaves nothing unfinished (torch: no reducer armed)."""
    mesh = wb.Mesh.grid(2, ["dp"])
    m = _Net()
    if mode == "disttensor":
        m = wb.parallelize(m, mesh, {})
    ddp = wb.DistributedDataParallel(m, mesh)
    x = wb.shard_tensor(torch.randn(6, 4, dtype=torch.float64), mesh, [wb.Shard(0)])
    with ddp.no_sync():
        ddp(x, skip_b=True).mean().backward()
    ddp(x).mean().backward()
    ddp.finish_gradient_synchronization()
    ddp(x, skip_b=True).mean().backward()
    ddp.finish_gradient_synchronization()
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"Expected to have finished reduction"):
            ddp(x)
    with torch.no_grad():
        ddp(x)                                           # no grad: no reducer, as torch


# ---- DDP (DistTensor mode): the replicas' in-place write check ------------------------------
def _dt_ddp():
    mesh = wb.Mesh.grid(2, ["dp"])
    torch.manual_seed(0)
    m = wb.parallelize(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)),
                       mesh, {})
    ddp = wb.DistributedDataParallel(m, mesh)
    return ddp, wb.shard_tensor(torch.randn(6, 4), mesh, [wb.Shard(0)])


def test_ddp_replica_check_takes_equal_nans_as_equal():
    """A manual update that makes every replica NaN (a diverged run) keeps them equal:
    torch's DDP trains on (NaN loss); was: 'the replicas of '0.weight' differ', blaming
    an init.  A write that does differ still raises."""
    ddp, x = _dt_ddp()
    ddp(x).sum().backward()
    ddp.finish_gradient_synchronization()
    with torch.no_grad():
        for p in ddp.parameters():
            p.sub_(0.1 * p.grad)                          # manual SGD: equal on every rank
            p.mul_(float("nan"))
    assert bool(ddp(x).full_tensor().isnan().all())
    ddp.check_replicas()
    with torch.no_grad():
        storage(next(iter(ddp.parameters())))[0].fill_(1.0)  # dp rank 0's copy only
    with pytest.raises(RuntimeError, match="replicas of '0.weight' differ"):
        ddp(x)


# ---- serve: the KV cache's room leaves room for the quantized weights' scales ---------------
@pytest.mark.parametrize("name,bits", [("tiny", 8), ("tiny", 4), ("gpt-tiny", 8),
                                       ("gpt-tiny", 4), ("tiny", None)])
def test_resident_bytes_are_the_quantized_models_measured_bytes(name, bits):
    """Was: the scales quantize_model stores (int8: one per row, int4: one per row and
    group of 32) left out: tiny int8 131,776 B where the quantized model holds 137,708,
    so kv_capacity overstated the room (by 1/16 of the weights' bytes at int4)."""
    from workbench.models.config import build_model, get_config
    from workbench.serve.batching import StepPricer
    from workbench.serve.quantize import quantize_model, weight_bytes
    torch.manual_seed(0)
    m = build_model(get_config(name))
    q = quantize_model(m, bits) if bits else m
    assert StepPricer(name, "a100", weight_bits=bits).resident_bytes == weight_bytes(q)["total"]


# ---- checkpoint.state_dict: StateDictOptions.dsd_fqn_modifiers refused, never ignored -------
def test_state_dict_helpers_refuse_fqn_modifier_hooks():
    """torch's get_model_state_dict drops the names a module's _fqn_modifiers() returns
    from the keys ('wrapped.lin.weight' -> 'lin.weight'); ours kept them: a dict torch's
    helpers would not load.  Was: the option ignored."""
    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wrapped = torch.nn.Module()
            self.wrapped.lin = torch.nn.Linear(2, 2)

        def _fqn_modifiers(self):
            return {"wrapped": "wrapped"}

    m = torch.nn.Sequential(Holder())
    for call in (lambda: wb.checkpoint.get_model_state_dict(m),
                 lambda: wb.checkpoint.set_model_state_dict(m, {}),
                 lambda: wb.checkpoint.get_state_dict(m, torch.optim.SGD(m.parameters(), 0.1))):
        with pytest.raises(NotImplementedError, match=r"module '0' defines _fqn_modifiers"):
            call()
    plain = torch.nn.Linear(2, 2)                                  # no hook: unchanged
    assert list(wb.checkpoint.get_model_state_dict(plain)) == ["weight", "bias"]
    opts = wb.checkpoint.StateDictOptions(dsd_fqn_modifiers="_none_defines_this")
    assert "0.wrapped.lin.weight" in wb.checkpoint.get_model_state_dict(m, options=opts)


# ---- torch.take: a non-long index gets torch's own message ----------------------------------
@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8, torch.bfloat16])
def test_take_index_dtype_error_is_torchs(dtype):
    """Was: 'but got Int32' / 'Int16' / 'Uint8' where torch says Int / Short / Byte."""
    x = _x(2, 3)
    idx = torch.tensor([0, 1]).to(dtype)
    with pytest.raises(RuntimeError) as want:
        torch.take(x, idx)
    d = wb.shard_tensor(x, wb.Mesh.grid((2,), ["a"]), [wb.Shard(0)])
    with pytest.raises(RuntimeError) as got:
        torch.take(d, idx)
    assert str(got.value) == str(want.value)
