"""One layer of the 22B GPT on DGX A100 against Korthikanti et al. 2022, Table 4.

h=6144, a=64, s=2048, micro-batch 4, TP 8, fp16 (Megatron on A100, 312 TFLOP/s).
The layer model (workbench/plan/layer_cost.py) uses the A100 profile as it is, every
number from an independent source (profiles/a100.json citations), none fitted to
Table 4: GEMMs at the rate measured for a large product on random inputs (0.827, He
2024; the MAMF best-shape burst is 0.859) divided by their tile and wave
quantization (256x128 tiles, one per SM, waves of 108: NVIDIA's Matrix Multiplication
Background guide; the fc1 GEMM's 768 tiles fill 8 waves to 89%); LayerNorm at apex's
measured persistent-kernel rates (1258 / 1163 GB/s, apex PR #1037); Megatron's unfused
attention core (batched GEMMs, softmax) and torch's dropout at the rates FlashAttention's
benchmark measured for them on an A100 (Dao et al. 2022, Appendix E.6; derivation checked
in tests/test_attention_kernels.py); other memory-bound kernels at the measured 0.88 of
HBM; 1 us per launch; NCCL rings inside the node by NCCL's own tuning model (LL / LL128 /
Simple, 8.4 us + 3.4 us per step for Simple, bus bandwidth capped at 235 GB/s on sm80);
NCCL's 24 SMs (of 108) for the tensor-parallel group inside the node (its 24 rings there,
NVIDIA/nccl-tests #100; ``kernel_cost.collective_sms``) taken from the GEMMs that overlap
a backward collective, whose tiles then run in more waves.

Result (ms, predicted / published): baseline 7.65 / 7.7, 11.88 / 11.9, 19.53 / 19.6;
sequence parallel 7.05 / 7.2, 11.58 / 11.8, 18.63 / 19.0; full recompute 7.65 / 7.7,
19.53 / 19.5, 27.19 / 27.2; selective 7.65 / 7.7, 13.16 / 13.2, 20.81 / 20.9;
selective + SP 7.05 / 7.2, 12.86 / 13.1, 19.91 / 20.3: every figure from 2.1% low to 0.2%
high, the one above (full recompute's backward) inside the published figure's rounding.
(With the all-ranks 16 SMs, before the group's figure: 0.4-2.9% low.)
(Before the attention core was priced at its measured rates, at the copy rate: 6-12% low,
three figures beyond 10%.) Not modeled for want of an independent A100 figure: HBM
traffic of NCCL slowing the kernels it overlaps, cuBLAS's choice of smaller tiles, the
RNG in Megatron's fused bias-dropout-add.
"""
import pytest

from workbench.plan.layer_cost import layer_ops, layer_times
from workbench.sim_mesh import cost

LAYER = dict(h=6144, a=64, s=2048, b=4, tp=8, dtype="float16", profile="a100")
TABLE4 = {  # (sp, recompute): forward, backward, combined, ms
    (False, "none"): (7.7, 11.9, 19.6),
    (True, "none"): (7.2, 11.8, 19.0),
    (False, "full"): (7.7, 19.5, 27.2),
    (False, "selective"): (7.7, 13.2, 20.9),
    (True, "selective"): (7.2, 13.1, 20.3),
}


def _ms(sp, recompute):
    r = layer_times(sp=sp, recompute=recompute, **LAYER)
    return r.forward * 1e3, r.backward * 1e3, r.combined * 1e3


@pytest.mark.parametrize("row", list(TABLE4))
def test_rows_absolute_within_10_percent(row):
    # the target: forward, backward and combined of every row within 10%
    for got, want in zip(_ms(*row), TABLE4[row]):
        assert got == pytest.approx(want, rel=0.10), (row, got, want)


@pytest.mark.parametrize("row", list(TABLE4))
def test_rows_relative_to_the_baseline(row):
    base = _ms(False, "none")[2]
    for got, want in zip(_ms(*row), TABLE4[row]):
        assert got / base == pytest.approx(want / 19.6, rel=0.04), (row, got, want)


def test_the_model_is_not_pessimistic():
    # what is left unmodeled (docstring) only adds time: no figure above the published,
    # as far as its one decimal says (+ 0.05 ms: full recompute's backward, 19.53 / 19.5)
    for row, want in TABLE4.items():
        for got, w in zip(_ms(*row), want):
            assert got < w + 0.05, (row, got, w)


