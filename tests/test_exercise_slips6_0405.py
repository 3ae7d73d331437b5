"""Checker slips found in the browser review of notebooks 04 and 05 (nbv0405): hints that
named the wrong mistake, or none."""
import pytest
import torch

import workbench as wb
from workbench.exercises import checks_spmd_pipeline as P
from workbench.parallel.rules import combine

from .exercise_helpers import fresh_cumsum_rule, message, passes  # noqa: F401 (a fixture)

R, S, Pa = wb.Replicate(), wb.Shard, wb.Partial()


@pytest.fixture(autouse=True)
def _fresh(fresh_cumsum_rule):
    """Tries and the "cumsum" rule restored around each test (exercise_helpers)."""


def _cumsum_opts(x, d):
    d = d % x.ndim
    opts = [((R,), (R,), "replicated")]
    opts += [((S(k),), (S(k),), "other dim") for k in range(x.ndim) if k != d]
    opts.append(((Pa,), (Pa,), "linear"))
    return combine(x.mesh.ndim, [opts] * x.mesh.ndim, 1)


# ---- 04 exercise 2: the cumsum rule --------------------------------------------------------------

def test_a_rule_whose_attribute_is_misnamed_is_told_its_signature():
    """Before: `def cumsum_rule(x, d)` got the dispatcher's message, 'missing attribute
    'd' ... (cumsum takes d, dim, dtype; ...)', which reads as if cumsum took a `d`, with the
    signature hint only at the end of five lines."""
    @wb.register_rule("cumsum", override=True)
    def cumsum_rule(x, d):
        return _cumsum_opts(x, d)
    msg = message(P.check_cumsum_rule, cumsum_rule)
    assert msg.startswith("your rule takes (x, d)"), msg
    assert "rule(x, dim=...)" in msg and "cumsum takes" not in msg, msg


def test_a_rule_without_the_dim_parameter_is_told_its_signature():
    @wb.register_rule("cumsum", override=True)
    def cumsum_rule(x):
        return _cumsum_opts(x, -1)
    msg = message(P.check_cumsum_rule, cumsum_rule)
    assert msg.startswith("your rule takes (x)"), msg


def test_a_rule_taking_attributes_as_keywords_still_passes(capsys):
    @wb.register_rule("cumsum", override=True)
    def cumsum_rule(x, **attrs):
        return _cumsum_opts(x, attrs["dim"])
    assert passes(capsys, P.check_cumsum_rule, cumsum_rule).startswith("Correct: 25 strategies")


# ---- 05 exercise 1: gradient buckets -------------------------------------------------------------

W1, B1 = 256 * 1024 * 4, 1024 * 4                    # fp32 bytes of each gradient
W2, B2 = 1024 * 1024 * 4, 1024 * 4
W3, B3 = 1024 * 256 * 4, 256 * 4


def test_buckets_closed_before_the_gradient_that_overflows_them_are_named():
    """Before: the generic 'fill a bucket with whole gradients ...'; the slip is reading the
    cap as a ceiling (close before the gradient that would pass it)."""
    msg = message(wb.exercises.check_bucket_sizes, [B3 + W3 + B2, W2, B1 + W1])
    assert "stops before the gradient that would take it past bucket_bytes" in msg, msg


