"""Items left by earlier sessions (fixlist7): each test failed before its fix."""
import pytest
import torch

import workbench as wb


# ---- 1. Hybrid exposes sequence parallelism's ``regather`` ---------------------------------

def _hybrid_sp_step(regather, seq, **kw):
    """One forward/backward of Hybrid(tp=2, sp=True) on a batch ``seq`` tokens long; the
    gradients (by name, gathered) and the loss."""
    from workbench.models.config import get_config
    from workbench.models.data import get_batch
    from workbench.recipes.hybrid import Hybrid

    cfg = get_config("tiny", vocab_size=128, dropout=0.0, n_layer=1)
    h = Hybrid(tp=2, sp=True, regather=regather, **kw)
    h.check(cfg, 2)
    torch.manual_seed(0)
    model = h.build_model(cfg, 0)
    x, y = get_batch(cfg, 2, 0, 0)
    opts = h.build_optimizer(model, 1e-3, 0.0)
    loss = h.forward_backward(model, x[:, :seq], y[:, :seq])
    h.finish_gradient_synchronization(opts)     # the sp norms' partial gradients summed
    grads = {n: (p.grad.full() if hasattr(p.grad, "full") else p.grad).clone()
             for n, p in model.named_parameters() if p.grad is not None}
    return loss, grads


def test_hybrid_regather_false_runs_an_uneven_sequence_the_error_told_to():
    """A 7-token batch on tp=2 with sp (shards 4, 3): the re-gather refuses uneven shards,
    and its error told a Hybrid user to 'pass regather=False', which Hybrid did not take
    (TypeError: unexpected keyword).  Now Hybrid(regather=False) runs it, its gradients
    equal those of a model that keeps the default on an even batch... held to one device
    below: the same step on tp=1 (no sp), and the error names Hybrid."""
    from workbench.recipes.hybrid import Hybrid

    with pytest.raises(ValueError, match=r"^Hybrid\(sp=True, regather=True\): the input "
                       r"\(2, 7, 64\).*dim 1 \(7\) over tp=2: 4, 3.*make dim 1 a multiple "
                       r"of 2, or pass regather=False to Hybrid to keep"):
        _hybrid_sp_step(True, 7)
    loss, grads = _hybrid_sp_step(False, 7)
    # one device: the same model and batch with no tp
    from workbench.models.config import get_config
    from workbench.models.data import get_batch
    cfg = get_config("tiny", vocab_size=128, dropout=0.0, n_layer=1)
    h1 = Hybrid()
    h1.check(cfg, 2)
    torch.manual_seed(0)
    m1 = h1.build_model(cfg, 0)
    x, y = get_batch(cfg, 2, 0, 0)
    ref_loss = h1.forward_backward(m1, x[:, :7], y[:, :7])
    torch.testing.assert_close(torch.as_tensor(float(loss)), torch.as_tensor(float(ref_loss)),
                               rtol=1e-5, atol=1e-5)
    ref = {n: (p.grad.full() if hasattr(p.grad, "full") else p.grad)
           for n, p in m1.named_parameters() if p.grad is not None}
    assert grads.keys() == ref.keys()
    for n in ref:
        torch.testing.assert_close(grads[n], ref[n], rtol=1e-4, atol=1e-5, msg=n)


def test_hybrid_regather_default_and_checks():
    """Same name and default as the layer's; a non-bool, or regather=False without sp,
    refused by name."""
    import inspect
    from workbench.parallel.strategies.tensor_parallel import tensor_parallel_region
    from workbench.recipes.context_parallel import ContextParallel
    from workbench.recipes.hybrid import Hybrid

    want = inspect.signature(tensor_parallel_region).parameters["regather"].default
    assert inspect.signature(Hybrid).parameters["regather"].default is want is True
    assert Hybrid(tp=2, sp=True).regather is True
    assert ContextParallel(cp=2, tp=2, sp=True, regather=False).regather is False
    with pytest.raises(TypeError, match=r"Hybrid\(regather=1\): give True or False"):
        Hybrid(tp=2, sp=True, regather=1)
    with pytest.raises(ValueError, match=r"Hybrid\(regather=False\) with sp=False"):
        Hybrid(tp=2, regather=False)