def test_what_each_technique_changes():
    base, sp = layer_times(**LAYER), layer_times(sp=True, **LAYER)
    full, sel = layer_times(recompute="full", **LAYER), layer_times(recompute="selective", **LAYER)
    # full recompute runs the whole forward again before the backward
    assert full.backward == pytest.approx(base.backward + base.forward)
    # selective recompute runs the attention core again: QK^T, softmax, dropout, PV, permute
    core = {"qk_baddbmm", "scale_mask_softmax", "attention_dropout", "pv_bmm", "context_permute"}
    redo = [o for o in sel.ops if o["phase"] == "recompute"]
    assert {o["name"] for o in redo} == core
    fwd_core = sum(o["seconds"] for o in base.ops if o["phase"] == "forward" and o["name"] in core)
    assert sel.backward == pytest.approx(base.backward + fwd_core)
    # sequence parallelism: same bytes on the wire, norm and dropout on s/t tokens
    def wire(r, phase):
        return sum(cost.wire_bytes(o["op_class"], o["bytes"], 8) for o in r.ops
                   if o["phase"] == phase and o["op_class"] in cost.KINDS)
    assert wire(sp, "forward") == wire(base, "forward") > 0
    ln = [o["seconds"] for r in (base, sp) for o in r.ops if o["name"] == "layernorm_1"]
    assert ln[1] < ln[0] / 4 and sp.forward < base.forward


def test_breakdown_is_plain_data_that_adds_up():
    r = layer_times(sp=True, recompute="selective", **LAYER)
    assert all(type(o) is dict for o in r.ops)
    assert r.forward == pytest.approx(sum(o["exposed"] for o in r.ops if o["phase"] == "forward"))
    assert r.combined == pytest.approx(sum(o["exposed"] for o in r.ops))
    hidden = [o for o in r.ops if o["overlaps"]]
    assert hidden and all(o["exposed"] <= o["seconds"] for o in hidden)
    names = {o["name"] for o in r.ops}
    assert all(o["overlaps"] in names for o in hidden)
    comm = [o for o in r.ops if o["algorithm"]]
    assert {o["algorithm"] for o in comm} == {"ring"}  # NCCL inside a DGX A100


def test_gemm_flops_are_exact():
    ops = layer_ops(**LAYER)
    h, s, b, t = 6144, 2048, 4, 8
    gemm = sum(o.flops for o in ops if o.phase == "forward" and o.name.endswith("_gemm"))
    assert gemm == 24 * b * s * h * h // t            # 24 B s h^2 per layer (Narayanan eq. 3)
    attn = sum(o.flops for o in ops if o.phase == "forward" and o.name in ("qk_baddbmm", "pv_bmm"))
    assert attn == 4 * b * s * s * h // t
    bwd = sum(o.flops for o in ops if o.phase == "backward" and o.op_class == "matmul")
    assert bwd == 2 * (gemm + attn)


def test_tp_1_has_no_collectives_and_all_the_work():
    one, eight = layer_times(**{**LAYER, "tp": 1}), layer_times(**LAYER)
    assert not [o for o in one.ops if o["algorithm"]]
    gemm = [sum(o["flops"] for o in r.ops if o["op_class"] == "matmul") for r in (one, eight)]
    assert gemm[0] == 8 * gemm[1]


def test_tp_across_nodes_is_slower():
    # one GPU per node: each all-reduce crosses InfiniBand on one 24 GB/s NIC instead
    # of NVLink at 0.783 x 300 GB/s (NCCL's Simple protocol inside the node), about
    # 10x slower
    def comm(r):
        return sum(o["seconds"] for o in r.ops if o["op_class"] == "all_reduce")
    inside = layer_times(**LAYER)
    across = layer_times(tp_ranks=[0, 8, 16, 24, 32, 40, 48, 56], **LAYER)
    n = 2048 * 4 * 6144 * 2
    nvlink = 8.4e-6 + 14 * 3.4e-6 + 14 / 8 * n / (0.783 * 300e9)
    # across nodes NCCL's tuning model (2.12.7): Simple, all 14 steps on the network, 28 us
    ring_ib = 8.4e-6 + 14 * 28e-6 + 14 / 8 * n / 24e9
    assert comm(inside) == pytest.approx(4 * nvlink)
    assert comm(across) == pytest.approx(4 * ring_ib)
    assert across.forward > 2 * inside.forward


@pytest.mark.parametrize("kw, match", [
    (dict(h=6000), r"h=6000 is not divisible by a=64"),
    (dict(tp=3), r"a=64 is not divisible by tp=3"),
    (dict(recompute="block"), r"recompute='block'.*none.*selective.*full"),
    (dict(tp_ranks=[0, 1]), r"tp_ranks=\[0, 1\] must list tp=8"),
    (dict(b=0), r"b=0 must be an int >= 1"),
    (dict(dtype="int64"), r"dtype='int64'"),
    (dict(profile="tpu"), r"profile='tpu'"),
])
def test_bad_input(kw, match):
    with pytest.raises(ValueError, match=match):
        layer_times(**{**LAYER, **kw})
