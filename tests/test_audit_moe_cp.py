"""User-trial audit of mixture of experts with expert parallelism, context parallelism and
``wb.compile``: every result held to one device's PyTorch (values, gradients), and what is
not supported refused with the fix rather than computed differently."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import workbench as wb
from workbench.models.config import build_model, get_config
from workbench.models.data import get_batch
from workbench.models.moe import MoE
from workbench.parallel.module import dist_parameters, parallelize
from workbench.parallel.strategies import context_parallel as cp
from workbench.parallel.strategies.expert_parallel import expert_mesh, expert_parallel
from workbench.recipes.context_parallel import ContextParallel

R, S = wb.Replicate(), wb.Shard


def _full(t):
    return t.full() if hasattr(t, "full") else t


# ---- context parallelism with a mixture of experts --------------------------------------------

def _moe_cfg(preset="tiny", **kw):
    return get_config(preset, **{**dict(n_layer=2, d_model=32, n_head=2, d_ff=48, seq_len=16,
                                        moe_experts=4, moe_topk=2), **kw})


@pytest.mark.parametrize("preset,cf,balanced,B", [
    ("tiny", None, True, 2), ("tiny", 0.5, True, 2), ("gpt-tiny", 0.5, True, 2),
    ("tiny", 0.5, False, 2), ("tiny", 0.5, True, 1)])       # B=1: cp does not divide it
def test_cp_with_moe_layers_gives_one_devices_logits_loss_and_gradients(preset, cf, balanced, B):
    """The MoE layer's output came back batch-sharded on cp, so the next block's attention
    was not the ring's and ran plain causal attention on tokens in ring order; and with a
    capacity, tokens were dropped in ring order instead of sequence order."""
    cfg = _moe_cfg(preset, moe_capacity_factor=cf)
    x, y = get_batch(cfg, B, 0, 0)
    ref = build_model(cfg, seed=0).train()
    logits_ref, loss_ref = ref(x, y)
    loss_ref.backward()
    s = ContextParallel(cp=2, balanced=balanced)
    s.check(cfg, B)
    model = s.build_model(cfg, 0)
    mesh = s.meshes[0]
    inv = torch.argsort(cp.slot_positions(x.shape[1], 2, balanced))
    with torch.no_grad():
        logits = s._stage(model, 0, s._batch(x, mesh)).full()[:, inv]
    torch.testing.assert_close(logits, logits_ref, rtol=1e-5, atol=1e-5)
    opts = s.build_optimizer(model, 1e-3, 0.0)
    loss = s.forward_backward(model, x, y)
    torch.testing.assert_close(loss, loss_ref.detach(), rtol=1e-5, atol=1e-6)
    opts[0].finish_gradient_synchronization()
    want = dict(ref.named_parameters())
    for name, p in dist_parameters(model):
        g = p._local.grad[(0,) * mesh.ndim]
        torch.testing.assert_close(g, want[name].grad, rtol=1e-4, atol=1e-6, msg=name)
    stats = [m.last_stats for m in model.modules() if isinstance(m, MoE)]
    stats_ref = [m.last_stats for m in ref.modules() if isinstance(m, MoE)]
    assert [st["dropped"] for st in stats] == [st["dropped"] for st in stats_ref]
    assert (stats_ref[0]["dropped"] > 0) == (cf is not None)


def test_train_cli_runs_cp_with_moe_flags_with_one_devices_losses(capsys):
    """``--cp`` with ``--moe-experts`` was refused ("not built yet"); it now gives one
    device's losses; ``--cp`` with ``--ep`` is still refused, with the fix."""
    import json
    from workbench.cli import main
    flags = ["train", "--preset", "tiny", "--steps", "2", "--seed", "0", "--moe-experts", "4",
             "--moe-capacity-factor", "0.5"]

    def losses(*more):
        assert main(flags + list(more)) == 0
        return [json.loads(r)["loss"] for r in capsys.readouterr().out.splitlines()
                if r.startswith("{")]
    assert losses("--cp", "2") == pytest.approx(losses(), rel=1e-6)
    assert main(flags + ["--cp", "2", "--ep", "2", "--dp", "2"]) == 2
    assert "--cp with --ep" in capsys.readouterr().err


