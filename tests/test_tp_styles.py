"""PyTorch's tensor-parallel API (``parallelize_module`` + ParallelStyles + ``loss_parallel``)
on DistTensors, held to one device, to PyTorch DTensor running the same plan, and to
Megatron-LM's communication.

The model is a tiny Llama with torchtitan's module names and its TP plan
(``apply_tp`` in torchtitan/models/llama3/infra/parallelize.py): embedding rowwise with a
Shard(1) output, per block attention_norm / ffn_norm SequenceParallel, attention and
feed_forward inputs gathered by PrepareModuleInput, wq/wk/wv and w1/w3 colwise, wo and w2
rowwise with Shard(1) outputs, the final norm SequenceParallel, the output head colwise with
a Shard(-1) output and ``loss_parallel``.  The oracle runs torch's own ``parallelize_module``
on a copy, every rank simulated by ``LocalTensorMode`` on a fake process group
(``tests/dtensor_support.py``), and counts its collectives with ``CommDebugMode``.
"""
from __future__ import annotations

import contextlib
import copy
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import workbench as wb
from tests.dtensor_support import CommDebugMode, DTensor, LocalTensorMode, oracle  # noqa: F401
from tests.tp_llama import L, OURS, V, R, S, apply_plan, make, torch_ns


def record_outputs(model):
    seen = {}
    for name, mod in model.named_modules():
        mod.register_forward_hook(lambda m, a, o, name=name: seen.__setitem__(
            name, tuple(o.placements) if hasattr(o, "placements") else None))
    return seen


def tp_counts(tr, mesh_dim="tp"):
    return Counter(e.name for e in tr.collectives() if 0 in e.ranks
                   and e.args.get("mesh_dim") == mesh_dim)


# ---- one device --------------------------------------------------------------------------

TP_PARAMS = {"tok_embeddings.weight": S(0), "output.weight": S(0), "norm.weight": R(),
             "attention_norm.weight": R(), "ffn_norm.weight": R(), "wq.weight": S(0),
             "wk.weight": S(0), "wv.weight": S(0), "wo.weight": S(1), "w1.weight": S(0),
             "w3.weight": S(0), "w2.weight": S(1)}
TP_OUTPUTS = {"tok_embeddings": S(1), "attention_norm": S(1), "attention.wq": S(2),
              "attention.wo": S(1), "attention": S(1), "ffn_norm": S(1),
              "feed_forward.w1": S(2), "feed_forward.w2": S(1), "norm": S(1), "output": S(2)}


def _expected(name, table):
    for k, v in table.items():
        if name == k or name.endswith("." + k):
            return v
    return None


