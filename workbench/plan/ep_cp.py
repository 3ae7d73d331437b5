"""Expert (``Layout(ep=)``) and context (``Layout(cp=)``) parallelism in the planner.

The hooks ``layout``, ``estimate``, ``memory`` and ``search`` call; the costs are
``moe_cost`` (a MoE block over ep ranks) and ``context_cost`` (ring attention over cp).

Rank order (Megatron-Core, ``parallel_state.py``'s default "tp-cp-ep-dp-pp"): tensor
parallel innermost, then context parallel, then data parallel, pipeline outermost,

    rank = t + tp (c + cp (d + dp s)),

and the expert-parallel group is ep consecutive data-parallel ranks (stride tp cp), so
an ep group stays in a node while tp cp ep <= the node's devices; its experts' gradients
are reduced over the other dp / ep (x cp) ranks, the expert-data-parallel group
(Megatron-Core's ``expert_data_parallel``), and their optimizer states shard over it.

A layer with EP or CP is priced op by op: the dense block's kernels (``layer_cost.
layer_ops``) at s / cp tokens, its MLP replaced by the MoE's (``moe_cost``, collectives
on the TP group and the EP group's ranks, ``cost.price`` on the topology: inside a node
or across nodes as the ranks fall), plus ring attention beyond the causal block
(``context_cost``).  ZeRO-1 shards the optimizer states over dp x cp (Megatron-Core's
distributed optimizer on its data-parallel group with context parallel), and so does this
library's runtime (``recipes/context_parallel.py``), which also runs ZeRO-2 over dp x cp:
``framework="workbench"`` prices it; and ZeRO-3 over dp x cp (FSDP over the flattened
group, as torchtitan), any dp and recompute (``check_zero_cp``).  Not modeled,
refused with the fix: ZeRO-2/3 with EP, ZeRO-2/3 with CP on another framework
(Megatron-LM's distributed optimizer is ZeRO-1), FP8 or ``overlap_grad_reduce`` with a
MoE, EP over the context-parallel ranks (Megatron-Core's "MoE parallel folding").
A MoE with tp > 1 takes sp (Megatron-Core: experts split over tp), or
``framework="workbench"`` with sp=False (this library's runtime: the MoE MLP whole on
every tp rank; ``moe_cost.mlp_tp``).
"""
from __future__ import annotations

from functools import lru_cache

from ..sim_mesh import cost as _cost
from ..sim_mesh.cost import wire_bytes
from . import context_cost as X
from . import costs as C
from . import moe_cost as M
from .ep_cp_search import CP_MIN_TOKENS, assumptions, candidates, explain_lines, table_notes

__all__ = ["check_fields", "check_zero_cp", "check_layout", "check_estimate", "applies",
           "loss_waits", "shares_zero_stream", "ring_program",
           "token_cfg", "layer_cost", "layer_detail", "expert_states", "expert_sync", "candidates",
           "assumptions", "explain_lines", "table_notes", "CP_MIN_TOKENS"]
# candidates, assumptions, explain_lines, table_notes: plan/ep_cp_search.py



def _int(name, v):
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"Layout: {name}={v!r} must be an int >= 1")


def check_fields(lay) -> None:
    """What ``Layout`` checks of ep and cp without the model."""
    _int("ep", lay.ep)
    _int("cp", lay.cp)
    if lay.cp_comm not in ("p2p", "a2a"):
        raise ValueError(f"Layout: cp_comm={lay.cp_comm!r}; give 'p2p' (ring attention) or "
                         f"'a2a' (DeepSpeed-Ulysses), Megatron-LM's --cp-comm-type names "
                         f"('a2a+p2p' and 'all_gather' are not modeled)")
    if lay.dp % lay.ep:
        raise ValueError(f"Layout: ep={lay.ep} must divide dp={lay.dp}: the expert-parallel "
                         f"group is carved out of the data-parallel ranks; use an ep dividing "
                         f"{lay.dp} or a dp that is a multiple of {lay.ep}")
    own = lay.zero in (2, 3) and lay.ep == 1 and lay.framework == "workbench"
    if (lay.ep > 1 or lay.cp > 1) and lay.zero >= 2 and not own:
        raise ValueError(f"Layout: zero={lay.zero} with ep={lay.ep}, cp={lay.cp} is not "
                         f"modeled (Megatron-LM's distributed optimizer, ZeRO-1, is what runs "
                         f"expert and context parallelism; this library's runtime runs ZeRO-2 "
                         f"and ZeRO-3 over dp x cp: framework='workbench'); use zero<=1"
                         + ("" if lay.ep > 1 else ", or framework='workbench'"))


