"""A serving engine that generates: continuous batching over a paged KV cache.

    engine = Engine(model, num_blocks=32, block_size=4, max_batch=4, token_budget=16)
    engine.add_request("a", [5, 7, 9], max_new_tokens=8, eos_token_id=0)
    engine.add_request("b", [3], max_new_tokens=4, temperature=0.8, top_k=20, seed=1)
    while engine.has_unfinished():
        for out in engine.step():           # this step's new token of each request
            print(out.request_id, out.token, out.finished)
    engine.outputs["a"]                     # every token "a" generated
    engine.log                              # what each step ran, as plain data

Iteration-level scheduling (Yu et al., "Orca", OSDI'22) with vLLM's memory management
(Kwon et al., "Efficient Memory Management for Large Language Model Serving with
PagedAttention", SOSP'23, sec. 4.2-4.5).  Every :meth:`Engine.step` decides again, then
runs ONE forward (``engine_forward.packed_forward``) over

* the running requests' new tokens, oldest first: one decode token each, or the next
  chunk of a prompt still being prefilled; with ``token_budget`` a step holds at most
  that many tokens and a long prompt is prefilled in chunks over several steps (vLLM's
  chunked prefill, after Agrawal et al., "Sarathi-Serve", OSDI'24);
* then waiting requests, first come first served, admitted while a batch slot
  (``max_batch``), the budget, and free blocks for all of their tokens remain (vLLM's
  ``can_allocate``); otherwise they wait.

A request's blocks are taken as its tokens fill them.  When a running request needs a
block and none is free, the NEWEST running request is preempted (possibly itself):
its blocks are freed and it goes back to the front of the queue, to be recomputed later
from its prompt and the tokens it had made (vLLM's recompute preemption, sec. 4.5; the
tokens already returned stay returned).  A request leaves the batch, and frees its
blocks, as soon as it samples ``eos_token_id`` or its ``max_new_tokens``-th token.

Every request's tokens are those of serving it alone with ``generate`` (greedy: token
for token; sampled: the same tokens when it has its own ``seed``, one
``torch.Generator`` per request as vLLM's per-request seed), whatever it shares a step
with: the token-wise layers see each token alone, attention sees only the sequence's
own pages.  (In bfloat16 a prompt prefilled in chunks, ``token_budget``, attends in
another order than one whole prefill, so its logits differ by rounding, 0.004 measured on
gpt-tiny: a near tie of the sampling filter's cut, or of the argmax, can then flip a
token, as it can between any two groupings of the same bfloat16 sums.)  A
tensor-parallel model (``serve_model(cfg, tp=...)``) is served the same way, its KV
pools sharded over the key/value heads and the block tables shared by the ranks (vLLM's
``tensor_parallel_size``; ``engine_tp.py``); :meth:`Engine.memory` reports the pool's
bytes per rank.

:attr:`Engine.log` holds a :class:`StepRecord` per step (which requests prefilled how
many tokens after how much context, which decoded, which were admitted, preempted and
finished, tokens and blocks in use); :meth:`Engine.timeline` prices it on the modeled
clock with ``batching.StepPricer``, as ``batching.continuous`` prices its own schedule, and
:meth:`Engine.result` reports it as that scheduler's ``Result`` (latency table, timeline
chart).  With a pool that never runs out, the engine makes ``batching.continuous``'s steps
(the same requests, prefill and decode tokens in each; tests hold it).
"""
from __future__ import annotations

import torch

from ..parallel.dist_tensor import DistTensor
from .engine_forward import packed_forward
from .engine_tp import EngineMemory, make_cache, memory
from .engine_requests import (RequestOutput, StepRecord, _check_model, _Request,
                              _token_list)
from .requests import Request, Result, Step
from .sampling import SamplingParams, sample_next

__all__ = ["Engine", "RequestOutput", "StepRecord"]


