"""One layer with EP and CP priced op by op (:func:`layer_cost`, :func:`layer_detail`): the
dense block's kernels at s / cp tokens (:func:`token_cfg`), the MoE's ops on their
groups (:func:`_price_moe`, :func:`_whole_sequences`), cached per small layout
(:func:`_layer` of :func:`_mini`).  "Module docstring" below: :mod:`.ep_cp`'s."""
from __future__ import annotations

from functools import lru_cache

from ..sim_mesh import cost as _cost
from ..sim_mesh.cost import wire_bytes
from . import context_cost as X
from . import costs as C
from . import moe_cost as M
from .ep_cp_attention import _a2a_rows, _op_sac_ring


def token_cfg(model, lay):
    """The model at the sequence one rank holds (s / cp)."""
    return X.token_cfg(model, lay.cp)


def _groups(lay):
    tp, cp = lay.tp, lay.cp
    return {"tp": tuple(range(tp)), "ep": tuple(tp * cp * d for d in range(lay.ep)),
            "cp": tuple(tp * c for c in range(cp))}


def _whole_sequences(tcfg, lay, e, fwd, bwd):
    """The model's own dispatch under context parallelism takes whole sequences
    (``moe_cost.dense_groups``; ``recipes.moe.keep_sequence_order``): where cp divides
    the micro-batch, an all-to-all over cp into the layer (the batch sharded instead of
    the sequence) and one out, each mirrored in backward; else an all-gather into it (the
    layer replicated over cp), a local split out, and in backward an all-gather of the
    output's gradient (the split's transpose), as the runtime's reshards record them."""
    b, h = lay.micro_batch, tcfg.d_model
    shard = e * b * tcfg.seq_len * h                  # the rank's (b, s / cp, h) input
    if b % lay.cp == 0:
        return ([("cp_to_sequences", "all_to_all", shard, "cp"), *fwd,
                 ("cp_from_sequences", "all_to_all", shard, "cp")],
                [("cp_from_sequences_grad", "all_to_all", shard, "cp"), *bwd,
                 ("cp_to_sequences_grad", "all_to_all", shard, "cp")])
    whole = shard * lay.cp
    return ([("cp_gather_sequences", "all_gather", whole, "cp"), *fwd],
            [("cp_split_sequences_grad", "all_gather", whole, "cp"), *bwd])


def _regathers(model, lay) -> bool:
    """A sequence-parallel input re-gathered in backward: all but torchtitan's dense block
    (``framework="fsdp"``: DTensor keeps the gathered input, ``llama_layer.backward_ops``;
    a MoE block's attention alike; its MLP's ops are ``moe_cost``'s)."""
    from .memory import _regather
    return _regather(model, lay)


def _mini(lay):
    """The fields a layer's price depends on, as a small hashable layout."""
    from .layout import Layout
    return Layout(dp=lay.ep, tp=lay.tp, sp=lay.sp, recompute=lay.recompute,
                  micro_batch=lay.micro_batch, ep=lay.ep, cp=lay.cp, cp_comm=lay.cp_comm,
                  framework="workbench" if lay.engine == "workbench" else None)


def _price_moe(ops, phase, lay, prof, dt, dense=False):
    """Price ``moe_cost``'s tuples: a list of (name, phase, kind or class, seconds, bytes
    sent, is_collective).  ``dense``: the model's own dispatch, whose batched matmuls
    are one kernel each (``moe_cost.dense_dispatch``)."""
    groups, out = _groups(lay), []
    for op in ops:
        if op[1] in _cost.KINDS:
            name, kind, nbytes, g = op
            ranks = groups[g]
            if len(ranks) == 1:
                continue
            out.append((name, phase, kind, C.group_price(kind, nbytes, ranks, prof),
                        wire_bytes(kind, int(nbytes), len(ranks)), True))
        else:
            name, cls, flops, nbytes, launches = op[:5]
            gemm = op[5] if len(op) > 5 else None
            if lay.framework == "workbench" and cls == "matmul" and gemm and gemm[0] > 1 \
                    and not dense:
                # this library's experts (models.moe): one GEMM per local expert, each at
                # its own shape's rate, as the runtime's clock prices them
                # (strategies.expert_parallel_clock), where a grouped GEMM runs them as one
                k, one = gemm[0], (1,) + tuple(gemm[1:])
                t = k * _cost.compute_time(flops / k, nbytes / k, prof, dt, cls, 0, None, one) \
                    + _cost.compute_time(0, 0, prof, dt, cls, launches)
            else:
                t = _cost.compute_time(flops, nbytes, prof, dt, cls, launches, None, gemm)
            out.append((name, phase, cls, t, 0, False))
    return out