def check_zero_cp(lay) -> None:
    """What ``estimate`` refuses of ZeRO-2/3 with cp (the layout itself stands: ``dry_run``
    runs it): nothing now; each was refused until the dry run held the estimate to it.
    ZeRO-3 over dp x cp (this library's runtime: ``ContextParallel(zero=3)``, FSDP over
    the flattened dp x cp group as torchtitan's "fsdp" mesh) is priced as the runtime runs
    it (``zero_cost.recipe_blocks`` over the dp x cp ranks; the loss beside the
    backward's prefetch, ``loss_waits``), ZeRO-2 likewise.  At dp >= 2 without
    recompute, "full" or "selective": measured dry run / estimate on
    tests/test_zero3cp.py's blocks, tests/test_cprecomp.py: step 0.946-0.995 (full;
    1.005-1.059 before the runtime's first backward stopped re-gathering w2 / fc2),
    0.961-1.034 (selective), memory total 1.000, activations 1.000-1.017.  At dp = 1
    ZeRO's group is the cp group itself, so the ring's K/V exchange (a collective on the
    cp group, ``parallel/strategies/context_parallel_comm.py`` ``_record``; Ulysses'
    all-to-alls alike) queues behind ZeRO's collectives on that group's one stream:
    priced as the runtime orders them (``ring_program``, ``zero_cost.run_program``;
    0.969-1.025 on tests/test_zerocp3.py's 44 layouts), with recompute its re-run of the
    exchange too (``_recomputed``: ZeRO-2 "full" / "selective", ZeRO-3 "selective"
    0.965-1.017, tests/test_zerocp4.py).

    Lifted last (tests/test_zerocp5.py, a sweep of Llama / GPT x ZeRO 2 / 3 x cp 2 / 4 x
    tp 1 / 2 / 2 + sp x ring / a2a x dp 1 / 2):

    - ZeRO-3 with the Llama's recompute "op" (torchtitan's op-level checkpointing), any
      dp: refused at 1.031-1.069.  What was left was no order of the estimate's but the
      runtime's first backward: a recompute reaching w2 after w2's backward began gathered
      it a second time, queued behind the head's reduce-scatter (~139 us at dp 2 cp 2),
      in the first backward only (``strategies/zero3_clock.py``
      ``_holds_backward_copy``; the dry run runs one micro-batch).  Now 0.984-1.003 at
      dp 2, 0.975-0.992 at dp 1.
    - dp = 1 with "op" (ZeRO-2 and 3; the ring's sends and merges or Ulysses'
      all-to-alls again, the kernels' outputs saved: ``_recomputed``'s ``saved``), and
      ZeRO-3 "full" at dp = 1 (its re-gathered layer runs the recomputed exchange after
      the value projection's re-run: ``zero_cost.recipe_blocks``' ``after_remat``):
      ZeRO-2 op 1.007-1.032, ZeRO-3 op 0.975-0.992, ZeRO-3 full 0.967-0.990 (with full
      recompute's early stop priced with cp, ``_layer``).

    Below 5% still, priced before: GPT dp 2 cp 4 tp 1 ring ZeRO-3 "full" 0.946 (ZeRO-2
    0.954; without recompute 0.982).

    (Full recompute in chunks of k > 1 layers: ``Layout`` refuses it with
    framework='workbench'.)  ``search`` still tries ZeRO-2/3 with cp at dp = 1 without
    recompute only and ZeRO-3 without "op" (``ep_cp_search.candidates``)."""
    return None


