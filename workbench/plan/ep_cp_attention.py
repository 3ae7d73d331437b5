"""Context parallelism's attention rows beyond the dense block's: Ulysses' all-to-alls and
this library's reorders around its kernel (:func:`_a2a_rows`, :func:`_a2a_reorder`)
and what recompute "op" runs again of this library's ring (:func:`_op_sac_ring`)."""
from __future__ import annotations

from ..sim_mesh import cost as _cost
from . import context_cost as X


def _cost_itemsize(model) -> int:
    return model.torch_dtype.itemsize


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
