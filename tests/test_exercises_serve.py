"""The checks of notebook 15: right answers pass, common mistakes get their hint, the
value shows only from the third try, and the checks' hand formulas agree with the
library (StepPricer's weight bytes, a real checkpoint's reads, a static batch's
padded decode tokens)."""
import pytest
import torch

import workbench as wb
from workbench.exercises import checks_serve as C
from workbench.exercises.feedback import CheckError, REVEAL_AFTER, reset_tries
from workbench.serve.batching import Request, StepPricer, static

from .exercise_helpers import fails, passes


@pytest.fixture(autouse=True)
def _fresh():
    reset_tries()
    yield
    reset_tries()


def test_every_check_is_exported():
    assert set(C.__all__) == {"check_decode_floor_ms", "check_load_reads",
                              "check_static_useful_share"}
    assert all(getattr(wb.exercises, name) is getattr(C, name) for name in C.__all__)


def test_decode_floor(capsys):
    p = StepPricer("llama2-7b", "ascend-910b")
    params, bw = p.weight_bytes / 2, p.profile.memory_bandwidth
    ms = p.weight_bytes / bw * 1e3
    # the library's decode step of one short sequence is at least the floor, and close
    assert ms < p.seconds(decode=[1]) * 1e3 < 1.5 * ms
    passes(capsys, C.check_decode_floor_ms, ms, ms / 2, params, bw)
    fails("counts bits", C.check_decode_floor_ms, ms * 8, ms / 2, params, bw)
    fails("int8 floor equals", C.check_decode_floor_ms, ms, ms, params, bw)
    fails("int4", C.check_decode_floor_ms, ms, ms / 4, params, bw)
    fails("fp32", C.check_decode_floor_ms, ms * 2, ms, params, bw)
    fails("bytes over the bandwidth", C.check_decode_floor_ms, ms * 3, ms * 1.5, params, bw)
    fails("milliseconds|small", C.check_decode_floor_ms, ms / 1e3, ms / 2, params, bw)
    # the bandwidth taken in TB/s (1.6 for 1.6e12 B/s)
    fails("bytes per second", C.check_decode_floor_ms, ms * 1e12, ms * 5e11, params, bw)


def test_load_reads_agree_with_a_real_checkpoint(tmp_path, capsys):
    x = torch.arange(16 * 2).reshape(16, 2)
    wb.checkpoint.save(tmp_path, {"w": wb.shard_tensor(x, wb.Mesh.grid(8, ["x"]),
                                                       [wb.Shard(0)])})
    t = wb.shard_tensor(torch.zeros_like(x), wb.Mesh.grid(3, ["x"]), [wb.Shard(0)])
    rep = wb.checkpoint.load(tmp_path, {"w": t})
    for r in range(3):
        read = sorted(int(f.split("_")[2]) for f in rep.files(r))
        passes(capsys, C.check_load_reads, read, rank=r)
    fails("every file", C.check_load_reads, list(range(8)))
    fails(r"saved rank 2 holds rows 4\.\.5: rank 1 holds none of those .*and 1 more saved",
          C.check_load_reads, [2, 3, 4])
    fails(r"saved rank 2 holds rows 4\.\.5: rank 1 holds none of those \(rank 1 holds chunk 1 "
          r"of torch.chunk\(16, 3\): ceil\(16 / 3\) rows per chunk, the last one shorter\) \(try",
          C.check_load_reads, [2, 3, 4, 5])
    fails(r"\[3, 4\] overlap rank 1's rows, but 1 more saved rank\(s\) do too", C.check_load_reads,
          [3, 4])
    fails("not saved rank 1: the layouts differ", C.check_load_reads, [1])
    fails("those are rank 1's rows", C.check_load_reads, list(range(6, 12)))
    fails(r"the saved ranks are 0\.\.7", C.check_load_reads, [3, 4, 8])
    fails("empty list", C.check_load_reads, [])
    fails("list of rank numbers", C.check_load_reads, "3, 4, 5")


def test_load_reads_takes_numpy_and_torch_integers(capsys):
    """A student who computes the ranks with NumPy or torch (np.arange, a tensor, a range)
    gives integers; before, [np.int64(3), ...] read "give a list of rank numbers (ints)"."""
    import numpy as np
    for ranks in ([3, 4, 5], range(3, 6), np.arange(3, 6), list(np.arange(3, 6)),
                  torch.tensor([3, 4, 5]), list(torch.tensor([3, 4, 5])), (5, 4, 3)):
        passes(capsys, C.check_load_reads, ranks)
    fails("not saved rank 1", C.check_load_reads, np.array([1]))
    for bad in ("3, 4, 5", 3, [3.0, 4.0, 5.0], np.array([3.0, 4.0, 5.0]), [True, 4, 5],
                np.array([[3, 4, 5]]), torch.tensor(3), None, {3: 1}):
        fails("list of rank numbers", C.check_load_reads, bad)


class OneSecond(StepPricer):
    def seconds(self, prefill=(), decode=()):
        return 1.0


def test_static_useful_share_agrees_with_the_schedule(capsys):
    outs = (12, 3, 7, 2)
    res = static([Request(i, 0.0, 5, o) for i, o in enumerate(outs)],
                 OneSecond("tiny", "a100"), max_batch=4)
    passes(capsys, C.check_static_useful_share, res.useful_decode_share)
    want = sum(o - 1 for o in outs) / (4 * 11)
    assert res.useful_decode_share == want
    fails("o - 1 decode steps", C.check_static_useful_share, sum(outs) / 48)
    fails("computed over needed", C.check_static_useful_share, 1 / want)
    fails("padded share, or counts o decode tokens", C.check_static_useful_share, 1 - want)
    fails("max - 1 decode steps per slot", C.check_static_useful_share, 20 / 48)
    fails("percentage", C.check_static_useful_share, 100 * want)
    fails("slot by slot", C.check_static_useful_share, 0.3)
    fails("did you round", C.check_static_useful_share, 0.45)      # 0.4545 to two places
    # with other outputs the padded share and the o-for-o - 1 slip differ: each its own hint
    outs = (5, 5, 2)
    want = sum(o - 1 for o in outs) / (3 * 4)
    fails("padded share; give", C.check_static_useful_share, 1 - want, outputs=outs)
    fails("needs o - 1 decode tokens", C.check_static_useful_share, 12 / 12, outputs=outs)


def test_value_only_from_the_third_try():
    for n in range(1, REVEAL_AFTER + 1):
        with pytest.raises(CheckError) as err:
            C.check_static_useful_share(0.9)
        assert ("expected 0.4545" in str(err.value)) == (n >= REVEAL_AFTER)