def check_layout(model, lay) -> None:
    """What ``check_layout`` checks of ep and cp against the model."""
    moe = M.moe_of(model)
    if moe is None and lay.ep > 1:
        raise ValueError(f"Layout: ep={lay.ep} splits experts, but the model has none "
                         f"(moe_experts=0); use ep=1 or a MoE model "
                         f"(moe_experts=E, moe_topk=k)")
    if moe is not None:
        if moe.experts % lay.ep:
            raise ValueError(f"Layout: ep={lay.ep} does not divide moe_experts={moe.experts} "
                             f"(each expert-parallel rank holds whole experts); use an ep in "
                             f"{[d for d in range(1, moe.experts + 1) if moe.experts % d == 0]}")
        if lay.zero >= 2:
            raise ValueError(f"Layout: zero={lay.zero} with a MoE model is not modeled; use "
                             f"zero<=1 (Megatron-LM's distributed optimizer)")
        if lay.tp > 1 and not lay.sp and lay.engine != "workbench":
            raise ValueError(f"Layout: a MoE model with tp={lay.tp} needs sp=True (Megatron-LM: "
                             f"'When using MoE and tensor parallelism, sequence parallelism "
                             f"must be used'); set sp=True, or framework='workbench' with "
                             f"sp=False for this library's runtime (the MoE MLP whole on "
                             f"every tp rank: plan/moe_cost.py)")
        if lay.tp > 1 and not lay.sp and moe.shared:
            raise ValueError(f"Layout: framework='workbench', tp={lay.tp}, sp=False with "
                             f"moe_shared_experts={moe.shared} is not priced (the runtime keeps "
                             f"the shared experts whole on every tp rank; the planner's layer "
                             f"parameters split them); use moe_shared_experts=0, tp=1, or "
                             f"framework='megatron' with sp=True")
        mt = M.mlp_tp(lay.tp, lay.sp)
        if moe.d_ff % mt or (moe.shared and (moe.shared * moe.d_ff) % mt):
            raise ValueError(f"Layout: tp={lay.tp} must divide the expert width moe_d_ff="
                             f"{moe.d_ff} (experts are tensor-parallel as the dense MLP); "
                             f"choose another tp")
    X.check_cp(model, lay.cp)
    X.check_cp_comm(model, lay)
    # sp with cp: s / cp must divide by tp (layout.check_layout, after this)


def check_estimate(model, lay, attention, fp8, overlap_grad_reduce) -> None:
    """What ``estimate`` refuses of ep and cp (module docstring)."""
    X.check_cp(model, lay.cp, attention, lay.cp_comm)
    check_zero_cp(lay)
    if M.moe_of(model) is not None:
        if fp8:
            raise ValueError("fp8=True with a MoE model is not modeled; use fp8=False")
        if overlap_grad_reduce:
            raise ValueError("overlap_grad_reduce=True with a MoE model is not modeled (its "
                             "expert gradients reduce over their own group); use False")
        if lay.tp > 1 and lay.sp and lay.engine == "workbench":
            # the runtime's MoE block on tp ranks' sequence shards (Hybrid runs it with ep =
            # 1): neither its dispatch over shards nor its reshards are priced, and the dry
            # run refuses it (dryrun_ep_cp.check); was priced as Megatron-Core's experts
            # split over tp, which this runtime does not run
            raise ValueError(f"estimate: framework='workbench' with a MoE model, tp={lay.tp} "
                             f"and sp=True is not priced (this library's runtime keeps the "
                             f"MoE MLP whole on every tp rank; the dry run refuses it too); "
                             f"use sp=False, or framework='megatron' (Megatron-Core's experts "
                             f"split over tp with sequence parallelism)")


def applies(model, lay) -> bool:
    """Whether a layer of ``model`` on ``lay`` needs this module's pricing."""
    return lay.cp > 1 or M.moe_of(model) is not None


def token_cfg(model, lay):
    """The model at the sequence one rank holds (s / cp)."""
    return X.token_cfg(model, lay.cp)


