"""Pipeline schedules: generators, the simulator, and the published bubble formulas.

Reference first: a naive fixed-point simulator written independently of the
event-driven engine times random valid schedules; then the formulas of GPipe,
1F1B (Narayanan et al. 2021), interleaved 1F1B (Narayanan et al. SC21) and
ZB-H1 (Qi et al. 2024) are checked exactly with integer costs."""
from __future__ import annotations

import doctest
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workbench.parallel import schedules as S
from workbench.parallel.schedules import (Action, Schedule, ScheduleError, formula_bubble, gpipe,
                                          interleaved_1f1b, one_f_one_b, simulate, transfers,
                                          zb_h1)

FEW = settings(max_examples=25, deadline=None)
ps, ms, costs = st.integers(1, 6), st.integers(1, 12), st.integers(1, 4)


# ---- a naive reference: scan all ranks until nothing changes -----------------------------
def reference(s: Schedule, f, b, w=None, p2p=0.0):
    """Start time of every action, by repeated scanning (O(N^2)); None on deadlock."""
    p, last = s.p, s.stages - 1
    done, pos, clock = {}, [0] * p, [0.0] * p
    starts = [[None] * len(row) for row in s.actions]
    cost = {"F": f, "B": b + (w if w is not None and not s.split_backward else 0), "W": w}
    moved = True
    while moved:
        moved = False
        for r, row in enumerate(s.actions):
            while pos[r] < len(row):
                a = row[pos[r]]
                st_ = a.chunk * p + r
                deps = {"F": [("F", st_ - 1)] if st_ > 0 else [],
                        "B": [("F", st_)] + ([("B", st_ + 1)] if st_ < last else []),
                        "W": [("B", st_)]}[a.kind]
                if any((k, d, a.mb) not in done for k, d in deps):
                    break
                t = clock[r]
                for k, d in deps:
                    t = max(t, done[(k, d, a.mb)] + (p2p if d % p != r else 0))
                starts[r][pos[r]] = t
                clock[r] = t + cost[a.kind]
                done[(a.kind, st_, a.mb)] = clock[r]
                pos[r] += 1
                moved = True
    if any(pos[r] < len(row) for r, row in enumerate(s.actions)):
        return None
    return starts


