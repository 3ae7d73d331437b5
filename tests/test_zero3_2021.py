"""DeepSpeed v0.3 ZeRO-3 (``plan.zero3_2021``): each cost term against its cited component
figure or source rule, and the estimate's hook."""
import pytest

import workbench as wb
from workbench.plan import costs as C
from workbench.plan import zero3_2021 as Z
from workbench.plan.edge_cost import edge_times


def _gpt(h, layers=2, V=51200):
    return wb.models.ModelConfig(arch="gpt", vocab_size=V, seq_len=2048, tie_embeddings=True,
                                 dropout=0.1, d_model=h, n_layer=layers, n_head=h // 128,
                                 dtype="float16")


def _trace(cfg, recompute="full", mb=1):
    prof = wb.plan.Cluster("a100", 8).profile
    att = "flash" if cfg.arch == "llama" else "materialized"
    layer = C.layer_cost(cfg, mb, 1, False, recompute, prof, att, False)
    head = C.head_cost(cfg, mb, 1, False, prof)
    return Z.gpt_trace(cfg, layer, head, edge_times(cfg, mb, 1, False, prof), recompute)


def test_list_all_gather_host_and_stream_times():
    # _allgather_param's loop (p x 6.9 us, measured) before NCCL starts, then c10d's p
    # copies (p x 6.1 us) issued while NCCL runs; the stream ends after NCCL and copies
    p, price, bw = 1536, 0.010, 2e12
    host, start, end = Z.list_collective("all_gather", 604e6, p, price, 1.0, 1.0, 0.0, bw)
    assert (Z.AG_LOOP_S, Z.RECORD_COPY_S) == (6.9e-6, 6.1e-6)
    assert start == pytest.approx(1.0 + p * 6.9e-6)
    assert host == pytest.approx(start + p * 6.1e-6)
    assert end == pytest.approx(max(start + price + 4 * 604e6 / bw, host))
    assert host - 1.0 == pytest.approx(0.0200, abs=1e-4)      # 20 ms of host per gather


def test_list_reduce_scatter_copies_before_nccl():
    # reduce_scatter's pre hook copies the p chunks into c10d's flat buffer first;
    # the NCCL stream is busy until 2.0, the gradient ready at 1.5
    p, price, bw = 384, 0.006, 2e12
    host, start, end = Z.list_collective("reduce_scatter", 151e6, p, price, 1.0, 1.5, 2.0, bw)
    assert host == pytest.approx(1.0 + p * (7.5e-6 + 6.1e-6))
    assert start == pytest.approx(max(host, 2.0 + 4 * 151e6 / bw))
    assert end == pytest.approx(start + price)


def test_host_cost_per_collective_grows_with_ranks():
    # the per-chunk loops: the host time of one list collective is linear in p
    t = [Z.list_collective("all_gather", 1e8, p, 0.0, 0.0, 0.0, 0.0, 1e30)[0]
         for p in (384, 768, 1536)]
    assert t[1] == pytest.approx(2 * t[0]) and t[2] == pytest.approx(4 * t[0])


@pytest.mark.parametrize("h, kept", [(12288, {"fc2"}), (8192, {"fc2", "fc1"})])
def test_reuse_distance_keeps_recomputed_weights(h, kept):
    # _keep_for_later: a recomputed matrix stays gathered for its backward when the
    # modules between its two uses hold fewer than 1e9 elements: fc2 (nothing between)
    # always; fc1 (fc2 twice, 8 h^2) at h 8192 (537 M), not at 12288 (1.21 G)
    tr = _trace(_gpt(h))
    keep = Z._keep(tr)
    got = {e.module.split(".")[1] for e, k in zip(tr, keep) if e.phase == "r" and k
           and e.module.startswith("0.")}
    assert got == kept
    for e, k in zip(tr, keep):
        if e.phase == "f" and e.module.startswith("0."):
            assert not k                  # released after the forward (reused far later)
    # the last layer's fc2 is recomputed right after the head: kept when the root's
    # embedding and that layer's other matrices between hold fewer than 1e9
    last = [k for e, k in zip(tr, keep) if e.phase == "f" and e.module == "1.fc2"]
    assert last == [h * 51200 + 8 * h * h < Z.MAX_REUSE_NUMEL]


