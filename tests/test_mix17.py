"""mix17: notebook 13's exercise 2 refuses a forward that draws from torch's generator.

On simulated ranks the ranks' forwards draw one after another from the one generator, so
``torch.randn(ids.shape[0], ...)`` gives one device's numbers; each torchrun process
draws from its own generator seeded alike, so every rank draws the first rows' numbers
(measured with torchrun, 2 gloo processes, wb DDP: loss of step 1 0.0042383 against one
device's 0.0041688; the simulated ranks' 0.0041688)."""
import pytest
import torch
from torch import nn

import workbench as wb
from workbench.exercises.checks import CheckError


class Base(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(32, 16) * 0.1)
        self.scale = nn.Parameter(torch.ones(16), requires_grad=False)      # frozen

    def features(self, ids):
        return self.table[ids] * self.scale                                 # (B, T, 16)

    def forward(self, ids):
        return torch.tanh(self.features(ids)) @ self.table.T                # (B, T, 32)


class Drawn(Base):                  # the browser review's model: a draw of the batch's rows
    def forward(self, ids):
        x = self.features(ids) + 0.1 * torch.randn(ids.shape[0], ids.shape[1], 16)
        return torch.tanh(x) @ self.table.T


class Dropped(Base):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.25)

    def forward(self, ids):
        return torch.tanh(self.drop(self.features(ids))) @ self.table.T


class Kept(Base):                   # the fix the message names: drawn once, read by token
    def __init__(self):
        super().__init__()
        self.register_buffer("noise", 0.1 * torch.randn(32, 16))

    def forward(self, ids):
        return torch.tanh(self.features(ids) + self.noise[ids]) @ self.table.T


def build(cls, eval_mode=False):
    def make_model():
        torch.manual_seed(0)
        m = cls()
        return m.eval() if eval_mode else m
    return make_model


def test_the_simulated_ranks_alone_give_one_devices_draw():
    """What hid the bug: DDP on 2 simulated ranks draws one device's numbers."""
    ids = torch.randint(0, 32, (4, 16), generator=torch.Generator().manual_seed(0))
    mesh = wb.Mesh.grid(2, ["dp"])
    torch.manual_seed(1)
    one = build(Drawn)()(ids)
    torch.manual_seed(1)
    ddp = wb.DistributedDataParallel(build(Drawn)(), mesh)
    sim = ddp(wb.shard_tensor(ids, mesh, [wb.Shard(0)]))
    assert torch.allclose(sim.full(), one, atol=1e-6)


@pytest.mark.parametrize("cls", [Drawn, Dropped])
def test_a_forward_that_draws_is_refused_naming_torchrun_and_the_fix(cls):
    wb.exercises.reset_tries()
    with pytest.raises(CheckError) as err:
        wb.exercises.check_like_one_device(build(cls))
    msg = " ".join(str(err.value).split())
    assert "draws random numbers" in msg and "torchrun" in msg
    assert "rank 1's rows of the output differ from one device's by up to" in msg
    assert "model.eval()" in msg and "self.noise[ids]" in msg


def test_the_refusal_leaves_the_global_generator_as_it_was():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    wb.exercises.reset_tries()
    with pytest.raises(CheckError):
        wb.exercises.check_like_one_device(build(Drawn))
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("cls, eval_mode", [(Base, False), (Kept, False), (Dropped, True)])
def test_a_forward_that_draws_nothing_still_passes(cls, eval_mode, capsys):
    wb.exercises.reset_tries()
    wb.exercises.check_like_one_device(build(cls, eval_mode))
    assert capsys.readouterr().out.startswith(f"Correct: {cls.__name__} under DDP and FSDP")


def test_the_replay_is_what_each_process_computes():
    """Rank 1's process starts from the state rank 0's starts from: its rows get the
    numbers rank 0's rows get (why the check names rank 1)."""
    ids = torch.randint(0, 32, (4, 16), generator=torch.Generator().manual_seed(0))
    m = build(Drawn)()
    start = torch.get_rng_state()
    noise = []
    for rows in ids.chunk(2):
        torch.set_rng_state(start)
        noise.append(torch.randn(rows.shape[0], rows.shape[1], 16))
    assert torch.equal(noise[0], noise[1])
    torch.set_rng_state(start)
    assert not torch.equal(torch.randn(4, 16, 16)[2:], noise[1])   # one device's rows 2, 3
    torch.set_rng_state(start)
    whole = m(ids)                                                   # one device's forward
    torch.set_rng_state(start)
    rank0 = m(ids[:2])                                               # process 0
    torch.set_rng_state(start)
    rank1 = m(ids[2:])                                               # process 1
    assert torch.equal(rank0, whole[:2]) and not torch.allclose(rank1, whole[2:])