def loss_waits(lay) -> bool:
    """Whether this library's cross-entropy waits for ZeRO-3's backward prefetch: it
    all-reduces its global target count once per mesh dim the targets are sharded on
    (``parallel/ops_table/cross_entropy.py``, ``_cross_entropy_local``: dp, and cp), each
    on that dim's group, and a group's collectives run in order on its own stream
    (``sim_mesh/trace.py``), so the count queues behind the gathers only where one of
    those groups is ZeRO's: dp alone or cp alone.  With dp > 1 and cp > 1 ZeRO runs on
    the flattened dp x cp group (``recipes/context_parallel.py``, ``Zero3Stage`` over
    ("dp", "cp")), another stream: the loss runs beside the gathers (``zero_cost``'s
    ``lead``)."""
    return lay.dp == 1 or lay.cp == 1


def shares_zero_stream(lay) -> bool:
    """Whether ZeRO's collectives and the attention's cp exchange run on one stream: ZeRO
    (2 or 3) over dp x cp ranks with dp = 1 is over the cp group itself (``Layout.
    grad_ranks``; ``recipes/context_parallel.py``), the group the ring's send/recvs
    (``parallel/strategies/context_parallel_comm.py`` ``_record``) and Ulysses' all-to-alls
    run on, and a group's collectives run in issue order on its one stream
    (``sim_mesh/trace.py``, as ``ProcessGroupNCCL``'s one NCCL stream per group)."""
    return lay.cp > 1 and lay.dp == 1 and lay.zero >= 2


