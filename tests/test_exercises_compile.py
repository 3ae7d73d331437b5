"""The checks of notebook 16: right answers pass, common mistakes get their hint, and the
checks' hand formulas agree with what wb.compile and the trace count."""
import pytest
import torch

import workbench as wb
from workbench.exercises import checks_compile as C
from workbench.exercises.feedback import CheckError, reset_tries

from .exercise_helpers import fails, passes

R, S = wb.Replicate, wb.Shard


@pytest.fixture(autouse=True)
def _fresh():
    reset_tries()
    yield
    reset_tries()


def test_every_check_is_exported():
    assert set(C.__all__) == {"check_no_graph_break", "check_greedy_vs_whole_bytes",
                              "check_sink_saving_us"}
    assert all(getattr(wb.exercises, name) is getattr(C, name) for name in C.__all__)


def _branchy(x):
    m = x.abs().amax()
    if m > 1:
        x = x / m
    return torch.relu(x)


def test_no_graph_break(capsys):
    passes(capsys, C.check_no_graph_break,
           lambda x: torch.relu(x / torch.clamp(x.abs().amax(), min=1.0)))
    passes(capsys, C.check_no_graph_break,
           lambda x: torch.relu(x / torch.maximum(x.abs().amax(), torch.ones(()))))
    fails("still falls back to eager.*line", C.check_no_graph_break, _branchy)
    fails("max\\(1, m\\)", C.check_no_graph_break, lambda x: torch.relu(x / x.abs().amax()))
    fails("another result", C.check_no_graph_break, lambda x: torch.relu(x))
    fails("function itself", C.check_no_graph_break, 3.0)

    def stub(x):
        raise NotImplementedError()
    fails("raised NotImplementedError.*replace the stub", C.check_no_graph_break, stub)
    fails("raised NameError", C.check_no_graph_break, lambda x: torch.relu(x) + undefined)  # noqa: F821
    # Python's max() of a tensor reads its value as an `if` does
    fails("still falls back to eager.*Python's max\\(\\)", C.check_no_graph_break,
          lambda x: torch.relu(x / max(1.0, x.abs().amax())))
    # clamp's max= is a ceiling: min(1, m) divides small inputs by m
    fails("nor by min\\(1, m\\).*torch.clamp\\(m, min=1\\)", C.check_no_graph_break,
          lambda x: torch.relu(x / torch.clamp(x.abs().amax(), max=1.0)))
    # the name says rows, the function scales the whole tensor by one number
    fails("each row .or column. by its own largest", C.check_no_graph_break,
          lambda x: torch.relu(x / torch.clamp(x.abs().amax(-1, keepdim=True), min=1.0)))
    fails("ABSOLUTE value", C.check_no_graph_break,
          lambda x: torch.relu(x / torch.clamp(x.amax(), min=1.0)))
    fails("forget `return`", C.check_no_graph_break,
          lambda x: None if x is not None else x)
    fails("negative entries.*relu", C.check_no_graph_break,
          lambda x: x / torch.clamp(x.abs().amax(), min=1.0))
    # .max() over every dim is captured (it broke the graph before compile10): a right
    # answer written with it passes
    for spell in (lambda x: torch.relu(x / torch.clamp(x.abs().max(), min=1.0)),
                  lambda x: torch.relu(x / torch.clamp(torch.max(x.abs()), min=1.0))):
        passes(capsys, C.check_no_graph_break, spell)


def test_greedy_vs_whole_bytes_matches_the_trace(capsys):
    full = 16 * 32 * 4
    passes(capsys, C.check_greedy_vs_whole_bytes, 384 + 1536, 1536)
    fails("compiled program's count", C.check_greedy_vs_whole_bytes, 1536, 1536)
    fails("\\(p-1\\)/p", C.check_greedy_vs_whole_bytes, full / 4 + full, 1536)
    fails("bytes", C.check_greedy_vs_whole_bytes, (384 + 1536) / 4, 1536)
    fails("one all_gather", C.check_greedy_vs_whole_bytes, 1920, 1920)
    # the exercise's own case (24 x 64 on 8 ranks): section 2's numbers name that case
    big = 24 * 64 * 4
    passes(capsys, C.check_greedy_vs_whole_bytes, 7 / 8 * big / 8 + 7 / 8 * big, 7 / 8 * big,
           rows=24, cols=64, p=8)
    fails("section 2's case.*\\(24, 64\\) tensor on 8 ranks", C.check_greedy_vs_whole_bytes,
          1920, 1536, rows=24, cols=64, p=8)
    fails("section 2's case", C.check_greedy_vs_whole_bytes, 7 / 8 * big / 8 + 7 / 8 * big,
          1536, rows=24, cols=64, p=8)
    # an all_gather priced on one shard, or as p - 1 whole copies
    right_g = 7 / 8 * big / 8 + 7 / 8 * big
    fails("\\(p-1\\)/p of one shard", C.check_greedy_vs_whole_bytes, right_g, 7 / 8 * big / 8,
          rows=24, cols=64, p=8)
    fails("not p - 1 whole copies", C.check_greedy_vs_whole_bytes, right_g, 7 * big,
          rows=24, cols=64, p=8)
    fails("not \\(p-1\\)/p of one shard", C.check_greedy_vs_whole_bytes, 2 * 7 / 8 * big / 8,
          7 / 8 * big, rows=24, cols=64, p=8)
    fails("not p - 1 whole copies", C.check_greedy_vs_whole_bytes, 7 / 8 * big / 8 + 7 * big,
          7 / 8 * big, rows=24, cols=64, p=8)
    # the library's own counts, op by op and compiled, agree with the hand formula
    mesh = wb.Mesh.grid((4,))
    x = wb.shard_tensor(torch.randn(16, 32), mesh, [S(1)])
    f = lambda t: torch.softmax(t, 1)          # noqa: E731
    with wb.trace(profile="a100") as tr:
        wb.reshard(f(x), mesh, [R()])
    greedy = max(tr.bytes_per_rank().values())
    prog = wb.compile(f, x, pin={"output": [R()]}, profile="a100", method="trace")
    passes(capsys, C.check_greedy_vs_whole_bytes, greedy, prog.bytes)


def test_sink_saving(capsys):
    lt = wb.get_profile("ascend-910b").launch_overhead
    passes(capsys, C.check_sink_saving_us, 96 * lt * 1e6, 97)
    fails("launched once", C.check_sink_saving_us, 97 * lt * 1e6, 97)
    fails("1e6", C.check_sink_saving_us, 96 * lt * 1e3, 97)
    fails("one launch", C.check_sink_saving_us, lt * 1e6, 97)
    # the notebook's PROFILE is the A100's: its 1 us per launch is not the 910B's
    fails("A100's launch overhead", C.check_sink_saving_us,
          96 * wb.get_profile("a100").launch_overhead * 1e6, 97)
    # 96 is also a count of launches, not their time: the hint names that too
    fails("count of launches rather than their time.*launch_overhead", C.check_sink_saving_us,
          96, 97)
    # the whole O1 -> O2 step difference (launches and bucketing) is more than every launch
    fails("launches only.*bucketing", C.check_sink_saving_us, 97 * lt * 1e6 + 120, 97)