def _price(n):
    return 1e-3


def test_gathers_one_per_parameter_per_use():
    # 175B shapes, two layers: the root's tied embedding once, the positions forward
    # and backward, 4 matrices forward, 4 recomputed, 3 in backward (fc2 kept)
    tr = _trace(_gpt(12288))
    r = Z.simulate(tr, 64, _price, _price, 2e12)
    assert r["gathers"] == 1 + 2 + 2 * (4 + 4 + 3)
    # one reduce-scatter per parameter with a gradient (_reduce_scatter_gradients
    # loops over the bucket's parameters): per layer 4 matrices, 4 biases, 2 norms of
    # 2; the final norm's 2; the positions; the tied embedding once (its hook fires
    # when its gradient is whole, after the lookup's backward)
    assert r["reduce_scatters"] == 2 * 12 + 2 + 1 + 1


def test_no_prefetch_when_the_tied_embedding_fills_max_live():
    # 530B: the root holds V h = 1.05e9 >= stage3_max_live_parameters, so nothing is
    # prefetched: every gather waits (host-synchronous), the step is the serial sum
    cfg = _gpt(20480)
    assert cfg.vocab_size * cfg.d_model >= Z.MAX_LIVE_NUMEL
    tr = _trace(cfg)
    p, ag, bw = 64, 2e-3, 1e30
    r = Z.simulate(tr, p, lambda n: ag, lambda n: 0.0, bw)
    per_gather = Z.SYNC_S + p * Z.AG_LOOP_S + max(ag, p * Z.RECORD_COPY_S) + Z.SYNC_S
    assert r["seconds"] >= r["compute"] + r["gathers"] * per_gather * 0.999


def test_prefetch_overlaps_only_the_module_that_issued_it():
    # module A's pre-forward gathers a (and waits), then prefetches b (below max live):
    # b's gather runs beside A's compute, B waits for it: 5 + max(10, 5) + 10 ms, where
    # the gathers in series would take 5 + 5 + 10 + 10
    tr = [Z.Entry("A", (("a", 10**6),), 0.010, "f"), Z.Entry("B", (("b", 10**6),), 0.010, "f")]
    r = Z.simulate(tr, 2, lambda n: 0.005, lambda n: 0.0, 1e30)
    host = 2 * (Z.AG_LOOP_S + Z.RECORD_COPY_S)
    assert r["gathers"] == 2
    assert r["seconds"] == pytest.approx(0.025, abs=4 * Z.SYNC_S + 2 * host + 2 * Z.RELEASE_S)
    # with a holding stage3_max_live_parameters, nothing is prefetched (the check is
    # on the gathered elements before the prefetch, whatever the next one's size)
    tr = [Z.Entry("A", (("a", Z.MAX_LIVE_NUMEL),), 0.010, "f"), tr[1]]
    r = Z.simulate(tr, 2, lambda n: 0.005, lambda n: 0.0, 1e30)
    assert r["seconds"] == pytest.approx(0.030, abs=4 * Z.SYNC_S + 2 * host + 2 * Z.RELEASE_S)