def ring_program(model, lay, prof, attention, fp8=False):
    """The attention's cp exchange of one layer and micro-batch as the runtime orders it
    on the stream it shares with ZeRO (``shares_zero_stream``), for
    ``zero_cost.recipe_blocks(ring=)``: a dict of the forward and backward programs
    (``zero_cost.run_program``) and the seconds of ``layer_cost`` they stand for
    (``fwd_compute``, ``fwd_comm``, ``bwd_compute``, ``bwd_comm``), with recompute the
    program its re-run of the attention runs and its seconds (``remat``,
    ``remat_compute``, ``remat_comm``: ``_recomputed``); None where the stream is not
    shared.

    Ring ("p2p", ``strategies.context_parallel._ring_forward``): at each step but the
    last the next K/V block is sent (async) before the step's block is computed, the
    partial output merged, then the send waited for; step 0 is the causal block (the
    layer's ``flash_attention``), steps 1 .. cp-1 half blocks (``context_cost``).
    Backward (``context_parallel_backward``): each step waits for its K/V, sends it on
    again (but the last), computes its block's gradients, waits for the dK/dV that
    arrived, accumulates and sends the sum on; at the end it waits for its own block's.
    Ulysses ("a2a", ``strategies.context_parallel_a2a``): q, k and v each resharded by a
    blocking all-to-all, the kernel over the whole sequence, the output resharded back;
    backward the output gradient's, the kernel's, then dq, dk and dv's.  Each collective
    is queued behind whatever ZeRO's stream holds then (its gathers prefetched, its
    reduce-scatters issued): the wait the dry run showed (module docstring of
    tests/test_zerocp3.py)."""
    if not shares_zero_stream(lay) or lay.engine != "workbench":
        return None
    rows, _ = _layer(model, _mini(lay), prof, attention, fp8, _regathers(model, lay))

    def row(name, phase):
        got = [r[3] for r in rows if r[0] == name and r[1] == phase]
        if len(got) != 1:
            raise AssertionError(f"ring_program: {len(got)} rows {name!r} ({phase}) in the "
                                 f"layer's cost, expected one")
        return got[0]

    cp = lay.cp
    fa, fg = row("flash_attention", "forward"), row("flash_attention_grad", "backward")
    if lay.cp_comm == "a2a":
        ranks = X.ring_ranks(lay)
        q, k, v, o = (C.group_price("all_to_all", n, ranks, prof)
                      for n in X.a2a_times(model, lay, prof).blocks)
        fwd = (("sync", q), ("sync", k), ("sync", v), ("compute", fa), ("sync", o))
        bwd = (("sync", o), ("compute", fg), ("sync", q), ("sync", k), ("sync", v))
        # recompute "op": the kernel's output saved, its four all-to-alls again
        saved = (("sync", q), ("sync", k), ("sync", v), ("sync", o))
        return _recomputed(rows, dict(fwd=fwd, bwd=bwd, fwd_compute=fa,
                    fwd_comm=row("cp_a2a_qkv_o", "forward"), bwd_compute=fg,
                    bwd_comm=row("cp_a2a_qkv_o_grad", "backward")),
                    ("flash_attention",), ("cp_a2a_qkv_o",), saved)
    rt = X.ring_times(model, _mini(lay), prof)
    half_f, merge = rt.half_forward - rt.merge, rt.merge
    half_b, acc = rt.half_backward - rt.accumulate, rt.accumulate
    # recompute "op" (``_op_sac_ring``): the steps' outputs saved, the sends, casts and
    # merges around them run again (``saved``)
    fwd, bwd, saved = [], [], []
    for t in range(cp):
        send = [("async", ("kv", t), rt.hop)] if t < cp - 1 else []
        kernel, rest = (fa, rt.casts / 2) if t == 0 else (half_f, merge)
        wait = [("wait", ("kv", t))] if t < cp - 1 else []
        fwd += send + [("compute", kernel), ("compute", rest)] + wait
        saved += send + [("compute", rest)] + wait
    fwd.append(("compute", rt.casts / 2))          # the merged output cast back
    saved.append(("compute", rt.casts / 2))
    for t in range(cp):
        if t > 0:
            bwd.append(("wait", ("kv", t - 1)))
        if t < cp - 1:
            bwd.append(("async", ("kv", t), rt.hop))
        bwd.append(("compute", fg if t == 0 else half_b))
        if t > 0:
            bwd.append(("wait", ("dkv", t - 1)))
        bwd += [("compute", acc), ("async", ("dkv", t), rt.hop_grad)]
    bwd.append(("wait", ("dkv", cp - 1)))
    return _recomputed(rows, dict(fwd=tuple(fwd), bwd=tuple(bwd),
                fwd_compute=fa + row("cp_ring_attention", "forward"),
                fwd_comm=row("cp_ring_kv_exposed", "forward"),
                bwd_compute=fg + row("cp_ring_attention_grad", "backward"),
                bwd_comm=row("cp_ring_kv_grad_exposed", "backward")),
                ("flash_attention", "cp_ring_attention", "cp_ring_merge_recompute"),
                ("cp_ring_kv_exposed", "cp_ring_kv_recompute_exposed"), saved)


def _recomputed(rows, prog, compute, comm, saved):
    """``ring_program``'s program with recompute: where the layer's cost re-runs the
    attention's exchange (its rows of phase "recompute" named in ``compute`` / ``comm``),
    ``remat``: the program the recompute runs on the same stream (the forward's, or with
    recompute "op", ``saved``: the forward's without the attention kernels, whose outputs
    the policy keeps), and the seconds of those rows (``remat_compute``, ``remat_comm``);
    ``zero_cost.recipe_blocks`` runs it where the recompute runs (ZeRO-3's re-gathered
    layer: after the value projection's re-run) or before the backward's program."""
    rc = [r for r in rows if r[1] == "recompute" and r[0] in compute + comm]
    if not rc:
        return dict(prog, remat=(), remat_compute=0.0, remat_comm=0.0)
    kernel = any(r[0] in ("flash_attention", "cp_ring_attention") for r in rc)
    return dict(prog, remat=tuple(prog["fwd"]) if kernel else tuple(saved),
                remat_compute=sum(r[3] for r in rc if r[0] in compute),
                remat_comm=sum(r[3] for r in rc if r[0] in comm))


def _cost_itemsize(model) -> int:
    return model.torch_dtype.itemsize


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