def test_context_parallel_refuses_plain_causal_attention_on_ring_ordered_tokens():
    """Inside ``context_parallel`` (balanced) the mesh's sequences are in ring order: causal
    attention on a query of that mesh that is not sequence-sharded on cp would mask the
    wrong keys; it is refused with the fix, not computed."""
    mesh = wb.Mesh([0, 1], ["cp"])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 4, generator=g) for _ in range(3))
    qkv = [wb.shard_tensor(cp.ring_order(t, 2, 2), mesh, [S(0)]) for t in (q, k, v)]
    with cp.context_parallel(mesh, "cp"), pytest.raises(ValueError, match="ring order"):
        F.scaled_dot_product_attention(*qkv, is_causal=True)
    with cp.context_parallel(mesh, "cp"):      # no mask: the order of the keys is no matter
        out = F.scaled_dot_product_attention(*qkv)
    torch.testing.assert_close(out.full(), cp.ring_order(F.scaled_dot_product_attention(q, k, v),
                                                         2, 2), rtol=1e-5, atol=1e-6)
    with cp.context_parallel(mesh, "cp", balanced=False):     # contiguous: the order kept
        out = F.scaled_dot_product_attention(*[wb.shard_tensor(t, mesh, [R]) for t in (q, k, v)],
                                             is_causal=True)
    torch.testing.assert_close(out.full(), F.scaled_dot_product_attention(q, k, v, is_causal=True),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("i,d", [(0, 0), (0, 1), (1, 0), (1, 2)])
def test_replicate_to_shard_of_one_copy_per_rank_keeps_each_copys_chunk(i, d):
    """A replicated tensor stored as one copy per rank along a mesh dim (data-parallel
    replicas: cp x tp with a MoE crashed in the experts' matmul): Replicate -> Shard keeps
    rank c's chunk of its own copy, and each copy gets its own chunk's gradient."""
    from workbench.parallel.dist_tensor import DistTensor
    mesh = wb.Mesh.grid((2, 2), ["cp", "tp"])
    g = torch.Generator().manual_seed(0)
    full, w = torch.randn(4, 6, 3, generator=g), torch.randn(4, 6, 3, generator=g)
    lead = [1, 1]
    lead[i] = 2
    loc = full.expand(*lead, 4, 6, 3).clone().requires_grad_()
    x = DistTensor(loc, mesh, [R, R], full.shape, full.dtype)
    ps = [R, R]
    ps[i] = S(d)
    y = wb.reshard(x, mesh, ps)
    torch.testing.assert_close(y.full(), full)
    (y * wb.shard_tensor(w, mesh, ps)).sum().backward()
    for c in range(2):
        chunk = torch.zeros_like(w)
        sl = [slice(None)] * 3
        step = -(-w.shape[d] // 2)                     # torch.chunk's sizes: 3 -> 2, 1
        sl[d] = slice(c * step, (c + 1) * step)
        chunk[tuple(sl)] = w[tuple(sl)]
        copy = loc.grad.select(i, c).squeeze(0)
        torch.testing.assert_close(copy, chunk)


@pytest.mark.parametrize("kw", [dict(cp=2, tp=2), dict(cp=2, tp=2, sp=True)])
def test_cp_with_tp_and_moe_trains_with_one_devices_losses(kw):
    from workbench.train import train
    cfg = _moe_cfg(n_head=4)
    ref = [r["loss"] for r in train(cfg, steps=2, seed=0, timing=False)]
    got = [r["loss"] for r in train(cfg, steps=2, seed=0, timing=False,
                                    strategy=ContextParallel(**kw))]
    assert got == pytest.approx(ref, rel=1e-6)


# ---- wb.compile: a captured module against its eager self -------------------------------------

class _Drop(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.drop = nn.Dropout(0.5)
        self.register_buffer("gain", torch.ones(6))

    def forward(self, x):
        y = self.drop(self.lin(x)) * self.gain
        return y * 2 if self.training else y


def _drop_module():
    torch.manual_seed(0)
    mesh = wb.Mesh.grid((2,), ("dp",))
    m = wb.parallelize(_Drop(), mesh, {})
    x = wb.shard_tensor(torch.randn(4, 6, generator=torch.Generator().manual_seed(1)), mesh,
                        [S(0)])
    return m, x


@pytest.mark.parametrize("at_capture", ["train", "eval"])
def test_compiled_module_refuses_a_call_in_another_train_eval_mode(at_capture):
    """The graph kept the capture's dropout and ``self.training`` branch after
    ``model.eval()`` (a silently different result); now refused with the fix."""
    m, x = _drop_module()
    getattr(m, at_capture)()
    prog = wb.compile(m, x)
    assert not prog.eager
    m.train(at_capture == "eval")
    with pytest.raises(ValueError, match="train/eval mode"):
        prog(x)
    m.train(at_capture == "train")
    if at_capture == "eval":               # deterministic: the compiled result is eager's
        torch.testing.assert_close(prog(x).full(), m(x).full())
    else:
        prog(x)


def test_compiled_module_reads_its_buffers_as_they_are_when_called():
    """A buffer replaced after capture (``m.gain = t``) was silently the old one."""
    m, x = _drop_module()
    m.eval()
    prog = wb.compile(m, x)
    m.gain.mul_(3)
    torch.testing.assert_close(prog(x).full(), m(x).full())
    m.gain = torch.full((6,), 5.0)
    torch.testing.assert_close(prog(x).full(), m(x).full())
    m.gain = torch.ones(3)
    with pytest.raises(ValueError, match="'gain'.*compile the module again"):
        prog(x)


def test_an_op_that_cannot_run_on_meta_tensors_is_a_break_with_its_name():
    """``F.nll_loss`` with a target made inside the program raised torch's own "Tensor on
    device meta is not on the expected device cpu" from capture; now the program runs
    eagerly with the op named, and since the capture by trace records ``nll_loss`` as the
    table ops eager dispatch runs it as, the program compiles and gives eager's loss."""
    mesh = wb.Mesh.grid((2,), ("dp",))
    t = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
    x = wb.shard_tensor(t, mesh, [S(0)])
    fn = lambda t: F.nll_loss(F.log_softmax(t, -1), torch.tensor([0, 1, 2, 3]))  # noqa: E731
    prog = wb.compile(fn, x)
    if prog.eager:
        assert "nll_loss" in str(prog.breaks[0]) and "op table" in str(prog.breaks[0])
    else:
        assert "capture by trace" in str(prog)
    torch.testing.assert_close(prog(x).full(), fn(t))


def _ring_qkv():
    mesh = wb.Mesh([0, 1], ["cp"])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 4, generator=g) for _ in range(3))
    # laid out by to_ring_layout, which records the order (seq_order.py, tests/test_cp11.py)
    qkv = [cp.to_ring_layout(wb.shard_tensor(t, mesh, [R]), "cp", 2) for t in (q, k, v)]
    ref = cp.ring_order(F.scaled_dot_product_attention(q, k, v, is_causal=True), 2, 2)
    return mesh, qkv, ref


def test_a_compiled_program_refuses_a_call_under_context_parallel():
    """The graph's attention ran as plain causal attention on the ring-ordered tokens
    under ``context_parallel`` (0.53 off); the mode is not seen by the graph, so refused."""
    mesh, qkv, ref = _ring_qkv()

    def attn(a, b, c):
        return F.scaled_dot_product_attention(a, b, c, is_causal=True)
    prog = wb.compile(attn, *qkv)
    with cp.context_parallel(mesh, "cp"):
        torch.testing.assert_close(attn(*qkv).full(), ref, rtol=1e-5, atol=1e-6)   # eager
        with pytest.raises(NotImplementedError, match="context_parallel"):
            prog(*qkv)


def test_ring_attention_compiles_as_a_break_and_runs_eagerly():
    """Capture ran ``ring_attention`` on plain meta tensors and let its TypeError ("q is a
    Tensor", though the user gave DistTensors) escape ``wb.compile``."""
    mesh, qkv, ref = _ring_qkv()
    for t in qkv:
        t.requires_grad_()
    prog = wb.compile(lambda a, b, c: cp.ring_attention(a, b, c, "cp"), *qkv)
    assert prog.eager and "meta tensors" in str(prog.breaks[0])
    out = prog(*qkv)
    torch.testing.assert_close(out.full(), ref, rtol=1e-5, atol=1e-6)
    out.sum().backward()
    assert all(t.grad is not None for t in qkv)


class _Counts(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.calls, self.last, self._cache = 0, None, None

    def forward(self, x):
        y = self.lin(x)
        self.calls += 1
        self.last = y
        self._cache = y * 1                      # a private one too (MoE keeps _last)
        return y


@pytest.mark.parametrize("method", ["auto", "trace"])
def test_a_forward_that_sets_module_state_runs_eagerly_and_keeps_its_state(method):
    """The graph did not repeat ``self.calls += 1`` / ``self.last = y`` on each call (and
    tracing left a meta tensor in ``self.last``): such a module now runs eagerly, named."""
    mesh = wb.Mesh.grid((2,), ("dp",))
    m = wb.parallelize(_Counts(), mesh, {})
    x = wb.shard_tensor(torch.randn(4, 6), mesh, [S(0)])
    prog = wb.compile(m, x, method=method)
    assert prog.eager and "sets module state (calls, last, _cache)" in str(prog.breaks[0])
    assert m.calls == 0 and m.last is None and m._cache is None     # put back after capture
    y = prog(x)
    prog(x)
    assert m.calls == 2 and m.last.device.type == "cpu"
    torch.testing.assert_close(y.full(), m.lin(x).full())


def test_a_parameter_changed_after_capture_is_refused_with_the_fix():
    """``model.double()`` after compile gave torch's "expected scalar type Float but found
    Double" from inside the graph; a new layout would have run the old plan."""
    mesh = wb.Mesh.grid((2,), ("dp",))
    torch.manual_seed(0)
    m = wb.parallelize(nn.Sequential(nn.Linear(6, 6), nn.GELU(), nn.Linear(6, 3)), mesh, {})
    x = wb.shard_tensor(torch.randn(4, 6), mesh, [S(0)])
    prog = wb.compile(m, x)
    with torch.no_grad():                      # in place: the call sees the new values
        m[0].weight.mul_(2)
    torch.testing.assert_close(prog(x).full(), m(x).full())
    m.double()
    with pytest.raises(ValueError, match=r"parameter '0.weight' was \(6, 6\) torch.float32"):
        prog(x)


def test_export_keeps_log_softmax_dtype_and_embedding_padding_idx():
    """The export mapping dropped ``log_softmax``'s dtype (float32 where eager gives
    float64) and ``embedding``'s padding_idx (the padding row got a gradient)."""
    mesh = wb.Mesh.grid((2,), ("dp",))
    x = wb.shard_tensor(torch.randn(4, 6, generator=torch.Generator().manual_seed(0)), mesh,
                        [S(0)])

    def lsm(t):
        return F.log_softmax(t, -1, dtype=torch.float64)
    prog = wb.compile(lsm, x, method="export")
    assert prog.graph.method == "export"
    out = prog(x)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out.full(), lsm(x.full()))

    class Emb(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4, padding_idx=0)

        def forward(self, ids):
            return self.emb(ids).sum()
    torch.manual_seed(0)
    ref = Emb()
    m = wb.parallelize(Emb(), mesh, {})
    m.load_state_dict(ref.state_dict())
    ids = torch.tensor([[0, 1, 2], [0, 0, 3]])
    prog = wb.compile(m, wb.shard_tensor(ids, mesh, [S(0)]), method="export")
    assert prog.graph.method == "export"
    prog(wb.shard_tensor(ids, mesh, [S(0)])).backward()
    ref(ids).backward()
    torch.testing.assert_close(m.emb.weight.grad.full(), ref.emb.weight.grad)


# ---- save -> load -> continue with expert parallelism ----------------------------------------

@pytest.mark.parametrize("first,then", [
    (dict(ep=2), {}), ({}, dict(ep=2)), (dict(ep=2, pp=2, zero=1), dict(ep=2, dp=2))])
def test_resume_with_expert_parallelism_keeps_the_experts_optimizer_states(tmp_path, first, then):
    """The experts' AdamW states (their own optimizer on the expert mesh) were neither saved
    nor loaded: the step after a resume differed from the uninterrupted run (3.7089 vs
    3.7150 at step 4)."""
    from workbench.recipes import Hybrid
    from workbench.train import train
    cfg = _moe_cfg(moe_capacity_factor=0.5)

    def run(steps, layout, **kw):
        s = Hybrid(**layout) if layout else None
        return [r["loss"] for r in train(cfg, steps=steps, seed=0, timing=False, batch_size=4,
                                         strategy=s, **kw)]
    want = run(4, {})
    run(2, first, save=str(tmp_path / "ck"))
    assert run(4, then, resume=str(tmp_path / "ck")) == pytest.approx(want[2:], rel=1e-6)


_W = torch.randn(6, 6, generator=torch.Generator().manual_seed(3))
_SCALE = 2.0


def _global_fn(x):
    return (x @ _W) * _SCALE


def test_what_the_code_reads_is_read_again_or_a_change_refused():
    """A global tensor rebound after compile, a global or closure number changed, a module
    attribute the forward reads changed: the graph silently used the captured ones."""
    global _W, _SCALE
    mesh = wb.Mesh.grid((2,), ("dp",))
    x = wb.shard_tensor(torch.randn(4, 6, generator=torch.Generator().manual_seed(4)), mesh,
                        [S(0)])
    w0, s0 = _W, _SCALE
    try:
        prog = wb.compile(_global_fn, x)
        _W = torch.randn(6, 6, generator=torch.Generator().manual_seed(5))
        torch.testing.assert_close(prog(x).full(), _global_fn(x.full()))     # read again
        _SCALE = 3.0
        with pytest.raises(ValueError, match="global _SCALE was 2.0 at capture and is now 3.0"):
            prog(x)
    finally:
        _W, _SCALE = w0, s0
    scale = 2.0

    def closure(t):
        return t * scale
    prog = wb.compile(closure, x)
    scale = 5.0
    with pytest.raises(ValueError, match="closure variable scale was 2.0"):
        prog(x)

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 6)
            self.scale, self.unused = 2.0, 1

        def forward(self, t):
            return self.lin(t) * self.scale
    torch.manual_seed(0)
    m = wb.parallelize(Scaled(), mesh, {})
    prog = wb.compile(m, x)
    m.unused = 5                                 # not read by forward: no matter
    torch.testing.assert_close(prog(x).full(), m(x).full())
    m.scale = 7.0
    with pytest.raises(ValueError, match="module attribute scale was 2.0"):
        prog(x)


