"""Megatron-LM-v1.1.5-ZeRO3's eager (unfused) softmax, bias-GeLU and bias-dropout-add
(``plan.zero3_2021.unfused_bytes`` / ``unfused_seconds``, ``framework="deepspeed-0.3"``):
the bytes the term adds are what PyTorch's own kernels for the source's lines read and
write (counted under a dispatch mode) less what the planner's layer prices for the fused
kernels (``layer_cost``'s op list), and the estimate charges them for this framework
only."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import workbench as wb
from workbench.plan import zero3_2021 as Z
from workbench.plan.layer_cost import layer_ops
from workbench.sim_mesh.kernel_cost import compute_time

_VIEWS = {"view", "expand", "t", "transpose", "detach", "alias", "_unsafe_view",
          "as_strided", "unsqueeze", "squeeze", "permute", "reshape", "expand_as"}


def _extent(t):
    """Bytes of the distinct elements a (possibly broadcast) view reads."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        n *= size if stride != 0 else 1
    return n * t.element_size()


class _Bytes(TorchDispatchMode):
    """Each ATen kernel run: its name and the bytes it reads (the distinct elements of
    its tensor inputs) and writes (its outputs; an in-place op's mutated input)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name.rstrip("_") not in _VIEWS:
            ins = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
            outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
            self.ops.append((name, sum(_extent(a) for a in ins)
                             + sum(o.numel() * o.element_size() for o in outs)))
        return out


def _cfg(dropout, h=64, a=4, s=32):
    return wb.models.ModelConfig(arch="gpt", vocab_size=512, seq_len=s, d_model=h,
                                 n_layer=2, n_head=a, dropout=dropout, dtype="float32",
                                 tie_embeddings=True)


def _fused(cfg, b):
    """Bytes the planner's layer prices for the fused kernels (layer_cost's ops)."""
    ops = {o.name: o.bytes for o in layer_ops(cfg.d_model, cfg.n_head, cfg.seq_len, b, 1,
                                              dtype=cfg.dtype, dropout=cfg.dropout > 0)}
    return ops


def test_unfused_bytes_are_pytorchs_kernels_less_the_fused_ones():
    # the source's lines (fused_softmax.py:118-128 with gpt2_model.py:31-33,
    # transformer.py:127-132, :422-426) run on small float32 tensors at dropout 0 (ATen's
    # dropout returns its input: the same kernels on CPU and CUDA)
    torch.manual_seed(0)
    b = 2
    cfg = _cfg(0.0)
    s, h, a, f = cfg.seq_len, cfg.d_model, cfg.n_head, cfg.d_ff
    scores = torch.randn(b, a, s, s, requires_grad=True).clone()    # not a leaf
    mask = torch.ones(1, 1, s, s, dtype=torch.bool).triu(1)
    y, bias_f = torch.randn(s, b, f), torch.randn(f)
    x, bias_h, res = torch.randn(s, b, h), torch.randn(h), torch.randn(s, b, h)
    grad = torch.randn(b, a, s, s)
    with _Bytes() as fwd:
        probs = torch.nn.Softmax(dim=-1)(scores.masked_fill_(mask, -10000.0))
        F.gelu(y + bias_f)
        for _ in range(2):      # two bias-dropout-adds a layer
            res + F.dropout(x + bias_h.expand_as(res), p=0.0, training=True)
    with _Bytes() as bwd:
        torch.autograd.backward(probs, grad)
    names = [n for n, _ in fwd.ops]
    assert names == ["masked_fill_", "_softmax", "add", "gelu", "add", "add", "add", "add"]
    assert sorted(n for n, _ in bwd.ops) == ["_softmax_backward_data", "masked_fill"]
    fused = _fused(cfg, b)
    priced_fwd = fused["scale_mask_softmax"] + fused["bias_gelu"] \
        + fused["bias_dropout_add_1"] + fused["bias_dropout_add_2"]
    extra = Z.unfused_bytes(cfg, b)
    assert extra["forward"] == (sum(n for _, n in fwd.ops) - priced_fwd, 6 - 2)
    assert extra["backward"] == (sum(n for _, n in bwd.ops)
                                 - fused["scale_mask_softmax_grad"], 1)
    assert extra["core"] == (fwd.ops[0][1] + fwd.ops[1][1] - fused["scale_mask_softmax"], 1)


def test_dropout_adds_one_intermediate_per_bias_dropout_add():
    # with p > 0 F.dropout writes its own output (CUDA's fused dropout kernel; the mask
    # it writes, the fused kernel writes too): one more T h tensor written and read back
    # in each of the two calls, and one more kernel
    b = 4
    on, off = Z.unfused_bytes(_cfg(0.1), b), Z.unfused_bytes(_cfg(0.0), b)
    cfg = _cfg(0.1)
    T, h, e = cfg.seq_len * b, cfg.d_model, 4
    assert on["forward"][0] - off["forward"][0] == 2 * 2 * e * T * h
    assert on["forward"][1] - off["forward"][1] == 2
    assert on["backward"] == off["backward"]


def test_unfused_seconds_at_the_elementwise_rate_with_recompute():
    prof = wb.plan.Cluster("a100", 8).profile
    cfg = wb.models.ModelConfig(arch="gpt", vocab_size=51200, seq_len=2048, d_model=12288,
                                n_layer=96, n_head=96, dropout=0.1, dtype="float16",
                                tie_embeddings=True)
    x = Z.unfused_bytes(cfg, 4)
    S = 4 * 96 * 2048 * 2048
    assert x["core"][0] == 2 * 2 * S + 2048 * 2048           # masked_fill_: 6.4 GB at mb 4
    fwd = compute_time(0.0, float(x["forward"][0]), prof, "float16", "elementwise",
                       launches=x["forward"][1])
    bwd = compute_time(0.0, float(x["backward"][0]), prof, "float16", "elementwise",
                       launches=x["backward"][1])
    full = Z.unfused_seconds(cfg, 4, prof, "full")
    assert full == pytest.approx({"forward": fwd, "backward": bwd + fwd})
    assert Z.unfused_seconds(cfg, 4, prof, "none") == pytest.approx({"forward": fwd,
                                                                       "backward": bwd})
    sel = Z.unfused_seconds(cfg, 4, prof, "selective")["backward"] - bwd
    assert 0 < sel < fwd
    # GPT 175B at micro-batch 4: 14 ms a layer with full recompute (9.7 GB forward)
    assert x["forward"][0] / 1e9 == pytest.approx(9.66, abs=0.01)
    assert sum(full.values()) == pytest.approx(0.0144, abs=0.0005)


def test_unfused_refuses_bad_arguments():
    prof = wb.plan.Cluster("a100", 8).profile
    cfg = _cfg(0.1)
    with pytest.raises(ValueError, match="micro_batch"):
        Z.unfused_bytes(cfg, 0)
    with pytest.raises(ValueError, match="recompute"):
        Z.unfused_seconds(cfg, 1, prof, "op")
    llama = wb.models.ModelConfig(arch="llama", vocab_size=512, seq_len=32, d_model=64,
                                  n_layer=2, n_head=4, dtype="float32")
    with pytest.raises(ValueError, match="arch"):
        Z.unfused_bytes(llama, 1)
    assert Z.unfused_seconds(llama, 1, prof, "full") == {"forward": 0.0, "backward": 0.0}


def test_estimate_charges_it_for_deepspeed_0_3_only():
    cfg = wb.models.ModelConfig(arch="gpt", vocab_size=51200, seq_len=2048, d_model=4096,
                                n_layer=4, n_head=32, dropout=0.1, dtype="float16",
                                tie_embeddings=True)
    cl = wb.plan.Cluster("a100", 16)
    kw = dict(dp=16, tp=1, pp=1, zero=3, recompute="full", micro_batch=2, global_batch=32)
    old = wb.plan.estimate(cfg, wb.plan.Layout(**kw, framework="deepspeed"), cl)
    new = wb.plan.estimate(cfg, wb.plan.Layout(**kw, framework="deepspeed-0.3"), cl)
    x = Z.unfused_seconds(cfg, 2, cl.profile, "full")
    assert Z.UNFUSED_SOURCE not in old.details["assumptions"]
    assert Z.UNFUSED_SOURCE in new.details["assumptions"]
    lo, ln = old.details["layer"], new.details["layer"]
    assert ln.fwd_compute == pytest.approx(lo.fwd_compute + x["forward"])
    assert ln.bwd_compute == pytest.approx(lo.bwd_compute + x["backward"])


# -- chunks of k layers that do not divide the layers (zero3_2021.check_chunks) --------

def test_chunk_layers_wrap_to_layer_0_as_megatron_v115():
    # transformer.py:949-969 custom(l, l + k), _get_layer_index modulo the layers
    assert Z.chunk_layers(6, 2) == [[0, 1], [2, 3], [4, 5]]
    last = Z.chunk_layers(105, 2)
    assert len(last) == 53 and last[-1] == [104, 0]
    assert Z.chunk_layers(105, 1)[-1] == [104]
    assert Z.chunk_layers(7, 3) == [[0, 1, 2], [3, 4, 5], [6, 0, 1]]
    with pytest.raises(ValueError, match="k=0"):
        Z.chunk_layers(4, 0)


def test_a_layer_in_two_reentrant_chunks_reaches_its_gradient_hook_twice():
    # PyTorch's own behaviour behind DeepSpeed's assert: a reentrant checkpoint's backward
    # is its own torch.autograd.backward call (DeepSpeed checkpointing.py:686, as
    # torch.utils.checkpoint's reentrant variant), so a parameter used in two chunks
    # runs its AccumulateGrad (where stage3.py:1404-1409 hooks the reduction) twice in
    # one backward; used twice inside one chunk, once
    from torch.utils.checkpoint import checkpoint
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 8) for _ in range(3)]
    w = layers[0].weight
    calls = []
    acc = w.expand_as(w).grad_fn.next_functions[0][0]   # kept alive, as self.grad_accs
    acc.register_hook(lambda *a: calls.append(1))

    def chunk(idx):
        def run(x):
            for i in idx:
                x = torch.tanh(layers[i](x))
            return x
        return run

    x = torch.randn(4, 8, requires_grad=True)
    for idx in Z.chunk_layers(3, 2):            # [[0, 1], [2, 0]]
        x = checkpoint(chunk(idx), x, use_reentrant=True)
    x.sum().backward()
    assert len(calls) == 2
    calls.clear()
    y = checkpoint(chunk([0, 1, 2, 0]), torch.randn(4, 8, requires_grad=True),
                   use_reentrant=True)
    y.sum().backward()
    assert len(calls) == 1


def test_deepspeed_0_3_refuses_chunks_that_do_not_divide_the_layers():
    cfg = wb.models.ModelConfig(arch="gpt", vocab_size=51200, seq_len=2048, d_model=4096,
                                n_layer=5, n_head=32, dropout=0.1, dtype="float16",
                                tie_embeddings=True)
    cl = wb.plan.Cluster("a100", 16)
    lay = wb.plan.Layout(dp=16, zero=3, recompute="full", micro_batch=1, global_batch=16,
                         framework="deepspeed-0.3", recompute_num_layers=2)
    with pytest.raises(ValueError, match=r"recompute_num_layers=2 does not divide the 5 "
                                         r"layers.*\[0\].*Multiple gradient reduction"):
        wb.plan.estimate(cfg, lay, cl)
    with pytest.raises(ValueError, match="divide"):
        Z.check_chunks(cfg, lay)
    Z.check_chunks(cfg, lay.replace(recompute_num_layers=1))
    Z.check_chunks(cfg.replace(n_layer=6), lay)
    assert wb.plan.estimate(cfg, lay.replace(recompute_num_layers=1), cl).step_time > 0
    # today's DeepSpeed (framework="deepspeed") is not refused by this rule
    assert wb.plan.estimate(cfg, lay.replace(framework="deepspeed"), cl).step_time > 0
