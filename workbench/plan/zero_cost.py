"""ZeRO-2/3's collectives against one micro-batch's compute, on the dp group's comm stream.

What DeepSpeed does (``deepspeed/runtime/engine.py``, ``runtime/zero/stage_1_and_2.py``,
``runtime/zero/stage3.py``; ZeRO-2/3 run without pipelines, ``plan.layout``):

- gradients are reduced every micro-batch, not once per step: ``engine.backward`` calls
  ``allreduce_gradients`` after each backward, which for stages >= 2 runs
  ``overlapping_partition_gradients_reduce_epilogue`` ("ZeRO stage >= 2 communicates
  during non gradient accumulation boundaries as well"); that epilogue reduces the last
  bucket and synchronizes the reduction stream (``independent_gradient_partition_
  epilogue``), so whatever is still in flight when a backward ends is exposed, once per
  micro-batch;
- a gradient is reduced when autograd has accumulated it (a hook on the parameter's
  ``AccumulateGrad``, with ``overlap_comm``): the tied word embedding's gradient (the
  head's contribution plus the lookup's) and the learned positions' are complete only
  after the embedding's backward, the last of the step, so their reduce-scatter
  overlaps nothing: with a large vocabulary that tail is most of the exposed time;
- ZeRO-3 gathers a module's parameters before its forward and again before its backward,
  prefetching the next modules, in the order the last step ran them, up to
  ``stage3_prefetch_bucket_size`` elements (default 5e7, ``runtime/zero/config.py``);
  the embedding runs first, so its gather is exposed; in backward the prefetch starts
  at the root module's pre-backward hook (the loss's gradient), before the head's
  backward.  Per step: gather forward + gather backward + reduce-scatter, 1.5x data
  parallelism's volume (ZeRO sec. 7.2.2).

The model: the stage's modules in forward order (the embeddings, each layer, the final
norm with the head and loss), each with its parameters, forward and backward compute; one
comm stream for the rank's dp group (as ``sim_mesh.trace``, one per process group): a
collective starts when the stream is free and its data is ready (a gather when issued, a
reduce-scatter when the gradient is complete), in issue order, and a module computes once
its gather has ended.  While a collective is in flight a module computes at ``rate``
(``sim_mesh.cost.overlap_rate`` of the dp group, which the caller gives: NCCL's kernels
hold 16 of the A100's 108 SMs for a group spanning nodes, 24 for one inside a node, as
``layer_cost`` prices the tensor-parallel overlap), so hiding a collective still costs
compute time.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..parallel.strategies.zero3 import PREFETCH_NUMEL   # DeepSpeed's default, cited there
from ..sim_mesh.cost import finish_beside

__all__ = ["Block", "PREFETCH_NUMEL", "PERSISTENCE_NUMEL", "REDUCE_BUCKET_NUMEL",
           "zero_exposed", "stage_blocks", "recipe_blocks"]

# DeepSpeed's defaults (deepspeed/runtime/zero/config.py): a parameter of fewer elements
# than stage3_param_persistence_threshold (1e5) is not partitioned ("Smaller values use
# less memory, but can greatly increase communication (especially latency-bound
# messages)"), so never gathered; gradients are reduced in buckets of reduce_bucket_size
# (5e8) elements (stage 2: stage_1_and_2.py; stage 3: __reduce_and_partition_ipg_grads)
PERSISTENCE_NUMEL = 100_000
REDUCE_BUCKET_NUMEL = 500_000_000


@dataclass(frozen=True)
class Block:
    """A module of the stage: ``numel`` parameters on this rank before ZeRO's split,
    seconds of forward and backward compute (backward with its recompute); ``parts``:
    the elements of each of its parameters when their gradients are reduce-scattered one
    by one (this library's recipe: a hook per parameter), empty when the block's
    gradient goes in one collective."""
    numel: float
    fwd: float
    bwd: float
    parts: tuple = ()
    group: int = -1          # the layer it belongs to (recipe_blocks), -1: none
    remat: float = 0.0       # seconds of its forward re-run inside ``bwd`` (recompute)
    # seconds its compute waits, after it, on collectives of other streams (its layer's
    # exposed tensor-parallel collectives and ring K/V exchange: ``recipe_blocks``),
    # forward and backward: the clock goes on, ZeRO's stream with it, no compute slowed
    wait_fwd: float = 0.0
    wait_bwd: float = 0.0
    # what runs after its compute on ZeRO's own stream, forward and backward (its
    # reduce-scatters issued first): a program of ``("compute", s)``, ``("async", name,
    # s)`` (a collective of s seconds issued now, ``("wait", name)`` for it),
    # ``("sync", s)`` (a blocking one), :func:`run_program`; the ring's exchange where
    # ZeRO's group is the cp group (``ep_cp.ring_program``); ``shared``: the seconds the
    # layer's cost counts for those programs (forward, backward)
    after_fwd: tuple = ()
    after_bwd: tuple = ()
    shared: tuple = (0.0, 0.0)
    # what runs on ZeRO's stream after its re-run in a recomputed layer's backward
    # (``regather``): the recomputed attention's exchange after the value projection
    after_remat: tuple = ()


class _Stream:
    """One rank's comm stream: collectives in issue order; a key ``("rs", i)`` is the
    reduce-scatter of module i's gradient, a key ``i`` the gather of its parameters."""

    def __init__(self, all_gather, reduce_scatter):
        self.ag, self.rs, self.free, self.ends = all_gather, reduce_scatter, 0.0, {}
        self.busy = []          # (start, end) of each collective, in time order
        self.done = 0           # busy[:done] ended by the last compute's start

    def issue(self, key, numel: float, ready: float, seconds: "float | None" = None) -> None:
        """Queue the gather (``key`` an int) or reduce-scatter (a tuple) of ``numel``
        elements, or with ``seconds`` a collective of that duration, ready at ``ready``."""
        if key in self.ends or (numel <= 0 and seconds is None):
            return
        cost = self.rs if isinstance(key, tuple) else self.ag
        start = max(self.free, ready)
        self.free = start + (cost(numel) if seconds is None else seconds)
        self.ends[key] = self.free
        if self.free > start:
            self.busy.append((start, self.free))

    def compute(self, t: float, work: float, rate: float) -> float:
        """When ``work`` seconds of compute started at ``t`` end: at full speed while
        the stream is idle, at ``rate`` while a collective is in flight."""
        # the collectives run one after another (each starts once the stream is free), so
        # busy's ends increase; _run's compute starts never go back in time: those that
        # ended by t never matter again (finish_beside skips them), so skip them here
        busy, k = self.busy, self.done
        while k < len(busy) and busy[k][1] <= t:
            k += 1
        self.done = k
        return finish_beside(t, work, rate, busy[k:] if k else busy)


def run_program(stream, program, t: float, rate: float, tag) -> float:
    """Run ``program`` (``Block.after_fwd`` / ``after_bwd``) from ``t`` on ``stream``:
    compute at ``rate`` beside the stream's collectives; an async collective queued
    behind the stream's (a group's collectives run in issue order on its one stream,
    ``sim_mesh.trace``), waited for by ``("wait", name)``; a blocking one starts once
    the stream is free and the compute waits for its end (``Trace.record_collective``).
    Returns when the program's compute ends."""
    for op in program:
        kind = op[0]
        if kind == "compute":
            t = stream.compute(t, op[1], rate)
        elif kind == "async":
            stream.issue(("p", tag, op[1]), 0.0, t, seconds=op[2])
        elif kind == "wait":
            t = max(t, stream.ends[("p", tag, op[1])])
        elif kind == "sync":
            stream.issue(("p", tag, ("sync", len(stream.ends))), 0.0, t, seconds=op[1])
            t = max(t, stream.free)
        else:
            raise ValueError(f"run_program: {op!r} is no step of a program; give "
                             f"('compute', s), ('async', name, s), ('wait', name) or "
                             f"('sync', s)")
    return t


def _prefetch(stream, blocks, order, pos: int, now: float, budget: float) -> None:
    """Issue the gathers of the modules after position ``pos`` of ``order``, up to
    ``budget`` elements (at least one: DeepSpeed's coordinator, ``Zero3._wait``)."""
    ahead = 0.0
    for k in range(pos + 1, len(order)):    # by index: a slice would copy the rest each time
        if ahead >= budget:
            break
        j = order[k]
        stream.issue(j, blocks[j].numel, now)
        ahead += blocks[j].numel


def _run(stream, blocks, order, backward: bool, gather: bool, budget: float,
         rate: float = 1.0, bucket: "float | None" = None,
         loss_waits: bool = False, stay=(), regather: bool = False,
         lead: float = 0.0, beside: float = 0.0) -> float:
    """Run ``blocks`` in ``order`` from time 0 and return the compute's end: with
    ``gather``, each waits for its parameters' gather (issued ahead); in ``backward``
    each module's gradient is reduce-scattered once it has run (``bucket``: once the
    gradients completed since the last reduce-scatter reach ``bucket`` elements, the
    rest at the end, as DeepSpeed's buckets), and the prefetch starts with the backward
    (the root module's pre-backward hook).  ``stay``: indices of blocks still gathered
    (none of their own gathers issued).  ``regather``: a layer's backward starts with its
    recompute, which gathers each of its modules as it re-runs them, in forward order,
    without prefetch (this library's recipe, ``strategies.zero3_clock``: a gather hook
    in a backward waits for its module, ``ahead=False``, and the module's backward then
    reuses that copy and prefetches nothing).  ``lead``: seconds of compute the backward
    runs first, from time 0 beside its prefetch (the loss, :func:`zero_exposed`)."""
    t, pending = 0.0, 0.0
    gb = [Block(0.0, b.fwd, b.bwd) if i in stay else b for i, b in enumerate(blocks)]
    groups, rerun = {}, set()
    if regather and gather and backward:
        for i in sorted(order):
            if blocks[i].group >= 0:
                groups.setdefault(blocks[i].group, []).append(i)
    if gather and backward:
        _prefetch(stream, gb, order, -1, t, budget)
        if loss_waits:          # the loss's dp collective queued behind those gathers
            t = stream.compute(t, beside, rate)      # what runs before it, beside them
            t = max(t, stream.free)
            t = stream.compute(t, lead - beside, rate)   # the rest of the loss, after it
        elif lead:              # the loss beside them (zero_exposed's ``lead``)
            t = stream.compute(t, lead, rate)
    for pos, i in enumerate(order):
        g = blocks[i].group if groups else -1
        if g >= 0:              # a recomputed layer (regather): no prefetch
            if g not in rerun:
                rerun.add(g)
                for j in groups[g]:                  # its forward again, module by module
                    stream.issue(j, gb[j].numel, t)
                    t = max(t, stream.ends.get(j, 0.0))
                    t = stream.compute(t, blocks[j].remat, rate)
                    if blocks[j].after_remat:
                        t = run_program(stream, blocks[j].after_remat, t, rate, ("r", pos, j))
            t = stream.compute(t, blocks[i].bwd - blocks[i].remat, rate)
        elif gather:
            stream.issue(i, gb[i].numel, t)
            t = max(t, stream.ends.get(i, 0.0))
            _prefetch(stream, gb, order, pos, t, budget)
        if g < 0:
            t = stream.compute(t, blocks[i].bwd if backward else blocks[i].fwd, rate)
        t += blocks[i].wait_bwd if backward else blocks[i].wait_fwd
        if not backward and blocks[i].after_fwd:
            t = run_program(stream, blocks[i].after_fwd, t, rate, ("f", pos))
        if backward and bucket is None and blocks[i].parts:
            for k, n in enumerate(blocks[i].parts):     # one per parameter, as produced
                stream.issue(("rs", i, k), n, t)
        elif backward and bucket is None:
            stream.issue(("rs", i), blocks[i].numel, t)
        elif backward:
            pending += blocks[i].numel
            if pending >= bucket:
                stream.issue(("rs", i), pending, t)
                pending = 0.0
        if backward and blocks[i].after_bwd:    # after its gradients' reduce-scatters
            t = run_program(stream, blocks[i].after_bwd, t, rate, ("b", pos))
    if pending:
        stream.issue(("rs", "rest"), pending, t)
    return t


def zero_exposed(blocks, zero: int, all_gather, reduce_scatter,
                 prefetch_numel: float = PREFETCH_NUMEL,
                 rate: float = 1.0, bucket: "float | None" = None,
                 loss_waits: bool = False, stay=(), regather: bool = False,
                 lead: tuple = (0.0, 0.0), beside: "float | None" = None
                 ) -> tuple[float, float]:
    """(forward, backward) seconds that one micro-batch's ZeRO-``zero`` collectives add
    to its compute (module docstring).  ``blocks``: the stage's :class:`Block` s in
    forward order; ``all_gather(numel)`` / ``reduce_scatter(numel)``: seconds of that
    collective on ``numel`` parameters' 16-bit values over the data-parallel group;
    ``rate``: how fast compute runs beside a collective (1: as alone); ``bucket``: the
    gradient elements one reduce-scatter waits for (None: one per block);
    ``loss_waits``: the backward starts only once the gathers prefetched for it have
    ended (this library's recipe with an untied head: gathering the head again at the
    end of the forward starts the backward's prefetch, ``parallel/strategies/fsdp.py``,
    and the cross-entropy's all-reduce of the global target count over the dp group,
    ``parallel/ops_table/cross_entropy.py``, queues behind those gathers on the same
    stream; a tied head's weight is still live, so nothing is gathered before the loss;
    DeepSpeed's loss is local to the rank); ``stay``: indices of blocks kept gathered
    from their forward to their backward (FSDP2's root and torchtitan's last block,
    ``fsdp2_cost``), not gathered again for backward; ``regather``: ZeRO-3 with recompute
    as this library's recipe runs it (:func:`_run`; the blocks' ``group`` and ``remat``,
    :func:`recipe_blocks`); ``lead``: (forward, backward) seconds of the last block's
    ``fwd`` and ``bwd`` that run after the backward's prefetch is issued and before that
    block's backward waits for its gather: this library's recipe issues the prefetch when
    the forward's last module (the head) ends (``parallel/strategies/zero3_clock.py``,
    ``_backward_hook`` calls ``_prefetch_backward``), so the loss's forward and backward
    (the logits' cast and the cross-entropy) run beside those gathers, where the head's
    backward waits for its own; moved from the forward to the backward's start, not added
    (with ``loss_waits`` the loss waits for the gathers instead: give (0, 0), or
    ``beside``: the seconds of ``lead`` that run before the loss's collective queued
    behind the gathers, beside them, the rest of ``lead`` running once it ends and
    before the last block's backward starts its prefetch; where ZeRO's group is the cp
    group: the logits' cast, and a tied head's GEMM, whose module is the embedding, so
    that the prefetch starts as the final norm ends, beside; the cross-entropy forward
    and backward and the cast's backward after, ``estimate._loss_lead``)."""
    if zero not in (2, 3):
        raise ValueError(f"zero={zero!r}: the per-micro-batch collectives are ZeRO-2's "
                         "and ZeRO-3's; use 2 or 3")
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate <= 1:
        raise ValueError(f"rate={rate!r} must be in (0, 1]: the speed of compute beside "
                         "a collective, 1 when it runs as alone")
    lf, lb = lead
    if (lf or lb) and (zero != 3 or (loss_waits and beside is None) or not blocks
                       or lf < 0 or lb < 0 or lf > blocks[-1].fwd or lb > blocks[-1].bwd):
        raise ValueError(f"lead={lead!r}: the loss's seconds run beside ZeRO-3's backward "
                         f"prefetch, so zero=3, loss_waits=False (or True with beside=, the "
                         f"seconds before the loss's collective) and each within the last "
                         f"block's own fwd / bwd (got zero={zero}, loss_waits={loss_waits})")
    if beside is not None and not 0 <= beside <= lf + lb:
        raise ValueError(f"beside={beside!r}: the seconds of lead={lead!r} run before the "
                         f"loss's collective; give a number in [0, {lf + lb}]")
    order = list(range(len(blocks)))
    if lf or lb:                # the loss leaves the last block: it runs as ``lead``
        last = blocks[-1]
        blocks = list(blocks[:-1]) + [replace(last, fwd=last.fwd - lf, bwd=last.bwd - lb)]
    fwd = 0.0
    if zero == 3 or any(b.after_fwd for b in blocks):
        s = _Stream(all_gather, reduce_scatter)
        end = _run(s, blocks, order, False, zero == 3, prefetch_numel, float(rate))
        fwd = end - sum(b.fwd + b.wait_fwd + b.shared[0] for b in blocks)
    s = _Stream(all_gather, reduce_scatter)
    end = _run(s, blocks, order[::-1], True, zero == 3, prefetch_numel, float(rate), bucket,
               loss_waits, stay, regather and zero == 3, lf + lb, beside or 0.0)
    # the loss's own seconds are the blocks' (the stage's compute): only what it waits or
    # slows beside the gathers is exposed
    return fwd, max(end, s.free) - sum(b.bwd + b.wait_bwd + b.shared[1] for b in blocks) \
        - lf - lb


def stage_blocks(cfg, lay, stage: int, layer, head, edge,
                 per_module: bool = False, recipe: bool = False,
                 remat: float = 0.0, ring=None) -> list[Block]:
    """The modules of pipeline ``stage`` of ``lay`` as :class:`Block` s, forward order:
    the embeddings (word V h / t, positions s h, ``embed_norm``'s 2 h) on the first
    stage, its layers (``costs.layer_cost``), the final norm and the head on the last
    (the head's own V h / t unless tied to the embedding on one stage); their parameters sum to
    ``memory.stage_params``.  Their seconds are compute only, and only compute hides
    ZeRO's collectives here; on the simulated clock the tensor-parallel collectives run
    on their own group's stream (``sim_mesh.trace``), so a ZeRO collective may also run
    beside one of them there, which this model does not count (the dry run and the
    estimate agree within 4% on tests/test_dryrun.py's ZeRO layouts with TP).
    ``per_module``: DeepSpeed's granularity, each layer's four weight matrices their own
    blocks (biases and norms below ``PERSISTENCE_NUMEL`` left out: never gathered).
    ``recipe``: this library's recipe's granularity (:func:`recipe_blocks`, with
    ``ring``)."""
    if recipe:
        return recipe_blocks(cfg, lay, stage, layer, head, edge, remat, ring)
    if ring is not None:
        raise ValueError("stage_blocks: ring= (the cp exchange on ZeRO's stream) is priced "
                         "for this library's recipe only; give recipe=True")
    from .memory import layer_params
    h, V, s, tp, pp = cfg.d_model, cfg.vocab_size, cfg.seq_len, lay.tp, lay.pp
    out = []
    llama = cfg.arch == "llama"
    if stage == 0:      # word embedding (and GPT's position table, BLOOM's LayerNorm)
        out.append(Block(V * h / tp + (0 if llama else s * h)
                         + (2 * h if getattr(cfg, "embed_norm", False) else 0),
                         edge["first"][0], edge["first"][1]))
    if per_module:
        # DeepSpeed ZeRO-3 gathers module by module (each nn.Linear its own fetch) and
        # never the parameters under PERSISTENCE_NUMEL (biases, norms: not partitioned);
        # ASSUMPTION: the layer's compute is shared among its four matrices in
        # proportion to their weights (their GEMMs' share of its FLOPs; the attention
        # core and the memory-bound kernels go along)
        f = cfg.d_ff
        if llama:      # q, k, v, o, w1, w3, w2 (llama_layer)
            from .llama_layer import weight_matrices
            ws = weight_matrices(cfg, tp)
        else:
            ws = (3 * h * h / tp, h * h / tp, h * f / tp, f * h / tp)
        mats = [w for w in ws if w >= PERSISTENCE_NUMEL]
        tot = sum(mats)
        one = [Block(w, layer.fwd_compute * w / tot, layer.bwd_compute * w / tot)
               for w in mats]
        out += one * lay.stage_layers(cfg.n_layer)[stage]
    else:
        out += [Block(layer_params(cfg, tp), layer.fwd_compute, layer.bwd_compute)] \
            * lay.stage_layers(cfg.n_layer)[stage]
    if stage == pp - 1:
        own = V * h / tp if pp > 1 or not cfg.tie_embeddings else 0.0
        out.append(Block((h if llama else 2 * h) + own, head.fwd_compute + edge["last"][0],
                         head.bwd_compute + edge["last"][1]))
    return out


def _recipe_modules(cfg, tp: int) -> list[tuple]:
    """One layer's modules as this library's recipe gathers them, forward order, each as
    the elements of its parameters (``models.gpt`` / ``models.llama``: GPT's LayerNorm
    weight and bias, q, k, v, o, fc1, fc2 with their biases, the row-parallel biases
    whole; Llama's RMSNorm weight and its seven bias-free matrices); their sums are
    ``memory.zero3_modules``' (unpadded)."""
    h, f = cfg.d_model, cfg.d_ff
    if cfg.arch == "llama":
        from .llama_layer import weight_matrices
        q, k, v, o, w1, w3, w2 = weight_matrices(cfg, tp)
        return [(h,), (q,), (k,), (v,), (o,), (h,), (w1,), (w3,), (w2,)]
    col = (h * h / tp, h / tp)
    return [(h, h), col, col, col, (h * h / tp, h), (h, h), (h * f / tp, f / tp),
            (f * h / tp, h)]


def recipe_blocks(cfg, lay, stage: int, layer, head, edge, remat: float = 0.0,
                  ring=None) -> list[Block]:
    """The modules of pipeline ``stage`` as this library's recipe runs ZeRO-2/3
    (``parallel.strategies.fsdp_dist``: a pre-forward hook per module holding parameters
    gathers that module's, no persistence threshold, prefetching along the order the
    forward ran; ``DistTensorFSDP._reduce_scatter_hook`` and ``DataParallel(zero=2)``:
    one reduce-scatter per parameter as its gradient is produced): the word embedding
    (and GPT's position table and embedding LayerNorm, modules of their own), each
    layer's modules
    (:func:`_recipe_modules`), the final norm and the head (its own V h / t unless tied
    on one stage).  ASSUMPTION: a layer's compute is shared among its modules in
    proportion to their parameters (as DeepSpeed's ``per_module`` blocks), the final
    norm's left in the head's block; so is ``remat``, the seconds of a layer's backward
    that re-run its forward (recompute), and each module is tagged with its layer
    (``Block.group``) for ``zero_exposed(regather=True)``.  ``ring``: the attention's
    exchange over the cp group where that group is ZeRO's (``ep_cp.ring_program``: its
    programs and the seconds of ``layer`` they stand for), run where the runtime runs it,
    between the value projection and the output projection (the forward after v's
    module, the backward after o's and its reduce-scatters), on ZeRO's stream; the
    layer's other seconds shared among the modules as above.  With recompute, the
    exchange's re-run (``ring["remat"]``) after v's re-run where ``remat`` re-gathers
    the layer (ZeRO-3 "full" / "op": ``Block.after_remat``), else before the backward's
    program (ZeRO-2; ZeRO-3 "selective")."""
    from .memory import stage_params
    h, V, s, tp, pp = cfg.d_model, cfg.vocab_size, cfg.seq_len, lay.tp, lay.pp
    llama = cfg.arch == "llama"
    nl = lay.stage_layers(cfg.n_layer)[stage]
    out = []
    if stage == 0:
        emb = [(V * h / tp,)] + ([] if llama else [(s * h,)])
        if getattr(cfg, "embed_norm", False):
            emb.append((h, h))                     # BLOOM's LayerNorm on the embeddings
        tot = sum(sum(p) for p in emb)
        out += [Block(sum(p), edge["first"][0] * sum(p) / tot, edge["first"][1] * sum(p) / tot,
                      p) for p in emb]
    mods = _recipe_modules(cfg, tp)
    tot = sum(sum(p) for p in mods)
    # PyTorch's non-reentrant checkpoint stops re-running once every tensor the backward
    # needs is back (``llama_layer.op_sac_recompute``): a block without dropout re-runs
    # up to w2's (GPT: fc2's) input, so w2 / fc2 is gathered for its backward as any
    # module, with prefetch, and its backward runs before the recompute (the dry run's
    # trace, GPT dp 2 cp 4 "full": fc2's two GEMMs, then the re-run up to the GeLU;
    # tests/test_zerocp5.py); with dropout the mask follows it, so it re-runs
    rerun = len(mods) - 1 if not cfg.dropout > 0 else len(mods)
    rtot = sum(sum(p) for p in mods[:rerun])
    fc, fw, bc, bw = layer.fwd_compute, layer.fwd_comm, layer.bwd_compute, layer.bwd_comm
    if ring is not None:
        # the recomputed attention's exchange (``ring["remat"]``): with ZeRO-3's
        # re-gathered layer (``remat``) after the value projection's re-run, as the
        # runtime re-runs the block's forward module by module; else (ZeRO-2: no
        # re-gather) before the backward's program, on the same stream
        rc, rf, rb = ring.get("remat", ()), ring.get("remat_compute", 0.0), \
            ring.get("remat_comm", 0.0)
        fc, fw = fc - ring["fwd_compute"], fw - ring["fwd_comm"]
        bc, bw = bc - ring["bwd_compute"] - rf, bw - ring["bwd_comm"] - rb
        # q, k, v, o are modules 1-4 of both models (_recipe_modules)
        if remat:
            remat -= rf
            prog = {3: dict(after_fwd=ring["fwd"], after_remat=tuple(rc),
                            shared=(ring["fwd_compute"] + ring["fwd_comm"], rf + rb)),
                    4: dict(after_bwd=ring["bwd"],
                            shared=(0.0, ring["bwd_compute"] + ring["bwd_comm"]))}
        else:
            prog = {3: dict(after_fwd=ring["fwd"],
                            shared=(ring["fwd_compute"] + ring["fwd_comm"], 0.0)),
                    4: dict(after_bwd=tuple(rc) + tuple(ring["bwd"]),
                            shared=(0.0, ring["bwd_compute"] + ring["bwd_comm"] + rf + rb))}
    else:
        prog = {}
    for k in range(nl):
        # the backward's own seconds by parameters, the re-run's over the modules that
        # re-run (was: all of ``bc`` by parameters, so w2 / fc2, which do not re-run,
        # carried a share of the re-run before it in their backward)
        out += [Block(sum(p), fc * sum(p) / tot,
                      (bc - remat) * sum(p) / tot + (remat * sum(p) / rtot if j < rerun
                                                     else 0.0),
                      p, k if j < rerun else -1,
                      remat * sum(p) / rtot if j < rerun else 0.0,
                      fw * sum(p) / tot, bw * sum(p) / tot, **prog.get(j, {}))
                for j, p in enumerate(mods)]
    if stage == pp - 1:
        norm = (h,) if llama else (h, h)
        fwd, bwd = head.fwd_compute + edge["last"][0], head.bwd_compute + edge["last"][1]
        if pp > 1 or not cfg.tie_embeddings:
            out += [Block(sum(norm), 0.0, 0.0, norm), Block(V * h / tp, fwd, bwd, (V * h / tp,))]
        else:
            out.append(Block(sum(norm), fwd, bwd, norm))
    assert abs(sum(b.numel for b in out) - stage_params(cfg, tp, pp, stage, nl)) < 1, \
        "recipe_blocks: the modules' parameters must be the stage's"
    return out
