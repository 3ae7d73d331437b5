"""The checks of notebook 13: right answers pass, wrong answers are told what is wrong."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import workbench as wb
from workbench.exercises.checks import CheckError


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.tok = nn.Parameter(torch.randn(32, 8) * 0.1)
        self.pos = nn.Parameter(torch.randn(16, 8), requires_grad=False)
        self.up = nn.Linear(8, 8)

    def forward(self, ids):
        x = self.tok[ids] + self.pos[: ids.shape[1]]
        return F.gelu(self.up(x)) @ self.tok.T


RIGHT = 4 * (32 * 8 + 8 * 8 + 8)


def test_ddp_bytes_right(capsys):
    wb.exercises.check_ddp_bytes(RIGHT, Tiny)
    assert capsys.readouterr().out.startswith("Correct: ")


@pytest.mark.parametrize("wrong,msg", [(RIGHT + 4 * 16 * 8, "frozen"),
                                       (RIGHT + 123, "too high")])
def test_ddp_bytes_wrong(wrong, msg):
    wb.exercises.reset_tries()
    with pytest.raises(CheckError, match=msg):
        wb.exercises.check_ddp_bytes(wrong, Tiny)


def test_ddp_bytes_formula_equals_what_ddp_all_reduces():
    """The check counts by hand; DDP's own trace must record the same buffer bytes."""
    from workbench.sim_mesh.trace import trace
    mesh = wb.Mesh.grid(4, ["dp"])
    ddp = wb.DistributedDataParallel(Tiny(), mesh)
    ids = wb.shard_tensor(torch.randint(0, 32, (8, 16), generator=torch.Generator().manual_seed(0)),
                          mesh, ["S(0)"])
    with trace() as tr:
        ddp(ids).sum().backward()
    assert sum(e.args["buffer_bytes"] for e in tr.collectives() if e.label.startswith("ddp")) \
        == RIGHT


def test_like_one_device_passes_a_good_model_and_refuses_one_without_frozen(capsys):
    wb.exercises.check_like_one_device(Tiny)
    assert "Correct: Tiny" in capsys.readouterr().out

    def unfrozen():
        m = Tiny()
        m.pos.requires_grad_(True)
        return m
    with pytest.raises(CheckError, match="frozen"):
        wb.exercises.check_like_one_device(unfrozen)


def test_like_one_device_catches_a_model_that_differs_per_rank():
    class Noisy(Tiny):
        def forward(self, ids):
            return super().forward(ids) + torch.rand(())      # a fresh draw on every rank
    with pytest.raises(CheckError, match="differs from one device"):
        wb.exercises.check_like_one_device(Noisy)


def test_ddp_bytes_without_the_model_says_so():
    # found in the browser: check_ddp_bytes(grad_bytes) showed a TypeError traceback
    # through the checker (feedback.py) instead of a message
    wb.exercises.reset_tries()
    with pytest.raises(CheckError, match="pass the model too"):
        wb.exercises.check_ddp_bytes(RIGHT)


def test_ddp_bytes_shows_the_answer_as_given():
    # found in the browser: 15.552 (kB) read "your answer is 15.55 B" and a wrong
    # 15552.0001 "1.555e+04 B", which reads as a round 15,550
    for wrong, shown in ((RIGHT + 0.0001, "1,312.0001"), (10 * RIGHT + 0.5, "13,120.5")):
        wb.exercises.reset_tries()
        with pytest.raises(CheckError, match=f"your answer is {shown} B"):
            wb.exercises.check_ddp_bytes(wrong, Tiny)


def test_like_one_device_names_rows_mixed_across_the_batch():
    # found in the browser: a forward that mixes the batch's rows (x - x.mean(0)) was told
    # only "is your forward deterministic (no dropout)?", which it is
    class Centered(Tiny):
        def forward(self, ids):
            x = self.tok[ids]                                  # (B, T, W)
            return (x - x.mean(0)) @ self.tok.T                # mixes the rows of the batch
    with pytest.raises(CheckError, match="differs from one device.*mix rows"):
        wb.exercises.check_like_one_device(Centered)


