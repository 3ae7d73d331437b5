"""The cp exchange and the loss beside ZeRO's collectives: whether this library's loss
waits for ZeRO-3's backward prefetch (:func:`loss_waits`), whether ZeRO's stream is the
cp group's (:func:`shares_zero_stream`), and then the exchange as the runtime orders it
(:func:`ring_program`, with recompute :func:`_recomputed`)."""
from __future__ import annotations

from . import context_cost as X
from . import costs as C
from .ep_cp_layer import _layer, _mini, _regathers


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
