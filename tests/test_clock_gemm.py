"""Tile and wave quantization of GEMMs (cost.gemm_efficiency), against the rule of
NVIDIA's Matrix Multiplication Background User's Guide, ch. 3: an A100 runs 256x128
tiles one per SM, in waves of 108; a partly filled last wave costs a full one."""
import math

import pytest

from workbench.sim_mesh import cost
from workbench.sim_mesh.profiles import get_profile

A100 = get_profile("a100")


def _by_hand(b, rows, cols, sms=108, full=108, tile=(256, 128)):
    best = 0.0
    for m, n in (tile, tile[::-1]):
        tiles = b * math.ceil(rows / m) * math.ceil(cols / n)
        waves = math.ceil(tiles / sms)
        best = max(best, b * rows * cols / (waves * full * m * n))
    return best


@pytest.mark.parametrize("gemm", [(1, 8192, 3072), (1, 8192, 6144), (1, 6144, 768),
                                  (1, 2304, 6144), (32, 2048, 2048), (1, 2048, 12288),
                                  (3, 1000, 3000)])
def test_efficiency_is_the_guides_wave_rule(gemm):
    assert cost.gemm_efficiency(gemm, "a100") == pytest.approx(_by_hand(*gemm))
    assert cost.gemm_efficiency(gemm, "a100", 92) == pytest.approx(_by_hand(*gemm, sms=92))


def test_full_waves_lose_nothing_and_one_tile_more_costs_a_wave():
    exact = (1, 256 * 27, 128 * 8)                   # 216 tiles: two full waves
    assert cost.gemm_efficiency(exact, "a100") == 1.0
    more = (1, 256 * 27 + 1, 128 * 8)                # a 28th row of tiles: 224 tiles
    assert cost.gemm_efficiency(more, "a100") == pytest.approx(
        (256 * 27 + 1) * 1024 / (3 * 108 * 256 * 128))
    # the 22B GPT's MLP GEMM on TP 8: 768 tiles in 8 waves of 108 (the last 12/108 full)
    assert cost.gemm_efficiency((1, 8192, 3072), "a100") == pytest.approx(768 / 864)


def test_small_gemms_and_profiles_without_a_tile_keep_the_rate():
    # the guide's 1792 x 1792 example is 98 tiles: under one wave, cuBLAS picks
    # smaller tiles; the model keeps the unquantized rate
    assert cost.gemm_efficiency((1, 1792, 1792), "a100") == 1.0
    assert cost.gemm_efficiency((1, 1792, 1792), "a100", 54) == 0.5
    assert cost.gemm_efficiency((1, 8192, 3072), "ascend-910b") == 1.0


def test_h100_waves_of_its_132_sms():
    # H100 SXM5: 132 SMs (H100 whitepaper), the guide's 256x128 tile assumed (profile):
    # 8192 x 3072 is 32 x 24 = 768 tiles (or 64 x 12, the same) = 5.82 waves of 132 -> 6
    assert cost.gemm_efficiency((1, 8192, 3072), "h100") == pytest.approx(768 / (6 * 132))
    # 7B-class MLP GEMM, 4096 tokens x 11008 (Llama 2 7B's ffn): 16 x 86 = 1,376 tiles of
    # 256 x 128 (11008 = 86 x 128) -> 11 waves (1,452 slots); 128 x 256 the other way:
    # 32 x 43 = 1,376 too; 1,376 / 1,452
    assert cost.gemm_efficiency((1, 4096, 11008), "h100") == pytest.approx(1376 / 1452)
    # under one wave (fewer than 132 tiles): the unquantized rate
    assert cost.gemm_efficiency((1, 1792, 1792), "h100") == 1.0


def test_compute_time_divides_the_compute_term_only():
    g = (1, 8192, 3072)
    flops, nbytes = 2 * 8192 * 3072 * 6144, 2 * (8192 * 6144 + 6144 * 3072 + 8192 * 3072)
    plain = cost.compute_time(flops, nbytes, "a100", "float16", "matmul", 0)
    shaped = cost.compute_time(flops, nbytes, "a100", "float16", "matmul", 0, gemm=g)
    assert shaped == pytest.approx(plain / (768 / 864))
    # a memory-bound op or another class is not a GEMM: the shape changes nothing
    assert cost.compute_time(10, 1e9, "a100", "float16", "matmul", 1, gemm=g) == \
        cost.compute_time(10, 1e9, "a100", "float16", "matmul", 1)
    assert cost.compute_time(flops, 0, "a100", "float16", "elementwise", 1, gemm=g) == \
        cost.compute_time(flops, 0, "a100", "float16", "elementwise", 1)


def test_overlap_stretches_a_gemm_by_its_waves_on_the_sms_left():
    g = (1, 2304, 6144)      # 432 tiles: 4 full waves on 108 SMs, 5 on the 92 NCCL leaves
    r = _by_hand(*g, sms=92) / _by_hand(*g)
    assert r == pytest.approx(4 / 5)
    stretched, exposed = cost.overlap(1e-3, 0.5e-3, "a100", gemm=g)
    assert stretched == pytest.approx(1e-3 + (1 - r) * 0.5e-3) and exposed == 0.0
    # without a shape: the SM share (92 / 108), as before
    assert cost.overlap(1e-3, 0.5e-3, "a100")[0] == pytest.approx(1e-3 + 16 / 108 * 0.5e-3)


@pytest.mark.parametrize("gemm, sms, match", [((1, 2), None, "three ints"),
                                              ((1, -1, 2), None, "three ints"),
                                              ((1, 2, 3.0), None, "three ints"),
                                              ((1, 2, 3), 0, "sms=0"),
                                              ((1, 2, 3), 109, "sms=109")])
def test_bad_input(gemm, sms, match):
    with pytest.raises(ValueError, match=match):
        cost.gemm_efficiency(gemm, "a100", sms)


def test_profile_tile_is_validated():
    d = A100.to_dict()
    d["gemm_tile"] = {"m": 256, "n": 128}
    with pytest.raises(ValueError, match="gemm_tile needs exactly"):
        type(A100).from_dict(d)
    d["gemm_tile"] = {"m": 256, "n": 0, "per_sm": 1}
    with pytest.raises(ValueError, match="gemm_tile"):
        type(A100).from_dict(d)
    d["gemm_tile"] = {"m": 256, "n": 128, "per_sm": 1}
    assert type(A100).from_dict(d) == A100


def test_explain_compute_gives_compute_times_terms_for_a_gemm():
    # fc1 of Table 4's layer on one tp rank: 768 tiles in 8 waves of 108 (89% full)
    flops, nbytes, shape = 2 * 8192 * 6144 * 3072, 2 * (8192 * 6144 + 6144 * 3072
                                                         + 8192 * 3072), (1, 8192, 3072)
    terms = cost.explain_compute(flops, nbytes, "a100", "float16", "matmul", gemm=shape)
    assert terms["seconds"] == cost.compute_time(flops, nbytes, "a100", "float16", "matmul",
                                                 gemm=shape)
    assert terms["seconds"] == pytest.approx(terms["compute"] + terms["launch"])
    plain = cost.explain_compute(flops, nbytes, "a100", "float16", "matmul")
    assert terms["compute"] == pytest.approx(
        plain["compute"] / cost.gemm_efficiency(shape, "a100"))
