"""Checker slips found in the browser review of notebooks 06, 07 and 08 (nbv0608): a
mistake named wrongly (a PrepareModuleInput handing the MLP a sequence shard read "Megatron's
g sends one all-reduce"; a colwise output made whole read "leave the norm out of the plan")
or not at all, and right answers refused for their type (a rank read off ``Mesh.mesh``, a
tensor as in torch's DeviceMesh; a NumPy integer).  Each test failed before its fix."""
import numpy as np
import pytest
import torch

from workbench.exercises import checks_spmd_pipeline as P
from workbench.exercises import checks_strategies as C
from workbench.exercises import checks_tp_api as T
from workbench.exercises.feedback import reset_tries
from workbench.parallel.tp_prepare import PrepareModuleInput
from workbench.parallel.tp_styles import ColwiseParallel, RowwiseParallel
from workbench.parallel.placement import Replicate, Shard
from workbench.sim_mesh.mesh import Mesh

from .exercise_helpers import fails, message, passes


@pytest.fixture(autouse=True)
def _fresh():
    reset_tries()
    yield
    reset_tries()


# 06, exercise 1: one GPT-3 layer, b = 1, bf16, t = 8
N, T8 = 2048 * 12288 * 2, 8
TP = 4 * 2 * (T8 - 1) / T8 * N
SP = 8 * (T8 - 1) / T8 * N


def test_sp_bytes_without_the_ring_factor_is_named():
    """8 n for TP + SP (each all-gather and reduce-scatter counted as the whole n) got only
    "too high: compare each factor"; the same slip on the TP answer was named."""
    fails(r"\(t-1\)/t", C.check_tp_sp_layer_bytes, TP, 8 * N)


# 06, exercise 4: the MLP plan without sequence parallelism
def _pmi(desired=Replicate()):
    return PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(desired,))


def test_prepare_module_input_handing_a_sequence_shard_is_named():
    """desired_input_layouts=(Shard(1),) (input and desired swapped in mind) made w1 and
    w3 all-gather the input back, and the message blamed g: "forward sent all_gather,
    all_gather, all_reduce ...; Megatron's g sends one all-reduce"."""
    plan = {"mlp": _pmi(Shard(1)), "mlp.w1": ColwiseParallel(), "mlp.w3": ColwiseParallel(),
            "mlp.w2": RowwiseParallel()}
    msg = message(T.check_tp_mlp_plan, plan)
    assert "desired_input_layouts" in msg and "g sends" not in msg


def test_a_colwise_output_made_whole_is_named_not_the_norm():
    """ColwiseParallel(output_layouts=Replicate()) on w1 all-gathers the hidden activation;
    the message said "leave the norm out of the plan" to a plan without the norm."""
    plan = {"mlp": _pmi(), "mlp.w1": ColwiseParallel(output_layouts=Replicate()),
            "mlp.w3": ColwiseParallel(), "mlp.w2": RowwiseParallel()}
    msg = message(T.check_tp_mlp_plan, plan)
    assert "norm" not in msg and "w1" in msg and "output_layouts" in msg


# 07, exercises 2 and 3: NumPy and torch integers are numbers
def test_min_microbatches_takes_numpy_and_tensor_integers(capsys):
    """np.int64(64) (np.argmax over a table of bubbles) read "m_1f1b should be an int, got
    np.int64(64)"."""
    passes(capsys, P.check_min_microbatches, np.int64(64), torch.tensor(32))
    fails("an int", P.check_min_microbatches, 64.5, 32)


def test_zb_bubble_takes_numpy_integers_and_tells_a_tensor_to_pass_its_number(capsys):
    """np.int64(9) read "bubble should be a number of time units, got np.int64(9)"; a
    tensor got no word of .item()."""
    passes(capsys, P.check_zb_bubble, np.int64(9))
    fails(r"\.item\(\)", P.check_zb_bubble, torch.tensor(9.0))