def test_estimate_hook_and_errors():
    cfg = _gpt(4096, layers=4)
    lay = wb.plan.Layout(dp=16, tp=1, pp=1, zero=3, recompute="full", micro_batch=1,
                         global_batch=32, framework="deepspeed-0.3")
    e = wb.plan.estimate(cfg, lay, wb.plan.Cluster("a100", 16))
    new = wb.plan.estimate(cfg, lay.__class__(**{**lay.__dict__, "framework": "deepspeed"}),
                           wb.plan.Cluster("a100", 16))
    # the same layers but Megatron-LM-v1.1.5's eager softmax, GeLU and bias-dropout-add
    # (zero3_2021.unfused_seconds); the optimizer step as each release runs it
    # (plan.optimizer_step: v0.3.16 stage3.py's 80 B per partitioned parameter, today's
    # 78 in fp16)
    x = Z.unfused_seconds(cfg, 1, wb.plan.Cluster("a100", 16).profile, "full")
    assert e.breakdown["compute"] - e.details["optimizer"] == pytest.approx(
        new.breakdown["compute"] - new.details["optimizer"]
        + lay.m * cfg.n_layer * (x["forward"] + x["backward"]))
    assert e.details["optimizer"] > new.details["optimizer"]
    assert e.step_time > new.step_time            # the per-chunk host loops, the syncs
    assert any("v0.3.13" in a for a in e.details["assumptions"])
    with pytest.raises(ValueError, match="deepspeed-0.3"):
        wb.plan.Layout(dp=16, zero=2, global_batch=32, framework="deepspeed-0.3")
    with pytest.raises(ValueError, match="tp=pp=cp=1"):
        wb.plan.estimate(cfg, wb.plan.Layout(dp=8, tp=2, zero=3, global_batch=32,
                                             framework="deepspeed-0.3"),
                         wb.plan.Cluster("a100", 16))


def test_llama_trace_reduces_every_parameter():
    # a Llama layer: RMSNorm, q, k, v, o, RMSNorm, w1, w3, w2; no biases, an untied head
    # gathered by its own module (kept from its forward to its backward: nothing between)
    from workbench.models.config import get_config
    cfg = get_config("llama2-7b", n_layer=2, d_model=1024, n_head=16, n_kv_head=4,
                     d_ff=2816, dtype="float16")
    tr = _trace(cfg)
    r = Z.simulate(tr, 8, _price, _price, 2e12)
    mats = sum(n >= Z.PERSISTENCE_NUMEL for _, ps in Z._layer_modules(cfg) for _, n in ps)
    assert r["reduce_scatters"] == cfg.n_layer * 9 + 1 + 1 + (not cfg.tie_embeddings)
    assert r["gathers"] >= cfg.n_layer * mats


def test_ring_latency_at_1536_ranks_is_nccl_2_9s_tuning_model():
    # NCCL v2.9.6-1 src/graph/tuning.cc (the release of spring 2021): ring all-gather
    # latency = baseLat + (nsteps - nInterSteps) x intra hwLat + nInterSteps x NET hwLat,
    # nsteps = p - 1, nInterSteps = nodes - 1; LL128: 10.0 + 1.9 (NVLink) + 4.0 (NET) us.
    # The clock prices a 1.2 GB gather over 192 DGX nodes with LL128 (its lowest time):
    # that latency, once per collective, however many parameters' gathers there are
    from workbench.plan.zero3_count import fixed_seconds
    prof = wb.plan.Cluster("a100", 1536).profile
    got = fixed_seconds("all_gather", 2 * 604e6, tuple(range(1536)), prof)
    assert got == pytest.approx((10.0 + 1344 * 1.9 + 191 * 4.0) * 1e-6, rel=1e-6)


def test_post_step_gather_copies_each_chunk_that_holds_data():
    # _allgather_params' reassembly copies, per persistent parameter, each rank's chunk
    # that holds some of it: a 12,288-element bias over 1,536 ranks, 1,536 chunks of 8;
    # a 20,480-element one over 2,240 ranks, chunks of 10, the last 192 only padding
    tr = [Z.Entry("ln", (("w", 12288),), 0.0, "f")]
    secs, _ = Z.post_step_gather(tr, 1536, lambda n: 0.0)
    want = Z.SYNC_S + 1536 * Z.NARROW_S + 1536 * Z.RECORD_COPY_S + 1536 * Z.REASSEMBLE_S
    assert secs == pytest.approx(want)
    tr = [Z.Entry("ln", (("w", 20480),), 0.0, "f")]
    secs, _ = Z.post_step_gather(tr, 2240, lambda n: 0.0)
    want = Z.SYNC_S + 2240 * Z.NARROW_S + 2240 * Z.RECORD_COPY_S + 2048 * Z.REASSEMBLE_S
    assert secs == pytest.approx(want)
    # the matrices are not persistent: nothing of theirs is gathered after the step
    assert Z.post_step_gather([Z.Entry("fc", (("w", 10**6),), 0.0, "f")], 8, _price) \
        == (0.0, 0.0)


