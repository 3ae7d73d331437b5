"""torchtitan's full activation checkpointing, as PyTorch runs it, against the planner.

torchtitan wraps each ``TransformerBlock`` for full AC with ``ptd_checkpoint_wrapper(module,
checkpoint_impl=CheckpointImpl.NO_REENTRANT, checkpoint_fn=checkpoint, use_reentrant=False,
preserve_rng_state=False)`` (pytorch/torchtitan eb6aa6389
``torchtitan/parallelisms/parallelize_llama.py``:73-80; op-level SAC the same wrapper with
its ``context_fn``, :65-72): PyTorch's non-reentrant checkpoint, whose recompute stops as
soon as every tensor the forward saved is back (``torch.utils.checkpoint``: the module
default ``_enable_checkpoint_early_stop = True`` of the 2024 releases; torch 2.13's
``_checkpoint_without_reentrant_generator(..., early_stop=True)``).  A block's last saved
tensors are w2's GEMM inputs (autograd saves an op's inputs before it runs the kernel), so
the w2 GEMM never re-runs.  Measured here by counting the ``aten.mm`` kernels of the
backward of torchtitan's eager block (its model code at eb6aa6389, written out) with and
without the checkpoint; the planner's ``framework="fsdp"`` must re-run what PyTorch re-runs
(``benchmarks/torchtitan_breakdown.py``, "The pairs' relative errors").
"""
import pytest
import torch
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl, checkpoint_wrapper)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

import workbench as wb
from workbench.plan import costs as C
from workbench.plan import llama_layer as L
from workbench.plan import titan_eager as E
from workbench.plan.estimate import layer_for
from workbench.models import op_sac

H, HEADS, KV, FF, S, B = 64, 4, 2, 96, 16, 2       # a small GQA Llama block


