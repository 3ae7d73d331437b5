"""Each pipeline rank of an estimate: its stage's name and kind in
``details["stages"]``, the point-to-point crossings it is charged on its own links
(:func:`_p2p`, :func:`_crossings`), its own row (:func:`_rows`) and memory
(:func:`_rank_memory`), and the order ties between ranks are broken in.  "Module docstring"
below: :mod:`.estimate`'s."""
from __future__ import annotations

from ..sim_mesh.cost import wire_bytes
from . import costs as C
from . import deepspeed_step as DS
from . import allocator as AL
from .layout import Layout
from .memory import stage_memory, stage_workspace_terms


def _crossings(lay: Layout, stage: int, links) -> tuple[float, float]:
    """(forward, backward) seconds of the stage crossings pipeline rank ``stage`` is
    charged per micro-batch, each on its own link (``links[r]``: one crossing of rank r ->
    r + 1, ``_p2p``): v forward on the link to the next rank, v backward on the link from
    the previous one (a blocking receive waits on the link: the last rank's forward waits
    on pp - 2 -> pp - 1, the first's backward on 0 -> 1); interleaved chunks cross pp - 1
    -> 0 too; this library's recipe as its dry run composes it: one fewer on the first
    rank's backward and the last's forward (``_recipe_chunks``)."""
    pp, v = lay.pp, lay.v
    if pp == 1:
        return 0.0, 0.0
    if v > 1:
        lf, lb = links[stage], links[(stage - 1) % pp]
    else:
        lf, lb = links[min(stage, pp - 2)], links[max(stage - 1, 0)]
    recipe = lay.engine == "workbench"
    return (v - (recipe and stage == pp - 1)) * lf, (v - (recipe and stage == 0)) * lb


def _rows(lay: Layout, stages: dict, links, ds=None) -> list:
    """Per pipeline rank r, its stage dict (``stage`` r) with its own crossings
    (``_crossings``): the middle stages share one dict, stage 1's, whose crossings are
    swapped for each rank's own.  ``ds``: DeepSpeed's pipeline engine
    (``deepspeed_step.pipeline_step``), whose rows are per stage already (each with its
    own transfers): taken as they are."""
    out = []
    for r in range(lay.pp):
        d = stages[_stage_name(r, lay.pp, lay.stages is not None)]
        if ds is not None:
            out.append(dict(d, stage=r, crossings=ds["stages"][r]["transfers"],
                            **{k: ds["stages"][r][k] for k in DS.STAGE_KEYS}))
            continue
        (f0, b0), (f1, b1) = d["crossings"], _crossings(lay, r, links)
        out.append(dict(d, stage=r, forward=d["forward"] - f0 + f1,
                        time=d["time"] - f0 - b0 + f1 + b1, comm=d["comm"] - f0 - b0 + f1 + b1,
                        crossings=(f1, b1)))
    return out


def _tie_order(lay: Layout, stages: dict) -> list:
    """The pipeline ranks in the order of their entries in ``stages`` (first, last, the
    middle ones), then by rank: the slowest or busiest of equals is the first so met."""
    names = list(stages)
    return sorted(range(lay.pp),
                  key=lambda r: (names.index(_stage_name(r, lay.pp, lay.stages is not None)),
                                 r))


def _rank_memory(cfg, lay: Layout, row: dict, r: int, attention: str, prof,
                 fusion) -> None:
    """Rank r's own memory in its row (``_rows``), where its entry is another rank's (a
    middle stage's: the communication library's buffers are per rank, each with its own
    neighbours' links, ``comm_memory``; the schedule's in-flight micro-batches too)."""
    psi, n_layers = row["psi"], lay.stage_layers(cfg.n_layer)[r]
    mem = stage_memory(cfg, lay, r, attention, prof, fusion)
    row.update(memory=mem, workspace_terms=stage_workspace_terms(cfg, lay, r, attention, prof,
                                                                 fusion),
               allocator_cache=AL.cached_bytes(cfg, lay, r, psi, n_layers),
               reserved_memory=AL.reserved_bytes(cfg, lay, r, psi, n_layers, mem, attention))


def _stage_name(s: int, pp: int, uneven: bool) -> str:
    """The key of stage ``s`` in ``details["stages"]``."""
    if pp == 1:
        return "only"
    if s in (0, pp - 1):
        return "first" if s == 0 else "last"
    return f"stage {s}" if uneven else "middle"


def _stage_kinds(pp: int, uneven: bool = False) -> list[tuple[str, int, int]]:
    """(name, a representative stage, how many stages are like it): uneven stages each
    their own."""
    if uneven:
        return [(_stage_name(s, pp, True), s, 1) for s in range(pp)]
    if pp == 1:
        return [("only", 0, 1)]
    out = [("first", 0, 1), ("last", pp - 1, 1)]
    return out + ([("middle", 1, pp - 2)] if pp > 2 else [])


def _p2p(cfg, lay: Layout, prof) -> tuple[list, float]:
    """(seconds of one activation (or gradient) crossing on each link, bytes of one
    crossing): ``links[r]`` is pipeline rank r -> r + 1 (and, interleaved, pp - 1 -> 0:
    chunks cross it too), each priced on its own ranks, so that with fewer than a node's
    devices per stage (tp x dp x cp below it) a crossing inside a node is NVLink's and one
    leaving it the network's (was: every crossing at the slowest link's price, one
    inter-node crossing of 15 charged on all of them; plan_random_layouts.py).
    Megatron-LM's scatter/gather (module docstring) where tp > 1 without sequence
    parallelism; this library's recipe (framework "workbench") has none: each TP rank
    sends its whole replicated activation to its peer (``Hybrid``'s stage send,
    ``sim_mesh.collectives.send_recv`` of the stage output's local tensor), measured on
    the dry run's trace (Llama 2 7B, tp 8, pp 2 across two 910B nodes: 1.352 ms a crossing
    against 0.331 ms priced as scatter/gather)."""
    n = 2 * cfg.seq_len * lay.micro_batch * cfg.d_model
    ends = [(s, s + 1) for s in range(lay.pp - 1)] + ([(lay.pp - 1, 0)] if lay.v > 1 else [])
    # every TP / CP / DP rank sends to its peer at once: the crossing is its slowest pair's
    # (C.crossing_price; was the t = d = c = 0 pair's, NVLink's where a stage straddling
    # two nodes sends some of its pairs across: tp 2, dp 3, pp 2 on 8-GPU nodes)
    pairs = [lay.crossing_pairs(a, b) for a, b in ends]
    if lay.tp > 1 and not lay.sp and lay.engine == "workbench":
        return [C.crossing_price(n, ps, prof) for ps in pairs], n
    gather = sent = 0.0
    if lay.tp > 1 and not lay.sp:
        gather = C.group_price("all_gather", n, tuple(lay.tp_ranks()), prof)
        sent = wire_bytes("all_gather", n, lay.tp)
    return [C.crossing_price(n / lay.tp, ps, prof) + gather
            for ps in pairs], n / lay.tp + sent