def _op_sac_ring(lay, ring, prof) -> list:
    """Recompute "op" on this library's ring: the policy saves the attention kernels'
    outputs (``models.op_sac``: the ring's steps replay), but the ring's forward around
    them runs again before the block's backward, its K/V sends and its merges
    (``strategies.context_parallel._ring_forward``: each step but the last sends the next
    block and waits for it; step 0's output cast beside the first send, each later
    step's merge (``context_cost._merge_ops``) beside the next, the last alone, the
    merged output cast back); measured on the dry run's trace (tests/test_zerocp3.py:
    the sends and merge ops twice per layer, the steps once).  Other frameworks' rings:
    not this evidence, left as they were."""
    if lay.recompute != "op" or lay.framework != "workbench" or not ring.steps:
        return []
    c0 = ring.casts / 2
    ranks = X.ring_ranks(lay)          # the hop's SMs: its group's (ring_times)
    run0, out0 = _cost.overlap(c0, ring.hop, prof, ranks=ranks)
    run_m, out_m = _cost.overlap(ring.merge, ring.hop, prof, ranks=ranks)
    k = ring.steps
    return [("cp_ring_merge_recompute", "recompute", "elementwise",
             run0 + (k - 1) * run_m + ring.merge + c0, 0, False),
            ("cp_ring_kv_recompute_exposed", "recompute", "send_recv",
             out0 + (k - 1) * out_m, ring.sent_forward, True)]


_ATTN = ("flash_attention", "flash_attention_grad", "recompute:flash_attention")


def _a2a_rows(model, lay, prof, attention, fp8, regather, extra, ops, rows):
    """``cp_comm="a2a"`` (``context_cost``'s comment): the attention kernels over the whole
    sequence on (heads / tp) / cp heads, priced as the layer prices its own (``layer_ops``
    at s tokens and tp x cp head groups, its attention rows only), and the four
    all-to-alls forward (beside each forward and full recompute of the kernel) and
    backward, exposed."""
    from .layer_cost import layer_ops
    full = layer_ops(model.d_model, model.n_head, model.seq_len, lay.micro_batch,
                     lay.tp * lay.cp, False, lay.recompute, model.d_ff, model.dtype, prof,
                     list(range(lay.tp * lay.cp)), attention, fp8, regather=regather, **extra)
    whole = {}
    for o in full:
        if o.name in _ATTN:
            whole.setdefault((o.name, o.phase), []).append(o.exposed)
    out, seen = [], {}
    for r in rows:
        key = (r[0], r[1])
        if r[0] in _ATTN:
            i = seen.get(key, 0)
            seen[key] = i + 1
            r = (r[0], r[1], r[2], whole[key][i], r[4], r[5])
        out.append(r)
    a2a = X.a2a_times(model, lay, prof)
    phases = [o.phase for o in ops if o.name == "flash_attention"]
    if lay.recompute == "op" and lay.framework == "workbench":
        # recompute "op": the kernel's output saved (models.op_sac), the four
        # all-to-alls around it run again before the block's backward (blocking
        # collectives no policy saves: measured on the dry run's trace, three of q, k, v
        # and one of the output more per layer, tests/test_zerocp3.py)
        phases.append("recompute")
    for phase in phases:
        out.append(("cp_a2a_qkv_o", phase, "all_to_all", a2a.forward, a2a.sent_forward, True))
    out.append(("cp_a2a_qkv_o_grad", "backward", "all_to_all", a2a.backward,
                a2a.sent_backward, True))
    reorder = _a2a_reorder(model, lay, prof)
    if reorder:
        for phase in phases:
            out.append(("cp_a2a_reorder", phase, "data_movement", reorder, 0, False))
        out.append(("cp_a2a_reorder_grad", "backward", "data_movement", reorder, 0, False))
    return out


