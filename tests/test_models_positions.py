"""The models' per-token positions and kept logits (workbench/models/positions.py): Hugging
Face's ``position_ids`` and ``logits_to_keep`` on the Llama (RoPE) and the GPT (learned
positions).  References: the default forward (positions 0..S-1), and a copy of the model
whose position tables are re-indexed so that its default forward sees the asked positions;
errors before anything runs (a KV cache untouched)."""
import copy

import pytest
import torch

import workbench as wb
from workbench.serve import KVCache

CASES = [(p, d) for p in ("tiny", "gpt-tiny") for d in ("float32", "bfloat16")]
_MODELS = {}


def model(preset, dtype="float32"):
    if (preset, dtype) not in _MODELS:
        cfg = wb.models.get_config(preset, dtype=dtype)
        _MODELS[preset, dtype] = wb.models.build_model(cfg, seed=0).eval()
    return _MODELS[preset, dtype]


def ids(B, S, seed=0):
    return torch.randint(0, 75, (B, S), generator=torch.Generator().manual_seed(seed))


def at_positions(m, pos):
    """A copy of ``m`` whose positions 0..S-1 are ``m``'s ``pos`` (S,): the reference, by the
    default forward, for a row run at those positions."""
    c = copy.deepcopy(m)
    with torch.no_grad():
        if hasattr(c, "rope_cos"):
            c.rope_cos[:len(pos)] = m.rope_cos[pos]
            c.rope_sin[:len(pos)] = m.rope_sin[pos]
        else:
            c.pos_emb.weight[:len(pos)] = m.pos_emb.weight[pos]
    return c


@pytest.mark.parametrize("preset,dtype", CASES)
def test_default_positions_given_explicitly_change_nothing(preset, dtype):
    m, x = model(preset, dtype), ids(2, 9)
    ref, _ = m(x)
    for pos in (torch.arange(9)[None], torch.arange(9).expand(2, 9)):     # (1, S) and (B, S)
        out, _ = m(x, position_ids=pos)
        assert out.dtype == ref.dtype and torch.equal(out, ref)


@pytest.mark.parametrize("preset,dtype", CASES)
def test_every_row_and_token_at_its_own_position(preset, dtype):
    m, x = model(preset, dtype), ids(2, 7, seed=1)
    pos = torch.tensor([[5, 6, 7, 8, 9, 10, 11], [30, 2, 17, 0, 4, 4, 63]])   # any, per token
    out, _ = m(x, position_ids=pos)
    assert out.shape == (2, 7, 75)
    for b in range(2):
        ref, _ = at_positions(m, pos[b])(x[b:b + 1])
        assert torch.equal(out[b], ref[0]), b
    shifted, _ = m(x, position_ids=torch.full((1, 7), 9) + torch.arange(7))
    assert not torch.equal(shifted, m(x)[0])            # the positions do reach the output


@pytest.mark.parametrize("preset", ["tiny", "gpt-tiny"])
def test_positions_after_a_kv_cache(preset):
    """A decode step after a cached prompt, at its position given explicitly: the same as
    the cache's own offset."""
    m, x = model(preset), ids(1, 6, seed=2)
    a, b = KVCache.for_model(m), KVCache.for_model(m)
    with torch.no_grad():
        m(x[:, :5], cache=a)
        m(x[:, :5], cache=b)
        ref, _ = m(x[:, 5:], cache=a)
        out, _ = m(x[:, 5:], cache=b, position_ids=torch.tensor([[5]]))
    assert torch.equal(out, ref) and b.get_seq_length() == 6


@pytest.mark.parametrize("preset,dtype", CASES)
def test_logits_to_keep_runs_the_head_on_the_kept_positions(preset, dtype):
    m, x = model(preset, dtype), ids(2, 8, seed=3)
    full, _ = m(x)
    for keep, sel in ((0, slice(None)), (1, slice(-1, None)), (3, slice(-3, None)),
                      (20, slice(None)), (torch.tensor([0, 5, 7, -1]), [0, 5, 7, -1])):
        out, loss = m(x, logits_to_keep=keep)
        assert loss is None
        assert out.shape == full[:, sel].shape, keep
        torch.testing.assert_close(out, full[:, sel])   # the head's GEMM on fewer rows


@pytest.mark.parametrize("preset", ["tiny", "gpt-tiny"])
def test_bad_positions_and_kept_logits_are_named_and_leave_the_cache(preset):
    m, x = model(preset), ids(2, 4)
    cache = KVCache.for_model(m)
    with torch.no_grad():
        m(x, cache=cache)
    bad_pos = [(torch.arange(4.0)[None], TypeError, "dtype"),
               ([[0, 1, 2, 3]], TypeError, "integer tensor"),
               (torch.arange(4), ValueError, r"shape \(4,\)"),
               (torch.arange(3)[None], ValueError, r"\(2, 4\)"),
               (torch.arange(4).expand(3, 4), ValueError, r"\(1, 4\)"),
               (torch.tensor([[0, 1, -1, 2]]), ValueError, r"\[-1, 2\]"),
               (torch.tensor([[0, 1, 2, m.cfg.seq_len]]), ValueError, "seq_len")]
    for pos, err, msg in bad_pos:
        with pytest.raises(err, match=msg):
            m(x, cache=cache, position_ids=pos)
    bad_keep = [(-1, "int >= 0"), (True, "int >= 0"), (1.0, "int >= 0"),
                (torch.tensor([[1]]), "1-d integer"), (torch.tensor([0.0]), "1-d integer"),
                (torch.tensor([4]), r"\[-4, 3\]"), (torch.tensor([-5]), r"\[-4, 3\]")]
    for keep, msg in bad_keep:
        with pytest.raises(ValueError, match=msg):
            m(x, cache=cache, logits_to_keep=keep)
    with pytest.raises(ValueError, match="targets"):
        m(x, x, logits_to_keep=1)
    assert cache.get_seq_length() == 4                  # no failed call appended a key


def test_packed_positions_on_a_laid_out_model():
    """The same on Megatron's tensor-parallel layout (serve_model, tp=2): the position
    lookups and the kept positions run on DistTensors."""
    from workbench.serve import serve_model
    m, x = model("tiny"), ids(2, 6, seed=4)
    pos, keep = torch.tensor([[3, 4, 5, 0, 1, 2], [7, 8, 9, 10, 11, 12]]), torch.tensor([2, 5])
    ref, _ = m(x, position_ids=pos, logits_to_keep=keep)
    served = serve_model("tiny", tp=2)
    with torch.no_grad():
        out, _ = served.model(served.place(x), position_ids=pos, logits_to_keep=keep)
    torch.testing.assert_close(out.full(), ref)