class Engine:
    """Continuous batching with a paged KV cache over ``model`` (module docstring):
    ``num_blocks`` blocks of ``block_size`` token slots, at most ``max_batch`` requests
    in a step, at most ``token_budget`` tokens in a forward (None: whole prompts)."""

    def __init__(self, model, num_blocks: int, block_size: int, max_batch: int = 8,
                 token_budget: int | None = None):
        _check_model(model)
        for name, v in (("num_blocks", num_blocks), ("block_size", block_size),
                        ("max_batch", max_batch)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Engine({name}={v!r}): give an int >= 1")
        if token_budget is not None and (isinstance(token_budget, bool) or not isinstance(
                token_budget, int) or token_budget < max_batch):
            raise ValueError(f"Engine(token_budget={token_budget!r}): give an int >= max_batch="
                             f"{max_batch} (every running request may decode in a step), or "
                             "None for whole prompts in one step")
        self.model, self.max_batch, self.token_budget = model, max_batch, token_budget
        self.cache = make_cache(model, num_blocks, block_size)      # sharded over tp if laid out
        self.waiting: list[_Request] = []
        self.running: list[_Request] = []       # in admission order: the last is the newest
        self.outputs: dict = {}                 # request id -> tokens generated so far
        self.finish_reason: dict = {}           # request id -> "eos" | "length" | "abort"
        self.log: list[StepRecord] = []
        self._steps: dict = {}      # request id -> [added, first token, finish step], prompt

    @property
    def num_blocks(self) -> int:
        """Blocks in the KV pool (each rank holds its heads' share of every block)."""
        return self.cache.allocator.num_blocks

    def memory(self) -> EngineMemory:
        """The KV pool's bytes per rank, and those of the blocks in use (``engine_tp``)."""
        return memory(self.cache)

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, request_id, prompt_token_ids, max_new_tokens: int, *,
                    eos_token_id: int | None = None, temperature: float = 0.0,
                    top_k: int | None = None, top_p: float | None = None,
                    seed: int | None = None) -> None:
        """Queue a request; it is admitted by a later :meth:`step`.  ``eos_token_id``: an
        id or a list of ids that finish it (``generate``'s).  ``seed``: its own
        ``torch.Generator`` (sampled requests then draw what ``generate`` draws with
        ``generator=torch.Generator().manual_seed(seed)``; None: the global RNG)."""
        cfg = self.model.cfg
        if request_id in self.outputs:
            raise ValueError(f"add_request(request_id={request_id!r}): a request with this id "
                             "was added already; give every request its own id")
        prompt = _token_list(prompt_token_ids, cfg.vocab_size)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
                or max_new_tokens < 1:
            raise ValueError(f"add_request(max_new_tokens={max_new_tokens!r}): give an int >= 1")
        n = len(prompt) + max_new_tokens
        if n > cfg.seq_len:
            raise ValueError(f"add_request({request_id!r}): {len(prompt)} prompt + "
                             f"{max_new_tokens} new tokens = {n} > seq_len={cfg.seq_len}, the "
                             "longest context the model's positions cover; ask for fewer tokens")
        stop = () if eos_token_id is None else tuple(eos_token_id) \
            if isinstance(eos_token_id, (list, tuple)) else (eos_token_id,)
        if eos_token_id is not None and (not stop or any(
                isinstance(e, bool) or not isinstance(e, int) or not 0 <= e < cfg.vocab_size
                for e in stop)):
            raise ValueError(f"add_request(eos_token_id={eos_token_id!r}): give a token id in "
                             f"[0, {cfg.vocab_size}), a non-empty list of them (vLLM's "
                             "stop_token_ids), or None")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"add_request(seed={seed!r}): give an int, or None")
        params = SamplingParams(temperature, top_k, top_p)
        need = self.cache.blocks_needed(None, n - 1)    # the last token's k, v never stored
        if need > self.num_blocks:
            raise ValueError(f"add_request({request_id!r}): {n - 1} tokens of KV cache need "
                             f"{need} blocks of {self.cache.block_size}, the pool has "
                             f"{self.num_blocks}; build the Engine with more "
                             "num_blocks, or ask for fewer tokens")
        gen = None if seed is None else torch.Generator().manual_seed(seed)
        self.waiting.append(_Request(request_id, prompt, max_new_tokens, stop, params,
                                     gen))
        self.outputs[request_id] = []
        self._steps[request_id] = [len(self.log), None, None, len(prompt)]   # log indices

    def abort_request(self, request_id) -> None:
        """Stop a waiting or running request now (vLLM's ``abort_request``): its blocks go
        back to the pool; the tokens it made stay in :attr:`outputs`."""
        r = next((q for q in self.waiting + self.running if q.id == request_id), None)
        if r is None:
            raise KeyError(f"abort_request({request_id!r}): no waiting or running request has "
                           f"this id (finished: {request_id in self.finish_reason})")
        (self.waiting if r in self.waiting else self.running).remove(r)
        self.cache.release(r.id)
        self.finish_reason[r.id] = "abort"

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ----------------------------------------------------------------------------
    def _schedule(self):
        """(request, new tokens) of this step, the admitted and the preempted (module
        docstring)."""
        budget = self.token_budget or float("inf")
        free = self.cache.allocator.num_free
        sched, preempted, admitted = [], [], []
        i = 0
        while i < len(self.running) and budget > 0:         # oldest first
            r = self.running[i]
            n = int(min(len(r.tokens) - r.computed, budget))
            need = self.cache.blocks_needed(r.id, n)
            while need > free and self.running[-1] is not r:   # preempt the newest
                v = self.running.pop()
                free += len(self.cache.tables.blocks.get(v.id, ()))
                self._preempt(v)
                preempted.append(v)
            if need > free:                                  # r is the newest: itself
                self.running.pop()
                free += len(self.cache.tables.blocks.get(r.id, ()))
                self._preempt(r)
                preempted.append(r)
                break
            sched.append((r, n))
            free, budget, i = free - need, budget - n, i + 1
        while self.waiting and not preempted and len(self.running) < self.max_batch \
                and budget > 0:
            r = self.waiting[0]
            if self.cache.blocks_needed(None, len(r.tokens)) > free:
                break                                       # waits for blocks
            n = int(min(len(r.tokens), budget))
            self.waiting.pop(0)
            self.running.append(r)
            admitted.append(r)
            sched.append((r, n))
            free, budget = free - self.cache.blocks_needed(None, n), budget - n
        self.waiting[:0] = preempted[::-1]      # back to the front, oldest first
        return sched, admitted, preempted

    def _preempt(self, r: _Request) -> None:
        self.cache.release(r.id)
        r.computed = 0

    @torch.no_grad()
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, sample; returns the new token of every request whose
        sequence reached its end this step (decodes and last prompt chunks)."""
        sched, admitted, preempted = self._schedule()
        outs, finished = [], []
        if sched:
            segments = [(r.id, r.tokens[r.computed:r.computed + n]) for r, n in sched]
            was_training = self.model.training
            self.model.eval()
            try:
                logits = packed_forward(self.model, self.cache, segments)   # (R, V)
            finally:
                self.model.train(was_training)
            record_pre = [(r.id, r.computed, n) for r, n in sched
                          if not (n == 1 and r.output and r.computed == len(r.tokens) - 1)]
            record_dec = [(r.id, r.computed) for r, n in sched
                          if n == 1 and r.output and r.computed == len(r.tokens) - 1]
            laid_out = isinstance(logits, DistTensor)
            rows = logits.full() if laid_out else logits    # (R, V): one gather (engine_tp)
            toks = self._sample(sched, logits, rows, laid_out)
            for i, ((r, n), row) in enumerate(zip(sched, rows)):
                r.computed += n
                if r.computed < len(r.tokens):
                    continue                    # a prompt chunk: nothing sampled yet
                tok = toks[i]
                r.output.append(tok)
                if len(r.output) == 1:
                    self._steps[r.id][1] = len(self.log)
                self.outputs[r.id].append(tok)
                reason = "eos" if tok in r.eos else \
                    "length" if len(r.output) == r.max_new_tokens else None
                if reason:
                    self.running.remove(r)
                    self.cache.release(r.id)
                    self.finish_reason[r.id] = reason
                    finished.append(r.id)
                    self._steps[r.id][2] = len(self.log)
                outs.append(RequestOutput(r.id, tok, reason is not None, reason, row))
        else:
            record_pre, record_dec = [], []
        if sched or preempted:
            self.log.append(StepRecord(
                len(self.log), tuple(record_pre), tuple(record_dec),
                tuple(r.id for r in admitted), tuple(r.id for r in preempted),
                tuple(finished), sum(n for _, n in sched), self.cache.allocator.num_used,
                len(self.running), len(self.waiting)))
        return outs

    def _sample(self, sched, logits, rows, laid_out) -> dict:
        """{row: token} of every request whose sequence reached its end this step, drawn
        before any request changes: a draw that fails (e.g. a temperature so small that
        logits / T overflow: nan probabilities) leaves every request as before the step's
        forward (the cache's new slots given back, the generators as they were; one
        admitted this step stays running, with nothing computed), not some requests a
        step behind the keys their cache holds."""
        gens = [r.generator for r, _ in sched if r.generator is not None]
        states = [g.get_state() for g in gens]
        rng = torch.get_rng_state()
        toks = {}
        try:
            for i, ((r, n), row) in enumerate(zip(sched, rows)):
                if r.computed + n < len(r.tokens):
                    continue                    # a prompt chunk: nothing sampled yet
                toks[i] = int(sample_next(logits[i:i + 1], r.params, r.generator).full()[0]) \
                    if laid_out and not r.params.greedy else \
                    int(sample_next(row[None], r.params, r.generator)[0])
        except BaseException:
            for g, st in zip(gens, states):
                g.set_state(st)
            torch.set_rng_state(rng)
            self.cache.rollback()
            raise
        return toks

    def run(self) -> dict:
        """Step until every request has finished; returns request id -> its tokens."""
        while self.has_unfinished():
            self.step()
        return {k: list(v) for k, v in self.outputs.items()}

    def generate_all(self, prompts, max_new_tokens, **kwargs) -> list[list[int]]:
        """Serve ``prompts`` (lists of token ids) as requests 0, 1, ... (the next ids no
        earlier request of this engine holds); ``max_new_tokens``
        one int or one per prompt; ``kwargs`` as :meth:`add_request`'s, for all."""
        prompts = list(prompts)
        news = max_new_tokens if isinstance(max_new_tokens, (list, tuple)) \
            else [max_new_tokens] * len(prompts)
        if len(news) != len(prompts):
            raise ValueError(f"generate_all: {len(news)} max_new_tokens for {len(prompts)} "
                             "prompts; give one int, or one per prompt")
        ids, i = [], len(self.outputs)
        while len(ids) < len(prompts):          # ids no earlier request holds (one added
            if i not in self.outputs:           # with add_request(1, ...) keeps its own)
                ids.append(i)
            i += 1
        added = []
        try:
            for i, p, m in zip(ids, prompts, news):
                self.add_request(i, p, m, **kwargs)
                added.append(i)
        except Exception:                       # all or nothing: unqueue this call's ones
            self.waiting = [r for r in self.waiting if r.id not in added]
            for i in added:                     # only those: an earlier request's stay
                self.outputs.pop(i, None)
                self._steps.pop(i, None)
            raise
        out = self.run()
        return [out[i] for i in ids]

    # ---- the modeled clock -------------------------------------------------------------------
    def timeline(self, pricer) -> list[Step]:
        """:attr:`log` on the modeled clock: one ``requests.Step`` per engine step, priced
        by ``pricer`` (a ``batching.StepPricer``: its roofline of the step's chunks and
        decode contexts), back to back from t = 0 (arrival times are not modeled)."""
        t, steps = 0.0, []
        for rec in self.log:
            dt = pricer.seconds(prefill=[(c, n) for _, c, n in rec.prefill],
                                decode=[c for _, c in rec.decode])
            ids = tuple(i for i, _ in rec.decode) + tuple(i for i, _, _ in rec.prefill)
            steps.append(Step(t, dt, sum(n for _, _, n in rec.prefill), len(rec.decode), ids))
            t += dt
        return steps

    def result(self, pricer, name: str = "engine") -> Result:
        """The finished requests on the modeled clock, as ``batching.continuous`` reports
        its schedule (a ``requests.Result``: throughput, time to first token, time per
        output token; ``viz.serving.batching_timeline``): a request arrives at the start of
        the first step after :meth:`add_request`, its tokens count at the end of their
        steps."""
        steps = self.timeline(pricer)
        ends = [st.start + st.seconds for st in steps]
        starts = [st.start for st in steps] + [ends[-1] if ends else 0.0]
        done = [(i, t) for i, t in self._steps.items() if t[2] is not None]
        reqs = [Request(i, starts[t[0]], t[3], len(self.outputs[i]))
                for i, t in done]
        return Result(name, steps, {i: ends[t[1]] for i, t in done},
                      {i: ends[t[2]] for i, t in done}, reqs)

    def __repr__(self) -> str:
        tp = getattr(self.cache, "tp", 1)
        return (f"Engine({len(self.running)} running, {len(self.waiting)} waiting, "
                f"{self.cache.allocator}" + (f", tp={tp})" if tp > 1 else ")"))
