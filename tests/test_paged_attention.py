"""Paged attention (workbench.ops.paged_attention, kv_blocks; workbench.serve.PagedKVCache):
every backend equals attention over the same keys laid out contiguously, for any block
size, sequence lengths and scattered physical blocks; the allocator refuses cleanly;
generation through pages picks the contiguous cache's tokens; the memory saved is
counted from the pools themselves; the NPU path honours the documented contract."""
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st

import workbench as wb
import workbench.npu as npu
from workbench.ops import BlockAllocator, BlockTables, OutOfBlocks, paged_attention, paged_memory
from workbench.serve import PagedKVCache, causal_offset_mask, generate, kv_bytes_per_token


def scattered_cache(lengths, block_size, hkv, d, seed, churn=True):
    """Random keys/values per sequence, written into a pool with holes (half its blocks,
    at random, stay taken) in round-robin chunks, so a sequence's blocks are neither
    consecutive nor in the order of its logical blocks' neighbours."""
    g = torch.Generator().manual_seed(seed)
    need = sum(-(-n // block_size) for n in lengths)
    n_blocks = 2 * need + 4 if churn else need
    alloc = BlockAllocator(n_blocks)
    if churn:
        taken = alloc.allocate(n_blocks)
        keep = torch.randperm(n_blocks, generator=g)[: need + 4].tolist()
        alloc.free([taken[i] for i in keep])
    tables = BlockTables(alloc, block_size)
    kp = torch.zeros(n_blocks, hkv, block_size, d)
    vp = torch.zeros_like(kp)
    ks = [torch.randn(hkv, n, d, generator=g) for n in lengths]
    vs = [torch.randn(hkv, n, d, generator=g) for n in lengths]
    for s in range(len(lengths)):
        tables.add(s)
    done = [0] * len(lengths)
    while done != list(lengths):
        for s, n in enumerate(lengths):
            step = min(n - done[s], int(torch.randint(1, 4, (), generator=g)))
            blk, off = tables.reserve(s, step)
            kp[blk, :, off] = ks[s][:, done[s]:done[s] + step].transpose(0, 1)
            vp[blk, :, off] = vs[s][:, done[s]:done[s] + step].transpose(0, 1)
            done[s] += step
    seqs = list(range(len(lengths)))
    return kp, vp, tables.table(seqs), tables.seq_lens(seqs), ks, vs, tables


@given(block_size=st.integers(1, 6), lengths=st.lists(st.integers(1, 17), min_size=1, max_size=3),
       sq=st.integers(1, 4), groups=st.sampled_from([1, 2]), seed=st.integers(0, 1000))
def test_every_backend_equals_attention_over_the_contiguous_keys(block_size, lengths, sq, groups,
                                                                  seed):
    sq = min(sq, min(lengths))
    hkv, d = 2, 4
    kp, vp, table, lens, ks, vs, _ = scattered_cache(lengths, block_size, hkv, d, seed)
    q = torch.randn(len(lengths), hkv * groups, sq, d, generator=torch.Generator().manual_seed(seed))
    want = torch.cat([wb.ops.flash_attention(q[b:b + 1], ks[b][None], vs[b][None],
                                             mask=causal_offset_mask(sq, n))
                      for b, n in enumerate(lengths)])
    for backend in ("reference", "unfused", "native"):
        with wb.ops.use(backend):
            got = paged_attention(q, kp, vp, table, lens)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=backend)
    # the gather is exact: the same kernel on the gathered keys gives the same bits
    with wb.ops.use("native"):
        got = paged_attention(q, kp, vp, table, lens)
    for b, n in enumerate(lengths):
        direct = F.scaled_dot_product_attention(q[b:b + 1], ks[b][None], vs[b][None],
                                                attn_mask=causal_offset_mask(sq, n),
                                                enable_gqa=groups > 1)
        assert torch.equal(got[b:b + 1], direct)


def test_the_allocator_hands_out_the_lowest_blocks_and_refuses_cleanly():
    a = BlockAllocator(4)
    assert a.allocate(2) == [0, 1] and a.num_free == 2
    with pytest.raises(OutOfBlocks, match=r"allocate\(3\): only 2 of 4 blocks are free"):
        a.allocate(3)
    assert a.num_free == 2 and a.num_used == 2                    # nothing taken
    a.free([0])
    assert a.allocate(1) == [0]
    with pytest.raises(ValueError, match="not allocated"):
        a.free([1, 3])                                             # 3 was never handed out
    assert a.num_used == 2                                         # 1 was not freed either
    a.free([1])
    with pytest.raises(ValueError, match="not allocated"):
        a.free([1])                                                # twice
    with pytest.raises(ValueError, match="num_blocks=0"):
        BlockAllocator(0)


def test_a_table_takes_a_block_only_when_a_sequence_crosses_into_it():
    t = BlockTables(BlockAllocator(3), block_size=4)
    t.add("a")
    blk, off = t.reserve("a", 5)                  # positions 0..4: blocks 0, 1
    assert blk.tolist() == [0, 0, 0, 0, 1] and off.tolist() == [0, 1, 2, 3, 0]
    assert t.reserve("a", 3)[0].tolist() == [1, 1, 1]            # fills block 1, no new one
    assert t.allocator.num_used == 2
    t.add("b")
    with pytest.raises(OutOfBlocks):
        t.reserve("b", 5)                          # needs 2, one is free: all or nothing
    assert t.lengths["b"] == 0 and t.blocks["b"] == [] and t.allocator.num_free == 1
    assert t.table(["a", "b"]).tolist() == [[0, 1], [0, 0]] and t.table(["a"]).dtype == torch.int32
    t.free("a")
    assert t.allocator.num_free == 3


def test_bad_tables_are_named():
    kp, vp, table, lens, *_ = scattered_cache([5], 2, 1, 4, 0, churn=False)
    q = torch.randn(1, 1, 1, 4)
    with pytest.raises(IndexError, match="block_table names block 99"):
        paged_attention(q, kp, vp, torch.tensor([[0, 99, 1]]), lens)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_attention(q, kp, vp, table, torch.tensor([7]))      # 3 blocks of 2 hold 6
    with pytest.raises(ValueError, match="block_table"):
        paged_attention(q, kp, vp, table.float(), lens)


@pytest.mark.parametrize("preset", ["tiny", "gpt-tiny"])
def test_generation_through_pages_picks_the_contiguous_caches_tokens(preset):
    m = wb.models.build_model(preset).eval()
    idx = torch.randint(0, 75, (3, 5), generator=torch.Generator().manual_seed(1))
    with wb.ops.use("reference"):                 # the block-by-block loop, online softmax
        cache = PagedKVCache.for_model(m, batch=3, num_blocks=24, block_size=4)
        out = generate(m, idx, 15, cache=cache)
    assert torch.equal(out, generate(m, idx, 15))
    mem = cache.memory()
    # counted from the pools: a block holds block_size tokens of every layer's k and v
    block_bytes = sum(p[0].nbytes for p in cache.k_pools + cache.v_pools)
    assert mem.bytes_per_token * mem.block_size == block_bytes
    assert mem.blocks_in_use == cache.allocator.num_used == 3 * 5      # 20 tokens / 4 each
    assert mem.bytes_paged == cache.allocator.num_used * block_bytes
    assert mem.bytes_contiguous == 3 * m.cfg.seq_len * kv_bytes_per_token(m.cfg)
    assert mem.saved == 1 - 20 / 64                                     # 20 of 64 slots
    cache.free()
    assert cache.allocator.num_free == 24


def test_paged_memory_counts_fragmentation_of_the_last_blocks():
    mem = paged_memory([1, 16, 17], block_size=16, max_len=64, bytes_per_token=10)
    assert mem.blocks_in_use == 1 + 1 + 2 and mem.tokens == 34
    assert mem.bytes_paged == 4 * 16 * 10 and mem.bytes_contiguous == 3 * 64 * 10
    assert mem.fragmentation == 1 - 34 / 64
    with pytest.raises(ValueError, match="max_len=64"):
        paged_memory([65], 16, 64, 10)


def test_a_pool_too_small_for_a_step_changes_no_table():
    m = wb.models.build_model("tiny").eval()
    cache = PagedKVCache.for_model(m, batch=2, num_blocks=3, block_size=4)
    with pytest.raises(OutOfBlocks, match="more num_blocks"):
        generate(m, torch.zeros(2, 5, dtype=torch.long), 3, cache=cache)
    assert cache.allocator.num_free == 3 and cache.get_seq_length() == 0


class StandInTorchNpu(types.ModuleType):
    """torch_npu's npu_fused_infer_attention_score as documented, paged-cache branch:
    keyword-only options, scale defaulting to 1.0, "BSH" query, the cache as
    (num_blocks, block_size, Hkv * D), block_table int32, per-sequence kv lengths."""

    def __init__(self):
        super().__init__("torch_npu")
        self.__version__ = "2.13.0"
        self.npu = types.SimpleNamespace(is_available=lambda: False, device_count=lambda: 0)
        self.calls = []

    def npu_fused_infer_attention_score(self, query, key, value, *, block_table=None,
                                        actual_seq_lengths_kv=None, num_heads=1, scale=1.0,
                                        input_layout="BSH", num_key_value_heads=0, block_size=0,
                                        **rest):
        self.calls.append(dict(scale=scale, layout=input_layout, block_size=block_size))
        assert input_layout == "BSH" and block_table.dtype == torch.int32 and not rest
        B, S, H = query.shape
        D = H // num_heads
        nb, bs, Hk = key.shape
        assert bs == block_size and Hk == num_key_value_heads * D
        outs = []
        for b in range(B):
            n = actual_seq_lengths_kv[b]
            rows = block_table[b, :-(-n // bs)].long()
            k = key[rows].reshape(-1, num_key_value_heads, D)[:n].transpose(0, 1)   # (N, n, D)
            v = value[rows].reshape(-1, num_key_value_heads, D)[:n].transpose(0, 1)
            q = query[b].reshape(S, num_heads, D).transpose(0, 1)
            g = num_heads // num_key_value_heads
            p = torch.softmax(q @ k.repeat_interleave(g, 0).transpose(-2, -1) * scale, -1)
            outs.append((p @ v.repeat_interleave(g, 0)).transpose(0, 1).reshape(S, H))
        return torch.stack(outs), None


@pytest.fixture
def fake():
    previous = sys.modules.get("torch_npu")
    sys.modules["torch_npu"] = stand_in = StandInTorchNpu()
    npu.probe(refresh=True)
    try:
        with wb.ops.use("npu"):
            yield stand_in
    finally:
        if previous is None:
            sys.modules.pop("torch_npu", None)
        else:
            sys.modules["torch_npu"] = previous
        npu.probe(refresh=True)


def test_npu_path_honours_the_documented_contract(fake):
    kp, vp, table, lens, *_ = scattered_cache([7, 3], 2, 2, 4, 5)
    q = torch.randn(2, 4, 1, 4)
    got = paged_attention(q, kp, vp, table, lens)
    with wb.ops.use("reference"):
        want = paged_attention(q, kp, vp, table, lens)
    torch.testing.assert_close(got, want)
    assert fake.calls == [dict(scale=0.5, layout="BSH", block_size=2)]     # scale passed
    with pytest.raises(NotImplementedError, match="decode"):
        paged_attention(torch.randn(2, 4, 2, 4), kp, vp, table, lens)


def test_cost_reads_each_sequences_blocks_once():
    kp, vp, table, lens, _, _, tables = scattered_cache([5, 9], 4, 2, 8, 1, churn=False)
    q = torch.randn(2, 4, 1, 8)
    c = wb.ops.cost("paged_attention", q, kp, vp, table, lens)
    used = tables.allocator.num_used
    assert used == 2 + 3                                    # 5 and 9 tokens in blocks of 4
    block = kp[0].nbytes + vp[0].nbytes                     # one block of keys and values
    assert c.bytes_fused == 2 * q.nbytes + used * block
    assert c.flops == 4 * 4 * 8 * (5 + 9)                   # 4 heads, D 8, one query each
    assert c.bytes_unfused > c.bytes_fused                  # the gathered copy on top
