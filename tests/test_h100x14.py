"""The Megatron-LM README's H100 rows (NVIDIA/Megatron-LM f2e5db402c images/model_table.png)
against the least their data-parallel sync can take from component figures
(``benchmarks/h100_breakdown.py``: ``dp_room``, ``compute_needed``).

- The DP sync's line-rate floor is the row's gradient bytes (fp32, as f2e5db402c forces
  for bf16) and weight bytes (bf16) over (n - 1) / n of a ring, through one 400 Gb/s NDR
  port per GPU of the group on a node (DGX H100: 50 GB/s), against the parameters per
  GPU counted here from the README's shapes.
- The planner never prices a row's DP sync below that floor.
- The 32B (tp 8, pp 1) is the one row whose published step leaves less than the floor;
  the 70B (tp 8, pp 2), whose DP group has the same shape (one GPU per node, 4.4e9
  parameters per GPU), leaves about its floor: the 32B's step cannot be reached from
  these components whatever the overlap, and what remains of it would ask all its
  kernels to run above the measured H100's sustained GEMM rate.
"""
import json
import os
import statistics
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import h100_breakdown as HB  # noqa: E402
from workbench.sim_mesh import measured as M  # noqa: E402
from workbench.sim_mesh.profiles import get_profile  # noqa: E402

NDR_PORT = 400e9 / 8          # DGX H100: one 400 Gb/s ConnectX-7 NDR port per GPU


@pytest.fixture(scope="module")
def parts():
    return {x["name"]: x for x in (HB.breakdown(r) for r in HB.rows())}


def _params_per_gpu(h, layers, tp, vocab=131072, seq=4096):
    """A Megatron GPT's parameters on one tensor-parallel rank (untied embeddings,
    learned positions, ffn 4h, biases): the layers' 12 h^2 + 13 h split over tp (the
    LayerNorms' and row-parallel biases' 5 h per layer held whole, ASSUMED negligible
    here: within the 0.5% tolerance), the word embedding and the output layer split
    over tp, the position table whole."""
    return (layers * (12 * h * h + 13 * h) + 2 * vocab * h) / tp + seq * h


def test_the_profile_port_is_the_dgx_h100_nic():
    assert get_profile("h100").inter_node.bandwidth == NDR_PORT


@pytest.mark.parametrize("name,h,layers,tp,per_node", [
    ("GPT 1.7B", 2048, 24, 1, 8), ("GPT 16B", 6144, 32, 4, 2), ("GPT 32B", 7168, 48, 8, 1)])
def test_the_floor_is_the_bytes_over_the_group_ports(parts, name, h, layers, tp, per_node):
    x = parts[name]
    assert x["per_node"] == per_node          # tp innermost: 8 / tp ranks of a group a node
    psi = _params_per_gpu(h, layers, tp)
    assert x["params"] == pytest.approx(psi, rel=0.005)
    y = HB.dp_room(x)
    frac = 47 / 48
    assert y["rs_line"] == pytest.approx(4 * psi * frac / (per_node * NDR_PORT), rel=0.005)
    assert y["ag_line"] == pytest.approx(2 * psi * frac / (per_node * NDR_PORT), rel=0.005)
    assert y["floor"] == pytest.approx(
        max(0.0, y["rs_line"] - x["last_backward"])
        + max(0.0, y["ag_line"] - x["first_forward"]), rel=1e-12)


def test_room_is_the_published_step_less_every_other_priced_term(parts):
    for x in parts.values():
        y = HB.dp_room(x)
        others = x["compute"] + x["tp_exposed"] + x["bubble"] + x["optimizer"]
        assert y["room"] == pytest.approx(x["published"] - others, abs=1e-9), x["name"]


def test_the_planner_never_prices_the_dp_sync_below_its_line_rate_floor(parts):
    for x in parts.values():
        y = HB.dp_room(x)
        assert y["priced"] >= y["floor"] - 1e-9, x["name"]


def test_only_the_32b_leaves_less_than_its_floor_and_the_70b_sits_on_it(parts):
    short = {n: HB.dp_room(x)["short"] for n, x in parts.items()}
    assert [n for n, s in short.items() if s < 0] == ["GPT 32B"]
    assert short["GPT 32B"] < -0.1                       # 0.16 s beyond any overlap
    a, b = parts["GPT 32B"], parts["GPT 70B"]
    assert (a["per_node"], b["per_node"]) == (1, 1)       # the same DP group shape
    y = HB.dp_room(b)
    assert abs(y["short"]) < 0.1 * y["floor"]             # the 70B leaves about its floor


