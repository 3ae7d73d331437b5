"""The serving engine on a tensor-parallel model: the paged KV cache sharded over the
key/value heads, one block table for every rank.

    served = serve_model("tiny", tp=2)
    engine = Engine(served.model, num_blocks=32, block_size=4)     # as on one device
    engine.memory()                     # the pool's bytes per rank, and those in use

vLLM's ``tensor_parallel_size`` (Kwon et al. 2023, "Efficient Memory Management for
Large Language Model Serving with PagedAttention", sec. 4.6 "Distributed Execution"):
the model is Megatron's tensor-parallel split (Shoeybi et al. 2019, sec. 3), so the
column-parallel wk, wv give each rank whole key/value heads, ``n_kv_head / tp`` of
them; each rank keeps the keys and values of ITS heads, in a pool of the same
``num_blocks`` blocks.  The scheduler and the block tables are shared: every rank
writes a token's keys and values into the same block id and slot ("all GPU workers
... share the same physical block IDs ... each GPU worker only stores a portion of
the KV cache for its corresponding attention heads", sec. 4.6), and attends its own
query heads to them with no communication (the heads are independent).  So a block
costs each rank ``2 * n_layer * (n_kv_head / tp) * block_size * head_dim`` elements,
1/tp of one device's.

:class:`ShardedPagedCache` holds every layer's pools as DistTensors placed as the
attention's keys are (``Shard(1)``, the head dim, over ``tp``; replicated over ``dp``
of size 1) and runs :meth:`RaggedPagedCache._attend` on each rank's local shards:
what rank r computes on its own heads, put back together with ``from_local``.  Grouped-
query attention needs ``n_kv_head`` divisible by tp (each rank then holds whole key
heads and the query heads that read them); dp > 1 is refused: the engine packs a
step's tokens into one row, which data parallelism would split over replicas; data
parallel serving runs one engine per replica (vLLM's ``data_parallel_size``).
On a simulated mesh the cache runs every rank's shard in turn; on torch.distributed
(``serve_model(..., distributed=True)`` under torchrun) each process runs its own, the
same schedule and block ids in every process (the scheduler is deterministic and a
request's seeded generator draws alike everywhere, as ``generate``'s).

The rest is the laid-out model's own forward (``serve_model``): the row-parallel
all-reduces, no more (tests count them).  The step's R rows of vocabulary-sharded
logits are then gathered once (as vLLM's logits processor gathers them before sampling;
``RequestOutput.logits`` is one device's row): a greedy request takes their argmax, the
same token as the vocabulary-parallel argmax ``generate`` runs on the same model (an
argmax of the same numbers, ties to the lowest index); a sampled request draws through
``generate``'s own path on the sharded row (the vocabulary-parallel topk, then the
softmax and one draw from its generator), so its tokens are ``generate``'s bit for bit.
In bfloat16 a tensor-parallel model's logits differ from one device's by rounding (the
partial sums of the row-parallel linears are added in another order), which can flip a
near-tie of ``generate`` itself: the engine's tokens are then the laid-out model's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..parallel import storage
from ..parallel.dist_tensor import DistTensor, from_local, shard_tensor
from ..parallel.placement import Replicate, Shard
from .engine_forward import RaggedPagedCache

__all__ = ["ShardedPagedCache", "EngineMemory", "layout_of", "make_cache"]


def layout_of(model):
    """(mesh, tp) of a laid-out model's parameters, or None for one device's plain
    tensors; a layout the engine cannot serve raises naming the fix."""
    params = [p for p in model.parameters() if isinstance(p, DistTensor)]
    if not params:
        return None
    mesh = params[0].mesh
    if any(p.mesh is not mesh for p in params):
        raise TypeError("Engine(model=...): the model's parameters live on several meshes "
                        "(pipeline stages?); the engine serves one tensor-parallel group: lay "
                        "the model out with serve_model(model.cfg, tp=..., "
                        "state_dict=model.state_dict())")
    names = tuple(mesh.dim_names)
    if "tp" not in names:
        raise TypeError(f"Engine(model=...): the model is laid out on a mesh {names} with no "
                        "'tp' dimension; serve a tensor-parallel layout, "
                        "serve_model(cfg, tp=...).model")
    tp = mesh.shape[names.index("tp")]
    other = {n: mesh.shape[i] for i, n in enumerate(names) if n != "tp"}
    if any(v > 1 for v in other.values()):
        raise ValueError(f"Engine(model=...): a layout with {other} (and tp={tp}); the engine "
                         "packs a step's tokens into one row, which data parallelism would "
                         "split over replicas. Serve data parallel as vLLM's "
                         "data_parallel_size does, one Engine per replica: build each on "
                         f"serve_model(cfg, tp={tp}).model (dp=1) and send each its own "
                         "requests")
    cfg = model.cfg
    for name, v in (("n_kv_head", cfg.n_kv_head), ("n_head", cfg.n_head)):
        if v % tp:
            raise ValueError(f"Engine(model=...): tp={tp} does not divide {name}={v}; each "
                             "rank keeps whole key/value heads in its pool: serve with a tp "
                             f"that divides {cfg.n_kv_head} (n_kv_head) and {cfg.n_head} "
                             "(n_head)")
    return mesh, tp


def make_cache(model, num_blocks: int, block_size: int) -> RaggedPagedCache:
    """The engine's cache for ``model``: one device's pools, or sharded over tp."""
    lay = layout_of(model)
    if lay is None:
        return RaggedPagedCache(model, num_blocks, block_size)
    return ShardedPagedCache(model, num_blocks, block_size, *lay)


class ShardedPagedCache(RaggedPagedCache):
    """:class:`RaggedPagedCache` whose pools are DistTensors sharded over the key/value
    heads on ``mesh``'s tp dimension (module docstring)."""

    def __init__(self, model, num_blocks: int, block_size: int, mesh, tp: int):
        self.mesh, self.tp = mesh, tp
        self.placements = tuple(Shard(1) if n == "tp" and tp > 1 else Replicate()
                                for n in mesh.dim_names)
        super().__init__(model, num_blocks, block_size)

    def _pool(self, shape, w):
        # (blocks, Hkv, bs, hd) global; each rank's local (blocks, Hkv / tp, bs, hd)
        return shard_tensor(torch.zeros(shape, dtype=w.dtype), self.mesh, self.placements)

    def _attend(self, kp, vp, q, k, v):
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, DistTensor) or t.mesh is not self.mesh or any(
                    a != b and n > 1        # a dim of size 1: Shard and Replicate alike
                    for a, b, n in zip(t.placements, self.placements, self.mesh.shape)):
                what = f"{tuple(t.placements)} on {t.mesh}" if isinstance(t, DistTensor) \
                    else f"a plain {type(t).__name__}"
                raise ValueError(f"ShardedPagedCache.attend: {name} is {what}; the pools are "
                                 f"{self.placements} on {self.mesh} (the key/value heads over "
                                 "tp, as the column-parallel wk, wv give them): serve the "
                                 "model laid out by serve_model(cfg, tp=...)")
        own = storage.holds_own(self.mesh)      # torch.distributed: this process's shard
        ys = [super(ShardedPagedCache, self)._attend(kp.local(r), vp.local(r), q.local(r),
                                                     k.local(r), v.local(r))
              for r in ([None] if own else self.mesh.ranks)]   # each rank: its heads, no comms
        return from_local(ys[0] if own else ys, self.mesh, q.placements, shape=q.shape,
                          check_replicas=False)

    def bytes_per_block(self) -> int:
        """Bytes one block takes on each rank: every layer's keys and values of its
        n_kv_head / tp heads."""
        pool = self.k_pools[0]
        return _block_bytes(pool.local(None if storage.holds_own(self.mesh)
                                       else self.mesh.ranks[0]), self.n_layer)