@pytest.mark.parametrize("shape", [(2,), (4,), (2, 2)], ids=["tp2", "tp4", "dp2xtp2"])
def test_torchtitan_plan_equals_one_device(shape):
    ref, tokens, labels = make()
    logits_ref = ref(tokens)
    loss_ref = F.cross_entropy(logits_ref.flatten(0, 1), labels.flatten(0, 1))
    loss_ref.backward()

    model = copy.deepcopy(ref)
    model.zero_grad(set_to_none=True)
    mesh = wb.Mesh.grid(shape, ["dp", "tp"][-len(shape):])
    apply_plan(OURS, model, mesh)
    md = mesh.dim("tp")
    if mesh.ndim == 2:            # the batch split over dp
        tokens = wb.shard_tensor(tokens, mesh, [S(0), R()])
        labels = wb.shard_tensor(labels, mesh, [S(0), R()])
    seen = record_outputs(model)
    with wb.trace("a100") as tr:
        with wb.loss_parallel():
            logits = model(tokens)
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))
            fwd, fwd_dp = tp_counts(tr), tp_counts(tr, "dp")
            loss.backward()
    bwd = tp_counts(tr) - fwd
    # the reference: logits, loss, every gradient
    torch.testing.assert_close(logits.full(), logits_ref)
    torch.testing.assert_close(loss.full(), loss_ref)
    n_params = 0
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad.full(), q.grad, msg=name)
        want = [R()] * mesh.ndim
        want[md] = _expected(name, TP_PARAMS)
        assert list(p.placements) == want, name
        assert list(p.grad.placements) == want, name           # gradients as their parameter
        n_params += 1
    # outputs: sharded as torch's DTensor lays them (Shard(-1) normalized), dp keeps the batch
    for name, ps in seen.items():
        want = _expected(name, TP_OUTPUTS)
        if want is not None:
            assert ps[md] == want, name
            assert mesh.ndim == 1 or ps[0] == S(0), name
    # Megatron's communication with sequence parallelism, per tp group: forward an
    # all-gather before each tp region and a reduce-scatter after it (2 per block, 1 for the
    # embedding, 1 before the head), backward the conjugates; vocabulary-parallel loss: 3
    # all-reduces (max, sum of exp, target logit); each SP norm weight's gradient
    # all-reduced once (Megatron: _allreduce_layernorm_grads once per step)
    regions = 2 * L + 1
    assert fwd == Counter(all_gather=regions, reduce_scatter=regions, all_reduce=3)
    assert bwd == Counter(all_gather=regions, reduce_scatter=regions, all_reduce=2 * L + 1)
    if mesh.ndim == 2:
        # dp: the loss's global target count, then in backward every parameter's gradient
        # all-reduced (unbucketed, one per parameter); the Partial loss is not reduced (each
        # rank seeds its own part, as torch)
        assert fwd_dp == Counter(all_reduce=1)
        assert tp_counts(tr, "dp") - fwd_dp == Counter(all_reduce=n_params)


@pytest.mark.parametrize("tp", [2, 4])
def test_plan_without_sequence_parallel_equals_one_device(tp):
    ref, tokens, labels = make()
    loss_ref = F.cross_entropy(ref(tokens).flatten(0, 1), labels.flatten(0, 1))
    loss_ref.backward()
    model = copy.deepcopy(ref)
    model.zero_grad(set_to_none=True)
    apply_plan(OURS, model, wb.Mesh.grid(tp, ["tp"]), sp=False)
    with wb.trace("a100") as tr:
        loss = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten(0, 1))
        fwd = tp_counts(tr)
        loss.backward()
    torch.testing.assert_close(loss.full(), loss_ref)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        got = p.grad.full() if isinstance(p, wb.DistTensor) else p.grad
        torch.testing.assert_close(got, q.grad, msg=name)
    # Megatron's f/g: g all-reduces each row-parallel output (embedding, wo, w2); f
    # all-reduces the input gradient of each colwise linear (its own input hook: wq, wk,
    # wv, w1, w3 and the head, as DTensor's from_local per module does); the head's
    # Replicate output is an all-gather whose backward is a local slice
    assert fwd == Counter(all_reduce=2 * L + 1, all_gather=1)
    assert tp_counts(tr) - fwd == Counter(all_reduce=5 * L + 1)


def test_training_loop_habits_after_parallelize_module():
    """state_dict, zero_grad and clipping keep one device's answers (wb.parallelize's)."""
    ref, tokens, labels = make()
    model = copy.deepcopy(ref)
    apply_plan(OURS, model, wb.Mesh.grid(2, ["tp"]))
    sd = model.state_dict()
    assert isinstance(sd["layers.0.attention.wq.weight"], wb.DistTensor)
    for k, v in ref.state_dict().items():
        got = sd[k].full() if isinstance(sd[k], wb.DistTensor) else sd[k]
        assert torch.equal(got, v), k
    for m, ctx in ((model, wb.loss_parallel()), (ref, contextlib.nullcontext())):
        with ctx:
            F.cross_entropy(m(tokens).flatten(0, 1), labels.flatten(0, 1)).backward()
    got = wb.clip_grad_norm_(model.parameters(), 0.1)
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    torch.testing.assert_close(torch.as_tensor(float(got)), want)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full(), q.grad, msg=n)       # clipped alike
    model.zero_grad()
    assert all(p.grad is None for p in model.parameters())


