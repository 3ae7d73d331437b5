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


# ---- a reshard's way back over uneven pieces, and uneven runs on torch.distributed ------------

import os  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

import workbench as wb  # noqa: E402
from workbench.sim_mesh.grid import chunk_bounds  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "dist_scripts"))
import uneven18_check as chk  # noqa: E402

CASES = [p[0] for p in chk.PROGRAMS] + ["sp-uneven-rows"]
# Found here, not fixed: a marked copy (x [S(0), S(1)] redistributed to [S(0), R]) read by
# w @ y, whose own plan all-gathers dp (off the marked tp dim) and slices tp.  DTensor's
# way back is one reduce-scatter over dp of the [P, S(1)] gradient (256 B sent); the
# simulator all-reduces the gathered input over dp (512 B, the dp all-gather's ordinary
# path: expand_replicas), torch.distributed reduce-scatters over dp and then all-gathers
# over tp (gather_backward_dist.gather back to y's [S(0), R], then the reshard's own
# backward slices): two different programs, the values equal.
_NOT_YET = {"S0S1-S0R-w-mm-gathers-dp"}


def _sizes(n, p):
    return [chunk_bounds(n, p, k)[1] for k in range(p)]


def simulated(name):
    if name == "sp-uneven-rows":
        return chk.run_sp(wb.Mesh.grid((4,), ["tp"]))
    _, shape, names, *_ = next(p for p in chk.PROGRAMS if p[0] == name)
    return chk.run(wb.Mesh.grid(shape, list(names)), name)


def test_way_back_records_each_groups_busiest_rank():
    """x (8, 10) f64 S(1) on 4 ranks (columns 3, 3, 3, 1), ``redistribute`` to R, then read:
    the way back records what the busiest rank sends (the plan's bytes, plan17b's rule),
    where it recorded (p-1)/p of the largest buffer: a column-parallel matmul's Partial
    gradient reduce-scattered back, 480 -> 576 B; a slice to S(0) sent back by one
    all-to-all, 120 -> 144 B."""
    cols, e = _sizes(10, 4), 8
    assert cols == [3, 3, 3, 1]
    r = simulated("uneven-S1-R-matmul")
    # every rank sends 3 pieces padded to the largest kept one: 8 rows x 3 columns
    assert r["bwd"] == [["reduce_scatter", 640, 3 * 8 * max(cols) * e]] == \
        [["reduce_scatter", 640, 576]]
    r = simulated("uneven-S1-R-mul-S0")
    # the gradient S(0) (2 rows of 10 a rank) to S(1): a rank keeps its columns of its rows
    sent = max(2 * (10 - c) * e for c in cols)
    assert r["bwd"] == [["all_to_all", 160, sent]] == [["all_to_all", 160, 144]]
    assert r["diff_out"] == 0 and r["diff_grad"] == 0
    # the plan the chooser and the planner see says the same bytes
    from workbench.parallel.reshard import plan_reshard
    from workbench.parallel.spec import TensorSpec
    mesh = wb.Mesh([0, 1, 2, 3])
    for grad, kind, want in (([wb.Partial()], "reduce_scatter", 576),
                             ([wb.Shard(0)], "all_to_all", 144)):
        plan = plan_reshard(TensorSpec((8, 10), mesh, grad, torch.float64), mesh,
                            [wb.Shard(1)], profile="a100")
        assert [(s.kind, s.bytes) for s in plan.steps] == [(kind, want)]


def test_sp_uneven_rows_simulated():
    """Megatron's f / g under sequence parallelism on 6 rows over 4 tp ranks (2, 2, 2, 0):
    each collective's busiest rank sends 3 pieces of 2 rows x 4 (f64), 192 B; regather
    refused (the simulator cannot keep one shard of cells)."""
    r = simulated("sp-uneven-rows")
    rows = _sizes(6, 4)
    assert rows == [2, 2, 2, 0]
    b = 3 * max(rows) * 4 * 8
    assert r["fwd"] == [["all_gather", 192, b], ["reduce_scatter", 192, b]]
    assert r["bwd"] == [["all_gather", 192, b], ["reduce_scatter", 192, b]]
    assert r["diff_out"] == 0 and r["diff_grad"] == 0
    assert r["regather"].startswith("megatron_f(sp=True, regather=True): the input (6, 4)")