def test_hybrid_regather_false_keeps_the_gathered_input_on_an_even_batch():
    """On an even batch both settings give the same gradients; regather=False records no
    backward re-gather, the default records them (Megatron-LM's)."""
    counts, grads = {}, {}
    for rg in (True, False):
        with wb.trace("a100") as tr:
            _, grads[rg] = _hybrid_sp_step(rg, 8)
        counts[rg] = sum(e.label == "f: re-gather" for e in tr.events)
    assert counts[False] == 0 < counts[True]
    for n in grads[True]:
        torch.testing.assert_close(grads[False][n], grads[True][n], rtol=1e-5, atol=1e-6)


def test_tensor_parallel_region_error_names_its_own_entry_point():
    """Called directly, the layer's error names tensor_parallel_region, whose regather
    the caller sets (was megatron_f, which the caller never called); megatron_f called
    directly still names itself."""
    from workbench.models.gpt import GPTLayer, TP_PLAN
    from workbench.parallel.strategies.tensor_parallel import (megatron_f,
                                                               tensor_parallel_region)

    mesh = wb.Mesh.grid((1, 2), ["dp", "tp"])
    torch.manual_seed(0)
    layer = GPTLayer(16, 4, dropout=0.0, dtype=torch.float32)
    wb.parallelize(layer, mesh, TP_PLAN, mesh_dim="tp")
    for m in (layer.attn, layer.mlp):
        tensor_parallel_region(m, mesh, "tp", sp=True, seq_dim=0)
    X = torch.randn(7, 2, 16, generator=torch.Generator().manual_seed(0))
    x = wb.shard_tensor(X, mesh, [wb.Replicate(), wb.Shard(0)])
    with pytest.raises(ValueError, match=r"^tensor_parallel_region\(sp=True, regather=True\)"
                       r".*pass regather=False to tensor_parallel_region to keep"):
        layer(x)
    with pytest.raises(ValueError, match=r"^megatron_f\(sp=True, regather=True\)"
                       r".*pass regather=False to megatron_f to keep"):
        megatron_f(x, 1, sp=True, seq_dim=0)


# ---- 2. fully_shard over DistTensors, then init before the first forward (torchtitan) ----

def _tp_fully_shard():
    from tests.test_fully_shard import tp_model, wrap_tp_fsdp
    mesh = wb.Mesh.grid((2, 2), ["dp", "tp"])
    return wrap_tp_fsdp(tp_model(), mesh), tp_model(), mesh


def _init(mod):                 # torchtitan's init_weights habit, through model.apply
    if isinstance(mod, torch.nn.Linear):
        torch.nn.init.normal_(mod.weight, std=0.3)
        if mod.bias is not None:
            torch.nn.init.zeros_(mod.bias)
    elif isinstance(mod, torch.nn.Embedding):
        torch.nn.init.normal_(mod.weight, std=1.0)