def test_a_hook_added_or_removed_after_capture_is_refused():
    """The graph kept running a forward hook removed after compile, and ignored one added
    (on a child, or globally)."""
    mesh = wb.Mesh.grid((2,), ("dp",))
    x = wb.shard_tensor(torch.randn(4, 6), mesh, [S(0)])
    torch.manual_seed(0)
    m = wb.parallelize(nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 6)), mesh, {})
    h = m[0].register_forward_hook(lambda mod, a, out: out * 2)
    prog = wb.compile(m, x)
    torch.testing.assert_close(prog(x).full(), m(x).full())        # the hook is in the graph
    h.remove()
    with pytest.raises(ValueError, match="hooks added or removed since capture on '0'"):
        prog(x)
    prog = wb.compile(m, x)
    h = nn.modules.module.register_module_forward_hook(lambda mod, a, out: None)
    try:
        with pytest.raises(ValueError, match="global module hooks"):
            prog(x)
    finally:
        h.remove()
    torch.testing.assert_close(prog(x).full(), m(x).full())


# ---- expert parallelism: one device's MoE layer --------------------------------------------

def _moe_layer(arch="llama", **kw):
    cfg = get_config("tiny" if arch == "llama" else "gpt-tiny", d_model=16, n_head=2, d_ff=24,
                     **{"moe_experts": 4, "moe_topk": 2, "moe_aux_loss_coef": 0.1, **kw})
    m = MoE(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m.train()


@pytest.mark.parametrize("arch,edp,ep,B,cf,k", [
    ("llama", 1, 2, 3, None, 2), ("gpt", 1, 2, 1, 0.5, 2),        # a rank with no sequence
    ("llama", 2, 2, 5, 0.5, 1), ("gpt", 1, 4, 3, 1.0, 2), ("llama", 1, 4, 4, 0.5, 1)])
def test_ep_layer_equals_one_device_on_batches_the_ranks_do_not_divide(arch, edp, ep, B, cf,
                                                                       k):
    """Uneven batch shards were refused (NotImplementedError); a batch of one sequence
    over two ranks also had its routes replicated by the router's rule."""
    kw = dict(moe_capacity_factor=cf, moe_topk=k, moe_shared_experts=1)
    ref, m = _moe_layer(arch, **kw), _moe_layer(arch, **kw)
    g = torch.Generator().manual_seed(1)
    x, gy = torch.randn(B, 5, 16, generator=g), torch.randn(B, 5, 16, generator=g)
    xr = x.clone().requires_grad_()
    (ref(xr) * gy).sum().backward()
    mesh = wb.Mesh([[i] for i in range(edp * ep)], ["dp", "tp"])
    m.token_dispatcher = expert_parallel(m.experts, expert_mesh(mesh, ep))
    parallelize(m, mesh, {})
    X = wb.shard_tensor(x, mesh, [S(0), R]).requires_grad_()
    y = m(X)
    (y * wb.shard_tensor(gy, mesh, [S(0), R])).sum().backward()
    torch.testing.assert_close(y.full(), ref(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(X.grad.full(), xr.grad, rtol=1e-5, atol=1e-5)
    for (name, p), (_, q) in zip(ref.named_parameters(), m.named_parameters()):
        torch.testing.assert_close(_full(q.grad), p.grad, rtol=1e-5, atol=1e-5, msg=name)
    assert m.last_stats["dropped"] == ref.last_stats["dropped"]
    assert m.last_stats["aux_loss"] == pytest.approx(ref.last_stats["aux_loss"], rel=1e-5)


@pytest.mark.parametrize("method", ["auto", "trace"])
def test_a_python_argument_is_part_of_the_signature_and_another_mesh_is_named(method):
    """``wb.compile(f, x, 2.0)`` raised IndexError inside export capture; a call with 3.0
    then ran with the 2.0 the graph holds; a call on another mesh failed with "the plan
    was made for another tensor layout"."""
    mesh, other = wb.Mesh.grid((2,), ("dp",)), wb.Mesh.grid((2,), ("tp",))
    x = torch.randn(4, 6)
    xd = wb.shard_tensor(x, mesh, [S(0)])

    def f(t, s):
        return t * s
    prog = wb.compile(f, xd, 2.0, method=method)
    assert not prog.eager
    torch.testing.assert_close(prog(xd, 2.0).full(), x * 2)
    with pytest.raises(ValueError, match="other Python values"):
        prog(xd, 3.0)
    with pytest.raises(ValueError, match="meshes"):
        prog(wb.shard_tensor(x, other, [S(0)]), 2.0)


def test_tensors_inside_a_list_argument_are_not_frozen_into_the_graph():
    """A list of DistTensors was captured as constants: a call with other tensors returned
    the example's sum (3.1 off); now such a program runs eagerly, with the reason."""
    mesh = wb.Mesh.grid((2,), ("dp",))
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)

    def f(ts):
        return ts[0] + ts[1]
    prog = wb.compile(f, [wb.shard_tensor(a, mesh, [S(0)]), wb.shard_tensor(b, mesh, [S(0)])])
    assert prog.eager and "inside a list" in str(prog.breaks[0])
    out = prog([wb.shard_tensor(b, mesh, [S(0)]), wb.shard_tensor(b, mesh, [S(0)])])
    torch.testing.assert_close(out.full(), 2 * b)


@pytest.mark.parametrize("wrapper", ["DistributedDataParallel", "FullyShardedDataParallel"])
def test_a_data_parallel_wrapper_compiles_to_an_eager_program_that_trains(wrapper):
    """Capture froze the wrapped module's parameters as constants (no gradient reached
    them: "element 0 of tensors does not require grad") and left the wrapper unable to run
    eagerly after; now it runs eagerly, named, with one device's steps."""
    mesh = wb.Mesh.grid((2,), ["dp"])
    torch.manual_seed(0)
    m = getattr(wb, wrapper)(nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 2)), mesh)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 2))
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    xd = wb.shard_tensor(x, mesh, [S(0)])
    prog = wb.compile(m, xd)
    assert prog.eager and "not registered on its submodules" in str(prog.breaks[0])
    opt, ropt = torch.optim.SGD(m.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    for _ in range(2):
        opt.zero_grad()
        ropt.zero_grad()
        y, r = prog(xd), ref(x)
        y.sum().backward()
        r.sum().backward()
        opt.step()
        ropt.step()
        torch.testing.assert_close(y.full(), r)


class _Records(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.history = [torch.ones(2)]

    def forward(self, x):
        y = self.lin(x)
        self.history.append(y)
        return y


@pytest.mark.parametrize("method", ["auto", "trace"])
def test_a_forward_that_appends_to_a_module_list_runs_eagerly(method):
    """``self.history.append(y)`` was not repeated by the graph (and left a meta tensor in
    the list after tracing)."""
    mesh = wb.Mesh.grid((2,), ("dp",))
    m = wb.parallelize(_Records(), mesh, {})
    x = wb.shard_tensor(torch.randn(4, 6), mesh, [S(0)])
    prog = wb.compile(m, x, method=method)
    assert prog.eager and "(history)" in str(prog.breaks[0]) and len(m.history) == 1
    prog(x)
    prog(x)
    assert len(m.history) == 3 and m.history[-1].mesh == mesh