class _Block(torch.nn.Module):
    """torchtitan's ``TransformerBlock`` (eb6aa6389 ``torchtitan/models/llama/model.py``):
    RMSNorm, wq / wk / wv, RoPE, repeat_kv, SDPA (causal), wo, RMSNorm, w2(silu(w1) * w3)."""

    def __init__(self):
        super().__init__()
        d = H // HEADS
        self.wq = torch.nn.Linear(H, H, bias=False)
        self.wk = torch.nn.Linear(H, KV * d, bias=False)
        self.wv = torch.nn.Linear(H, KV * d, bias=False)
        self.wo = torch.nn.Linear(H, H, bias=False)
        self.w1 = torch.nn.Linear(H, FF, bias=False)
        self.w2 = torch.nn.Linear(FF, H, bias=False)
        self.w3 = torch.nn.Linear(H, FF, bias=False)
        self.n1 = torch.nn.Parameter(torch.ones(H))
        self.n2 = torch.nn.Parameter(torch.ones(H))
        self.register_buffer("freqs", torch.polar(torch.ones(S, d // 2),
                                                  torch.rand(S, d // 2)))

    def forward(self, x):
        b, s, _ = x.shape
        d = H // HEADS
        n = E._rms_norm(x, self.n1)
        q = self.wq(n).view(b, s, HEADS, d)
        k = self.wk(n).view(b, s, KV, d)
        v = self.wv(n).view(b, s, KV, d)
        q, k, v = E._pre_attention(q, k, v, self.freqs, HEADS // KV)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = x + self.wo(o.transpose(1, 2).contiguous().view(b, s, -1))
        n = E._rms_norm(h, self.n2)
        return h + self.w2(F.silu(self.w1(n)) * self.w3(n))


class _MM(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm)
        return func(*args, **(kwargs or {}))


def _backward_gemms(wrap=None, early_stop=True) -> int:
    """``aten.mm`` kernels one backward of the block runs (``wrap``: torchtitan's AC)."""
    torch.manual_seed(0)
    block = _Block()
    if wrap is not None:
        block = wrap(block)
    x = torch.randn(B, S, H, requires_grad=True)
    with set_checkpoint_early_stop(early_stop):
        y = block(x)
    with _MM() as m:
        y.sum().backward()
    return m.n


def _full(block):       # parallelize_llama.py:73-80 at eb6aa6389
    return checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                              checkpoint_fn=checkpoint, use_reentrant=False,
                              preserve_rng_state=False)


def _op_sac(block):     # :65-72, the policy of op_sac (torchtitan's, every second mm kept)
    return checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                              checkpoint_fn=checkpoint, use_reentrant=False,
                              preserve_rng_state=False, context_fn=op_sac.context_fn)


def _planned_gemms(ops) -> int:
    return sum(op[1] == "matmul" for op in ops)


def _fwd():
    return L.forward_ops(H, HEADS, KV, S, B, 1, False, FF, 2, False)


def test_torchtitan_full_ac_reruns_six_of_seven_gemms_as_planned():
    """Full AC re-runs q, k, v, o, w1, w3, not w2: 6 GEMMs more in the backward; with
    early stop off (``set_checkpoint_early_stop(False)``) 7: the count can tell them apart."""
    plain = _backward_gemms()
    assert plain == 14                          # dgrad + wgrad of the seven linears
    assert _backward_gemms(_full) - plain == 6
    assert _backward_gemms(_full, early_stop=False) - plain == 7
    assert _planned_gemms(L.full_recompute(_fwd())) == 6
    assert "w2_gemm" not in [op[0] for op in L.full_recompute(_fwd())]


def test_torchtitan_op_sac_reruns_k_o_w3_as_planned():
    plain = _backward_gemms()
    assert _backward_gemms(_op_sac) - plain == 3
    rerun = [op[0] for op in L.op_sac_recompute(_fwd()) if op[1] == "matmul"]
    assert rerun == ["k_gemm", "o_gemm", "w3_gemm"]


@pytest.mark.parametrize("framework, early", [("fsdp", True), ("megatron", False),
                                              ("workbench", True)])
def test_estimate_full_recompute_stops_where_the_framework_stops(framework, early):
    """framework="fsdp" (torchtitan: non-reentrant checkpoint) prices the early-stopped
    recompute, as the recipe's; Megatron-LM's CheckpointFunction re-runs the whole forward."""
    cfg = wb.plan.presets.get_config("llama2-7b", seq_len=1024)
    lay = wb.plan.Layout(dp=8, zero=3 if framework != "megatron" else 1, recompute="full",
                         micro_batch=1, framework=framework)
    prof = wb.plan.Cluster("a100", 8).profile
    layer = layer_for(cfg, lay, prof, "flash")
    kw = dict(main_grad=framework != "workbench", split_qkv=framework == "workbench")
    stopped = C.layer_cost(cfg, 1, 1, False, "full", prof, "flash", early_stop=True, **kw)
    whole = C.layer_cost(cfg, 1, 1, False, "full", prof, "flash", **kw)
    assert whole.bwd_compute > stopped.bwd_compute * 1.05     # w2's GEMM is 1/9 of it
    assert layer.bwd_compute == pytest.approx((stopped if early else whole).bwd_compute)


def test_breakdown_pairs_read_the_rows_and_their_terms():
    """``torchtitan_breakdown.pairs``: the ratios are the rows' TPS/GPU (published and
    predicted) and the terms' deltas are per 1,000 tokens of a GPU, row less reference."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), "benchmarks"))
    import torchtitan_breakdown as TB
    out = [TB.breakdown(r) for r in TB.rows()]
    res = TB.pairs(out)
    assert [p["row"] for p in res] == [a for a, _ in TB.PAIRS]
    by = {TB._key(x): x for x in out}
    tps = {k: x["mbs"] * x["m"] * x["seq"] / x["published"] for k, x in by.items()}
    # the published TPS/GPU of the rows (benchmarks/published_torchtitan.py)
    assert tps[("Llama 2 70B", 64, "op", 1)] == pytest.approx(355.0)
    assert tps[("Llama 3.1 8B", 128, "op", 2)] == pytest.approx(5605.0)
    p70, p13, p8 = res
    assert p70["measured"] == pytest.approx(355 / 353)
    assert p13["measured"] == pytest.approx(1904 / 2162)
    assert p8["measured"] == pytest.approx(5605 / 5762)
    x, y = by[p70["row"]], by[p70["reference"]]
    assert p70["predicted"] == pytest.approx(
        (4096 / x["predicted"]) / (8192 / y["predicted"]))
    assert p70["delta"]["copies"] == pytest.approx(
        1e6 * (x["copies"] / 4096 - y["copies"] / 8192))
    # the 13B pair differs in its blocks only (the recompute); the 8B pair not in them
    d13, d8 = p13["delta"], p8["delta"]
    assert d13["blocks"] > 0 and abs(d13["copies"]) < 1e-9 and abs(d13["optimizer"]) < 1e-9
    assert d13["predicted"] == pytest.approx(d13["blocks"] + d13["head_loss"]
                                             + d13["exposed"], abs=1e-6)
    assert abs(d8["blocks"]) < 1e-9 and d8["optimizer"] < 0     # 1/128 of the optimizer
