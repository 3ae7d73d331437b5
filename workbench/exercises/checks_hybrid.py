"""Checks for the exercises of notebook 08 (hybrid parallel): a rank's groups, a rank's
model-state bytes, and the fastest (dp, tp, pp) layout.

A rank's groups are derived from its coordinates, model-state bytes from the values a
rank holds; :func:`check_best_layout`'s exercise is to ask the simulator, so it asks it
too."""
from __future__ import annotations

import math
import numbers

import torch

from ..parallel.module import dist_parameters
from ..sim_mesh.mesh import Mesh
from ..sim_mesh.profiles import get_profile
from .answers import _int, _ints
from .checks import _chunks, _number, _ok, _scale_slip
from .feedback import CheckError, exercise

__all__ = ["check_hybrid_groups", "check_hybrid_state_bytes", "check_best_layout"]


# ---- 08 hybrid: a rank's groups ----------------------------------------------------------------

@exercise
def check_hybrid_groups(dp_group, tp_group, pp_peer, rank: int = 6) -> None:
    """In Hybrid(dp=2, tp=2, pp=2): ``rank``'s data-parallel group, tensor-parallel group
    (in mesh order) and the rank holding the same (dp, tp) position on the other stage."""
    # by hand: stage s holds ranks 4s..4s+3 as a 2 x 2 (dp, tp) mesh in row-major order
    stage, local = divmod(rank, 4)
    i, j = divmod(local, 2)
    mesh = Mesh([[4 * stage, 4 * stage + 1], [4 * stage + 2, 4 * stage + 3]], ["dp", "tp"])
    other = Mesh([[4 * (1 - stage) + k for k in (0, 1)], [4 * (1 - stage) + k for k in (2, 3)]],
                 ["dp", "tp"])
    want_dp = (4 * stage + j, 4 * stage + 2 + j)                 # same tp coordinate
    want_tp = (4 * stage + 2 * i, 4 * stage + 2 * i + 1)         # same dp coordinate
    want_peer = 4 * (1 - stage) + local
    got_dp = tuple(_ints("dp_group", dp_group, "ranks"))
    got_tp = tuple(_ints("tp_group", tp_group, "ranks"))
    where = (f"rank {rank} is on stage {stage}, Mesh({mesh.tolist()}, ['dp', 'tp']), at "
             f"coordinate {(i, j)}")
    shown = f"dp {want_dp}, tp {want_tp}, peer {want_peer}"
    if (got_dp, got_tp) == (want_tp, want_dp):
        raise CheckError(f"dp and tp are swapped: {where}; dp groups are the columns of the "
                         "stage mesh (mesh dim 0), tp groups its rows (mesh dim 1)",
                         expected=shown)
    for name, got, want in (("dp", got_dp, want_dp), ("tp", got_tp, want_tp)):
        if got == want:
            continue
        if sorted(got) == sorted(want):
            raise CheckError(f"your {name} group {got} has the right ranks in the wrong "
                             f"order; give them in mesh order", expected=shown)
        raise CheckError(f"your {name} group is {got}: {where}; its {name} group is the "
                         f"ranks of that stage mesh along mesh dim '{name}'", expected=shown)
    pp_peer = _int("pp_peer", pp_peer, "one rank (an int)")
    if pp_peer != want_peer:
        hint = (" (that is a rank of the same stage)" if pp_peer in mesh.ranks else "")
        raise CheckError(f"your pipeline peer is {pp_peer}{hint}: {where}; its peer holds the "
                         f"same coordinate on the other stage's mesh {other.tolist()}",
                         expected=shown)
    _ok(f"rank {rank}: dp group {want_dp} (gradients), tp group {want_tp} (activations), "
        f"pipeline peer {want_peer} (activations and their gradients between stages)")


# ---- 08 hybrid: model-state bytes per rank ----------------------------------------------------

def _stage_model(dp, tp, pp, preset):
    from ..models.config import get_config
    from ..recipes.hybrid import Hybrid
    st = Hybrid(dp=dp, tp=tp, pp=pp)
    with torch.random.fork_rng(devices=[]):
        model = st.build_model(get_config(preset), 0)
    return model, st