@pytest.fixture(scope="module")
def torchrun_rows(tmp_path_factory):
    """tests/dist_scripts/uneven18_check.py's rows (4 gloo processes; the shared FOUR_PROC
    launch, tests/torchrun_support.py)."""
    from tests.torchrun_support import four_proc, json_rows
    out, text = four_proc(tmp_path_factory, "uneven18_check.py")
    assert out.returncode == 0, out.stderr[-3000:]
    return json_rows(text)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(
    strict=True, reason="a marked copy's reader whose plan gathers another dim: the "
    "simulator all-reduces, torch.distributed reduce-scatters then all-gathers (_NOT_YET)"))
    if n in _NOT_YET else n for n in CASES])
def test_torchrun_as_simulated(name, torchrun_rows):
    """Every process's row equals the simulator's run of the program: placements,
    collectives (kind, buffer bytes, bytes sent) forward and backward, exact values and
    gradients.  Before (measured on 4 gloo processes, rank 0): the uneven marked copies
    took the ordinary path (gather_backward_dist.mark refused an uneven source):
    uneven-S1-R-mul-S0 gathered the other operand (output Replicate, forward
    [all_gather 576, all_gather 480], for the simulator's [all_gather 576] and backward
    all_to_all), uneven-S1-R-mul-S1 backward [all_gather 576] for nothing,
    uneven-S1-R-matmul [all_reduce 960] for [reduce_scatter 576]; sp-uneven-rows aborted
    the processes (gloo: "Received data size doesn't match expected size")."""
    sim = simulated(name)
    mine = [r for r in torchrun_rows if r["case"] == name]
    assert sorted(r["rank"] for r in mine) == [0, 1, 2, 3], mine
    assert not [r for r in mine if "raised" in r], mine
    assert sim["diff_out"] == 0 and sim["diff_grad"] == 0, sim
    for r in mine:          # (the programs are symmetric: every group's as rank 0's)
        for k in ("placements", "grad_placements", "fwd", "bwd", "regather"):
            assert r.get(k) == sim.get(k), (name, r["rank"], k, r.get(k), sim.get(k))
        assert r["diff_out"] == 0 and r["diff_grad"] == 0, r


def test_chooser_prices_an_uneven_backward_step_as_sent():
    """``strategy.step_price``, the chooser's and wb.compile's price of a backward step:
    x (8, 10) f64 R on 4 ranks sliced to S(1) (columns 3, 3, 3, 1): its backward all-gather
    sends 3 pieces of 8 x 3, 576 B, priced as the padded buffer of 4 such pieces (768 B);
    was the ring formula on the 640 B gathered buffer, 480 B.  Even pieces: unchanged."""
    from workbench.parallel.ops_table.strategy import step_price
    from workbench.parallel.reshard import plan_reshard
    from workbench.parallel.spec import TensorSpec
    from workbench.sim_mesh import cost
    from workbench.sim_mesh.profiles import get_profile
    prof = get_profile("a100")
    mesh = wb.Mesh([0, 1, 2, 3])
    for shape, want, buf in (((8, 10), 3 * 8 * max(_sizes(10, 4)) * 8, 4 * 8 * 3 * 8),
                             ((8, 12), 3 * 8 * 3 * 8, 8 * 12 * 8)):
        spec = TensorSpec(shape, mesh, [wb.Replicate()], torch.float64)
        (s,) = plan_reshard(spec, mesh, [wb.Shard(1)], profile="a100").steps
        assert s.kind == "local_slice"
        t, b = step_price(s, spec, prof, back=True, nbytes=8 * shape[0] * shape[1])
        assert b == want
        assert t == max(cost.price("all_gather", buf, g, prof) for g in mesh.groups(0))
    assert cost.wire_bytes("all_gather", 640, 4) == 480
