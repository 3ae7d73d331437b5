"""FSDP2's root unit (``plan.fsdp2_root``): the embedding, the final norm and the output
layer are one parameter group, gathered before the forward and reduce-scattered after
the whole backward.  Held to PyTorch's own FSDP2 (a one-rank gloo group on the CPU, in a
fresh process), by hand on the stream model, and on the estimate."""
from __future__ import annotations

from dataclasses import replace

import pytest

import workbench as wb
from workbench.plan import fsdp2_cost as FS
from workbench.plan import fsdp2_root as FR
from workbench.plan.zero_cost import Block, zero_exposed



@pytest.fixture(scope="module")
def fsdp2_order(tmp_path_factory):
    """torchtitan's wrapping (fully_shard per block, then the model) on a toy Llama-like
    model in PyTorch's FSDP2 (tests/torch_references.py's FSDP2_ORDER, in a fresh
    process): the order in which it unshards and runs post-backward for each group, and
    which parameters the root's group holds."""
    from tests.torch_references import reference
    out = reference("fsdp2_order", tmp_path_factory)
    return eval(out.strip().splitlines()[-1])       # noqa: S307 (our own repr)


def test_pytorch_root_group_holds_embedding_norm_and_output(fsdp2_order):
    """torchtitan's ``fully_shard(model)`` after the blocks: the root's one group holds
    what the blocks do not (the module docstring's claim, in PyTorch's FSDP2)."""
    _, names = fsdp2_order
    assert names == ["norm.bias", "norm.weight", "output.weight", "tok_embeddings.weight"]


def test_pytorch_gathers_the_root_first_and_reduces_it_last(fsdp2_order):
    """The root is unsharded before any block in forward, and its post-backward (the
    reduce-scatter of the output layer's gradient with the embedding's) runs after every
    block's: the token ids need no gradient, so it runs in FSDP2's final callback."""
    log, _ = fsdp2_order
    unshard = [g for k, g in log if k == "unshard"]
    post = [g for k, g in log if k == "post_backward"]
    assert unshard[0] == "root"
    assert post[-1] == "root" and post.count("root") == 1
    assert sorted(post[:-1]) == ["layers.0", "layers.1"]


def _blocks():
    # embedding (100), two blocks (10 each), final norm and head (50); as stage_copies
    # gives them for 4 shards, stay = the root's two and the last block
    raw = [Block(100.0, 0.5, 1.0), Block(10.0, 2.0, 4.0), Block(10.0, 2.0, 4.0),
           Block(50.0, 1.0, 2.0)]
    c = FS.stage_copies(raw, 2, True, True, 4, 1, "a100")
    return c["blocks"], c["stay"]


def test_root_unit_by_hand():
    """One unit at index 0 holds the embedding's and the head's parameters and their copy
    kernels (the group's copy-out in forward, its gradients' copy-in in backward); the
    embedding's and the head's blocks keep their compute and hold nothing; stay shifts."""
    blocks, stay = _blocks()
    assert stay == (0, 2, 3)
    got, new_stay = FR.root_unit(blocks, stay, True, True, 4, "a100")
    assert new_stay == (0, 1, 3, 4)
    assert [b.numel for b in got] == [150.0, 0.0, 10.0, 10.0, 0.0]

    def copies(n):
        by = FS.unit_copy_bytes(n, 4)
        return (FS.copy_seconds(by["all_gather_copy_out"], "a100", "all_gather_copy_out"),
                FS.copy_seconds(by["reduce_scatter_copy_in"], "a100",
                                "reduce_scatter_copy_in"))
    (fe, ge), (fh, gh) = copies(100.0), copies(50.0)
    assert got[0].fwd == pytest.approx(fe + fh) and got[0].bwd == pytest.approx(ge + gh)
    assert got[1].fwd == pytest.approx(blocks[0].fwd - fe)
    assert got[1].bwd == pytest.approx(blocks[0].bwd - ge)
    assert got[4].fwd == pytest.approx(blocks[3].fwd - fh)
    assert got[2:4] == blocks[1:3]
    # the copies move, none is added or lost
    assert sum(b.fwd for b in got) == pytest.approx(sum(b.fwd for b in blocks))
    assert sum(b.bwd for b in got) == pytest.approx(sum(b.bwd for b in blocks))


