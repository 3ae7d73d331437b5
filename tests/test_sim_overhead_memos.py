"""The trace's prices memoized without changing one of them (task simperf2): a traced
gpt-tiny Hybrid(dp=2, tp=2) step priced the same collectives and kernels every step,
each ``cost.price`` counting its group's nodes again (``topology.group_of``'s Counter,
about 5 us a call) and each ``compute_time`` walking the profile again.

* ``topology.group_of`` memoized on (tuple of int ranks, devices per node);
* ``kernel_cost.compute_time`` memoized per profile once its arguments are checked;
* ``collectives.record_collective`` prices a mesh axis's groups once per (kind, bytes,
  mesh, axis, profile);
* ``Mesh.groups`` computed once per dim.

Per-profile tables are found by the profile's identity (``profiles.profile_memo``).
Each memoized value is held to the value computed cold, each key to what changes it."""
import dataclasses

import pytest
import torch

import workbench as wb
from workbench.models.config import get_config
from workbench.models.data import get_batch
from workbench.recipes.hybrid import Hybrid
from workbench.sim_mesh import collectives as C
from workbench.sim_mesh import cost, kernel_cost, profiles, topology
from workbench.sim_mesh.kernel_cost import AttentionShape


def cold():
    """Forget every memo (getattr: the tests also run on the code before them)."""
    getattr(profiles, "_MEMOS", {}).clear()
    getattr(topology, "_GROUPS", {}).clear()


def test_group_of_is_memoized_and_still_refuses_bad_ranks():
    """Failed before: every call counted the nodes again (a new Group each time)."""
    cold()
    p = profiles.get_profile("a100")
    g = topology.group_of((0, 1, 8, 9), p)
    assert g == topology.Group((2, 2))
    assert topology.group_of((0, 1, 8, 9), p) is g
    # equal keys that are not ints: (1.0, 2) == (1, 2) and (True, 2) == (1, 2)
    topology.group_of((1, 2), p)
    for bad in ((1.0, 2), (True, 2)):
        with pytest.raises(ValueError, match="ints"):
            topology.group_of(bad, p)
    # another node size: another key
    small = dataclasses.replace(p, devices_per_node=2)
    assert topology.group_of((0, 1, 8, 9), small) == topology.Group((2, 2))
    assert topology.group_of((0, 1, 2, 3), small) == topology.Group((2, 2))
    assert topology.group_of((0, 1, 2, 3), p) == topology.Group((4,))


def test_compute_time_memo_equals_the_cold_price_and_keys_what_changes_it():
    p = profiles.get_profile("h100")          # a measured profile: GEMMs and attention
    calls = [(2e9, 4e6, torch.bfloat16, "matmul", 1, None, (1, 512, 512)),
             (2e9, 4e6, torch.bfloat16, "matmul", 0, None, (1, 512, 512)),
             (2e9, 4e6, "float32", "matmul", 1, None, (1, 512, 512)),
             (2e9, 4e6, torch.bfloat16, "matmul", 1, None, (1, 256, 512)),
             (1e6, 4e6, torch.bfloat16, "elementwise", 1, None, None),
             (4e9, 1e6, torch.bfloat16, "attention", 1, None, AttentionShape(8, 1024, 64,
                                                                           True, False)),
             (4e9, 1e6, torch.bfloat16, "attention", 1, None, AttentionShape(8, 1024, 64,
                                                                           True, True))]
    cold()
    want = [kernel_cost.compute_time(f, b, p, dt, oc, launches=n, kernel=k, gemm=gm)
            for f, b, dt, oc, n, k, gm in calls]
    assert len(set(want)) == len(want)        # each key changes the price
    for _ in range(2):                        # warm: the same numbers, bit for bit
        got = [kernel_cost.compute_time(f, b, p, dt, oc, launches=n, kernel=k, gemm=gm)
               for f, b, dt, oc, n, k, gm in calls]
        assert got == want
    # a profile with other rates has its own table
    fast = dataclasses.replace(p, memory_bandwidth=p.memory_bandwidth * 2)
    assert kernel_cost.compute_time(1e6, 4e6, fast, torch.bfloat16, "elementwise") < \
        kernel_cost.compute_time(1e6, 4e6, p, torch.bfloat16, "elementwise")
    # the checks still run on a hit, and a list (unhashable) gemm is priced, not kept
    with pytest.raises(ValueError, match="gemm"):
        kernel_cost.compute_time(2e9, 4e6, p, torch.bfloat16, "matmul", gemm=(1, True, 512))
    with pytest.raises(ValueError, match="flops"):
        kernel_cost.compute_time(True, 4e6, p, torch.bfloat16, "matmul")
    assert kernel_cost.compute_time(2e9, 4e6, p, torch.bfloat16, "matmul", 1,
                                    gemm=[1, 512, 512]) == want[0]


