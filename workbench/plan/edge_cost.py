"""The kernels at the ends of a GPT pipeline, priced from the op table.

``costs.layer_cost`` prices the transformer layers and ``costs.head_cost`` the lm-head
GEMM; what runs around them was not priced: on the first stage the token and position
embedding lookups, their sum, the LayerNorm on it (``cfg.embed_norm``, BLOOM) and the
embedding dropout; on the last stage the final
LayerNorm, the logits' cast to float32 for the loss (Megatron computes the
vocabulary-parallel cross-entropy in fp32, as ``models.gpt.GPT`` does) and the
cross-entropy itself.  A Llama (``arch="llama"``) has no position table (RoPE, priced in
its blocks) and a final RMSNorm.  Each is priced here with its entry in the op table
(``parallel.ops_table``: the same FLOPs, bytes and op class the dispatcher puts on the
trace) on one rank's shapes, forward and backward, so the planner and the dry run count
the same kernels.
"""
from __future__ import annotations

from functools import lru_cache

import torch

__all__ = ["edge_times"]


def _meta(*shape, dtype):
    return torch.empty(shape, dtype=dtype, device="meta")


def _price(name, ins, outs, profile, dtype, **attrs) -> tuple[float, float]:
    from ..parallel.ops_table import pricing
    from ..parallel.ops_table.table import entry
    e = entry(name)
    c = e.cost(ins, outs, **attrs)
    return (pricing._time(c.flops, c.bytes, profile, dtype, e.op_class),
            pricing._time(c.backward_flops, c.backward_bytes, profile, dtype, e.op_class))


@lru_cache(maxsize=None)
def edge_times(cfg, b: int, tp: int, sp: bool, profile) -> dict:
    """{"first": (forward, backward), "last": (forward, backward), "loss": (forward,
    backward)} seconds on one rank for one micro-batch of ``b`` sequences (module
    docstring; "loss": the cast and cross-entropy of "last", without the final norm)."""
    s, h, V = cfg.seq_len, cfg.d_model, cfg.vocab_size
    dt, f32, i64 = cfg.torch_dtype, torch.float32, torch.int64
    vt = V // tp if V % tp == 0 and tp > 1 else V          # vocabulary-parallel when it divides
    ids, act = _meta(b, s, dtype=i64), _meta(b, s, h, dtype=dt)
    llama = cfg.arch == "llama"
    tok = _price("embedding", [ids, _meta(vt, h, dtype=dt)], [act], profile, dt)
    parts = [tok]
    if not llama:
        # learned positions: (b, s) position ids looked up, as Megatron-LM's
        # position_ids and the recipes' (``Hybrid._positions``), and added
        parts.append(_price("embedding", [ids, _meta(s, h, dtype=dt)], [act], profile, dt))
        parts.append(_price("add", [act, act], [act], profile, dt))
    tn = _meta(b, s // tp if sp else s, h, dtype=dt)                   # norm: s/t tokens with SP
    w = _meta(h, dtype=dt)
    if getattr(cfg, "embed_norm", False):              # BLOOM's LayerNorm on the embeddings
        parts.append(_price("layer_norm", [tn, w, w], [tn], profile, dt, normalized_shape=(h,)))
    if cfg.dropout > 0:
        ts = _meta(b, s // tp if sp else s, h, dtype=dt)
        parts.append(_price("mul", [ts, ts], [ts], profile, dt))      # x * mask
    first = tuple(map(sum, zip(*parts)))
    if llama:
        ln = _price("rms_norm", [tn, w], [tn], profile, dt, normalized_shape=(h,),
                    eps=cfg.norm_eps)
    else:
        ln = _price("layer_norm", [tn, w, w], [tn], profile, dt, normalized_shape=(h,))
    logits = _meta(b * s, vt, dtype=dt)
    logits32 = _meta(b * s, vt, dtype=f32)
    cast = _price("to", [logits], [logits32], profile, f32)
    ce = _loss(b * s, vt, profile)
    last = tuple(map(sum, zip(ln, cast, ce)))
    # "loss": the logits' cast and the cross-entropy alone (of "last"), what runs after
    # the head's forward and before its backward (plan.zero_cost's ``lead``)
    # "cast": the logits' cast alone (of "loss": what runs before the cross-entropy's
    # count all-reduce, ``estimate._loss_lead``)
    return {"first": first, "last": last, "loss": tuple(map(sum, zip(cast, ce))),
            "cast": tuple(cast)}


def _loss(rows: int, vocab: int, profile) -> tuple[float, float]:
    """The cross-entropy on float32 logits as the training clock prices it: at the
    profile's measured rate of the loss where it has one
    (``parallel.ops_table.loss_pricing.cross_entropy_times``: with the logits' cast,
    the measured time of the pair), else by the roofline of its op-table entry."""
    from ..parallel.ops_table.loss_pricing import cross_entropy_times
    f32 = torch.float32
    got = cross_entropy_times(rows, vocab, profile)
    if got is not None:
        return got
    return _price("cross_entropy", [_meta(rows, vocab, dtype=f32),
                                    _meta(rows, dtype=torch.int64)], [_meta(dtype=f32)],
                  profile, f32)