def _trains_as_one_device(m, ref, mesh, steps=2):
    """The first forwards' losses and the optimizer's steps: one device's."""
    from tests.test_audit_tp_fsdp import _loss
    from tests.test_fully_shard import batches
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for ids, y in batches(k=steps):
        got, want = _loss(m, mesh, ids, y), _loss(ref, None, ids, y)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for o, loss in ((opt, got), (ropt, want)):
            o.zero_grad()
            loss.backward()
            o.step()
    sd = m.state_dict()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(sd[n].full(), p.detach(), rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("how", ["apply", "reset_parameters", "params_copy", "data_copy"])
def test_init_after_fully_shard_before_the_first_forward_is_one_devices(how):
    """torchtitan's order: fully_shard, then init, then the optimizer and the first
    forward.  model.apply(init), reset_parameters (read through the attributes) and
    p.copy_(t) over named_parameters() already reached the shards; p.data.copy_(t) (t of
    the module's shape) failed before with torch's broadcasting error ('The size of
    tensor a (40) must match the size of tensor b (8)'): torch's .data is a plain tensor
    of the flat chunks' shape, outside the parameter's guards."""
    from tests.test_fully_shard import tp_model
    m, ref, mesh = _tp_fully_shard()
    src = tp_model(3).state_dict()
    for model in (m, ref):
        torch.manual_seed(5)
        if how == "apply":
            model.apply(_init)
        elif how == "reset_parameters":
            for mod in model.modules():
                if hasattr(mod, "reset_parameters"):
                    mod.reset_parameters()
        elif how == "params_copy":
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(src[n])
        else:
            for n, p in model.named_parameters():
                p.data.copy_(src[n])
    _trains_as_one_device(m, ref, mesh)


def test_random_fill_through_data_raises_instead_of_each_chunk_its_own_draw():
    """p.data.normal_(0, 0.2) over named_parameters() (Hugging Face's _init_weights
    habit): before, each dp rank's flat chunk took its own draw, silently (the model
    then differed from one device's same init by up to 0.95); then it raised as p.normal_
    did; now (habits12) it is one device's draw.  nn.init.normal_(p.data) is one device's
    draw, as nn.init.normal_(p); elementwise writes through .data stay one device's."""
    m, ref, mesh = _tp_fully_shard()
    params = dict(m.named_parameters())
    rparams = dict(ref.named_parameters())
    # habits12: a whole parameter's random fill through .data is one device's draw (was
    # refused here)
    for fill in (lambda t: t.normal_(0.0, 0.2), lambda t: t.uniform_(-0.2, 0.2)):
        for p in (params["blocks.0.up.weight"], rparams["blocks.0.up.weight"]):
            torch.manual_seed(4)
            with torch.no_grad():
                fill(p.data)
        torch.testing.assert_close(params["blocks.0.up.weight"].full_tensor(),
                                   rparams["blocks.0.up.weight"].detach(), rtol=0, atol=0)
    for model in (m, ref):
        torch.manual_seed(5)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith("bias"):
                    p.data.zero_()
                else:
                    torch.nn.init.normal_(p.data, std=0.2)
                p.data.mul_(1.5)
    _trains_as_one_device(m, ref, mesh)


def test_data_of_ddp_rows_keeps_the_guard_too():
    """The same .data alias on DistributedDataParallel's rows (simulated ranks): a random
    fill raised through p but drew each row on its own through p.data; then it raised,
    now (habits12) one device's draw in every row; p.data.copy_(t) of the module's shape
    is every row's."""
    mesh = wb.Mesh.grid(2, ["dp"])
    torch.manual_seed(0)
    ddp = wb.DistributedDataParallel(torch.nn.Linear(6, 4), mesh)
    p = ddp.module.weight
    torch.manual_seed(3)
    with torch.no_grad():
        p.data.uniform_(-1, 1)       # habits12: one device's draw in every row (was refused)
    torch.manual_seed(3)
    assert torch.equal(p.full_tensor(), torch.empty(4, 6).uniform_(-1, 1))
    t = torch.arange(24.0).reshape(4, 6)
    p.data.copy_(t)
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(0))
    ref = torch.nn.Linear(6, 4)
    with torch.no_grad():
        ref.weight.copy_(t)
        ref.bias.copy_(ddp.module.bias.full_tensor())
    out = ddp(wb.shard_tensor(torch.cat([x, x]), mesh, [wb.Shard(0)]))
    out = out.full() if isinstance(out, wb.DistTensor) else out
    torch.testing.assert_close(out[:3], ref(x))


# ---- 3. a unit slip's parenthesis is not split by the wrapping ---------------------------

def _shown(err) -> list:
    import re
    return re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(err._render_traceback_())).splitlines()


