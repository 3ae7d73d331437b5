"""How checks talk: a short message, the hint first, the expected value after repeated
tries or on request; and every expected value derived independently of the library,
which must agree with it."""
import pytest
import torch

import workbench as wb
import workbench.exercises as ex
from workbench.exercises import checks as exc
from workbench.exercises import checks_spmd_pipeline as exp
from workbench.exercises import checks_strategies as exs
from workbench.exercises import feedback as fb
from workbench.parallel import schedules as S
from workbench.sim_mesh import cost, estimates


@pytest.fixture(autouse=True)
def fresh():
    fb.reset_tries()
    yield
    fb.reset_tries()


def _wrong(fn, *args):
    with pytest.raises(fb.CheckError) as e:
        fn(*args)
    return e.value


def test_render_traceback_is_the_message_alone():
    err = _wrong(ex.check_training_days, 11.0)
    lines = err._render_traceback_()
    # one block, the message word for word (wrapped at text_width.WIDTH: JupyterLab
    # breaks a longer line mid-word)
    assert len(lines) == 1 and lines[0].split()[2:] == str(err).split()      # after "Not yet:"
    assert "Traceback" not in lines[0] and "checks.py" not in lines[0]


def test_the_value_shows_from_the_third_try_on():
    msgs = [str(_wrong(ex.check_training_days, 11.0)) for _ in range(fb.REVEAL_AFTER)]
    assert all("7.583" not in m for m in msgs[:-1])
    assert "try 1" in msgs[0] and "try 2" in msgs[1]
    assert msgs[-1].endswith("(expected 7.583 days)")


def test_a_right_answer_resets_the_count(capsys):
    for _ in range(fb.REVEAL_AFTER - 1):
        _wrong(ex.check_tp_group, (0, 1, 2, 3))
    ex.check_tp_group((4, 5, 6, 7))
    assert "try 1" in str(_wrong(ex.check_tp_group, (0, 1, 2, 3)))


def test_reveal_on_request(capsys):
    assert "no wrong try yet" in fb.reveal(ex.check_notation)
    _wrong(ex.check_notation, "bf16[I, J_tp]")
    assert fb.reveal("check_notation") == "check_notation expects 'bf16[I, J_tp]{U_dp}'"
    assert wb.exercises.reveal is fb.reveal
    with pytest.raises(ValueError, match="check function or its name"):
        fb.reveal("training_days")


def test_type_errors_carry_no_value():
    err = _wrong(ex.check_training_days, "7.6")
    assert err.expected is None and "try" not in str(err)


# ---- the independent derivations agree with the library -----------------------------------

def test_zero_bytes_agree():
    for stage in range(4):
        assert exc._zero_bytes(7.5e9, 64, stage) == pytest.approx(
            estimates.zero_model_state_bytes(7.5e9, 64, stage), rel=1e-12)


def test_chunks_agree_with_torch():
    for n in range(0, 13):
        for k in range(1, 6):
            assert exc._chunks(n, k) == [len(c) for c in torch.arange(n).chunk(k)] + \
                [0] * (k - len(torch.arange(n).chunk(k)))


def test_activation_formula_agrees():
    for case in estimates.ACTIVATION_CASES:
        assert exs._activation_bytes(2048, 12288, 96, 8, case) == pytest.approx(
            estimates.activation_bytes_per_layer(2048, 1, 12288, 96, 8, case), rel=1e-12)


def test_ring_bytes_agree():
    n = int(7.5e9 * 2)
    assert 2 * 63 * n // 64 == cost.wire_bytes("all_reduce", n, 64)
    assert 63 * n // 64 == cost.wire_bytes("all_gather", n, 64)


def test_hand_makespan_agrees_with_the_simulator():
    for sched in (S.one_f_one_b(3, 3), S.gpipe(3, 3), S.one_f_one_b(4, 6),
                  S.Schedule.from_text(["F0 B0 F1 B1 F2 B2"] * 3)):
        rows = [[f"{a.kind}{a.mb}" for a in row] for row in sched.actions]
        assert exp._makespan(rows) == S.simulate(sched).makespan
    assert exp._makespan([["B0", "F0"], ["F0", "B0"]]) == float("inf")     # deadlock


def test_bucket_fill_agrees_with_data_parallel():
    from workbench.parallel.strategies.data_parallel import DataParallel
    from workbench.sim_mesh.trace import trace
    mesh = wb.Mesh.grid(2, ["dp"])
    torch.manual_seed(0)
    model = exs._mlp((256, 1024, 1024, 256))
    wb.parallelize(model, mesh, {})
    dp = DataParallel(list(wb.dist_parameters(model)), mesh, "dp", bucket_bytes=2 * 2**20)
    with trace() as tr:
        model(wb.shard_tensor(torch.randn(2, 256), mesh, [wb.Shard(0)])).sum().backward()
        dp.step()
    got = [e.args["buffer_bytes"] for e in tr.collectives() if e.label == "dp bucket"]
    assert got == [5248000, 1052672]


def test_hybrid_groups_agree_with_stage_meshes(capsys):
    from workbench.recipes.hybrid import stage_meshes
    meshes = stage_meshes(2, 2, 2)
    for rank in range(8):
        s = rank // 4
        m, other = meshes[s], meshes[1 - s]
        c = m.coordinate(rank)
        exs.check_hybrid_groups(m.group_of(rank, "dp"), m.group_of(rank, "tp"),
                                other.tolist()[c[0]][c[1]], rank=rank)


def test_state_bytes_agree_with_memory():
    from workbench.models.config import get_config
    from workbench.recipes.hybrid import Hybrid
    for zero in range(4):
        st = Hybrid(dp=2, tp=2, pp=2, zero=zero)
        opts = st.build_optimizer(st.build_model(get_config("tiny"), 0), 1e-3, 0.0)
        for mixed in (False, True):
            assert exs._state_bytes(2, 2, 2, zero, 0, "tiny", mixed)[0] == \
                opts[0].memory(mixed_precision=mixed).total


def test_zb_formula_agrees_with_the_simulator():
    assert S.simulate(S.zb_h1(4, 8), f=2, b=2, w=1).bubble_time[0] == pytest.approx(9)
