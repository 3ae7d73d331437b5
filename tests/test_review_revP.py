"""Review of the z3tp / tpoptstate merges (ZeRO-3 / FSDP over DistTensors beside tensor
parallelism), held to a plain single-device torch model: freezing a parameter through
the module's attribute after a forward, and ``.data =`` on the module's parameter."""
import pytest
import torch

import workbench as wb
from tests.test_z3tp import assert_reads, data, reference, step, wrapped


@pytest.mark.parametrize("kind,dims", [("fsdp", (2, 2)), ("fsdp", (3, 2)), ("zero3", (2, 2))],
                         ids=["dp2-tp2", "dp3-tp2-padded", "zero3-dp2-tp2"])
def test_freezing_the_modules_attribute_after_a_forward_freezes_the_shard(kind, dims):
    # after a forward model[0].bias is the copy the forward gathered (until the next
    # one): requires_grad_(False) on it left the shard training (the bias went on
    # moving, every later value off torch's)
    model, w, opt, mesh, pl = wrapped(kind, dims)
    ref, ropt = reference()
    step(w, opt, mesh, pl, ref, ropt, 0)
    model[0].bias.requires_grad_(False)
    ref[0].bias.requires_grad_(False)
    assert [p.requires_grad for p in w.parameters()] == [True, False, True, True]
    assert [p.requires_grad for p in model.parameters()] == [True, False, True, True]
    frozen = ref[0].bias.detach().clone()
    for k in (1, 2):
        step(w, opt, mesh, pl, ref, ropt, k)
        assert_reads(model, ref, f"frozen bias, step {k + 1}")
    torch.testing.assert_close(ref[0].bias.detach(), frozen)
    if opt is None:
        return
    sd, rsd = opt.state_dict(), ropt.state_dict()
    for i, st in rsd["state"].items():
        for key, v in st.items():
            torch.testing.assert_close(sd["state"][i][key], v, msg=f"{i} {key}")


@pytest.mark.parametrize("via", ["named_parameters", "attribute after forward"])
def test_assigning_data_to_the_modules_parameter_raises_and_changes_nothing(via):
    # model.<p>.data = ... replaced the template's storage only: the module's
    # parameters read the new values while the shards (forward, state_dict, optimizer)
    # kept the old ones, silently
    model, w, opt, mesh, pl = wrapped("fsdp")
    ref, ropt = reference()
    if via != "named_parameters":
        step(w, opt, mesh, pl, ref, ropt, 0)
    p = dict(model.named_parameters())["0.weight"] if via == "named_parameters" \
        else model[0].weight
    with pytest.raises(RuntimeError, match=r"DistTensor\.data = .*shards.*load_state_dict"):
        with torch.no_grad():
            p.data = p.data * 2
    assert_reads(model, ref, "after the refused assignment")
    step(w, opt, mesh, pl, ref, ropt, 3)
    assert_reads(model, ref, "and a step")


@pytest.mark.parametrize("dims", [(2, 2), (3, 2)], ids=["dp2-tp2", "dp3-tp2-padded"])
def test_writing_the_attributes_data_after_a_forward_reaches_the_shards(dims):
    # model[0].weight.data.mul_(2) after a forward (the attribute: the gathered copy, a
    # stride-0 expand that .data cloned) wrote a throwaway clone: the training and every
    # read kept the old values.  Through named_parameters() it already worked.
    model, w, opt, mesh, pl = wrapped("fsdp", dims)
    ref, ropt = reference()
    step(w, opt, mesh, pl, ref, ropt, 0)
    with torch.no_grad():
        model[0].weight.data.mul_(2)
        ref[0].weight.data.mul_(2)
    assert_reads(model, ref, "after .data.mul_")
    for k in (1, 2):
        step(w, opt, mesh, pl, ref, ropt, k)
        assert_reads(model, ref, f"and step {k + 1}")