def test_unit_slip_parenthesis_stays_on_one_line():
    """check_training_days(7583) (days given in... 1,000 times too many) showed "a unit
    slip? (s, ms, us; B," / "KB, MB, GB): ..." in the notebook; each of _scale_slip's
    parenthesised unit lists now sits whole on one line, whatever text comes before it,
    every line within WIDTH and word for word the message."""
    from workbench.exercises.checks import _scale_slip
    from workbench.exercises.feedback import CheckError, reset_tries
    from workbench.text_width import WIDTH

    reset_tries()
    with pytest.raises(CheckError) as err:
        wb.exercises.check_training_days(7.583e3)
    assert any("(s, ms, us; B, KB, MB, GB):" in line for line in _shown(err.value))
    slips = [_scale_slip(r, 1.0, 1e-6, False) for r in (1e3, 1e-6, 1e9, 2**10, 2**-20)]
    assert all(slips)
    for slip in slips:
        phrase = slip[slip.index("("):slip.index(")") + 2]       # with its ":"
        for k in range(0, 120, 3):                  # the phrase at every place of a line
            e = CheckError("your answer " + "ab " * (k // 3) + "is 12 units: " + slip)
            lines = _shown(e)
            assert max(map(len, lines)) <= WIDTH
            assert " ".join(lines).split() == ("Not yet: " + str(e)).split()
            assert any(phrase in line for line in lines), (k, lines)


def test_keep_parens_leaves_a_phrase_longer_than_a_line_to_break():
    """A parenthesised phrase longer than a continuation line is wrapped at its spaces
    (its inner phrases kept whole), nothing dropped; without keep_parens nothing changes."""
    from workbench.text_width import HANG, WIDTH, wrap
    inner = "(kept as one)"
    text = "x " * 30 + "(" + "word " * 30 + inner + " " + "word " * 10 + ") end"
    out = wrap(text, keep_parens=True)
    assert max(map(len, out.splitlines())) <= WIDTH
    assert out.split() == text.split()
    assert any(inner in line for line in out.splitlines())
    assert wrap(text) == wrap(text, keep_parens=False)
    assert len("(" + "word " * 30) > WIDTH - HANG        # so it had to break


# ---- 5. attention dropout inside cuDNN's fused attention (Megatron-LM's GPT layer) --------

def test_fused_attention_prices_its_dropout_at_the_measured_cudnn_ratio(monkeypatch):
    """Megatron's GPT layer runs attention dropout 0.1 inside the fused kernel; its
    time was priced as the dropout-free kernel's.  Now the h100 profile's cuDNN rate is
    slowed by TransformerEngine #3312's measured 0.614 / 0.594 ms (forward and
    backward); a kernel without dropout, and the FlashAttention-2 rates (no sm90
    measurement with dropout), keep theirs."""
    import dataclasses
    from workbench.plan import layer_cost as L
    from workbench.sim_mesh import kernel_cost as K
    from workbench.sim_mesh.profiles import clear_memos, get_profile

    prof = get_profile("h100")
    assert prof.measured["attention_backend"] == "cudnn"
    fa2 = dataclasses.replace(prof, measured=dict(prof.measured, attention_backend="flash"))
    for backward in (False, True):
        plain = K.AttentionShape(32, 4096, 128, True, backward)
        drop = K.AttentionShape(32, 4096, 128, True, backward, True)
        r0 = K._measured_peak(prof, torch.bfloat16, "attention", 1.0, plain)
        r1 = K._measured_peak(prof, torch.bfloat16, "attention", 1.0, drop)
        assert r0 / r1 == pytest.approx(0.614 / 0.594, rel=1e-12)
        assert K._measured_peak(fa2, torch.bfloat16, "attention", 1.0, plain) == \
            K._measured_peak(fa2, torch.bfloat16, "attention", 1.0, drop)

    def flash_seconds():
        L._priced.cache_clear()
        ops = L.layer_ops(4096, 32, 4096, 1, 1, profile="h100", attention="flash")
        return {o.name: o.seconds for o in ops if o.name.startswith("flash_attention")}
    got = flash_seconds()
    monkeypatch.setattr(K, "CUDNN_DROPOUT_TIME", 1.0)
    clear_memos()                        # the clock's memos hold the measured ratio's prices
    try:
        free = flash_seconds()
    finally:
        L._priced.cache_clear()
        clear_memos()                    # and now the patched ones: not for later tests
    assert set(got) == {"flash_attention", "flash_attention_grad"}
    for name in got:
        assert got[name] / free[name] == pytest.approx(0.614 / 0.594, rel=1e-3), name