def test_mesh_groups_are_computed_once_and_handed_out_as_new_lists():
    mesh = wb.Mesh.grid((2, 4), ["dp", "tp"])
    first = mesh.groups("tp")
    assert first == [(0, 1, 2, 3), (4, 5, 6, 7)]
    first.append((9,))                        # the caller's list, not the mesh's
    assert mesh.groups(1) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert mesh.groups("dp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert mesh.group_of(6, "dp") == (2, 6)


def _traced_steps(profile, n=2):
    torch.manual_seed(0)
    cfg = get_config("gpt-tiny")
    st = Hybrid(dp=2, tp=2)
    model = st.build_model(cfg, 0)
    x, y = get_batch(cfg, 4, 0, 0)
    out = []
    for _ in range(n):
        model.zero_grad(set_to_none=True)
        with wb.trace(profile) as tr:
            st.forward_backward(model, x, y)
        out.append((list(tr.events), tr.time()))
    return out


@pytest.mark.parametrize("profile", ["a100", "ascend-910b"])
def test_a_warm_traced_step_counts_no_group_again_and_records_the_same_events(
        monkeypatch, profile):
    """Failed before: the second traced step counted every collective's group's nodes
    again (topology.group_of's Counter, once per cost.price call).  Its events and clock
    are the cold step's, bit for bit."""
    cold()
    (ev1, t1), = _traced_steps(profile, 1)
    n = [0]
    real = topology.Counter

    def counted(*a, **k):
        n[0] += 1
        return real(*a, **k)
    monkeypatch.setattr(topology, "Counter", counted)
    (ev2, t2), = _traced_steps(profile, 1)
    assert n[0] == 0
    assert ev2 == ev1 and t2 == t1
    assert sum(e.stream == "comm" for e in ev1) > 0


def test_price_memo_equals_the_cold_price_and_keeps_its_checks():
    p = profiles.get_profile("ascend-910b")
    calls = [("all_reduce", 1 << 20, (0, 1), "auto"), ("all_reduce", 1 << 20, (0, 8), "auto"),
             ("all_gather", 1 << 20, (0, 1), "auto"), ("all_reduce", 1 << 10, (0, 1), "auto"),
             ("all_reduce", 1 << 20, (0, 1, 2, 3), "ring")]
    cold()
    want = [cost.price(k, n, r, p, a) for k, n, r, a in calls]
    assert len(set(want)) == len(want)
    assert [cost.price(k, n, list(r), p, a) for k, n, r, a in calls] == want
    cold()
    assert [cost.price(k, n, r, p, a) for k, n, r, a in calls[::-1]] == want[::-1]
    for bad in (True, -1, float("nan")):
        with pytest.raises(ValueError, match="nbytes"):
            cost.price("all_reduce", bad, (0, 1), p)
    with pytest.raises(ValueError, match="kind"):
        cost.price("all_reduce_", 1 << 20, (0, 1), p)


def test_record_collective_memo_keeps_its_checks():
    """A bool for bytes or axis raised before and still does after a hit."""
    cold()
    mesh = wb.Mesh.grid((2, 2), ["a", "b"])
    with wb.trace() as tr:
        C.record_collective("all_reduce", mesh, 1, 4096)
        C.record_collective("all_reduce", mesh, 1, 4096)
        with pytest.raises(ValueError, match="nbytes"):
            C.record_collective("all_reduce", mesh, 1, True)
        C.record_collective("all_reduce", mesh, 1, 1)
        with pytest.raises(ValueError, match="nbytes"):
            C.record_collective("all_reduce", mesh, 1, True)
        with pytest.raises(ValueError, match="mesh dim"):
            C.record_collective("all_reduce", mesh, True, 4096)
    # two groups per call, three calls that ran: the same price each time
    ev = [e for e in tr.events if e.name == "all_reduce"]
    assert len(ev) == 6 and ev[0].duration == ev[2].duration == \
        cost.price("all_reduce", 4096, (0, 1), tr.profile)