def test_zb_bubble_slips_are_named():
    """Section 4's unit costs (f = b = w = 1: 3), the whole step (the makespan, 49) and the
    share as a percentage (18.4) got only the generic formula."""
    fails("f = b = w = 1", P.check_zb_bubble, 3)
    fails("whole step", P.check_zb_bubble, 49)      # m (f+b+w) + the idle 9
    fails("percentage", P.check_zb_bubble, 100 * 9 / 49)


# 08, exercise 1: a rank read off the mesh's tensor
def test_hybrid_groups_read_off_the_mesh_tensor_pass(capsys):
    """``Mesh.mesh`` is a tensor, as torch's DeviceMesh.mesh: its column and element were
    refused ("dp_group should be a list of ranks, got tensor([4, 6])")."""
    stage = Mesh([[4, 5], [6, 7]], ["dp", "tp"])
    passes(capsys, C.check_hybrid_groups, stage.mesh[:, 0], stage.mesh[1], torch.tensor(2))
    fails("one rank", C.check_hybrid_groups, (4, 6), (6, 7), torch.tensor(True))   # a mask


# 08, exercise 2: model states of a stage-0 rank under ZeRO-2
VALUES, TOTAL = 31_552, 116_416          # a stage-0 rank's values; the whole model's


def test_state_bytes_of_the_whole_model_is_named():
    """All 116,416 values of the model at ZeRO-2's 10 B each got only the generic hint."""
    fails("whole model", C.check_hybrid_state_bytes, TOTAL * 10)


def test_state_bytes_split_over_the_stage_mesh_is_named():
    """Gradients and Adam split over the stage's 4 ranks (dp x tp) instead of dp's 2 got
    only the generic hint."""
    fails("dp group", C.check_hybrid_state_bytes, VALUES * 4 + VALUES * 12 / 4)


def test_reveal_keeps_to_the_printed_width(capsys):
    """reveal printed the expected plan of 06's exercise 4 as one line of 160 characters,
    which JupyterLab breaks mid-word; the checks' own messages keep to 100."""
    from workbench.exercises.feedback import reveal
    from workbench.text_width import WIDTH
    plan = {"mlp.w1": ColwiseParallel(), "mlp.w3": ColwiseParallel(),
            "mlp.w2": RowwiseParallel()}
    message(T.check_tp_mlp_plan, plan)
    capsys.readouterr()
    text = reveal("check_tp_mlp_plan")
    out = capsys.readouterr().out
    assert "PrepareModuleInput" in out and out == text + "\n"
    assert all(len(line) <= WIDTH for line in out.splitlines()), out


def test_zb_bubble_given_as_the_per_rank_tuple_is_named():
    """``simulate(...).bubble_time`` (the exercise names it to confirm with) passed whole
    read "bubble should be a number, got (9.0, 9.0, 9.0, 9.0)"."""
    from workbench.parallel.schedules import simulate, zb_h1
    fails("per rank", P.check_zb_bubble, simulate(zb_h1(4, 8), f=2, b=2, w=1).bubble_time)


def test_layer_bytes_for_all_96_layers_is_named():
    """The bytes of GPT-3's 96 layers, where the exercise asks for one, got only "too
    high: compare each factor with the formula"."""
    fails("96 layers", C.check_tp_sp_layer_bytes, 96 * TP, 96 * SP)
    fails("96 layers", C.check_tp_sp_layer_bytes, TP, 96 * SP)


def test_hand_schedule_with_split_backward_is_not_called_slow():
    """07 ex1 written with B and W (section 4's split), in the best order, was timed with
    w = 1 on top of b = 1 and read "takes 14 time units ... a faster one exists"."""
    from workbench.parallel.schedules import Schedule
    rows = ["F0 F1 B0 W0 F2 B1 W1 B2 W2", "F0 F1 B0 W0 F2 B1 W1 B2 W2",
            "F0 B0 W0 F1 B1 W1 F2 B2 W2"]
    msg = message(P.check_hand_schedule, Schedule.from_text(rows))
    assert "faster" not in msg and "B and W" in msg
