"""Parallel strategies built on DistTensor, the collectives and the modeled clock.

One data-parallel family, PyTorch's three wrappers, each over a plain module (one row per
simulated rank, the module run once per rank: :mod:`.ddp`, :mod:`.fsdp`,
:mod:`.zero_optimizer`) or over a module whose parameters are DistTensors
(``wb.parallelize``, beside tensor parallelism on another mesh dim: :mod:`.ddp_dist`,
:mod:`.fsdp_dist`, :mod:`.zero_optimizer_dist` with ``partition="chunks"``).  The course's names run on them: ``DataParallel`` (plain DP and ZeRO-1/2,
:mod:`.data_parallel`) on DDP's DistTensor engine and ``ZeroRedundancyOptimizer``'s
per-chunk mode (:mod:`.zero_optimizer_dist`), ``Zero3``
(:mod:`.zero3`) is FSDP over DistTensors with its own AdamW.

Also: tensor and sequence parallel (:mod:`.tensor_parallel`), context parallelism (ring
attention with causal load balancing, :mod:`.context_parallel`; DeepSpeed-Ulysses'
all-to-all attention, ``cp_comm="a2a"``, :mod:`.context_parallel_a2a`; CP against SP as data,
:mod:`.context_parallel_cost`; gradients summed over dp x cp as one group,
:mod:`.flat_dims`), expert parallelism (a MoE layer's experts over an ep dim,
tokens by uneven all-to-all, :mod:`.expert_parallel`; its chunked overlap on the clock,
:mod:`.expert_parallel_clock`), activation counting
(:mod:`.memory`), and compute/communication overlap (``overlap.py``: decomposed
collectives; ``overlap_sweep.py``: their hidden share against k, sizes and profiles;
``overlap_multicopy.py``: MindSpore's multi-copy layer).  The recipes that wire them onto
the models live above, in ``workbench.recipes``.
"""