def _state_bytes(dp, tp, pp, zero, stage, preset, mixed=False, split=None):
    """By hand: the values the stage's first rank holds (its tp shards), times 4 B weight
    + 4 B gradient + 8 B Adam m, v (fp32; mixed: 2 + 2 + 12), the ZeRO-split parts cut
    by torch.chunk over dp (Rajbhandari et al. 2020); this rank is dp coordinate 0.
    ``split``: which of (weights, gradients, Adam's m and v) are cut over dp, in place of
    ``zero``'s (ZeRO-k cuts the last k of them... ZeRO-1 Adam's, ZeRO-2 the gradients too,
    ZeRO-3 everything)."""
    key = (dp, tp, pp, preset)
    if key not in _MODELS:          # one build per layout (a wrong answer prices 9 counts)
        _MODELS.clear()
        _MODELS[key] = _stage_model(dp, tp, pp, preset)
    model, st = _MODELS[key]
    rank = st.meshes[stage].ranks[0]
    w, g, opt = (2, 2, 12) if mixed else (4, 4, 8)
    cut = _ZERO_SPLITS[zero] if split is None else split
    total = 0
    for _, p in dist_parameters(model):
        if rank not in p.mesh.ranks:
            continue
        n = p.local(rank).numel()
        share = _chunks(n, dp)[0]
        total += sum(b * (share if c else n) for b, c in zip((w, g, opt), cut))
    return total, model, st


_MODELS: dict = {}


_SPLITS = {0: "nothing is split over dp (plain data parallelism)",
           1: "ZeRO-1 splits Adam's m and v (8 B per value) over the dp ranks",
           2: "ZeRO-2 splits Adam's m and v and the gradients over the dp ranks",
           3: "ZeRO-3 splits weights, gradients and Adam's m and v over the dp ranks"}
# which of (weights, gradients, Adam's m and v) ZeRO-k cuts over dp
_ZERO_SPLITS = {0: (False, False, False), 1: (False, False, True), 2: (False, True, True),
                3: (True, True, True)}
_PARTS = ("the weights", "the gradients", "Adam's m and v")


def _split_text(split, short: bool = False) -> str:
    """What a (weights, gradients, Adam) cut counts: a ZeRO stage's count, or the parts it
    cuts and keeps whole (``short``: a phrase to name beside another)."""
    cut = " and ".join(p for p, c in zip(_PARTS, split) if c)
    whole = " and ".join(p for p, c in zip(_PARTS, split) if not c)
    for z, zcut in _ZERO_SPLITS.items():
        if zcut == split:
            if short:
                return "no ZeRO (nothing split)" if z == 0 else f"ZeRO-{z}'s ({cut} split)"
            return f"the count {'without ZeRO' if z == 0 else f'of ZeRO-{z}'}: {_SPLITS[z]}"
    if short:
        return f"{cut} split over dp with {whole} whole"
    return f"the count with {cut} split over dp and {whole} whole"


