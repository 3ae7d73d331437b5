"""A PyTorch user's habits on the wrappers, round 12 (habits12): reductions over
``fully_shard``'s gradients under torch.distributed.  FSDP2's ``p.grad`` is a DTensor whose
``numel()`` and reductions are the full tensor's (torch 2.13
``torch/distributed/tensor/_api.py``); ``wb.fully_shard``'s read this process's chunk
(``rank_grads.ShardGrad``), silently.  Held to one device and to torch's own
``fully_shard`` on one gloo launch (shared with test_habits11's check).
"""
import os

import pytest


CASES = ["numel", "nelement", "sum", "mean", "abs_mean", "pow_sum", "std", "max", "min",
         "zeros", "sum_dim0", "norm", "norm_inf", "norm_dim0", "data_norm", "clone_sum",
         "detach_norm", "double_mean", "detach_mean", "clip_2", "clip_inf", "clip_1_foreach",
         "total_0", "total_-inf", "sgd_clip_steps"]


def _flat(v):
    return [x for e in v for x in _flat(e)] if isinstance(v, list) else [v]


@pytest.mark.slow
def test_fully_shard_gradient_reads_on_gloo_are_fsdp2s(tmp_path_factory):
    """2 gloo processes, ``Sequential(Linear(3, 5), ReLU, Linear(5, 3))`` (the weights' 15
    elements in chunks of 8 and 7, padded), each process half the batch.  Before (measured):
    ``p.grad.numel()`` [8, 3, 8, 2] for [15, 5, 15, 3], ``sum`` / ``mean`` / ``std`` /
    ``max`` / ``(g == 0).sum()`` / ``sum(0)``, and ``g.data.norm()`` / ``g.detach()``'s norm
    (Lightning's, fairseq's logging) this process's chunk's (the last weight's norm 0.1794
    for 0.3041); torch's ``get_total_norm`` of order 0 / -inf raised.  Now every read is
    the full gradient's, as torch's FSDP2 and one device give; and a loop that clips and
    steps SGD with momentum (its buffer a clone of the gradient) still trains as one
    device (``sgd_clip_steps``: the parameters after two steps)."""
    from tests.torchrun_support import json_rows, two_proc
    out, text = two_proc(tmp_path_factory, "habits12_check.py")   # one launch: 2-process parts
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {r["case"]: r for r in json_rows(text)}
    assert sorted(rows) == sorted(CASES)
    assert rows["numel"]["wb"] == [15, 5, 15, 3]
    for c in CASES:
        r = rows[c]
        one, theirs, mine = (_flat(r[k]) for k in ("one", "torch", "wb"))
        assert all(isinstance(v, (int, float)) for v in mine), r      # no error text
        assert len(mine) == len(one) == len(theirs), r
        assert mine == pytest.approx(one, abs=1e-6), r
        assert theirs == pytest.approx(one, abs=1e-6), r