def test_later_micro_batches_gather_the_persistent_parameters_again():
    # _partition_all_parameters released them after the backward: each is gathered
    # (one list collective) at its module's first use in the next micro-batch
    tr = _trace(_gpt(12288))
    first = Z.simulate(tr, 64, _price, _price, 2e12)
    rest = Z.simulate(tr, 64, _price, _price, 2e12, persistent_gathered=False)
    assert rest["gathers"] - first["gathers"] == 2 * 8 + 2
    assert rest["seconds"] > first["seconds"]


def test_v0314_trace_off_by_one_prefetches_and_keeps_nothing():
    # v0.3.14's root pre-forward reset (7b46d11fa) leaves every module one step behind
    # its recorded trace: get_params_to_prefetch and get_reuse_distance_in_numel both
    # find "Tracing failed" (v0.3.14 stage3.py:198-202, :233-238).  175B shapes, two
    # layers, prefetch open (step 10,000): v0.3.13 prefetches and keeps fc2 from its
    # recomputation to its backward; v0.3.14 gathers fc2 again and prefetches only at
    # the root (its own step id 0, taken before the reset, still matches): the
    # positions' table and layer 0's QKV (6.04e7 elements reached); the root keeps the
    # tied embedding from its forward to its backward in both
    tr = _trace(_gpt(12288))
    old = Z.simulate(tr, 64, _price, _price, 2e12, step=10_000)
    new = Z.simulate(tr, 64, _price, _price, 2e12, step=10_000, version="0.3.14")
    assert old["prefetches"] > 2 and new["prefetches"] == 2
    assert new["gathers"] == 1 + 2 + 2 * (4 + 4 + 4)
    assert old["gathers"] == 1 + 2 + 2 * (4 + 4 + 3)
    assert new["reduce_scatters"] == old["reduce_scatters"]
    assert new["seconds"] > old["seconds"]
    assert Z.simulate(tr, 64, _price, _price, 2e12, version="0.3.13") == \
        Z.simulate(tr, 64, _price, _price, 2e12)           # the default is v0.3.13
    assert Z.VERSION == "0.3.13"


def test_v0315_norm_per_fetched_parameter():
    # v0.3.15's fetch_sub_module builds f"... norm {param.norm()}" for each of the
    # module's own parameters (v0.3.16 stage3.py:441-445) on every fetch: a read of the
    # 16-bit parameter at the memory bandwidth, then .item()'s wait (SYNC_S); the root's
    # tied embedding is external to it (not its own), so the root runs none
    bw = 1e12
    tr = [Z.Entry("root", (("wte", 10**6),), 0.0, "f"),
          Z.Entry("A", (("a", 2 * 10**6), ("a.b", 1000)), 0.0, "f"),
          Z.Entry("B", (("b", 4 * 10**6),), 0.0, "f")]
    r14 = Z.simulate(tr, 8, lambda n: 0.0, lambda n: 0.0, bw, version="0.3.14")
    r16 = Z.simulate(tr, 8, lambda n: 0.0, lambda n: 0.0, bw, version="0.3.16")
    want = 2 * (2 * 10**6 + 1000 + 4 * 10**6) / bw + 3 * Z.SYNC_S
    assert r16["work"]["norm"] == pytest.approx(want) and r14["work"]["norm"] == 0.0
    assert r16["seconds"] - r14["seconds"] == pytest.approx(want)
    assert Z.behaviour("0.3.15") == Z.behaviour("0.3.16") == (True, True)


def test_unknown_version_raises():
    with pytest.raises(ValueError, match=r"version='0.4.0'.*0.3.13"):
        Z.simulate(_trace(_gpt(4096)), 8, _price, _price, 2e12, version="0.4.0")