# ---- PyTorch DTensor as the oracle ---------------------------------------------------------

def _torch_run(oracle, model, tokens, labels, tp, sp):
    from torch.distributed.tensor.parallel import loss_parallel
    ns = torch_ns()
    seen, counts = {}, []
    with LocalTensorMode(tp):
        apply_plan(ns, model, oracle.mesh((tp,)), sp=sp)
        params = {n: tuple(getattr(p, "placements", ())) for n, p in model.named_parameters()}
        for name, mod in model.named_modules():
            mod.register_forward_hook(lambda m, a, o, name=name: seen.__setitem__(
                name, tuple(o.placements) if isinstance(o, DTensor) else None))
        with CommDebugMode() as cm:
            with loss_parallel() if sp else contextlib.nullcontext():
                loss = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten(0, 1))
                counts.append(dict(cm.get_comm_counts()))
                loss.backward()
            counts.append(dict(cm.get_comm_counts()))
        loss_placements = tuple(getattr(loss, "placements", ()))
    name = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
            "all_reduce": "all_reduce"}
    counts = [Counter({name[str(k).split(".")[-1]]: v for k, v in c.items()}) for c in counts]
    return params, seen, counts[0], counts[1] - counts[0], loss_placements


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")   # CommDebugMode's
@pytest.mark.parametrize("tp, sp", [(2, True), (4, True), (2, False)])
def test_plans_as_pytorch_dtensor(oracle, tp, sp):  # noqa: F811
    ref, tokens, labels = make()
    t_params, t_seen, t_fwd, t_bwd, t_loss = _torch_run(oracle, copy.deepcopy(ref), tokens,
                                                        labels, tp, sp)
    model = copy.deepcopy(ref)
    apply_plan(OURS, model, wb.Mesh.grid(tp, ["tp"]), sp=sp)
    seen = record_outputs(model)
    with wb.trace("a100") as tr:
        with wb.loss_parallel() if sp else contextlib.nullcontext():
            loss = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten(0, 1))
            fwd = tp_counts(tr)
            loss.backward()
    bwd = tp_counts(tr) - fwd
    from workbench.parallel.interop import to_dtensor_placements as theirs
    assert {n: theirs(getattr(p, "placements", ())) for n, p in model.named_parameters()} \
        == t_params
    # where torch hands the next module a DTensor (use_local_output=False: norms, head)
    compared = [n for n, ps in t_seen.items() if ps is not None]
    assert not sp or {"norm", "output", "layers.0.ffn_norm"} <= set(compared)
    for n in compared:
        assert theirs(seen[n]) == t_seen[n], n
    if sp:                                    # (without: torch's loss is a plain tensor)
        assert theirs(loss.placements) == t_loss
    # the same collectives; with sequence parallelism torch leaves each norm weight's
    # gradient Partial (reduced when read), we all-reduce it in backward: one more each
    assert fwd == t_fwd
    assert bwd == t_bwd + Counter(all_reduce=(2 * L + 1) if sp else 0)


# ---- loss_parallel ------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(2,), (4,), (2, 2)])
@pytest.mark.parametrize("kw", [{}, {"reduction": "sum"}, {"reduction": "none"},
                                {"label_smoothing": 0.1}, {"ignore_index": 3}])
def test_loss_parallel_exact(shape, kw):
    torch.manual_seed(1)
    x, t = torch.randn(8, V, dtype=torch.float64), torch.randint(0, V, (8,))
    t[:2] = 3
    xr = x.clone().requires_grad_()
    want = F.cross_entropy(xr, t, **kw)
    want.sum().backward()
    mesh = wb.Mesh.grid(shape, ["dp", "tp"][-len(shape):])
    ps = [S(0), S(1)] if len(shape) == 2 else [S(1)]
    xd = wb.shard_tensor(x, mesh, ps).requires_grad_()
    td = wb.shard_tensor(t, mesh, [S(0), R()]) if len(shape) == 2 else t
    with wb.trace("a100") as tr:
        with wb.loss_parallel():
            got = F.cross_entropy(xd, td, **kw)
        fwd = tp_counts(tr)
        got.sum().backward()
    torch.testing.assert_close(got.full(), want)
    torch.testing.assert_close(xd.grad.full(), xr.grad)
    assert tuple(xd.grad.placements) == tuple(xd.placements)
    # the logits never move: max, sum of exp, target logit (+ sum of logits) all-reduced
    assert fwd == Counter(all_reduce=4 if kw.get("label_smoothing") else 3)