def test_root_unit_exposes_the_head_gather_and_reduce_scatter_by_hand():
    """Collectives of 1 s per parameter, one unit ahead, compute beside them at full
    speed.  Units: embedding (1 parameter, no compute), a block (1, 10 s each way,
    resharded after forward), head (1, no compute); the embedding and head stay gathered.
    Before: forward 2 s exposed (the embedding's gather, then the block's, nothing
    computing before it; the head's gather hidden behind the block's 10 s); backward 3 s
    (the block's regather, then its reduce-scatter and the embedding's after the last
    compute; the head's reduce-scatter hidden behind the block).  With the root unit:
    3 s and 4 s, the head's gather and its reduce-scatter exposed, 1 s each."""
    blocks = [Block(1.0, 0.0, 0.0), Block(1.0, 10.0, 10.0), Block(1.0, 0.0, 0.0)]
    stay = (0, 2)
    one = lambda n: n                                              # noqa: E731
    f0, b0 = zero_exposed(blocks, 3, one, one, prefetch_numel=1, stay=stay)
    assert (f0, b0) == (2.0, 3.0)
    merged = [Block(2.0, 0.0, 0.0), replace(blocks[0], numel=0.0), blocks[1],
              replace(blocks[2], numel=0.0)]
    f1, b1 = zero_exposed(merged, 3, one, one, prefetch_numel=1, stay=(0, 1, 3))
    assert (f1, b1) == (3.0, 4.0)
    got, st = FR.root_unit(blocks, stay, True, True, 1, "a100")
    assert [b.numel for b in got] == [2.0, 0.0, 1.0, 0.0] and st == (0, 1, 3)


def test_middle_stage_unchanged_and_last_stage_root_first():
    blocks, stay = _blocks()
    mid = blocks[1:3]
    assert FR.root_unit(mid, (1,), False, False, 4, "a100") == (mid, (1,))
    last = blocks[1:]                        # a last pipeline stage: blocks, then the head
    got, st = FR.root_unit(last, (1, 2), False, True, 4, "a100")
    assert [b.numel for b in got] == [50.0, 10.0, 10.0, 0.0] and st == (0, 2, 3)


@pytest.mark.parametrize("shards", [0, -1, 2.0, True, None])
def test_bad_shards_refused_naming_them(shards):
    blocks, stay = _blocks()
    with pytest.raises(ValueError, match="shards"):
        FR.root_unit(blocks, stay, True, True, shards, "a100")


def test_root_not_kept_gathered_refused():
    blocks, _ = _blocks()
    with pytest.raises(ValueError, match="stay"):
        FR.root_unit(blocks, (2,), True, True, 4, "a100")


def _fsdp(devices=64, **kw):
    cfg = wb.plan.presets.get_config("llama3-8b")
    lay = wb.plan.Layout(dp=devices, zero=3, recompute="op", micro_batch=1,
                         global_batch=devices, framework="fsdp", **kw)
    return cfg, lay, wb.plan.Cluster("a100", devices)


def test_estimate_exposes_the_output_layers_collectives(monkeypatch):
    """On Llama 3 8B over 64 A100s the root unit adds what the head's gather and its
    fp32 reduce-scatter take on the dp group, within the stream model's slack: more than
    the reduce-scatter alone, less than both plus their copies."""
    from workbench.plan import costs as C
    cfg, lay, cl = _fsdp()
    with_root = wb.plan.estimate(cfg, lay, cl, attention="flash")
    monkeypatch.setattr(FR, "root_unit", lambda b, s, *a: (b, s))
    without = wb.plan.estimate(cfg, lay, cl, attention="flash")
    n = cfg.vocab_size * cfg.d_model + cfg.d_model
    ranks = tuple(range(64))
    ag = C.group_price("all_gather", 2 * n, ranks, cl.profile)
    rs = C.group_price("reduce_scatter", 4 * n, ranks, cl.profile)
    extra = with_root.details["dp_sync"] - without.details["dp_sync"]
    assert rs < extra < 1.2 * (ag + rs)
    assert any("root unit" in a for a in with_root.details["assumptions"])


def test_other_frameworks_unchanged(monkeypatch):
    cfg = wb.plan.presets.get_config("llama3-8b")
    lay = wb.plan.Layout(dp=64, zero=3, recompute="full", micro_batch=1, global_batch=64,
                         framework="deepspeed")
    cl = wb.plan.Cluster("a100", 64)
    a = wb.plan.estimate(cfg, lay, cl, attention="flash")
    monkeypatch.setattr(FR, "root_unit", lambda *a: (_ for _ in ()).throw(AssertionError))
    b = wb.plan.estimate(cfg, lay, cl, attention="flash")
    assert a.step_time == b.step_time
    assert not any("root unit" in x for x in a.details["assumptions"])