def test_fully_shard_attribute_outside_forward_frozen_freezes_the_shard():
    # fully_shard after TP: module.weight read outside a forward is a fresh gathered
    # clone; requires_grad_(False) on it froze the clone only (the shard trained on:
    # blocks.0.up.weight off torch's at the next step, every parameter after two)
    from tests.test_audit_tp_fsdp import _loss
    from tests.test_fully_shard import batches, tp_model, wrap_tp_fsdp
    mesh = wb.Mesh.grid((2, 2), ["dp", "tp"])
    m, ref = wrap_tp_fsdp(tp_model(), mesh), tp_model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for k, (ids, y) in enumerate(batches(k=3)):
        for model, o, me in ((m, opt, mesh), (ref, ropt, None)):
            o.zero_grad()
            _loss(model, me, ids, y).backward()
            o.step()
        if k == 0:
            m.blocks[0].up.weight.requires_grad_(False)
            ref.blocks[0].up.weight.requires_grad_(False)
            assert not dict(m.named_parameters())["blocks.0.up.weight"].requires_grad
        want = dict(ref.named_parameters())
        for n, p in m.named_parameters():
            torch.testing.assert_close(p.full_tensor(), want[n].detach(), msg=f"{k} {n}")


def test_clipping_the_attributes_after_a_forward_clips_the_shards():
    # clip_grad_norm_ over [model[0].weight, ...] after a backward (the gathered copies,
    # which hold no gradient) returned 0 and clipped nothing; then it raised, as the
    # templates (model.parameters()) did.  torch clips the module's gradients: now both
    # clip the shards (habits4), as clip_grad_norm_(fsdp.parameters()) does.
    from tests.test_audit_tp_fsdp import _loss
    from tests.test_fully_shard import batches, tp_model, wrap_tp_fsdp
    model, w, opt, mesh, pl = wrapped("fsdp")
    x, y = data(0)
    ((w(wb.shard_tensor(x, mesh, pl)) - wb.shard_tensor(y, mesh, pl)) ** 2).mean().backward()
    w.finish_gradient_synchronization()
    before = [p.grad.clone() for p in w.parameters()]
    total = torch.nn.utils.get_total_norm(before)
    attrs = [model[0].weight, model[0].bias, model[2].weight, model[2].bias]
    for ps in (attrs, model.parameters()):
        torch.testing.assert_close(torch.nn.utils.clip_grad_norm_(ps, 1e9), total)
    assert all(torch.equal(p.grad, b) for p, b in zip(w.parameters(), before))
    torch.nn.utils.clip_grad_norm_(attrs, total.item() / 2)
    for p, b in zip(w.parameters(), before):     # the storages (habits10: torch.testing
        torch.testing.assert_close(                 # reads p.grad as the module's)
            p.grad.as_subclass(torch.Tensor),
            (b * (total.item() / 2) / (total + 1e-6)).as_subclass(torch.Tensor))
    # fully_shard after TP: an attribute read outside the forward
    fmesh = wb.Mesh.grid((2, 2), ["dp", "tp"])
    m = wrap_tp_fsdp(tp_model(), fmesh)
    ids, yy = next(iter(batches(k=1)))
    _loss(m, fmesh, ids, yy).backward()
    # (it raised, naming model.parameters()): the attribute clips its own shard
    shard = dict(m.named_parameters())["blocks.0.up.weight"]
    torch.testing.assert_close(torch.nn.utils.clip_grad_norm_([m.blocks[0].up.weight], 1e9),
                               torch.nn.utils.clip_grad_norm_([shard], 1e9))


@pytest.mark.slow
def test_torchrun_2x2_fsdp_data_writes_raise_and_freezing_the_attribute_freezes(tmp_path_factory):
    # under torch.distributed the template has its own storage and a step sets the
    # module's attribute to a fresh gathered clone: model.<p>.data.mul_(2) (through
    # named_parameters or the attribute) was silently lost (blocks.0.up.weight 0.457 off
    # one device's after the next step), and requires_grad_(False) on the attribute
    # froze the clone only (the weight 0.0101 off).  Now the write raises, the freeze
    # reaches the shard.
    from tests.torchrun_support import json_rows, tp_2x2
    out, text = tp_2x2(tmp_path_factory, "review_revP_check.py")      # one launch: the 2 x 2 checks
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {r["how"]: r["result"] for r in json_rows(text)}
    assert list(rows) == ["named", "attribute", "freeze attribute"]
    for how in ("named", "attribute"):
        assert isinstance(rows[how], str) and rows[how].startswith("raised: mul_: ") and \
            "would not reach the shards" in rows[how], rows[how]
    assert rows["freeze attribute"] == {}