def test_loss_parallel_nn_module_and_3d_logits():
    torch.manual_seed(2)
    x, t = torch.randn(2, V, 5), torch.randint(0, V, (2, 5))       # class dim 1
    xd = wb.shard_tensor(x, wb.Mesh.grid(2, ["tp"]), [S(1)])
    for _ in range(2):        # the second call: the dispatcher's cached choice, not forced
        with wb.trace("a100") as tr, wb.loss_parallel():
            got = nn.CrossEntropyLoss()(xd, t)
        torch.testing.assert_close(got.full(), F.cross_entropy(x, t))
        assert tr.counts() == Counter(all_reduce=3)


def test_loss_parallel_errors_as_torch():
    mesh = wb.Mesh.grid((2, 2), ["dp", "tp"])
    x, t = torch.randn(8, V), torch.randint(0, V, (8,))
    with wb.loss_parallel():
        with pytest.raises(ValueError, match="requires exactly one mesh dim to shard tensor "
                                             r"dimension 1.*0 such mesh dim"):
            F.cross_entropy(wb.shard_tensor(x, mesh, [S(0), R()]), t)
        with pytest.raises(ValueError, match="exactly one mesh dim.*2 such"):
            F.cross_entropy(wb.shard_tensor(x, mesh, [S(1), S(1)]), t)
        with pytest.raises(ValueError, match="non-TP mesh dims to be Shard or Replicate"):
            F.cross_entropy(wb.shard_tensor(x, mesh, [wb.Partial(), S(1)]), t)
        u = torch.randn(8, 30)                   # uneven shards: computed (test_loss8.py)
        uneven = wb.shard_tensor(u, wb.Mesh.grid(4, ["tp"]), [S(1)])
        torch.testing.assert_close(F.cross_entropy(uneven, t.clamp(max=29)).full(),
                                   F.cross_entropy(u, t.clamp(max=29)))
        plain = F.cross_entropy(x, t)            # plain tensors: torch's own
    torch.testing.assert_close(plain, F.cross_entropy(x, t))


# ---- the styles one by one ---------------------------------------------------------------

@pytest.mark.parametrize("style, w, b, out", [
    (wb.ColwiseParallel(), S(0), S(0), S(1)),
    (wb.ColwiseParallel(output_layouts=R()), S(0), S(0), R()),
    (wb.RowwiseParallel(input_layouts=R()), S(1), R(), R()),
    (wb.RowwiseParallel(input_layouts=R(), output_layouts=S(0)), S(1), R(), S(0)),
])
def test_linear_with_bias(style, w, b, out):
    torch.manual_seed(3)
    ref, x = nn.Linear(6, 8), torch.randn(4, 6, requires_grad=True)
    lin = copy.deepcopy(ref)
    wb.parallelize_module(lin, wb.Mesh.grid(2, ["tp"]), style)
    assert (lin.weight.placements, lin.bias.placements) == ((w,), (b,))
    xd = x.detach().requires_grad_()
    y = lin(xd)                               # a plain input is the global tensor
    assert y.placements == (out,)
    y.full().pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    torch.testing.assert_close(y.full(), ref(x))
    torch.testing.assert_close(xd.grad, x.grad)
    torch.testing.assert_close(lin.weight.grad.full(), ref.weight.grad)
    torch.testing.assert_close(lin.bias.grad.full(), ref.bias.grad)


@pytest.mark.parametrize("style, w, out", [(wb.ColwiseParallel(), S(1), S(2)),
                                           (wb.RowwiseParallel(input_layouts=R()), S(0), R())])