@dataclass(frozen=True)
class EngineMemory:
    """The engine's KV cache as plain data, per rank (one device: tp = 1)."""
    tp: int
    num_blocks: int
    block_size: int
    blocks_in_use: int
    bytes_per_block: int            # on each rank: 2 * n_layer * (Hkv / tp) * bs * hd * dtype

    @property
    def pool_bytes_per_rank(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def used_bytes_per_rank(self) -> int:
        return self.blocks_in_use * self.bytes_per_block

    def __str__(self) -> str:
        return (f"KV cache: {self.num_blocks} blocks of {self.block_size} tokens, "
                f"{self.bytes_per_block} B per block per rank; pool "
                f"{self.pool_bytes_per_rank} B per rank x tp={self.tp}; in use "
                f"{self.blocks_in_use} blocks = {self.used_bytes_per_rank} B per rank")


def memory(cache: RaggedPagedCache) -> EngineMemory:
    """``cache``'s :class:`EngineMemory`."""
    if isinstance(cache, ShardedPagedCache):
        tp, per_block = cache.tp, cache.bytes_per_block()
    else:
        tp, per_block = 1, _block_bytes(cache.k_pools[0], cache.n_layer)
    return EngineMemory(tp, cache.allocator.num_blocks, cache.block_size,
                        cache.allocator.num_used, per_block)


def _block_bytes(pool, n_layer: int) -> int:
    """One block of one layer's pool (blocks, heads, bs, hd), keys and values, all layers."""
    return 2 * n_layer * pool[0].numel() * pool.element_size()