def _a2a_reorder(model, lay, prof) -> float:
    """Seconds of the four reorders this library's Ulysses runs around the attention
    kernel with the ring's load-balanced layout (``strategies/context_parallel_a2a.py``
    ``ulysses_attention``: q, k, v put back in sequence order by ``torch.index_select``
    after their all-to-alls, the output into ring order before its own; the recipe's
    ``balanced=True``, ``recipes/context_parallel.py``), each priced as the op table
    prices ``index_select`` (``ops_table/indexing.py``: ``costs.movement``, the input
    and the int64 index read, the output written, one kernel, op class
    "data_movement"); backward alike (index_select's backward reads the output's
    gradient and the index, writes the input's).  0 for other frameworks (Megatron-LM's
    and torchtitan's all-to-all layouts are not priced with this runtime's reorders)."""
    if lay.cp == 1 or lay.cp_comm != "a2a" or lay.framework != "workbench":
        return 0.0
    e, b, S, d = _cost_itemsize(model), lay.micro_batch, model.seq_len, model.head_dim
    ah = model.n_head // lay.tp // lay.cp
    gh = (getattr(model, "n_kv_head", None) or model.n_head) // lay.tp // lay.cp
    idx = 8 * S
    return sum(_cost.compute_time(0, 2 * b * h * S * d * e + idx, prof, model.dtype,
                                  "data_movement") for h in (ah, gh, gh, ah))


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


def expert_states(model, lay, layers: int, grad_extra: int = 0) -> dict:
    """{"params", "grads", "optimizer", "buffers"} bytes of the routed experts of
    ``layers`` layers on one rank: E / ep experts per layer, split by ``moe_cost.mlp_tp``
    (t; whole on the runtime's layout, framework "workbench" with sp=False), their ZeRO-1
    optimizer states over the expert-data-parallel group of dp x cp / ep ranks;
    ``grad_extra`` bytes per parameter of the framework's gradient buffer."""
    if not getattr(model, "moe_experts", 0):
        return {}
    from .memory import model_state_bytes
    psi = layers * M.rank_expert_params(model, lay.tp, lay.ep, lay.sp)
    out = model_state_bytes(psi, lay.dp * lay.cp // lay.ep, lay.zero)
    out["buffers"] = grad_extra * psi
    return out


def merged_expert_params(model, lay, layers: int) -> float:
    """Routed-expert parameters a rank reduces together with its dense ones, in one
    collective: this library's recipe at ep = 1, whose one optimizer (``DataParallel`` /
    ZeRO over dp, or dp x cp) holds every parameter, the experts' gradients in the same
    buckets (the dry run's trace: one "dp bucket" all-reduce of 22.5 MB for a 2-layer
    Llama with 8 experts at dp 2, 110.8 us, where an all-reduce of the dense 5.2 MB and
    one of the experts' 17.3 MB price 126.0 us; tests/test_plan12.py); 0 elsewhere (ep >
    1: the experts' own optimizer over their expert-data-parallel group, Megatron-LM's
    expert buffers of their own: :func:`expert_sync`)."""
    if M.moe_of(model) is None or lay.engine != "workbench" or lay.ep != 1:
        return 0.0
    return layers * M.rank_expert_params(model, lay.tp, lay.ep, lay.sp)


def expert_sync(model, lay, prof, stage: int, layers: int, grad_bytes: int):
    """(seconds, bytes sent, parameters the rank updates) of the routed experts' gradient
    reduction over their expert-data-parallel group, after the dense one (ZeRO-0: an
    all-reduce; ZeRO-1: a reduce-scatter and the updated weights' all-gather)."""
    if M.moe_of(model) is None:
        return 0.0, 0.0, 0.0
    psi = layers * M.rank_expert_params(model, lay.tp, lay.ep, lay.sp)
    ranks = tuple(lay.rank(0, d, stage, c) for d in range(0, lay.dp, lay.ep)
                  for c in range(lay.cp))
    n = len(ranks)
    if n == 1:
        return 0.0, 0.0, psi
    g = grad_bytes * psi
    if lay.zero == 0:
        return (C.group_price("all_reduce", g, ranks, prof),
                wire_bytes("all_reduce", int(g), n), psi)
    t = C.group_price("reduce_scatter", g, ranks, prof) + \
        C.group_price("all_gather", 2 * psi, ranks, prof)
    return t, wire_bytes("reduce_scatter", int(g), n) + wire_bytes("all_gather",
                                                                   int(2 * psi), n), psi / n