def test_embedding(style, w, out):
    torch.manual_seed(4)
    ref, ids = nn.Embedding(10, 8), torch.randint(0, 10, (2, 5))
    emb = copy.deepcopy(ref)
    wb.parallelize_module(emb, wb.Mesh.grid(2, ["tp"]), style)
    y = emb(ids)
    assert emb.weight.placements == (w,) and y.placements == (out,)
    torch.testing.assert_close(y.full(), ref(ids))


def test_torch_placements_accepted_and_repr():
    from torch.distributed.tensor import Replicate as TR, Shard as TS
    st = wb.ColwiseParallel(input_layouts=TS(0), output_layouts=TR())
    assert st.input_layouts == (S(0),) and st.output_layouts == (R(),)
    assert repr(st) == ("ColwiseParallel(input_layouts=(Shard(dim=0),), "
                        "output_layouts=(Replicate(),), use_local_output=True)")
    torch.manual_seed(5)
    ref, x = nn.Linear(4, 6), torch.randn(4, 4)
    lin = copy.deepcopy(ref)
    wb.parallelize_module(lin, wb.Mesh.grid(2, ["tp"]), st)
    torch.testing.assert_close(lin(x).full(), ref(x))          # x global: sharded, gathered


@pytest.mark.parametrize("mod", [nn.LayerNorm(8), nn.RMSNorm(8), nn.Dropout(0.5)])
def test_sequence_parallel(mod):
    torch.manual_seed(6)
    mod.eval()
    ref, x = copy.deepcopy(mod), torch.randn(2, 4, 8)
    mesh = wb.Mesh.grid(2, ["tp"])
    wb.parallelize_module(mod, mesh, wb.SequenceParallel())
    assert all(p.placements == (R(),) for p in mod.parameters())
    y = mod(x)                                                 # plain: the global activation
    assert y.placements == (S(1),)
    torch.testing.assert_close(y.full(), ref(x))
    y = mod(wb.shard_tensor(x, mesh, [R()]))                   # a DistTensor: resharded
    assert y.placements == (S(1),)
    y2 = wb.parallelize_module(copy.deepcopy(ref), mesh, wb.SequenceParallel(sequence_dim=0))(x)
    assert y2.placements == (S(0),)


def test_sequence_parallel_dropout_in_training_draws_one_devices_mask():
    """Under keyed masks (as wb.train runs dropout) each rank keeps its slice of one
    device's mask: the Shard(1) output is the single-device dropout (sim_mesh/rng.py)."""
    from workbench.sim_mesh import rng
    x = torch.randn(2, 8, 6)
    d = wb.parallelize_module(nn.Dropout(0.5), wb.Mesh.grid(4, ["tp"]), wb.SequenceParallel())
    with rng.keyed(0), rng.site(1):
        y = d(x)
    with rng.keyed(0), rng.site(1):
        want = x * rng.draw_mask(tuple(x.shape), 0.5, x.dtype)
    assert y.placements == (S(1),) and torch.equal(y.full(), want)
    assert 0 < (want == 0).sum() < x.numel()


def test_prepare_module_input_output_and_kwargs():
    class Two(nn.Module):
        def forward(self, a, b, *, c):
            return a + b + c, a * c

    mesh = wb.Mesh.grid(2, ["tp"])
    m = wb.parallelize_module(Two(), mesh, wb.PrepareModuleInputOutput(
        input_layouts=(S(0), None), desired_input_layouts=(R(), None),
        input_kwarg_layouts={"c": R()}, desired_input_kwarg_layouts={"c": S(1)},
        output_layouts=(S(1), None), desired_output_layouts=(R(), None)))
    a, b, c = torch.randn(4, 6), torch.randn(4, 6), torch.randn(4, 6)
    with wb.trace("a100") as tr:
        y, z = m(a, b, c=c)
    assert y.placements == (R(),) and z.placements == (S(1),)
    torch.testing.assert_close(y.full(), a + b + c)
    torch.testing.assert_close(z.full(), a * c)
    assert "all_gather" in tr.counts()        # a: S(0) -> R;  y: S(1) -> R