@st.composite
def valid_schedules(draw):
    """A random schedule that can run: a random topological order, split into rows."""
    p, m, v = draw(st.integers(1, 4)), draw(st.integers(1, 5)), draw(st.integers(1, 3))
    split = draw(st.booleans())
    rnd = draw(st.randoms(use_true_random=False))
    last, kinds = p * v - 1, ("F", "B", "W") if split else ("F", "B")
    done, rows = set(), [[] for _ in range(p)]
    todo = {(k, s, mb) for k in kinds for s in range(p * v) for mb in range(m)}

    def ready(k, s, mb):
        need = {"F": [("F", s - 1)] if s else [],
                "B": [("F", s)] + ([("B", s + 1)] if s < last else []), "W": [("B", s)]}[k]
        return all((kk, ss, mb) in done for kk, ss in need)
    while todo:
        k, s, mb = rnd.choice(sorted(x for x in todo if ready(*x)))
        todo.remove((k, s, mb))
        done.add((k, s, mb))
        rows[s % p].append(Action(k, mb, s // p))
    return Schedule(p, m, v, tuple(map(tuple, rows)), split_backward=split)


@FEW
@given(valid_schedules(), costs, costs, costs, st.sampled_from([0.0, 0.5, 2.0]))
def test_engine_matches_naive_reference(s, f, b, w, p2p):
    w = w if s.split_backward else None
    r = simulate(s, f=f, b=b, w=w, p2p=p2p)
    ref = reference(s, f, b, w, p2p)
    assert [list(x) for x in r.starts] == ref
    busy = sum(len(row) for row in s.actions)
    assert r.bubble_fraction == pytest.approx(1 - sum(r.busy) / (s.p * r.makespan))
    assert busy == len(r.blocks)


@FEW
@given(valid_schedules(), st.data())
def test_swapping_two_actions_breaks_validation_exactly_when_reference_deadlocks(s, data):
    rows = [list(row) for row in s.actions]
    r = data.draw(st.integers(0, s.p - 1))
    i, j = sorted(data.draw(st.lists(st.integers(0, len(rows[r]) - 1), min_size=2, max_size=2)))
    rows[r][i], rows[r][j] = rows[r][j], rows[r][i]
    broken = Schedule(s.p, s.m, s.v, tuple(map(tuple, rows)), split_backward=s.split_backward)
    runs = reference(broken, 1, 1, 1 if s.split_backward else None) is not None
    if runs:
        S.validate(broken)
    else:
        with pytest.raises(ScheduleError):
            S.validate(broken)


# ---- the generators -----------------------------------------------------------------------
def test_generators_in_text_form():
    assert one_f_one_b(3, 4).to_text() == ["rank 0: F0 F1 F2 B0 F3 B1 B2 B3",
                                           "rank 1: F0 F1 B0 F2 B1 F3 B2 B3",
                                           "rank 2: F0 B0 F1 B1 F2 B2 F3 B3"]
    assert gpipe(2, 2).to_text() == ["rank 0: F0 F1 B0 B1", "rank 1: F0 F1 B0 B1"]
    zb = zb_h1(4, 8)       # the last stage defers its W's to the cool-down (Qi et al. fig. 3)
    assert zb.to_text()[3] == ("rank 3: F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 "
                               "F7 B7 W4 W5 W6 W7")
    il = interleaved_1f1b(2, 4, 2)
    assert il.actions[0][:4] == (Action("F", 0), Action("F", 1), Action("F", 0, 1),
                                 Action("F", 1, 1))
    assert repr(Action("B", 3, chunk=1)) == "Action('B', 3, chunk=1)"
    assert str(il.actions[0][2]) == "F0c1"
    assert "Schedule('1f1b', p=3, m=4, v=1" in repr(one_f_one_b(3, 4))


@FEW
@given(ps, ms, st.integers(1, 3))
def test_text_round_trip_and_validity(p, m, v):
    for s in (gpipe(p, m), one_f_one_b(p, m), zb_h1(p, m), interleaved_1f1b(p, p * m, v)):
        S.validate(s)
        back = Schedule.from_text(s.to_text(), m=s.m, v=s.v, name=s.name)
        assert back == s
        assert len(transfers(s)) == (2 * s.m * (s.stages - 1) if p > 1 else 0)


def test_transfers_are_derived_from_stage_order():
    T = S.Transfer
    assert transfers(one_f_one_b(2, 1)) == [T("activation", 0, 0, 1, 0, 0),
                                            T("gradient", 0, 1, 0, 0, 0)]
    il = transfers(interleaved_1f1b(2, 2, 2))          # stage 1 (rank 1) -> stage 2 (rank 0, c1)
    assert T("activation", 0, 1, 0, 0, 1) in il and T("gradient", 0, 0, 1, 1, 0) in il
    assert transfers(one_f_one_b(1, 3)) == []          # one rank: nothing to send
    assert set(S.SCHEDULES) == {"GPipe", "1F1B", "Interleaved 1F1B", "ZB-H1"}
    assert S.SCHEDULES["ZB-H1"](3, 4, 2) == zb_h1(3, 4)


def test_generator_argument_errors():
    with pytest.raises(ValueError, match=r"one_f_one_b\(p=0\).*int >= 1"):
        one_f_one_b(0, 4)
    with pytest.raises(ValueError, match=r"gpipe\(m=2.5\)"):
        gpipe(2, 2.5)
    with pytest.raises(ValueError, match=r"interleaved_1f1b\(m=6, p=4\).*multiple.*use m=8 or m=4"):
        interleaved_1f1b(4, 6, 2)
    # m < p: one multiple to offer, not "use m=16 or m=16" (the 07 explorer at p=16, m=8)
    with pytest.raises(ValueError, match=r"multiple.*Megatron-LM requires it too\); use m=16$"):
        interleaved_1f1b(16, 8, 2)
    assert interleaved_1f1b(3, 5, 1) == one_f_one_b(3, 5)        # v == 1 is plain 1F1B


# ---- published formulas, exactly --------------------------------------------------------
@FEW
@given(ps, ms, costs, costs)
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(p, m, f, b):
    for s in (gpipe(p, m), one_f_one_b(p, m)):
        r = simulate(s, f=f, b=b)
        assert r.makespan == (m + p - 1) * (f + b)
        assert r.bubble_time == ((p - 1) * (f + b),) * p
        assert Fraction(r.bubble_fraction).limit_denominator(10**6) == Fraction(p - 1, m + p - 1)
        assert formula_bubble(s, f, b).value == pytest.approx(r.bubble_fraction, abs=1e-15)


@FEW
@given(ps, st.integers(1, 4), st.integers(1, 4), costs, costs)
def test_interleaving_divides_the_bubble_time_by_v(p, k, v, f, b):
    m = k * p
    plain = simulate(one_f_one_b(p, m), f=v * f, b=v * b)    # a whole stage per action
    inter = simulate(interleaved_1f1b(p, m, v), f=f, b=b)    # 1/v of it per chunk action
    assert inter.bubble_time == ((p - 1) * (f + b),) * p
    assert all(x == v * y for x, y in zip(plain.bubble_time, inter.bubble_time))
    fb = formula_bubble(interleaved_1f1b(p, m, v), f, b)
    assert fb.value == pytest.approx(inter.bubble_fraction, abs=1e-15)
    assert fb.value == pytest.approx((p - 1) / (v * m + p - 1))


@FEW
@given(st.integers(1, 6), st.integers(0, 6), costs)
def test_zb_h1_has_a_third_of_1f1b_bubble_at_the_same_peak(p, extra, c):
    m = p + extra                                       # the paper's setting, m >= p
    zb = simulate(zb_h1(p, m), f=c, b=c, w=c)
    base = simulate(one_f_one_b(p, m), f=c, b=c, w=c)   # 1F1B: B then W, one backward
    assert base.bubble_time == ((p - 1) * 3 * c,) * p   # (p-1)(F+B+W)
    assert zb.bubble_time == ((p - 1) * c,) * p         # (p-1)(F+B-W): a third
    assert max(zb.peak_inflight) == max(base.peak_inflight) == p
    assert formula_bubble(zb_h1(p, m), c, c, c).value == pytest.approx(zb.bubble_fraction)


@FEW
@given(st.integers(2, 6), st.integers(0, 6), costs, costs, costs)
def test_zb_h1_general_costs(p, extra, f, b, w):
    s = zb_h1(p, p + extra)
    r = simulate(s, f=f, b=b, w=w)
    if w <= min(f, b):                                  # the paper's setting
        assert r.bubble_time == ((p - 1) * (f + b - w),) * p
        assert formula_bubble(s, f, b, w).value == pytest.approx(r.bubble_fraction)
    else:                                               # W no longer hides in one slot
        assert r.bubble_time == ((p - 1) * (f + b - min(f, b)),) * p
        assert formula_bubble(s, f, b, w) is None


@FEW
@given(ps, ms)
def test_activations_in_flight(p, m):
    assert simulate(gpipe(p, m)).peak_inflight == (m,) * p
    assert simulate(one_f_one_b(p, m)).peak_inflight == tuple(min(p - r, m) for r in range(p))
    assert max(simulate(zb_h1(p, m), w=1).peak_inflight) == min(p, m)


def test_memory_series_counts_forward_starts_and_backward_ends():
    r = simulate(one_f_one_b(2, 2))        # rank 0: F0 0-1, F1 1-2, B0 3-4, B1 5-6
    times, counts = r.memory[0]
    assert list(times) == [0, 1, 4, 6] and list(counts) == [1, 2, 1, 0]
    times, counts = simulate(one_f_one_b(3, 6)).memory[0]      # steady state: B ends as F starts
    assert list(counts) == [1, 2, 3, 2, 1, 0] and list(times) == [0, 1, 2, 12, 14, 16]
    zb = simulate(zb_h1(2, 2), w=1)       # split: W frees the activations
    assert zb.memory[1][1].max() == 2 and zb.peak_inflight == (2, 2)


# ---- costs, p2p, timeline -----------------------------------------------------------------
def test_cost_forms_agree():
    s = interleaved_1f1b(2, 4, 2)
    per_rank = simulate(s, f=[1, 2], b=[2, 3])
    per_stage = simulate(s, f=[1, 2, 1, 2], b=[2, 3, 2, 3])
    fn = simulate(s, f=lambda a, r: [1, 2][r], b=lambda a, r: [2, 3][r])
    assert per_rank.starts == per_stage.starts == fn.starts
    by_kind = simulate(s, f=lambda a: 1 + a.chunk, b=2)           # cost(action) alone
    assert by_kind.starts == simulate(s, f=[1, 1, 2, 2], b=2).starts
    assert formula_bubble(s, f=[1, 2], b=[2, 3]) is None
    with pytest.raises(ValueError, match=r"simulate\(f=<list of 3>\).*p=2.*p\*v=4"):
        simulate(s, f=[1, 2, 3])
    with pytest.raises(ValueError, match=r"simulate\(b=-1\)"):
        simulate(s, b=-1)
    with pytest.raises(ValueError, match=r"simulate\(w=None\).*zb_h1.*pass w="):
        simulate(zb_h1(2, 2))


def test_p2p_latency_and_comm_events():
    r = simulate(one_f_one_b(2, 1), f=1, b=1, p2p=0.5)
    # F0 r0 [0,1] -> +0.5 -> F0 r1 [1.5,2.5], B0 r1 [2.5,3.5] -> +0.5 -> B0 r0 [4,5]
    assert r.starts == ((0.0, 4.0), (1.5, 2.5)) and r.makespan == 5.0
    comm = [e for e in r.timeline if e.stream == "comm"]
    assert [(e.start, e.duration, e.ranks, e.args["kind"]) for e in comm] == [
        (1.0, 0.5, (0, 1), "activation"), (3.5, 0.5, (1, 0), "gradient")]
    assert not [e for e in simulate(one_f_one_b(2, 1)).timeline if e.stream == "comm"]


def test_fused_backward_draws_b_then_w():
    r = simulate(one_f_one_b(2, 1), f=1, b=2, w=3)
    ev = [(e.name, e.start, e.duration, e.ranks[0]) for e in r.timeline]
    assert ev == [("F", 0, 1, 0), ("B", 7, 2, 0), ("W", 9, 3, 0),
                  ("F", 1, 1, 1), ("B", 2, 2, 1), ("W", 4, 3, 1)]
    assert r.timeline[0].args == {"mb": 0, "chunk": 0, "stage": 0}


def test_doctests_in_the_schedules_package():
    import importlib
    for name in ("actions", "gpipe", "one_f_one_b", "interleaved", "zero_bubble"):
        mod = importlib.import_module(f"workbench.parallel.schedules.{name}")
        assert doctest.testmod(mod).failed == 0
    assert doctest.testmod(S).failed == 0


def test_large_schedule_is_linear_time():
    import time
    # CPU seconds of this process, not wall time: on a loaded machine (the suite under
    # -n 2 beside other jobs) wall time measured the load (failed at 08:31 on 2026-11-30)
    t = time.process_time()
    r = simulate(one_f_one_b(64, 1024))
    assert time.process_time() - t < 5.0        # O(N^2) would take minutes; benchmark: < 1 s
    assert r.peak_inflight[0] == 64 and len(r.blocks) == 2 * 64 * 1024


def test_printed_schedule_fits_a_notebook_line_and_keeps_every_action():
    """Notebook 07 printed interleaved 1F1B (p=4, m=8, v=2) in lines of 135 characters,
    which JupyterLab broke inside tokens (``F3c`` / ``1``).  Long rows are now cut into
    parts of the same positions on every rank, no line over 100 characters, and the parts
    joined give back every rank's row."""
    from workbench.parallel.schedules.actions import TEXT_WIDTH
    for s in (interleaved_1f1b(4, 8, 2), one_f_one_b(12, 32), zb_h1(8, 24),
              interleaved_1f1b(4, 12, 3)):
        text = str(s).splitlines()
        assert max(map(len, text)) <= TEXT_WIDTH == 100, s
        rows = {}
        for line in text[1:]:
            if line.startswith("rank"):
                head, tokens = line.split(":", 1)
                rows.setdefault(head, []).extend(tokens.split())
        assert [f"{h}: " + " ".join(t) for h, t in rows.items()] == s.to_text()
    short = gpipe(2, 2)                             # short rows: as before, one line a rank
    assert str(short).splitlines()[1:] == short.to_text()