@lru_cache(maxsize=4096)
def _layer(model, lay, prof, attention, fp8, regather=True):
    from .layer_cost import layer_ops
    tcfg = token_cfg(model, lay)
    moe = M.moe_of(model)
    llama = model.arch == "llama"
    extra = dict(kv_heads=model.n_kv_head, dropout=model.dropout > 0) if llama else \
        dict(dropout=model.dropout > 0)
    # this library's recompute by PyTorch's non-reentrant checkpoint stops early
    # (``layer_cost.layer_ops``), as ``estimate.layer_for`` prices it without cp; was
    # left out here: the whole forward re-run (GPT dp 2 cp 4 ZeRO-3 "full": dry run /
    # estimate 0.938, tests/test_zerocp5.py)
    if lay.engine == "workbench" and not moe:
        extra["early_stop"] = True
    if lay.engine == "workbench":
        # the recipe's weight gradients written in 16 bits (param.grad), not accumulated
        # into Megatron-LM's fp32 main_grad; the GPT's wq, wk, wv apart (as
        # ``estimate.layer_for`` prices them without cp or ep).  Was left out here: each
        # wgrad read and wrote an fp32 main_grad (w1's at cp 4, 256 tokens a rank: 14.9 us
        # where the dry run's trace shows 6.7; Llama dp 2 cp 4: dry run / estimate 0.979)
        extra.update(main_grad=False, split_qkv=not llama)
    ops = layer_ops(model.d_model, model.n_head, tcfg.seq_len, lay.micro_batch, lay.tp,
                    lay.sp, lay.recompute, model.d_ff, model.dtype, prof,
                    list(range(lay.tp)), attention, fp8, regather=regather, **extra)
    rows = []
    for o in ops:
        if moe is not None and o.name in M.MLP_OPS:
            continue
        coll = o.op_class in _cost.KINDS
        rows.append((o.name, o.phase, o.op_class, o.exposed,
                     wire_bytes(o.op_class, int(o.bytes), lay.tp) if coll else 0, coll))
    if moe is not None:
        e = tcfg.torch_dtype.itemsize
        groups = M.dense_groups(tcfg, lay)
        dense = groups is not None
        mcfg, mb = (tcfg, lay.micro_batch) if not dense else \
            (tcfg.replace(seq_len=groups[1]), groups[0])
        fwd = M.forward_ops(mcfg, mb, lay.tp, lay.ep, e, lay.sp, dense)
        bwd = M.backward_ops(mcfg, mb, lay.tp, lay.ep, e, lay.sp, dense,
                             main_grad=lay.engine != "workbench")   # the recipe: 16-bit
        if dense and lay.cp > 1:
            fwd, bwd = _whole_sequences(tcfg, lay, e, fwd, bwd)
        rows += _price_moe(fwd, "forward", lay, prof, tcfg.dtype, dense)
        if lay.recompute == "full":
            rows += _price_moe(fwd, "recompute", lay, prof, tcfg.dtype, dense)
        rows += _price_moe(bwd, "backward", lay, prof, tcfg.dtype, dense)
    ring = None
    if lay.cp > 1 and lay.cp_comm == "a2a":
        rows = _a2a_rows(model, lay, prof, attention, fp8, regather, extra, ops, rows)
    elif lay.cp > 1:
        ring = X.ring_times(model, lay, prof)
        for phase in [o.phase for o in ops if o.name == "flash_attention"]:
            rows.append(("cp_ring_attention", phase, "attention",
                         ring.forward - ring.forward_exposed_comm, 0, False))
            rows.append(("cp_ring_kv_exposed", phase, "send_recv", ring.forward_exposed_comm,
                         ring.sent_forward, True))
        rows.append(("cp_ring_attention_grad", "backward", "attention",
                     ring.backward - ring.backward_exposed_comm, 0, False))
        rows.append(("cp_ring_kv_grad_exposed", "backward", "send_recv",
                     ring.backward_exposed_comm, ring.sent_backward, True))
        rows += _op_sac_ring(lay, ring, prof)
    return tuple(rows), ring


def layer_cost(model, lay, prof, attention, fp8=False) -> "C.LayerCost":
    """One layer, one micro-batch, one rank, with EP and CP (module docstring)."""
    # torchtitan (FSDP2 + DTensor TP) keeps the gathered input: no backward re-gather
    rows, _ = _layer(model, _mini(lay), prof, attention, fp8, _regathers(model, lay))

    def total(phases, coll):
        return sum(r[3] for r in rows if (r[1] in phases) and r[5] == coll)

    return C.LayerCost(total(("forward",), False), total(("forward",), True),
                       total(("recompute", "backward"), False),
                       total(("recompute", "backward"), True), sum(r[4] for r in rows))


def layer_detail(model, lay, prof, attention, fp8=False) -> dict:
    """The MoE's all-to-alls and TP collectives and the ring, per layer and micro-batch:
    what ``Estimate.explain`` prints (seconds, bytes one rank sends)."""
    mini = _mini(lay)
    rows, ring = _layer(model, mini, prof, attention, fp8, _regathers(model, lay))
    a2a = [r for r in rows if r[2] == "all_to_all" and not r[0].startswith("cp_")]
    out = {"a2a_seconds": sum(r[3] for r in a2a), "a2a_bytes": sum(r[4] for r in a2a),
           "a2a_count": len(a2a), "ring": ring}
    if lay.cp > 1 and lay.cp_comm == "a2a":
        out["cp_a2a"] = X.a2a_times(model, mini, prof)
    if M.moe_of(model) is not None:
        ranks = _groups(mini)["ep"]
        out["ep_ranks"] = ranks
        out["ep_link"] = ("inside one node" if len(ranks) == 1 or
                          _cost.link_for(list(ranks), prof) is prof.intra_node
                          else "across nodes")
    return out