def test_use_local_output_keeps_a_dist_tensor():
    lin = wb.parallelize_module(nn.Linear(4, 8), wb.Mesh.grid(2, ["tp"]),
                                wb.ColwiseParallel(use_local_output=True))
    y = lin(torch.randn(3, 4))
    assert isinstance(y, wb.DistTensor) and y.shape == (3, 8) and y.placements == (S(1),)
    y.view(3, 2, -1)                          # torch code with -1 runs unchanged
    with pytest.raises(RuntimeError):
        y.view(3, 2, 2)                       # torch's local (3, 4) shard as 2 x 2: an error


def test_plain_tensor_input_under_sequence_parallel_is_the_global_tensor():
    mesh = wb.Mesh.grid(2, ["tp"])
    norm = wb.parallelize_module(nn.RMSNorm(8), mesh, wb.SequenceParallel())
    x = torch.randn(2, 6, 8)
    assert norm(x).shape == (2, 6, 8)          # torch would read (2, 6, 8) as a local shard


# ---- errors ------------------------------------------------------------------------------

def test_errors():
    mesh = wb.Mesh.grid(2, ["tp"])
    for style in (wb.ColwiseParallel(), wb.RowwiseParallel()):
        with pytest.raises(NotImplementedError, match="currently only support nn.Linear and "
                                                      "nn.Embedding!.*LayerNorm"):
            wb.parallelize_module(nn.LayerNorm(4), mesh, style)
    with pytest.raises(TypeError, match="Expect Union"):
        wb.parallelize_module(nn.Linear(2, 2), mesh, "colwise")
    with pytest.raises(TypeError, match=r"parallelize_plan\['w'\]"):
        wb.parallelize_module(nn.Linear(2, 2), mesh, {"w": "colwise"})
    with pytest.raises(ValueError, match="parallelize_plan=None"):
        wb.parallelize_module(nn.Linear(2, 2), mesh)
    with pytest.raises(TypeError, match="device_mesh=.*workbench Mesh"):
        wb.parallelize_module(nn.Linear(2, 2), "tp", wb.ColwiseParallel())
    with pytest.raises(ValueError, match="none is named 'tp'.*mesh_dim="):
        wb.parallelize_module(nn.Linear(2, 2), wb.Mesh.grid((2, 2), ["a", "b"]),
                              wb.ColwiseParallel())
    with pytest.raises(ValueError, match="src_data_rank=1"):
        wb.parallelize_module(nn.Linear(2, 2), mesh, wb.ColwiseParallel(), src_data_rank=1)
    with pytest.raises(TypeError, match="input_layouts=.*expected a placement"):
        wb.ColwiseParallel(input_layouts="R")
    with pytest.raises(TypeError, match="use_local_output=1"):
        wb.RowwiseParallel(use_local_output=1)
    with pytest.raises(TypeError, match="sequence_dim="):
        wb.SequenceParallel(sequence_dim=1.0)
    with pytest.raises(ValueError, match="input_layouts has 2 entries but desired"):
        wb.PrepareModuleInput(input_layouts=(S(0), None), desired_input_layouts=(R(),))
    with pytest.raises(ValueError, match="input_kwarg_layouts names"):
        wb.PrepareModuleInput(input_kwarg_layouts={"a": R()}, desired_input_kwarg_layouts={})
    with pytest.raises(ValueError, match="output_layouts=None"):
        wb.PrepareModuleOutput(output_layouts=None, desired_output_layouts=R())
    # at run time
    m = wb.parallelize_module(nn.Identity(), mesh, wb.PrepareModuleInput(
        input_layouts=(S(0), S(0)), desired_input_layouts=(R(), R())))
    with pytest.raises(ValueError, match="got 1 positional inputs but input_layouts has 2"):
        m(torch.randn(2))
    m = wb.parallelize_module(nn.Identity(), mesh, wb.PrepareModuleInput(
        input_layouts=(S(0),), desired_input_layouts=(R(),)))
    with pytest.raises(TypeError, match=r"input\[0\] is a str"):
        m("x")
    m = wb.parallelize_module(nn.Identity(), mesh, wb.PrepareModuleOutput(
        output_layouts=(S(0), S(0)), desired_output_layouts=(R(), R())))
    with pytest.raises(ValueError, match="returned 1 outputs but output_layouts has 2"):
        m(torch.randn(2))
    with pytest.raises(TypeError, match="input_kwarg_layouts=.*expected a dict"):
        wb.PrepareModuleInput(input_kwarg_layouts=[R()], desired_input_kwarg_layouts=[R()])
    with pytest.raises(TypeError, match="module=.*Linear.*: expected an nn.Module instance"):
        wb.parallelize_module(nn.Linear, mesh, wb.ColwiseParallel())
    sp = wb.parallelize_module(nn.RMSNorm(4), mesh, wb.SequenceParallel(sequence_dim=3))
    with pytest.raises(ValueError, match=r"Shard\(3\) on a 3-d tensor: dim must be in"):
        sp(torch.randn(2, 4, 4))
    with pytest.raises(TypeError, match="SequenceParallel: module called with no positional"):
        sp(input=torch.randn(2, 4, 4))
    lin = wb.parallelize_module(nn.Linear(2, 2), mesh, wb.ColwiseParallel())
    with pytest.raises(TypeError, match="ColwiseParallel: Linear called with no positional"):
        lin(input=torch.randn(2, 2))
    # an input on another mesh (the sub-mesh mesh["tp"] of a 2-d mesh)
    mesh2 = wb.Mesh.grid((2, 2), ["dp", "tp"])
    lin = wb.parallelize_module(nn.Linear(2, 2), mesh2["tp"], wb.ColwiseParallel())
    with pytest.raises(ValueError, match="mesh_dim='tp', not mesh\\['tp'\\]"):
        lin(wb.shard_tensor(torch.randn(4, 2), mesh2, [S(0), R()]))
    # a style applied twice
    lin = wb.parallelize_module(nn.Linear(2, 2), mesh, wb.ColwiseParallel())
    with pytest.raises(ValueError, match="already a DistTensor.*one style per module"):
        wb.parallelize_module(lin, mesh, wb.RowwiseParallel())


