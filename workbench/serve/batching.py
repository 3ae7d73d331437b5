"""Continuous batching against static batching, on the modeled clock.

    from workbench.serve.batching import poisson_trace, continuous, static, StepPricer
    trace = poisson_trace(200, rate=8.0, prompt=(32, 512), output=(16, 512), seed=0)
    pricer = StepPricer("llama2-7b", "ascend-910b")
    cont, stat = continuous(trace, pricer), static(trace, pricer)
    cont.throughput / stat.throughput, cont.ttft_p99, stat.tpot_p50

**Static batching** (request-level scheduling, as serving systems ran before Orca): when
the engine is free it takes up to ``max_batch`` waiting requests, prefills them padded to
the longest prompt, then decodes the whole batch until its longest output is done; a
request that finished early keeps its slot (and its padded work), and requests that
arrive meanwhile wait for the next batch.

**Continuous batching** (iteration-level scheduling: Yu et al., "Orca: A Distributed
Serving System for Transformer-Based Generative Models", OSDI'22; Kwon et al., "Efficient
Memory Management for Large Language Model Serving with PagedAttention" (vLLM), SOSP'23):
the scheduler decides again at every step.  A finished request leaves at once and a
waiting one takes its place; one step mixes the decode tokens of the running requests
with prompt tokens of new ones under a token budget (``token_budget``; a long prompt is
prefilled in chunks over several steps, vLLM's chunked prefill after Agrawal et al.,
"Sarathi-Serve", OSDI'24).  Admission reserves a request's prompt + output tokens of KV
cache, as Orca reserves ``max_tokens`` (vLLM allocates blocks as they fill and preempts
instead; with the capacity used here neither ever runs out).

**The clock** (:class:`StepPricer`): a step is one forward over all its tokens, priced on
the hardware profile's roofline (:func:`workbench.sim_mesh.kernel_cost.compute_time`,
Williams et al. 2009): FLOPs ``2 x matmul parameters x tokens`` plus attention's
``4 h`` per (query, key) pair; bytes the weights once per step plus each sequence's KV
cache read once (FlashAttention-style) and its new K, V written.  A prefill of hundreds of
tokens is compute-bound; a decode step of a few sequences moves the weights for a handful
of tokens and is memory-bound, which is why adding sequences to a decode step costs
almost nothing, and why keeping the batch full (continuous) pays.  Activations and the
embedding lookup are left out (small beside the weights at these sizes).

Everything returned is plain data (:mod:`.requests`): :class:`Request`, :class:`Step` (the
timeline) and :class:`Result` (throughput, time to first token and time per output token,
p50 / p99).
"""
from __future__ import annotations

from ..models.config import ModelConfig, get_config
from ..sim_mesh.kernel_cost import compute_time
from ..sim_mesh.profiles import get_profile
from .requests import (Request, Result, Step, latency_table, percentile, poisson_trace,
                       read_trace)

__all__ = ["Request", "Step", "Result", "StepPricer", "poisson_trace", "read_trace", "continuous",
           "static", "latency_table", "percentile", "KERNELS_PER_LAYER"]

KERNELS_PER_LAYER = 8       # norm, qkv, rotary, attention, o, norm, gate/up, down: an
                            # assumption of this model (each priced as one launch)