@exercise
def check_hybrid_state_bytes(nbytes, stage: int = 0, zero: int = 2, dp: int = 2, tp: int = 2,
                             pp: int = 2, preset: str = "tiny") -> None:
    """Model-state bytes (fp32 weights, gradients, Adam m and v) each rank of pipeline
    ``stage`` holds in Hybrid(dp, tp, pp, zero), as ``memory()`` counts them.

    A wrong answer is named by the split it counts: a ZeRO stage's, or another cut of
    (weights, gradients, Adam).  Two cuts can give the same count (the weights and the
    gradients are 4 B each, Adam's m and v 8 B: cutting the weights and gradients cuts as
    many bytes as ZeRO-1's cut of Adam); such an answer is named as both, since the
    count alone cannot tell which mistake it is."""
    got = _number("nbytes", nbytes)
    want, model, st = _state_bytes(dp, tp, pp, zero, stage, preset)
    if got == want:
        rank = st.meshes[stage].ranks[0]
        _ok(f"{want:,d} B on each rank of stage {stage} (rank {rank}: its tp shard of the "
            f"parameters; {_SPLITS[zero]})")
        return
    here = f"here {_SPLITS[zero]}"
    splits = {}
    for cut in [(a, b, c) for a in (False, True) for b in (False, True) for c in (False, True)]:
        if cut != _ZERO_SPLITS[zero]:
            splits.setdefault(_state_bytes(dp, tp, pp, zero, stage, preset, split=cut)[0],
                              []).append(cut)
    wrong = []
    for value, cuts in splits.items():
        cuts.sort(key=lambda c: c not in _ZERO_SPLITS.values())   # a ZeRO stage first
        if len(cuts) == 1:
            wrong.append((value, f"that is {_split_text(cuts[0])}; {here}"))
        else:
            wrong.append((value, f"that count fits {len(cuts)} splits (the same bytes either "
                          "way, so the count cannot tell which you made): "
                          + " or ".join(_split_text(c, short=True) for c in cuts) + f"; {here}"))
    wrong.append((_state_bytes(dp, tp, pp, zero, stage, preset, mixed=True)[0],
                  "that is the mixed-precision count (2 + 2 + 12 B); this run is fp32: 4 B "
                  "weight, 4 B gradient, 8 B Adam m and v"))
    if pp > 1:
        wrong.append((_state_bytes(dp, tp, pp, zero, 1 - stage, preset)[0],
                      f"that is stage {1 - stage}; stage {stage} holds "
                      + ("the last block, the final norm and the LM head" if stage else
                         "the embedding and the first block")))
    rank = st.meshes[stage].ranks[0]
    held = sum(p.local(rank).numel() for _, p in dist_parameters(model)
               if rank in p.mesh.ranks)
    whole = sum(p.numel() for _, p in dist_parameters(model) if rank in p.mesh.ranks)
    per_value = want / held
    wrong.append((whole * per_value, "that counts the whole stage; each rank holds only its "
                  f"tp shard (1/{tp}) of the attention and MLP weights, and copies of the "
                  "rest"))
    everything = sum(p.numel() for _, p in dist_parameters(model))
    if pp > 1:
        wrong.append((everything * per_value, f"that counts the whole model; a rank of stage "
                      f"{stage} holds only that stage's parameters, and of those its tp shard "
                      "(p.local(rank) for the parameters on its mesh)"))
    # the ZeRO-cut parts split over the stage mesh's dp x tp ranks, not over dp alone
    w_g_o = (4, 4, 8)
    over_mesh = sum(sum(b * (_chunks(n, dp * tp)[0] if c else n)
                        for b, c in zip(w_g_o, _ZERO_SPLITS[zero]))
                    for n in (p.local(rank).numel() for _, p in dist_parameters(model)
                              if rank in p.mesh.ranks))
    if zero and tp > 1:
        wrong.append((over_mesh, f"that splits over the stage's {dp * tp} ranks (dp x tp); "
                      f"ZeRO splits over the dp group ({dp} ranks): the tp ranks hold "
                      "different shards, nothing to split between them"))
    wrong.append((want / 4, "that is the number of fp32 values (weights, gradients, Adam's "
                  "m and v), not bytes: each value is 4 B"))
    # a count of bytes is whole: show the answer as given (315.52 must not read "316 B")
    shown = f"{got:,.0f}" if got == int(got) else f"{got:,}"
    for value, text in wrong:
        if math.isclose(got, value, rel_tol=1e-6):
            raise CheckError(f"your count is {shown} B: {text}", expected=f"{want:,d} B")
    slip = _scale_slip(got, want, 1e-6, share=False) if got else None
    if slip:                                   # kB or MB given for bytes
        raise CheckError(f"your count is {shown} B: {slip}", expected=f"{want:,d} B")
    raise CheckError(f"your count is {shown} B: count the values a "
                     f"rank of stage {stage} holds (p.local(rank).numel() for its parameters), "
                     f"then 4 B weight + 4 B gradient + 8 B Adam per value; {_SPLITS[zero]} "
                     f"(dp={dp})", expected=f"{want:,d} B")