def test_buckets_of_two_byte_gradients_are_named():
    """Before: 'your buckets hold 3,150,336 B in all; the gradients are 6,300,672 B'."""
    msg = message(wb.exercises.check_bucket_sizes, [(B3 + W3 + B2 + W2) // 2, (B1 + W1) // 2])
    assert "2 bytes per value" in msg and "fp32" in msg, msg


@pytest.mark.parametrize("scale, unit", [(2**20, "MiB"), (1e6, "MB")])
def test_buckets_in_mib_or_mb_are_named(scale, unit):
    """Before: 'sizes should be a list of bucket sizes in bytes, got [5.00..., 1.00...]'."""
    msg = message(wb.exercises.check_bucket_sizes,
                  [(B3 + W3 + B2 + W2) / scale, (B1 + W1) / scale])
    assert f"reads as {unit}" in msg and "in bytes" in msg, msg


def test_buckets_as_a_tensor_or_as_strings_say_what_to_pass():
    """Before: 'should be a list of bucket sizes in bytes, got tensor([5248000, 1052672])'
    with no word on what to change (the same for a list of strings)."""
    right = [B3 + W3 + B2 + W2, B1 + W1]
    # an integer tensor is read as its ints (merged with nbv0608's Mesh.mesh columns);
    # a float tensor is told what to pass
    assert ".tolist()" in message(wb.exercises.check_bucket_sizes,
                                  torch.tensor(right, dtype=torch.float64))
    assert "not a str" in message(wb.exercises.check_bucket_sizes, [str(b) for b in right])


def test_buckets_as_an_integer_tensor_pass(capsys):
    """The right sizes as an int64 tensor are the right answer (read as their ints), as a
    Mesh.mesh column is read as its ranks (nbv0608); a 2-d tensor is refused."""
    right = [B3 + W3 + B2 + W2, B1 + W1]
    passes(capsys, wb.exercises.check_bucket_sizes, torch.tensor(right))
    assert ".tolist()" in message(wb.exercises.check_bucket_sizes, torch.tensor([right]))


# ---- 05 exercise 2: the largest model that fits --------------------------------------------------

MEM = 64e9


@pytest.mark.parametrize("stage, per_param", [(0, 12), (1, 4 + 8 / 64), (2, 2 + 10 / 64),
                                              (3, 12 / 64)])
def test_twelve_bytes_of_model_states_are_named(stage, per_param):
    """K = 8 (no fp32 master weight), or 12 B in all at stage 0: before, 'too high: compare
    each factor with the formula'."""
    psi = [MEM / 16, MEM / (4 + 12 / 64), MEM / (2 + 14 / 64), MEM / (16 / 64)]
    psi[stage] = MEM / per_param
    msg = message(wb.exercises.check_zero_max_params, psi)
    assert f"stage {stage} limit" in msg and "K = 12" in msg, msg


def test_a_limit_given_as_a_string_says_so():
    msg = message(wb.exercises.check_zero_max_params,
                  ["4e9", MEM / (4 + 12 / 64), MEM / (2 + 14 / 64), MEM / (16 / 64)])
    assert "not a str" in msg, msg


# ---- 05 exercise 3: ZeRO-3's traffic ------------------------------------------------------------

N_BYTES = 7.5e9 * 2


def test_swapped_traffic_answers_are_named():
    """Before: 'your DP bytes are 4.43e+10: too high: compare each factor with the formula'."""
    msg = message(wb.exercises.check_zero3_traffic, 3 * 63 / 64 * N_BYTES, 2 * 63 / 64 * N_BYTES)
    assert "swapped" in msg, msg


def test_traffic_in_bits_is_named():
    for dp, z3, which in ((8 * 2 * 63 / 64 * N_BYTES, 3 * 63 / 64 * N_BYTES, "DP"),
                          (2 * 63 / 64 * N_BYTES, 8 * 3 * 63 / 64 * N_BYTES, "ZeRO-3")):
        msg = message(wb.exercises.check_zero3_traffic, dp, z3)
        assert msg.startswith(f"your {which} bytes") and "bits, not bytes" in msg, msg


def test_one_and_a_half_times_the_wrong_base_is_named():
    """1.5 x (N-1)/N n: the ratio applied to one collective's share, not to DP's traffic;
    before: 'too low: compare each factor with the formula'."""
    msg = message(wb.exercises.check_zero3_traffic, 2 * 63 / 64 * N_BYTES, 1.5 * 63 / 64 * N_BYTES)
    assert "1.5x is ZeRO-3 against DP" in msg, msg


# ---- 04 after exercise 2: torch.cumsum runs with the student's rule ------------------------------

def test_torch_cumsum_runs_with_a_rule_that_names_only_dim():
    """Notebook 04 says that once `cumsum_rule(x, dim)` is registered, torch.cumsum on a
    DistTensor runs with it.  Before, the dispatcher handed the rule every attribute its
    parse gives (dim and dtype): TypeError: cumsum_rule() got an unexpected keyword
    argument 'dtype', from inside torch.cumsum."""
    @wb.register_rule("cumsum", override=True)
    def cumsum_rule(x, dim):
        return _cumsum_opts(x, dim)
    torch.manual_seed(0)
    X = torch.randn(4, 8)
    mesh = wb.Mesh.grid(4, ["x"])
    for ps, dtype in (([S(1)], None), ([S(0)], torch.float64)):
        xs = wb.shard_tensor(X, mesh, ps)
        with wb.trace("ascend-910b") as tr:
            y = torch.cumsum(xs, dim=1, dtype=dtype)
        assert torch.equal(y.full(), torch.cumsum(X, 1, dtype=dtype))
        # the student's rule decided: S(1) must be made whole on the scanned dim (the
        # all-to-all to [S(0)] its options allow), S(0) stays
        assert y.placements == (S(0),)
        assert [e.name for e in tr.collectives()] == (["all_to_all"] if ps == [S(1)] else [])


def test_a_rule_missing_a_required_attribute_still_raises():
    @wb.register_rule("cumsum", override=True)
    def cumsum_rule(x, axis):
        return _cumsum_opts(x, axis)
    xs = wb.shard_tensor(torch.randn(4, 8), wb.Mesh.grid(4, ["x"]), [S(0)])
    with pytest.raises(TypeError, match="axis"):
        torch.cumsum(xs, dim=1)


def test_the_strategies_of_one_call_instead_of_the_rule_say_so():
    """Before: the repr of every Strategy of the list, 363 characters, and no word that the
    rule was called rather than passed."""
    @wb.register_rule("cumsum", override=True)
    def cumsum_rule(x, dim):
        return _cumsum_opts(x, dim)
    strategies = cumsum_rule(wb.TensorSpec((4, 8), wb.Mesh.grid(4, ["x"]), [S(0)]), 1)
    msg = message(P.check_cumsum_rule, strategies)
    assert "without calling it" in msg and "Strategy(" not in msg, msg


def test_a_dict_of_answers_is_told_to_be_a_list():
    """Before: list(d) read the dict's keys: 'your buckets are [0, 1]: your buckets hold 1 B
    in all', 'your stage 0 limit is 0 parameters: too low'."""
    psi = [MEM / 16, MEM / (4 + 12 / 64), MEM / (2 + 14 / 64), MEM / (16 / 64)]
    assert "got a dict" in message(wb.exercises.check_zero_max_params, dict(enumerate(psi)))
    assert "got a dict" in message(wb.exercises.check_bucket_sizes,
                                   {0: B3 + W3 + B2 + W2, 1: B1 + W1})


def test_n_d_minus_one_is_named():
    """64 - 1 devices: before, 'too low: compare each factor with the formula'."""
    psi = [MEM / 16, MEM / (4 + 12 / 64), MEM / (2 + 14 / 64), MEM / (16 / 63)]
    msg = message(wb.exercises.check_zero_max_params, psi)
    assert "stage 3 limit" in msg and "N_d - 1 = 63" in msg, msg


def test_a_spent_iterator_is_shown_by_its_items():
    """Before: 'got <generator object <genexpr> at 0x...>: give each as an int'."""
    msg = message(wb.exercises.check_bucket_sizes, (float(b) for b in (B3 + W3 + B2 + W2, B1 + W1)))
    assert "got [5248000.0, 1052672.0]" in msg and "generator" not in msg, msg
