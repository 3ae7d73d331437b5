"""The module trace DeepSpeed v0.3's ZeRO-3 records for one micro-batch
(:func:`gpt_trace` of :class:`Entry`), a layer's modules with parameters and which
modules keep their parameters for a reuse (:func:`_keep`).  "Module docstring" below:
:mod:`.zero3_2021`'s."""
from __future__ import annotations

from dataclasses import dataclass

from .zero3_2021_release import MAX_REUSE_NUMEL, PERSISTENCE_NUMEL


@dataclass(frozen=True)
class Entry:
    """One module's turn in the recorded trace: its id, the partitioned parameters it
    uses ((id, elements), persistent ones left out), its compute seconds, and its phase
    ("f" forward, "r" recomputed forward inside the backward, "b" backward); ``copies``:
    seconds of DeepSpeed's own copies on the compute stream before it (activation
    checkpointing's partitioned input, :func:`partition_activation_seconds`), not
    counted as compute."""
    module: str
    params: tuple
    compute: float
    phase: str
    copies: float = 0.0


def _layer_modules(cfg) -> list[tuple[str, tuple]]:
    """A layer's modules with parameters, forward order, unsplit (tp = 1): each a name
    and its (parameter, elements); GPT: LayerNorm, fused QKV, projection, LayerNorm,
    fc1, fc2, each with its bias; Llama: RMSNorm, q, k, v, o, RMSNorm, w1, w3, w2."""
    h, f = cfg.d_model, cfg.d_ff
    if cfg.arch == "llama":
        from .llama_layer import weight_matrices
        q, k, v, o, w1, w3, w2 = weight_matrices(cfg, 1)
        return [("norm1", (("norm1.w", h),)), ("q", (("q.w", q),)), ("k", (("k.w", k),)),
                ("v", (("v.w", v),)), ("o", (("o.w", o),)), ("norm2", (("norm2.w", h),)),
                ("w1", (("w1.w", w1),)), ("w3", (("w3.w", w3),)), ("w2", (("w2.w", w2),))]
    return [("ln1", (("ln1.w", h), ("ln1.b", h))),
            ("qkv", (("qkv.w", 3 * h * h), ("qkv.b", 3 * h))),
            ("proj", (("proj.w", h * h), ("proj.b", h))),
            ("ln2", (("ln2.w", h), ("ln2.b", h))),
            ("fc1", (("fc1.w", h * f), ("fc1.b", f))),
            ("fc2", (("fc2.w", f * h), ("fc2.b", h)))]


def gpt_trace(cfg, layer, head, edge, recompute: str,
              checkpoint_copies: tuple = (0.0, 0.0), chunk: int = 1) -> list[Entry]:
    """One micro-batch's trace as DeepSpeed records it (module docstring), tp = pp = 1:
    the root (holding the tied word embedding), the embeddings, each layer's modules
    with parameters (``_layer_modules``; the persistent ones, biases and norms, are
    never gathered but their gradients are reduce-scattered like any other), the
    final norm, the head; the backward from the head down, each layer's modules
    recomputed first when ``recompute == "full"``.  A module's share of the layer's
    compute is its share of the layer's partitioned weights (as ``zero_cost.
    stage_blocks``); the norms' is left in the matrices'.  ``checkpoint_copies``:
    (forward, backward) seconds a layer's checkpointed input costs DeepSpeed's
    activation checkpointing (:func:`partition_activation_seconds`), charged before the
    layer's first module in the forward and before its recomputation (full recompute
    only).  ``chunk``: ``--checkpoint-num-layers`` (``plan.recompute_chunks``): the layers
    are checkpointed in chunks of ``chunk``, so the backward recomputes a chunk's layers
    in forward order (each module gathered as the recompute re-runs it) and then runs
    their backwards, last layer first; the checkpoint copies are one per chunk (its
    input), charged before its first layer."""
    h, V, s = cfg.d_model, cfg.vocab_size, cfg.seq_len
    mods = _layer_modules(cfg)
    big = {m: sum(n for _, n in ps if n >= PERSISTENCE_NUMEL) for m, ps in mods}
    tot = sum(big.values())
    full = recompute == "full"
    fwd_l = layer.fwd_compute
    bwd_l = layer.bwd_compute - (fwd_l if full else 0.0)
    tied = cfg.tie_embeddings
    wte = (("wte", V * h),)

    if not full:
        checkpoint_copies = (0.0, 0.0)

    from .recompute_chunks import chunk_sizes
    starts, k0 = set(), 0           # each chunk's first layer: its input is checkpointed
    spans = []
    for n in chunk_sizes(cfg.n_layer, chunk if full else 1):
        starts.add(k0)
        spans.append(range(k0, k0 + n))
        k0 += n

    def layer_entries(k, phase, share, order):
        first = {"f": checkpoint_copies[0], "r": checkpoint_copies[1]}.get(phase, 0.0)
        first = first if k in starts else 0.0
        return [Entry(f"{k}.{m}", tuple((f"{k}.{pid}", n) for pid, n in ps),
                      share * big[m] / tot, phase, first if j == 0 else 0.0)
                for j, (m, ps) in enumerate(order)]

    out = [Entry("root", wte if tied else (), 0.0, "f"),
           Entry("wte", wte, edge["first"][0], "f")]
    pos = cfg.arch != "llama"
    emb_ln = (("emb_ln.w", h), ("emb_ln.b", h)) if cfg.embed_norm else ()   # BLOOM's
    if pos:
        out.append(Entry("wpe", (("wpe", s * h),), 0.0, "f"))
    if emb_ln:
        out.append(Entry("emb_ln", emb_ln, 0.0, "f"))
    for k in range(cfg.n_layer):
        out += layer_entries(k, "f", fwd_l, mods)
    final = (("lnf.w", h),) if cfg.arch == "llama" else (("lnf.w", h), ("lnf.b", h))
    head_p = () if tied else (("head", V * h),)
    out += [Entry("lnf", final, 0.0, "f"),
            Entry("head", head_p, head.fwd_compute + edge["last"][0], "f"),
            Entry("root", wte if tied else (), 0.0, "b"),
            Entry("head", head_p, head.bwd_compute + edge["last"][1], "b"),
            Entry("lnf", final, 0.0, "b")]
    for span in reversed(spans):
        if full:                    # CheckpointFunction.backward: the chunk re-run, then
            for k in span:          # torch.autograd.backward through it
                out += layer_entries(k, "r", fwd_l, mods)
        for k in reversed(span):
            out += layer_entries(k, "b", bwd_l, mods[::-1])
    if emb_ln:
        out.append(Entry("emb_ln", emb_ln, 0.0, "b"))
    if pos:
        out.append(Entry("wpe", (("wpe", s * h),), 0.0, "b"))
    out.append(Entry("wte", wte, edge["first"][1], "b"))
    return out


def _keep(trace) -> list[bool]:
    """Whether each entry's module keeps its parameters after it ran: the trace uses the
    module again within MAX_REUSE_NUMEL elements (``_keep_for_later``: the elements of
    the modules between, from the next step on)."""
    nxt, keep = {}, [False] * len(trace)
    acc, suffix = 0.0, [0.0] * (len(trace) + 1)
    for i in range(len(trace) - 1, -1, -1):
        acc += sum(n for _, n in trace[i].params)
        suffix[i] = acc
    for i in range(len(trace) - 1, -1, -1):
        j = nxt.get(trace[i].module)
        if j is not None:
            keep[i] = suffix[i + 1] - suffix[j] < MAX_REUSE_NUMEL
        nxt[trace[i].module] = i
    return keep
