"""What the planner plans for: a :class:`Cluster` and a :class:`Layout` on it.

    cl  = Cluster(profile="a100", devices=1024)      # 128 nodes of 8 (the profile's node)
    lay = Layout(dp=16, tp=8, pp=8, sp=False, zero=0, recompute="full",
                 micro_batch=1, global_batch=1536, schedule="1f1b", v=1)

Rank order (Megatron-LM's default, ``megatron/core/parallel_state.py``): tensor
parallel innermost, then data parallel, then pipeline parallel outermost,

    rank = t + tp * (d + dp * s)       t < tp, d < dp, s < pp,

so a TP group is ``tp`` consecutive ranks (one node when tp <= devices per node), a
DP group strides by ``tp`` and a pipeline's neighbours are ``tp * dp`` ranks apart.
Nodes are packed: rank r sits on node r // devices_per_node (as ``sim_mesh.cost``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..sim_mesh.profiles import Profile, get_profile
from .frameworks import resolve as _resolve_framework
from . import ep_cp as _ep_cp
from . import recompute_chunks as _chunks

__all__ = ["Cluster", "Layout", "SCHEDULES", "check_layout", "check_model", "attention_for"]

# "interleaved_1f1b" needs v >= 2 model chunks per device; the others v == 1.
SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b")
_RECOMPUTE = ("none", "selective", "full", "op")
_ALIASES = {"interleaved": "interleaved_1f1b", "one_f_one_b": "1f1b"}


def _int(owner, name, v, lo=1):
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{owner}: {name}={v!r} must be an int >= {lo}")


@dataclass(frozen=True)
class Cluster:
    """``devices`` devices of one hardware ``profile``, in nodes of the profile's
    ``devices_per_node`` (the last node may be partly filled).

    ``profile`` is a name (``"a100"``, ``"ascend-910b"``, ...), a :class:`Profile`, or None
    for :func:`~workbench.sim_mesh.profiles.get_profile`'s default
    (``DEFAULT_PROFILE``, ``"a100"``), as every ``profile=None`` in the workbench means;
    it is stored as the resolved Profile."""
    profile: str | Profile = "a100"
    devices: int = 8

    def __post_init__(self):
        try:
            prof = get_profile(self.profile)
        except (ValueError, TypeError) as e:
            raise ValueError(f"Cluster: {e}") from None
        object.__setattr__(self, "profile", prof)
        _int("Cluster", "devices", self.devices)

    @property
    def nodes(self) -> int:
        return -(-self.devices // self.profile.devices_per_node)

    @property
    def memory_bytes(self) -> int:
        return self.profile.memory_bytes

    def __str__(self):
        nodes = f"{self.nodes} node{'' if self.nodes == 1 else 's'}"
        return (f"{self.devices} x {self.profile.name} ({nodes} of "
                f"{self.profile.devices_per_node}, {round(self.memory_bytes / 1e9, 1):g} GB each)")


@dataclass(frozen=True)
class Layout:
    """How one training step is spread: data (``dp``), tensor (``tp``, with sequence
    parallelism ``sp``) and pipeline (``pp``, ``schedule``, ``v`` chunks per device)
    parallelism, ZeRO stage ``zero`` over the dp group, activation ``recompute``
    ("none", "selective", "full", or "op": torchtitan's op-level selective checkpointing,
    dense Llama only, priced by ``plan.llama_layer``, run by ``models.op_sac``), and ``global_batch`` sequences per optimizer step
    split into micro-batches of ``micro_batch`` per dp rank (None: one micro-batch),
    run by ``framework`` ("megatron", "deepspeed", "workbench", "fsdp" or "deepspeed-0.3"
    with zero=3:
    ``plan.frameworks``;
    None: Megatron-LM for ZeRO 0-1, DeepSpeed for ZeRO 2-3, read back as
    :attr:`engine`).  ``stages``: the layers of each pipeline stage when they are
    uneven (Megatron-LM's ``--decoder-first-pipeline-num-layers`` /
    ``--decoder-last-pipeline-num-layers``: fewer layers beside the embedding or the
    head, which weigh as layers do); 1F1B or GPipe only.  ``recompute_num_layers``: with
    recompute="full", the layers of one checkpointed chunk (Megatron-LM's
    ``--recompute-method uniform --recompute-num-layers``, Megatron-DeepSpeed's
    ``--checkpoint-num-layers``; ``plan.recompute_chunks``), 1 by default."""
    dp: int = 1
    tp: int = 1
    pp: int = 1
    sp: bool = False
    zero: int = 0
    recompute: str = "none"
    micro_batch: int = 1
    global_batch: int | None = None
    schedule: str = "1f1b"
    v: int = 1
    framework: str | None = None
    stages: tuple | None = None     # layers per pipeline stage (None: n_layer / pp each)
    ep: int = 1                     # expert parallel: experts split over ep of the dp ranks
    cp: int = 1                     # context parallel: the sequence split over cp ranks
    cp_comm: str = "p2p"            # cp's attention: "p2p" ring or "a2a" (DeepSpeed-Ulysses),
    #                                 Megatron-LM's --cp-comm-type (plan.context_cost)
    recompute_num_layers: int = 1   # full recompute in chunks of k layers (plan.recompute_chunks)

    def __post_init__(self):
        for name in ("dp", "tp", "pp", "micro_batch", "v"):
            _int("Layout", name, getattr(self, name))
        if self.global_batch is None:
            object.__setattr__(self, "global_batch", self.dp * self.micro_batch)
        _int("Layout", "global_batch", self.global_batch)
        if not isinstance(self.sp, bool):
            raise ValueError(f"Layout: sp={self.sp!r} must be True or False")
        if self.sp and self.tp == 1:
            raise ValueError("Layout: sp=True splits the sequence over the tensor-parallel "
                             "group, but tp=1; set tp > 1 or sp=False")
        if self.zero not in (0, 1, 2, 3) or not isinstance(self.zero, int) or \
                isinstance(self.zero, bool):        # not 1.0: an int stage
            raise ValueError(f"Layout: zero={self.zero!r}; ZeRO stages are 0 (off), 1 "
                             f"(optimizer states), 2 (+ gradients), 3 (+ parameters)")
        if self.zero >= 2 and self.pp > 1:
            # DeepSpeed refuses ZeRO-2/3 with its pipeline engine: gradients accumulate
            # over micro-batches on every stage, which partitioned gradients cannot hold.
            raise ValueError(f"Layout: zero={self.zero} with pp={self.pp}: ZeRO-2/3 partition "
                             f"gradients, which pipeline gradient accumulation needs whole "
                             f"(DeepSpeed allows only ZeRO-0/1 with pipelines); use zero<=1 "
                             f"or pp=1")
        if isinstance(self.schedule, str):     # "1F1B", "GPipe", "Interleaved 1F1B" too
            key = self.schedule.strip().lower().replace(" ", "_").replace("-", "_")
            object.__setattr__(self, "schedule", _ALIASES.get(key, key))
        if self.recompute not in _RECOMPUTE:
            raise ValueError(f"Layout: recompute={self.recompute!r}; use one of {_RECOMPUTE}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"Layout: schedule={self.schedule!r} is not known; use one of "
                             f"{SCHEDULES}")
        if self.schedule == "interleaved_1f1b" and self.v < 2:
            raise ValueError(f"Layout: schedule='interleaved_1f1b' with v={self.v}: give "
                             f"v >= 2 model chunks per device (v=1 is schedule='1f1b')")
        if self.schedule != "interleaved_1f1b" and self.v != 1:
            raise ValueError(f"Layout: v={self.v} chunks per device needs "
                             f"schedule='interleaved_1f1b' (got {self.schedule!r})")
        if self.schedule == "interleaved_1f1b" and self.pp == 1:
            raise ValueError("Layout: schedule='interleaved_1f1b' needs pp > 1 stages")
        per_step = self.micro_batch * self.dp
        if self.global_batch % per_step:
            gb, dp = self.global_batch, self.dp
            fix = (f"use a micro_batch dividing global_batch / dp = {gb // dp} (one of "
                   f"{[d for d in range(1, gb // dp + 1) if (gb // dp) % d == 0][:8]}...)"
                   if gb % dp == 0 else
                   f"dp={dp} does not divide it: use a global_batch that is a multiple of "
                   f"{per_step}, or a dp dividing {gb}")
            raise ValueError(f"Layout: global_batch={gb} is not divisible by micro_batch x dp = "
                             f"{self.micro_batch} x {dp} = {per_step}; {fix}")
        _resolve_framework(self.framework, self.zero)
        _chunks.check_field(self)
        _ep_cp.check_fields(self)
        if self.stages is not None:
            st = tuple(self.stages) if isinstance(self.stages, (list, tuple)) else None
            if st is None or len(st) != self.pp or any(
                    isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in st):
                raise ValueError(f"Layout: stages={self.stages!r} must list the layers of each "
                                 f"of the pp={self.pp} pipeline stages, ints >= 0")
            if self.schedule == "interleaved_1f1b":
                raise ValueError("Layout: uneven stages (stages=...) with "
                                 "schedule='interleaved_1f1b' are not modeled; use '1f1b' "
                                 "or 'gpipe'")
            object.__setattr__(self, "stages", st)
        if self.schedule == "interleaved_1f1b" and self.m % self.pp:
            raise ValueError(f"Layout: schedule='interleaved_1f1b' needs the number of "
                             f"micro-batches m={self.m} to be a multiple of pp={self.pp} "
                             f"(Megatron-LM's rule); change global_batch or micro_batch")

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def stage_layers(self, n_layer: int) -> tuple:
        """Layers on each pipeline stage: ``stages``, or n_layer / pp each."""
        return self.stages if self.stages is not None else (n_layer // self.pp,) * self.pp

    @property
    def engine(self) -> str:
        """The framework this layout runs (``framework``, or its ZeRO stage's default)."""
        return _resolve_framework(self.framework, self.zero)

    @property
    def m(self) -> int:
        """Micro-batches per optimizer step on each pipeline."""
        return self.global_batch // (self.micro_batch * self.dp)

    def rank(self, t: int = 0, d: int = 0, s: int = 0, c: int = 0) -> int:
        """Global rank of TP rank t, DP rank d, pipeline stage s (module docstring) and
        context-parallel rank c (Megatron-LM's order tp-cp-dp-pp: ``plan.ep_cp``)."""
        return t + self.tp * (c + self.cp * (d + self.dp * s))

    def crossing_pairs(self, a: int, b: int) -> list[tuple[int, int]]:
        """(sender, receiver) of every rank of pipeline stage ``a`` and its peer of stage
        ``b``: the same TP, CP and DP coordinates (a stage crossing: each rank sends its
        own, at once, ``schedules.execute._send``)."""
        return [(self.rank(t, d, a, c), self.rank(t, d, b, c)) for d in range(self.dp)
                for c in range(self.cp) for t in range(self.tp)]

    def tp_ranks(self, d=0, s=0) -> list[int]:
        return [self.rank(t, d, s) for t in range(self.tp)]

    def dp_ranks(self, t=0, s=0) -> list[int]:
        return [self.rank(t, d, s) for d in range(self.dp)]

    def grad_ranks(self, t=0, s=0) -> list[int]:
        """The ranks that reduce a dense gradient together: dp x cp (Megatron-LM reduces
        over the data- and context-parallel ranks, which hold the same weights)."""
        return [self.rank(t, d, s, c) for d in range(self.dp) for c in range(self.cp)]

    def replace(self, **changes) -> "Layout":
        return replace(self, **changes)

    def short(self) -> str:
        """One line: ``dp16 tp8 pp8 1f1b mb1 full`` (+ ``sp``, ``zero1``, ``v2``)."""
        out = f"dp{self.dp} tp{self.tp} pp{self.pp}"
        out += f" {self.schedule}" + (f" v{self.v}" if self.v > 1 else "")
        out += f" mb{self.micro_batch} rc:{self.recompute}"
        out += f" chunk{self.recompute_num_layers}" if self.recompute_num_layers != 1 else ""
        out += " sp" if self.sp else ""
        out += f" zero{self.zero}" if self.zero else ""
        out += f" stages{list(self.stages)}" if self.stages is not None else ""
        out += (f" ep{self.ep}" if self.ep > 1 else "") + (f" cp{self.cp}" if self.cp > 1 else "")
        out += " a2a" if self.cp_comm == "a2a" else ""
        return out + (f" {self.framework}" if self.framework is not None else "")


def check_model(model) -> None:
    """Raise ValueError unless ``model`` is a 16-bit ``ModelConfig`` of arch "gpt"
    (Megatron's GPT) or "llama" (``plan.llama_layer``)."""
    if getattr(model, "arch", None) not in ("gpt", "llama"):
        raise ValueError(
            f"model={model!r}: the planner models ModelConfig(arch='gpt') (Megatron's GPT, "
            f"Korthikanti et al. 2022) and ModelConfig(arch='llama'); give one, e.g. "
            f"get_config('gpt3-175b') or get_config('llama2-7b')")
    if model.dtype not in ("bfloat16", "float16"):
        raise ValueError(f"model dtype={model.dtype!r}: the planner models mixed-precision "
                         f"training (16-bit weights and activations, fp32 optimizer "
                         f"states); use model.replace(dtype='bfloat16')")


def attention_for(model, attention) -> str:
    """The attention kernel an estimate prices: ``attention``, or by default (None)
    Megatron's unfused core for a GPT (Korthikanti et al. 2022, Table 2) and the fused
    kernel a Llama runs (the course's ``models.llama``; Megatron-LM's Llama recipes
    train with ``--use-flash-attn``)."""
    if attention is None:
        return "flash" if getattr(model, "arch", None) == "llama" else "materialized"
    if attention not in ("materialized", "flash"):
        raise ValueError(f"attention={attention!r}; use 'materialized' (Korthikanti Table 2) "
                         f"or 'flash'")
    if attention == "materialized" and getattr(model, "arch", None) == "llama":
        raise ValueError("attention='materialized' with arch='llama': the Llama block is "
                         "modeled with the fused attention kernel it runs; give "
                         "attention='flash' (or leave it None)")
    return attention


def check_layout(model, layout: Layout, cluster: Cluster) -> None:
    """Raise ValueError when ``layout`` does not fit ``cluster`` or ``model``."""
    if not isinstance(layout, Layout):
        raise ValueError(f"layout={layout!r} must be a workbench.plan.Layout")
    if not isinstance(cluster, Cluster):
        raise ValueError(f"cluster={cluster!r} must be a workbench.plan.Cluster")
    check_model(model)
    lay = layout
    if lay.world != cluster.devices:
        cp = (" x cp", f" x {lay.cp}") if lay.cp > 1 else ("", "")
        raise ValueError(f"Layout dp x tp x pp{cp[0]} = {lay.dp} x {lay.tp} x {lay.pp}{cp[1]} "
                         f"= {lay.world} but the cluster has devices={cluster.devices}; choose "
                         f"dp = {cluster.devices} / (tp x pp{cp[0]}) so the layout uses every "
                         f"device"
                         + (f" (ep={lay.ep} is carved out of dp, not a factor of its own)"
                            if lay.ep > 1 else ""))
    _ep_cp.check_layout(model, lay)
    _chunks.check_layout(model, lay)
    if lay.recompute == "op" and (model.arch != "llama" or getattr(model, "moe_experts", 0)):
        raise ValueError(f"Layout: recompute='op' (torchtitan's op-level selective "
                         f"checkpointing) is modeled for dense Llama blocks, not "
                         f"arch={model.arch!r}"
                         + (" with experts" if getattr(model, "moe_experts", 0) else "")
                         + "; use 'none', 'selective' or 'full'")
    if model.n_head % lay.tp:
        raise ValueError(f"Layout: tp={lay.tp} does not divide n_head={model.n_head} (each "
                         f"tensor-parallel rank owns whole heads); use a tp dividing "
                         f"{model.n_head}")
    if lay.stages is not None:
        if sum(lay.stages) != model.n_layer:
            raise ValueError(f"Layout: stages={list(lay.stages)} hold {sum(lay.stages)} layers "
                             f"but the model has n_layer={model.n_layer}; make them add up")
    elif model.n_layer % (lay.pp * lay.v):
        raise ValueError(f"Layout: pp x v = {lay.pp} x {lay.v} does not divide n_layer="
                         f"{model.n_layer} (each stage chunk holds whole layers); use pp x v "
                         f"dividing {model.n_layer}")
    if model.n_kv_head % lay.tp:
        raise ValueError(f"Layout: tp={lay.tp} does not divide n_kv_head={model.n_kv_head} "
                         f"(each tensor-parallel rank owns whole key/value heads, as "
                         f"Megatron-LM requires); use a tp dividing {model.n_kv_head}")
    if lay.sp and (model.seq_len // lay.cp) % lay.tp:
        # Megatron-LM splits the [s, b, h] activations along s (megatron/core/
        # tensor_parallel/mappings.py, _split_along_first_dim: "First dimension of the
        # tensor should be divisible by tensor parallel size"), as this library's recipe
        # (Hybrid.check): the sequence, not s x b, must divide
        s = model.seq_len // lay.cp
        good = [t for t in range(2, min(s, 64) + 1) if s % t == 0
                and model.n_head % t == 0][:6]
        raise ValueError(f"Layout: sp=True with tp={lay.tp} splits each sequence of "
                         f"seq_len" + (f" / cp = {model.seq_len} / {lay.cp}" if lay.cp > 1
                                       else "") + f" = {s} tokens over the tensor-parallel "
                         f"ranks, which must divide it; use a tp dividing {s}"
                         + (f" (one of {good})" if good else "")
                         + " or a seq_len that is a multiple of tp, or sp=False")
    if model.d_ff % lay.tp:
        raise ValueError(f"Layout: tp={lay.tp} does not divide d_ff={model.d_ff} (the "
                         f"column-parallel MLP splits its width evenly); use a tp dividing "
                         f"{model.d_ff}")
    if model.vocab_size % lay.tp:
        # Megatron-LM pads the vocabulary to a multiple of --make-vocab-size-divisible-by
        # (128) x tp (megatron/training/tokenizer/tokenizer.py, _vocab_size_with_padding)
        pad = -(-model.vocab_size // (128 * lay.tp)) * 128 * lay.tp
        raise ValueError(f"Layout: tp={lay.tp} does not divide vocab_size={model.vocab_size} "
                         f"(the vocabulary-parallel embedding and head split it evenly); pad "
                         f"the vocabulary as Megatron-LM does (model.replace(vocab_size="
                         f"{pad}): a multiple of 128 x tp) or use a tp dividing "
                         f"{model.vocab_size}")
