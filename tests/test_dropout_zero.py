"""Dropout at p = 0 (and in eval) is the identity: ATen's ``dropout`` returns its input
(aten/src/ATen/native/Dropout.cpp, ``_dropout_impl``: ``if (p == 0 || !train ||
input.sym_numel() == 0) return input;``; the fused ``native_dropout`` only for 0 < p < 1),
so no kernel runs.  The op table priced it as an element-wise kernel forward and backward
(2.2 us each on the dry run's trace of a 1024-wide GPT), and the planner's GPT layer priced
the residual branches' dropout gradient kernels whatever p; both now price none at p = 0.
Measured (dry run / estimate, GPT 2 layers, h 1024, a100): dp 2 full recompute ZeRO-0
1.001 -> 0.996 and ZeRO-3 -> 0.998 (with p = 0.1: 1.0006 before and after)."""
import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from workbench.plan.layer_cost import layer_ops


@pytest.mark.parametrize("p,training", [(0.0, True), (0.3, False)])
def test_identity_dropout_runs_no_kernel(p, training):
    mesh = wb.Mesh.grid(2, ["dp"])
    x = wb.shard_tensor(torch.randn(4, 8, generator=torch.Generator().manual_seed(0)),
                        mesh, [wb.Shard(0)])
    x.requires_grad_(True)
    with wb.trace("a100") as tr:
        y = F.dropout(x, p, training)
        y.sum().backward()
    assert not [e for e in tr.events if e.name == "dropout"]
    torch.testing.assert_close(y.full(), x.full())
    torch.testing.assert_close(x.grad.full(), torch.ones(4, 8))


def test_dropout_with_p_runs_its_kernel_forward_and_backward():
    mesh = wb.Mesh.grid(2, ["dp"])
    x = wb.shard_tensor(torch.randn(4, 8, generator=torch.Generator().manual_seed(0)),
                        mesh, [wb.Shard(0)])
    x.requires_grad_(True)
    torch.manual_seed(0)
    with wb.trace("a100") as tr:
        F.dropout(x, 0.5, True).sum().backward()
    drops = [e for e in tr.events if e.name == "dropout" and 0 in e.ranks]
    assert sorted(e.label for e in drops) == ["backward", "forward"]
    assert all(e.duration > 0 for e in drops)


def test_the_gpt_layer_prices_dropout_kernels_only_with_dropout():
    kw = dict(h=1024, a=16, s=1024, b=1, tp=1, attention="flash")
    on, off, default = (layer_ops(**kw, dropout=d) for d in (True, False, None))
    names = lambda ops: [o.name for o in ops]
    assert names(default) == names(on)                       # Megatron's default: 0.1
    gone = set(names(on)) - set(names(off))
    assert gone == {"bias_dropout_add_1_grad", "bias_dropout_add_2_grad"}
    fwd = lambda ops, n: next(o for o in ops if o.name == n and o.phase == "forward")
    # the forward kernel stays (bias + residual), without the one-byte mask it wrote
    assert fwd(on, "bias_dropout_add_1").bytes - fwd(off, "bias_dropout_add_1").bytes == 1024 * 1024
    # a Llama block's default stays without dropout
    ll = dict(kw, kv_heads=4)
    assert names(layer_ops(**ll)) == names(layer_ops(**ll, dropout=False))


def test_the_cp_layer_prices_the_recipes_16_bit_weight_gradients():
    """``ep_cp._layer`` for framework="workbench": the weight gradients written in 16 bits
    (param.grad), as ``estimate.layer_for`` prices the recipe without cp; Megatron-LM
    accumulates them into an fp32 main_grad."""
    from workbench.models.config import get_config
    from workbench.plan import Cluster, Layout, ep_cp
    cfg = get_config("llama2-7b", n_layer=2, d_model=1024, n_head=16, n_kv_head=4,
                     d_ff=2816, seq_len=1024)
    prof = Cluster("a100", 8).profile
    rows = {}
    for fw in ("workbench", "megatron"):
        lay = Layout(framework=fw, dp=2, cp=4, global_batch=4)
        got, _ = ep_cp._layer(cfg, ep_cp._mini(lay), prof, "flash", False,
                              ep_cp._regathers(cfg, lay))
        rows[fw] = {r[0]: r[3] for r in got if r[1] == "backward"}
    s = 1024 // 4
    want = {fw: layer_ops(1024, 16, s, 1, 1, ffn=2816, kv_heads=4, attention="flash",
                          main_grad=fw == "megatron", dropout=False) for fw in rows}
    for fw in rows:
        w2 = next(o.exposed for o in want[fw] if o.name == "w2_wgrad")
        assert rows[fw]["w2_wgrad"] == pytest.approx(w2)
    assert rows["workbench"]["w2_wgrad"] < rows["megatron"]["w2_wgrad"] / 2
