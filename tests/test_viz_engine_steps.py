"""The engine's step figure draws its log and nothing else: a prompt cell per prefill
chunk (labelled with its tokens), a decode cell per decode token, a cross per
preemption, a bar per finished request, the blocks in use and the queue of every step."""
import pytest
import torch

import workbench as wb
from workbench.serve.engine import Engine, StepRecord
from workbench.viz.engine_steps import engine_steps
from workbench.viz.placements import to_png


def gids(ax, gid):
    return [a for a in ax.get_children() if a.get_gid() == gid]


def tiny_engine_log():
    """A pool too small for all: an admission wait and preemptions, on a random tiny Llama."""
    cfg = wb.models.get_config("tiny")
    m = wb.models.build_model(cfg, seed=0).eval()
    g = torch.Generator().manual_seed(0)
    e = Engine(m, num_blocks=6, block_size=4, max_batch=3)
    for i, (n, new) in enumerate([(5, 9), (7, 6), (9, 4)]):
        e.add_request(f"r{i}", torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist(), new)
    e.run()
    return e


def test_every_record_is_drawn_once():
    e = tiny_engine_log()
    log = e.log
    assert any(r.preempted for r in log) and any(r.waiting for r in log)   # the case is there
    fig = engine_steps(log, num_blocks=6)
    ax, axb, axw = fig.axes
    pre = [(rec.step, rid, n) for rec in log for rid, _, n in rec.prefill]
    cells = gids(ax, "prefill")
    assert len(cells) == len(pre)
    order = [t.get_text() for t in ax.get_yticklabels()]
    for (step, rid, n), cell in zip(pre, cells):
        assert cell.get_x() == step - 0.5 and order[round(cell.get_y() + 0.4)] == rid
    labels = [t.get_text() for t in ax.texts]
    assert labels == [str(n) for _, _, n in pre]                 # each chunk's token count
    assert len(gids(ax, "decode")) == sum(len(r.decode) for r in log)
    assert len(gids(ax, "preempted")) == sum(len(r.preempted) for r in log)
    assert len(gids(ax, "finished")) == sum(len(r.finished) for r in log) == 3
    assert [b.get_height() for b in gids(axb, "blocks")] == [r.blocks_in_use for r in log]
    assert [b.get_height() for b in gids(axw, "waiting")] == [r.waiting for r in log]
    (pool,) = gids(axb, "pool")
    assert list(pool.get_ydata()) == [6, 6]
    assert to_png(engine_steps(log, 6)) == to_png(engine_steps(log, 6))     # deterministic


def test_a_hand_written_log_and_bad_input():
    log = [StepRecord(0, (("a", 0, 3),), (), ("a",), (), (), 3, 1, 1, 1),
           StepRecord(1, (("b", 0, 2),), (("a", 3),), ("b",), (), ("a",), 3, 1, 1, 0),
           StepRecord(2, (), (("b", 2),), (), (), ("b",), 1, 0, 0, 0)]
    fig = engine_steps(log)                     # no pool: no line
    ax, axb, _ = fig.axes
    assert [t.get_text() for t in ax.get_yticklabels()] == ["a", "b"]
    assert not gids(axb, "pool") and len(gids(ax, "decode")) == 2
    with pytest.raises(ValueError, match=r"log=\[\]"):
        engine_steps([])
    with pytest.raises(TypeError, match="StepRecord"):
        engine_steps([{"step": 0}])
    with pytest.raises(ValueError, match="num_blocks=0"):
        engine_steps(log, num_blocks=0)         # fewer than the log's 1 block in use