def test_ddp_bytes_without_a_formula_says_how_to_count():
    """Exercise 1 counts parameters; a wrong count that matches no known mistake is told
    how to count, not to "compare each factor with the formula"."""
    for wrong, msg in [(RIGHT + 123, "count 4 bytes per value of each distinct parameter"),
                       (RIGHT // 4, "number of values"), (RIGHT // 2, "not 2")]:
        wb.exercises.reset_tries()
        with pytest.raises(CheckError, match=msg) as err:
            wb.exercises.check_ddp_bytes(wrong, Tiny)
        assert "formula" not in str(err.value)


def test_like_one_device_tells_an_unseeded_model_to_seed():
    """A make_model() without a seed builds other weights on every call: the diagnosis is
    the seed, not dropout."""
    class Unseeded(Tiny):
        def __init__(self):
            nn.Module.__init__(self)                    # Tiny's layers, without its seed
            self.tok = nn.Parameter(torch.randn(32, 8) * 0.1)
            self.pos = nn.Parameter(torch.randn(16, 8), requires_grad=False)
            self.up = nn.Linear(8, 8)
    with pytest.raises(CheckError, match="seed it inside") as err:
        wb.exercises.check_like_one_device(Unseeded)
    assert "dropout" not in str(err.value)


@pytest.mark.parametrize("wrong,msg", [(4 * RIGHT, "sum over the 4 ranks"),
                                       (1.5 * RIGHT, "ring all-reduce SENDS"),
                                       (2 * RIGHT, "twice the gradients"),
                                       # the rebuild's broadcasts notebook 13 prints: the
                                       # 3 trainable indices and the count, one length
                                       (RIGHT + 4 * 4 + 4, "rebuild's two broadcasts"),
                                       (RIGHT / 1e3, "1,000 times too small: a unit slip")])
def test_ddp_bytes_names_ranks_ring_and_unit_slips(wrong, msg):
    wb.exercises.reset_tries()
    with pytest.raises(CheckError, match=msg):
        wb.exercises.check_ddp_bytes(wrong, Tiny)


def test_like_one_device_refuses_a_model_instance_or_class_with_a_message():
    def make_model():
        torch.manual_seed(0)
        return Tiny()
    for arg, msg in ((make_model(), "not make_model\\(\\)"), (lambda: Tiny, "not the class"),
                     (lambda: 1 / 0, "make_model\\(\\) raised ZeroDivisionError")):
        with pytest.raises(CheckError, match=msg):
            wb.exercises.check_like_one_device(arg)


def test_ddp_bytes_names_a_tied_weight_counted_twice():
    """Tiny ties its head by using tok twice in forward (one registration): a student
    who counts the head as its own matrix is told which parameter was counted twice."""
    wb.exercises.reset_tries()
    with pytest.raises(CheckError, match="counts tok twice"):
        wb.exercises.check_ddp_bytes(RIGHT + 4 * 32 * 8, Tiny)


def test_like_one_device_says_what_the_model_is_called_with():
    """A forward that cannot take token ids (a Linear on the int64 ids) is told what the
    check feeds it, without a traceback through the check (a tuple output is named as
    such: tests/test_exercise_slips7_1214.py)."""
    class Floats(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lin = nn.Linear(16, 4)
            self.lin.bias.requires_grad_(False)

        def forward(self, x):
            return self.lin(x)

    msg = "RuntimeError: .*int64 tensor \\(4, 16\\) of token ids in \\[0, 32\\)"
    with pytest.raises(CheckError, match=msg) as err:
        wb.exercises.check_like_one_device(Floats)
    assert str(err.value).startswith("on one device, training your model raised")


def test_like_one_device_passes_on_a_wrappers_refusal_in_one_line():
    """BatchNorm trains on one device but FSDP refuses it (batch statistics per rank; DDP
    runs it as torch DDP does, tests/test_ddp_batchnorm.py): the refusal comes as the
    check's message, naming the wrapper."""
    class Normed(Tiny):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(16)

        def forward(self, ids):
            return self.bn(super().forward(ids))
    with pytest.raises(CheckError, match="^under FSDP, training your model raised "
                                         "NotImplementedError: .*SyncBatchNorm") as err:
        wb.exercises.check_like_one_device(Normed)
    assert "the check calls" not in str(err.value)


def test_like_one_device_wraps_a_model_with_an_unused_parameter_as_torch_ddp_needs(capsys):
    """A trainable parameter forward never uses: torch's DDP raises at the second step
    unless find_unused_parameters=True, so the check passes it and says so."""
    class Spare(Tiny):
        def __init__(self):
            super().__init__()
            self.spare = nn.Parameter(torch.zeros(5))
    wb.exercises.check_like_one_device(Spare)
    out = capsys.readouterr().out
    assert "Correct: Spare" in out and "unused ['spare']" in out
    assert "find_unused_parameters=True" in out
    wb.exercises.check_like_one_device(Tiny)             # nothing unused: nothing said
    assert "unused" not in capsys.readouterr().out