# ---- 08 hybrid: the fastest layout ---------------------------------------------------------------

_LAYOUT_TIMES: dict = {}


def _layouts(world, cfg, batch):
    from ..recipes.hybrid import Hybrid
    out = []
    for dp in range(1, world + 1):
        for tp in range(1, world // dp + 1):
            if world % (dp * tp):
                continue
            pp = world // (dp * tp)
            try:
                Hybrid(dp=dp, tp=tp, pp=pp).check(cfg, batch)
            except ValueError:
                continue
            out.append((dp, tp, pp))
    return out


def _layout_ms(layout, preset, batch, profile) -> float:
    key = (layout, preset, batch, profile)
    if key not in _LAYOUT_TIMES:
        from ..recipes.hybrid import Hybrid
        from ..train import train
        st = Hybrid(*layout)
        st.profile = profile
        _LAYOUT_TIMES[key] = train(preset, steps=1, seed=0, batch_size=batch, strategy=st,
                                   timing=False)[0]["modeled_ms"]
    return _LAYOUT_TIMES[key]


@exercise
def check_best_layout(layout, preset: str = "tiny", batch: int = 8,
                      profile: str = "ascend-910b", world: int = 8) -> None:
    """The (dp, tp, pp) layout of ``world`` ranks (no SP, no ZeRO) with the shortest
    modeled training step of ``preset`` on ``profile``."""
    from ..models.config import get_config
    from ..recipes.hybrid import Hybrid
    if isinstance(layout, Hybrid):
        layout = (layout.dp, layout.tp, layout.pp)
    # three whole numbers: int() would truncate (8.9, 1, 1) to the answer and read the
    # string "811" digit by digit
    if isinstance(layout, (str, bytes)):
        raise CheckError(f"give the layout as (dp, tp, pp), a tuple of three ints, got "
                         f"{layout!r}")
    try:
        items = list(layout)
    except TypeError:
        raise CheckError(f"give the layout as (dp, tp, pp), got {layout!r}") from None
    if len(items) != 3:
        raise CheckError(f"give the layout as (dp, tp, pp), got {layout!r}")
    if not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in items):
        raise CheckError(f"give the layout as (dp, tp, pp), a tuple of three ints, got "
                         f"{layout!r}")
    got = tuple(int(v) for v in items)
    cfg = get_config(preset)
    if math.prod(got) != world:
        raise CheckError(f"dp x tp x pp = {math.prod(got)}; the layout must use all "
                         f"{world} ranks")
    try:
        Hybrid(*got).check(cfg, batch)
    except ValueError as e:
        raise CheckError(f"Hybrid(dp={got[0]}, tp={got[1]}, pp={got[2]}) does not fit the "
                         f"model: {e}") from None
    times = {lay: _layout_ms(lay, preset, batch, profile) for lay in _layouts(world, cfg, batch)}
    best = min(times, key=times.get)
    if times[got] > times[best] * (1 + 1e-9):
        # what the trace shows at this size: a kernel costs mostly its launch, a message its
        # latency; tp and pp add those without shortening a rank's (launch-bound) compute
        launch_us = get_profile(profile).launch_overhead * 1e6
        why = []
        if got[2] > 1:
            why.append("a pipeline makes each stage wait for the other, and every "
                       "micro-batch pays each kernel's launch again")
        if got[1] > 1:
            why.append(f"tensor parallelism splits a kernel's arithmetic but not its "
                       f"{launch_us:g} us launch, and adds all-reduces in every block")
        raise CheckError(f"{got} takes {times[got]:.3f} ms per step on {profile}; another "
                         f"layout of {world} ranks is faster. Time every "
                         f"layout that fits ({len(times)} of them): at this size a kernel "
                         f"costs mostly its launch and a message its latency, not their size"
                         + "".join(f"; {w}" for w in why),
                         expected=f"{best}: {times[best]:.3f} ms")
    order = sorted(times, key=times.get)
    _ok(f"{best} = (dp, tp, pp): {times[best]:.3f} ms; then " + ", ".join(
        f"{lay} {times[lay]:.3f}" for lay in order[1:]) + " ms")
