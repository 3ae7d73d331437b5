"""uneven18: uneven shards priced and run as the library (or the framework) sends them.

plan17b made the simulator, torch.distributed and the reshard planner agree that an
uneven all-gather / reduce-scatter sends (p-1) x the largest padded piece
(``sim_mesh.grid.gather_sent``).  Here the sites that priced such a collective by (p-1)/p
of the whole buffer where the pieces may be uneven, each held to the bytes computed
independently from the pieces (shard bounds, or the framework's partition rule), and the
torch.distributed runs where an uneven layout took another way than the simulator's.
"""
from __future__ import annotations

import pytest

from workbench.plan import costs as PC
from workbench.plan import zero3_2021 as Z
from workbench.sim_mesh.cost import wire_bytes


def _deepspeed_pieces(numel: int, p: int) -> list[int]:
    """DeepSpeed v0.3.13's partitions of one parameter over p ranks (partition_parameters.py
    ``_partition_param``: ``partition_size = tensor_size // world_size`` of the aligned
    size), counted as the elements each rank holds before padding, and the padded size."""
    part = (numel + p - 1) // p
    held = [max(0, min(part, numel - k * part)) for k in range(p)]
    assert sum(held) == numel
    return held, part


# ---- the planner twin of grid.gather_sent ---------------------------------------------------

def test_padded_flat_is_p_minus_1_padded_pieces():
    for numel, p in ((10, 4), (7, 3), (12, 4), (1, 8), (0, 2), (100_003, 4)):
        held, part = _deepspeed_pieces(numel, p) if numel else ([0] * p, 0)
        buf, sent = PC.padded_flat(numel, p, 2)
        assert buf == part * p
        assert sent == (p - 1) * part * 2          # every rank sends p-1 padded pieces
    # the old formula on the unpadded buffer differs where p does not divide it
    assert PC.padded_flat(10, 4, 2)[1] == 18 and wire_bytes("all_gather", 20, 4) == 15
    # a multiple of p (Megatron / DeepSpeed alignments): padded to it
    assert PC.padded_flat(10, 4, 2, multiple=8) == (16, 24)


@pytest.mark.parametrize("bad", [dict(numel=-1), dict(numel=2.5), dict(numel="8"), dict(p=0),
                                 dict(p=True), dict(multiple=6), dict(multiple=0)])
def test_padded_flat_refuses_bad_arguments(bad):
    kw = dict(numel=10, p=4, elem=2)
    kw.update(bad)
    with pytest.raises(ValueError, match=next(iter(bad))):
        PC.padded_flat(**kw)


# ---- DeepSpeed v0.3 ZeRO-3: one list collective per parameter, padded ------------------------

def test_zero3_2021_prices_and_counts_the_padded_parameter():
    """A parameter of 100,003 elements on 4 ranks: DeepSpeed gathers and reduce-scatters
    4 partitions of 25,001 (the last 3 of them padding), so each collective prices a
    buffer of 100,004 elements and a rank sends 3 x 25,001 x 2 B = 150,006 B; the old
    (p-1)/p of 2 x 100,003 B, floored, is 150,004 B."""
    n, p = 100_003, 4
    assert n >= Z.PERSISTENCE_NUMEL               # partitioned, not persistent
    tr = [Z.Entry("A", (("a", n),), 1e-6, "f"), Z.Entry("A", (("a", n),), 1e-6, "b")]
    asked = {"ag": [], "rs": []}

    def ag(k):
        asked["ag"].append(k)
        return 1e-5

    def rs(k):
        asked["rs"].append(k)
        return 1e-5
    r = Z.simulate(tr, p, ag, rs, 2e12)
    held, part = _deepspeed_pieces(n, p)
    assert held == [25_001, 25_001, 25_001, 25_000]
    assert asked["ag"] == [part * p] * r["gathers"] and asked["rs"] == [part * p]
    per = (p - 1) * part * 2
    assert per == 150_006 and wire_bytes("all_gather", 2 * n, p) == 150_004
    assert r["sent"] == (r["gathers"] + r["reduce_scatters"]) * per
    # the chunk copies of c10d's list collectives: p partitions, the padding too
    assert r["work"]["chunk_copy"] == pytest.approx(
        (r["gathers"] + r["reduce_scatters"]) * 2 * 2 * part * p / 2e12)


def test_zero3_2021_post_step_gather_is_the_rule():
    """_post_step's one coalesced gather of the persistent parameters: p partitions of the
    sum of their padded partitions (as before, now by the one rule)."""
    tr = [Z.Entry("A", (("b", 7), ("c", 5)), 1e-6, "f")]
    p = 3
    _, sent = Z.post_step_gather(tr, p, lambda k: 1e-6)
    part = sum(_deepspeed_pieces(n, p)[1] for n in (7, 5))      # 3 + 2
    assert sent == (p - 1) * part * 2 == 20