def test_failed_plan_changes_nothing():
    seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    mesh = wb.Mesh.grid(2, ["tp"])
    bad = [{"0": wb.ColwiseParallel(), "nope": wb.RowwiseParallel()},
           {"0": wb.ColwiseParallel(), "1": wb.RowwiseParallel()},          # a ReLU
           {"*": wb.SequenceParallel(), "0": wb.ColwiseParallel()}]          # one module twice
    msgs = ["no submodule of Sequential matches 'nope'", "only support nn.Linear",
            "keys '\\*' and '0' both lay out"]
    for plan, msg in zip(bad, msgs):
        with pytest.raises((ValueError, NotImplementedError), match=msg):
            wb.parallelize_module(seq, mesh, plan)
        assert not any(isinstance(p, wb.DistTensor) for p in seq.parameters())
        assert not any(m._forward_pre_hooks or m._forward_hooks for m in seq.modules())


@pytest.mark.slow
def test_torchtitan_plan_under_torchrun(tmp_path_factory):
    from tests.torchrun_support import json_rows, two_proc
    out, text = two_proc(tmp_path_factory, "tp_styles_check.py")      # one launch: 2-process checks
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json_rows(text)
    assert sorted(r["rank"] for r in rows) == [0, 1]
    for r in rows:
        got, want = r["loss"]
        assert abs(got - want) <= 1e-5 * want and r["grads"] < 1e-5, r
        assert r["sp_shape"] == [2, 8, 16] and r["sp"] < 1e-5, r