class StepPricer:
    """Seconds of one engine step on ``profile`` for ``model`` (module docstring)."""

    def __init__(self, model="llama2-7b", profile="ascend-910b", dtype: str | None = None,
                 weight_bits: int | None = None):
        self.cfg = model if isinstance(model, ModelConfig) else get_config(model)
        self.profile = get_profile(profile)
        self.dtype = dtype or self.cfg.dtype
        c = self.cfg
        sizes = {"float32": 4, "bfloat16": 2, "float16": 2}
        if self.dtype not in sizes:
            raise ValueError(f"StepPricer(dtype={self.dtype!r}): use one of {list(sizes)}")
        self.itemsize = sizes[self.dtype]
        # weight-only quantization (int8, int4): the matmul weights are read at
        # weight_bits each (their scales, one per row or group, left out); the compute
        # still runs in ``dtype`` after dequantizing
        if weight_bits not in (None, 4, 8):
            raise ValueError(f"StepPricer(weight_bits={weight_bits!r}): give 8, 4 or None "
                             "(the weights in dtype)")
        self.weight_bits = weight_bits or 8 * self.itemsize
        # the weights a token's forward multiplies by, and a token's keys and values in
        # every layer: serve.roofline's and serve.kv_cache's counts (one definition)
        from .kv_cache import kv_bytes_per_token
        from .roofline import linear_weights
        self.head_params = c.vocab_size * c.d_model                    # the lm head
        self.layer_params = (linear_weights(c) - self.head_params) // c.n_layer
        self.weight_bytes = (c.n_layer * self.layer_params + self.head_params) \
            * self.weight_bits // 8
        self.kv_bytes_per_token = kv_bytes_per_token(c, self.dtype)
        # what the server holds (kv_capacity): every parameter, not only those a step
        # multiplies by: the embedding table (and the head, untied), norms, biases, GPT's
        # position table; the linears at weight_bits, the rest in dtype (quantize_model's
        # split: a head tied to the embedding stays in dtype)
        # (and the quantized linears' scales, in dtype: quantize_model's default groups)
        from .roofline import resident_scales, resident_weights
        quantized, other = resident_weights(c)
        scales = resident_scales(c, weight_bits) if weight_bits else 0
        self.resident_bytes = quantized * self.weight_bits // 8 + (other + scales) * self.itemsize

    def kv_capacity(self, utilization: float = 0.9) -> int:
        """Tokens of KV cache that fit beside the weights in ``utilization`` of the
        device memory (vLLM's ``gpu_memory_utilization`` default, 0.9).  The weights are
        every parameter the server holds (``resident_bytes``: the embedding and an untied
        head too), not only the ones a step reads (``weight_bytes``)."""
        if isinstance(utilization, bool) or not isinstance(utilization, (int, float)) \
                or not 0 < utilization <= 1:
            raise ValueError(f"kv_capacity(utilization={utilization!r}): give the share of the "
                             "device memory to use, in (0, 1] (vLLM's default 0.9)")
        free = self.profile.memory_bytes * utilization - self.resident_bytes
        return max(0, int(free // self.kv_bytes_per_token))

    def terms(self, prefill=(), decode=()) -> tuple:
        """(FLOPs, bytes, sampled tokens) of a step: ``prefill`` a list of (context
        before, new tokens) chunks, ``decode`` the context length of each decoding
        sequence."""
        c = self.cfg
        chunks = list(prefill) + [(p, 1) for p in decode]
        tokens = sum(n for _, n in chunks)
        if not tokens:
            return 0.0, 0.0, 0
        pairs = sum(n * p + n * (n + 1) / 2 for p, n in chunks)      # causal (query, key)
        sampled = len(chunks)                                        # logits: last token each
        flops = 2 * c.n_layer * self.layer_params * tokens + 4 * c.n_layer * c.d_model * pairs \
            + 2 * self.head_params * sampled
        kv_read = sum(p + n for p, n in chunks) * self.kv_bytes_per_token
        return flops, self.weight_bytes + kv_read + tokens * self.kv_bytes_per_token, sampled

    def seconds(self, prefill=(), decode=()) -> float:
        flops, nbytes, _ = self.terms(prefill, decode)
        if not flops:
            return 0.0
        return compute_time(flops, nbytes, self.profile, self.dtype, op_class="matmul",
                            launches=self.cfg.n_layer * KERNELS_PER_LAYER)


def _check(trace, max_batch, pricer):
    if not trace:
        raise ValueError("the trace holds no requests")
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch={max_batch!r}: give an int >= 1")
    if not isinstance(pricer, StepPricer):
        raise TypeError(f"pricer={pricer!r:.60}: give a StepPricer(model, profile)")
    ids = set()
    for r in trace:
        if not isinstance(r, Request):
            raise TypeError(f"trace holds {r!r:.60}; give Request(id, arrival, prompt, output)s")
        if not (isinstance(r.prompt, int) and isinstance(r.output, int) and r.prompt >= 1
                and r.output >= 1 and 0 <= r.arrival < float("inf")):
            raise ValueError(f"{r}: prompt and output must be ints >= 1 (tokens), arrival a "
                             "finite time >= 0 (seconds)")
        if r.id in ids:
            raise ValueError(f"two requests have id={r.id!r}: the results are keyed by id; "
                             "give every request its own")
        ids.add(r.id)
    return sorted(trace, key=lambda r: (r.arrival, r.id))


def _check_context(reqs, pricer):
    """Every request must fit the model's context: prompt + output <= seq_len (a server
    refuses a longer one, as vLLM's ``max_model_len`` check does; pricing it would time
    work the model cannot do)."""
    ctx = pricer.cfg.seq_len
    long = [r for r in reqs if r.prompt + r.output > ctx]
    if long:
        r = long[0]
        raise ValueError(f"request {r.id}: prompt {r.prompt} + output {r.output} = "
                         f"{r.prompt + r.output} tokens > seq_len={ctx}, the longest context "
                         f"of the model priced ({len(long)} request(s) too long); shorten "
                         "them, or price a model with a longer context")


def static(trace, pricer: StepPricer, max_batch: int = 32) -> Result:
    """Request-level batching (module docstring): a batch runs until its longest output
    is done, padded to its longest prompt; the KV cache reserves the padded batch."""
    reqs = _check(trace, max_batch, pricer)
    _check_context(reqs, pricer)
    cap = pricer.kv_capacity()
    t, i, queue, steps, first, finish = 0.0, 0, [], [], {}, {}
    while len(finish) < len(reqs):
        if not queue and i < len(reqs) and reqs[i].arrival > t:
            t = reqs[i].arrival
        while i < len(reqs) and reqs[i].arrival <= t:
            queue.append(reqs[i])
            i += 1
        batch, queue = queue[:max_batch], queue[max_batch:]
        plen, olen = max(r.prompt for r in batch), max(r.output for r in batch)
        if len(batch) * (plen + olen) > cap:
            raise ValueError(f"static: a batch of {len(batch)} x {plen + olen} tokens "
                             f"exceeds the KV cache's {cap} tokens; lower max_batch")
        ids = tuple(r.id for r in batch)
        dt = pricer.seconds(prefill=[(0, plen)] * len(batch))
        steps.append(Step(t, dt, len(batch) * plen, 0, ids))
        t += dt
        for r in batch:
            first[r.id] = t
            if r.output == 1:
                finish[r.id] = t
        for k in range(1, olen):            # every slot decodes, finished or not (padding)
            # feeding token k: the cache holds the prompt and tokens 1 .. k - 1
            dt = pricer.seconds(decode=[plen + k - 1] * len(batch))
            steps.append(Step(t, dt, 0, len(batch), ids))
            t += dt
            for r in batch:
                if r.output == k + 1:
                    finish[r.id] = t
    return Result("static", steps, first, finish, reqs)


def continuous(trace, pricer: StepPricer, max_batch: int = 32,
               token_budget: int = 512) -> Result:
    """Iteration-level scheduling (module docstring): every step decodes one token of each
    running request and fills the rest of ``token_budget`` with prompt tokens of admitted
    requests (chunked prefill), admitting waiting ones while a slot and KV cache are free."""
    reqs = _check(trace, max_batch, pricer)
    if isinstance(token_budget, bool) or not isinstance(token_budget, int) \
            or token_budget < max_batch:
        raise ValueError(f"token_budget={token_budget!r}: give an int >= max_batch "
                         f"({max_batch}), so that every running request can decode")
    _check_context(reqs, pricer)
    cap = pricer.kv_capacity()
    t, i, waiting, running, steps, first, finish = 0.0, 0, [], [], [], {}, {}
    done = {}               # request id -> prompt tokens prefilled (== prompt: decoding)
    made = {}               # request id -> output tokens made
    used = 0                # KV tokens reserved
    while len(finish) < len(reqs):
        while i < len(reqs) and reqs[i].arrival <= t:
            waiting.append(reqs[i])
            i += 1
        while waiting and len(running) < max_batch and \
                used + waiting[0].prompt + waiting[0].output <= cap:
            r = waiting.pop(0)
            used += r.prompt + r.output
            running.append(r)
            done[r.id], made[r.id] = 0, 0
        if not running:
            if waiting:
                raise ValueError(f"continuous: request {waiting[0].id} needs "
                                 f"{waiting[0].prompt + waiting[0].output} KV tokens, more "
                                 f"than the cache's {cap}")
            t = reqs[i].arrival
            continue
        decode = [r for r in running if done[r.id] == r.prompt]
        budget = token_budget - len(decode)
        chunks = []
        for r in running:                   # first come, first served
            if done[r.id] < r.prompt and budget > 0:
                n = min(r.prompt - done[r.id], budget)
                chunks.append((r, n))
                budget -= n
        dt = pricer.seconds(prefill=[(done[r.id], n) for r, n in chunks],
                            # the token fed (the last made) is not in the cache yet
                            decode=[r.prompt + made[r.id] - 1 for r in decode])
        steps.append(Step(t, dt, sum(n for _, n in chunks), len(decode),
                          tuple(r.id for r in decode) + tuple(r.id for r, _ in chunks)))
        t += dt
        for r in decode:
            made[r.id] += 1
        for r, n in chunks:
            done[r.id] += n
            if done[r.id] == r.prompt:      # the prompt's last chunk samples token 1
                made[r.id], first[r.id] = 1, t
        for r in list(running):
            if done[r.id] == r.prompt and made[r.id] == r.output:
                finish[r.id] = t
                running.remove(r)
                used -= r.prompt + r.output
    return Result("continuous", steps, first, finish, reqs)