def test_the_sustained_rate_is_the_files_median_second():
    prof = get_profile("h100")
    data = json.loads(M._path(prof.measured["file"]).read_text(encoding="utf-8"))
    secs = [r["tflops"] for r in data["sustained"]["per_second"]]
    assert len(secs) >= 5
    assert M.summary(prof.measured["file"])["sustained_tflops"] == statistics.median(secs)


def test_the_32b_would_need_every_kernel_above_the_sustained_gemm_rate(parts):
    got = {n: HB.compute_needed(parts[n]) for n in ("GPT 1.7B", "GPT 7.1B", "GPT 16B",
                                                    "GPT 32B")}
    x = got["GPT 32B"]
    # the model FLOPs a GPU runs: Megatron's count for the step's 192 x 4096 tokens / 384
    h, L, s, V = 7168, 48, 4096, 131072
    flops = 72 * 192 * s * L * h * h * (1 + s / (6 * h) + V / (12 * h * L)) / 384
    assert x["model_flops"] == pytest.approx(flops, rel=0.002)     # published rounding
    assert x["needed"] > x["sustained"]
    assert x["needed"] > 1.15 * x["planner"]
    # its neighbours ask less of their kernels than the planner's compute gives
    for n in ("GPT 1.7B", "GPT 7.1B", "GPT 16B"):
        assert got[n]["needed"] < got[n]["planner"], n


def test_compute_needed_refuses_a_pipelined_row(parts):
    with pytest.raises(ValueError, match="GPT 70B.*one-stage"):
        HB.compute_needed(parts["GPT 70B"])


@pytest.mark.parametrize("name", ["GPT 1.7B", "GPT 7.1B"])
def test_gemm_rates_count_the_layer_flops_and_the_rate_the_gap_needs(name):
    row = next(r for r in HB.rows() if r["name"] == name)
    g = HB.gemm_rates(row)
    m = row["layout"]
    h, L = row["model"]["d_model"], row["model"]["n_layer"]
    micro = m["global_batch"] // (m["dp"] * m["micro_batch"])
    # the layer part of Megatron-LM's num_floating_point_operations (training.py:73-108
    # at f2e5db402c): 12 B s L h^2 x (2 + 4), the attention core (s / h) and logits apart
    megatron_layers = 12 * m["micro_batch"] * micro * 4096 * L * h * h * 6 / m["tp"]
    assert g["flops"] == pytest.approx(megatron_layers, rel=1e-12)
    assert g["gap"] > 0                                   # the two optimistic rows
    # at the needed rate the layer and output-layer GEMMs take exactly the gap more
    import tp8_audit as T8
    fam = T8.audit(row)["families"]
    both = fam["layer GEMMs"] + fam["output-layer GEMMs"]
    assert both * g["rate"] / g["needed"] - both == pytest.approx(g["gap"], rel=1e-9)
    # the measured rates at these shapes are well above what the gap needs
    assert g["rate"] > 1.15 * g["needed"]


def test_wgrad_accum_bound_is_six_bytes_per_weight_at_the_copy_rate():
    """Megatron's fused wgrad accumulation reads and writes fp32 main_grad (4 + 4 bytes)
    where the measured wgrad writes bf16 (2): 6 bytes per weight element and micro-batch,
    at the profile's measured copy rate (3,018.5 GB/s: a 6.4 GB device copy, profile
    h100 ``memory_efficiency`` 0.901 of 3.35 TB/s)."""
    prof = get_profile("h100")
    rate = prof.memory_bandwidth * prof.memory_efficiency
    assert rate == pytest.approx(3018.5e9, rel=1e-3)
    row = next(r for r in HB.rows() if r["name"] == "GPT 1.7B")
    w = HB.wgrad_accum_bound(row)
    # 24 layers of 12 h^2 weights (h 2,048), the 131,072 x 2,048 output layer, 4 micro-batches
    assert w["layers"] == pytest.approx(4 * 6 * 24 * 12 * 2048 ** 2 / 3018.5e9, rel=1e-3)
    assert w["head"] == pytest.approx(4 * 6 * 131072 * 2048 / 3018.5e9, rel=1e-3)
    assert w["ratio_if_added"] < w["ratio"]
    with pytest.raises(ValueError, match="GPT 70B.*pp=2"):
        HB.wgrad_accum_bound(next(r for r in HB.rows() if r["name"] == "GPT 70B"))