def test_tied_embedding_and_head():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(V, 8), nn.Linear(8, V, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, ids):
            return self.head(self.emb(ids))

    torch.manual_seed(7)
    ref, ids = Tied(), torch.randint(0, V, (2, 4))
    m, mesh = copy.deepcopy(ref), wb.Mesh.grid(2, ["tp"])
    wb.parallelize_module(m, mesh, {"emb": wb.RowwiseParallel(input_layouts=R()),
                                    "head": wb.ColwiseParallel(output_layouts=R())})
    assert m.head.weight is m.emb.weight and m.emb.weight.placements == (S(0),)
    y = m(ids)
    y.pow(2).sum().backward()
    ref(ids).pow(2).sum().backward()
    torch.testing.assert_close(y.full(), ref(ids))
    torch.testing.assert_close(m.emb.weight.grad.full(), ref.emb.weight.grad)   # both uses
    bad = copy.deepcopy(ref)
    with pytest.raises(ValueError, match="'emb.weight' and 'head.weight' are one tied "
                                         "parameter but get Shard\\(dim=1\\) and Shard\\(dim=0\\)"):
        wb.parallelize_module(bad, mesh, {"emb": wb.ColwiseParallel(),
                                          "head": wb.ColwiseParallel()})
    assert not any(isinstance(p, wb.DistTensor) for p in bad.parameters())   # untouched
    wb.parallelize_module(bad, mesh, {"emb": wb.ColwiseParallel()})
    with pytest.raises(ValueError, match="an earlier parallelize_module call"):
        wb.parallelize_module(bad, mesh, {"head": wb.ColwiseParallel()})


def test_a_parent_style_and_a_child_style_on_one_parameter():
    """SequenceParallel on a block and ColwiseParallel on its linear reach one parameter by
    two keys: the refusal called it "one tied parameter", naming '0.weight' twice (found
    with notebook 06's exercise 4, a SequenceParallel on "mlp"); it is two styles for one
    parameter."""
    mesh = wb.Mesh.grid(2, ["tp"])
    seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(ValueError, match="keys '' and '0' both lay out '0.weight'.*one style"):
        wb.parallelize_module(seq, mesh, {"": wb.SequenceParallel(), "0": wb.ColwiseParallel()})
    assert not any(isinstance(p, wb.DistTensor) for p in seq.parameters())      # untouched


def test_pytorch_style_objects_accepted():
    """torchtitan's plan written with torch.distributed.tensor.parallel's own classes runs
    through wb.parallelize_module: the same layouts and values as ours."""
    ref, tokens, labels = make()
    loss_ref = F.cross_entropy(ref(tokens).flatten(0, 1), labels.flatten(0, 1))
    mesh = wb.Mesh.grid(2, ["tp"])
    ns = torch_ns()
    ns.apply = wb.parallelize_module
    theirs, ours = copy.deepcopy(ref), copy.deepcopy(ref)
    apply_plan(ns, theirs, mesh)
    apply_plan(OURS, ours, mesh)
    assert [(n, p.placements) for n, p in theirs.named_parameters()] == \
        [(n, p.placements) for n, p in ours.named_parameters()]
    with wb.loss_parallel():
        loss = F.cross_entropy(theirs(tokens).flatten(0, 1), labels.flatten(0, 1))
    torch.testing.assert_close(loss.full(), loss_ref)
    from torch.distributed.tensor import Replicate as TR, Shard as TS
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput
    st = wb.parallelize_module(nn.Identity(), mesh, PrepareModuleInputOutput(
        input_layouts=TS(0), desired_input_layouts=TR(), output_layouts=TR(),
        desired_output_layouts=TS(1)))
    x = torch.randn(4, 6)
    y = st(x)
    assert y.placements == (S(1),)
    torch.testing.assert_close(y.full(), x)

    class Float8Colwise(torch.distributed.tensor.parallel.ColwiseParallel):
        pass
    with pytest.raises(TypeError, match="Float8Colwise: a torch ParallelStyle workbench "
                                        "cannot read"):
        wb.parallelize_module(nn.Linear(2, 2), mesh, {"": Float8Colwise()})
