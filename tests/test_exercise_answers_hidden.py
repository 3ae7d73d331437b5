"""No exercise's answer may be visible before its check cell.

For each exercise check in the course's notebooks, the expected value is computed here,
from the check itself (the value a wrong answer's ``CheckError.expected`` names, or the
check module's own derivation), never from a notebook's stored outputs. Every rendering
of it a student could recognise (its roundings, with thousands separators, as a percent
for shares, the answer's word in the sentence that would give it away) must be absent
from the outputs of the cells above the check: printed text, results, error messages
and the state of any widget those cells display (a slider's default, an HTML readout).
Figures are PNGs and cannot be read here; their data is printed beside them in these
notebooks, and ``tests/test_viz_*`` check what the renderers draw.

Answers that are code (a function, a rule, a model, a schedule) cannot be printed before
they are written and have no needle here; the table says so for each.
"""
from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest

import workbench as wb
from workbench.exercises import checks_fused, checks_overlap_profiling, checks_plan
from workbench.exercises.feedback import CheckError, reset_tries

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


# ---- what the outputs above a check show ---------------------------------------------------

def _load(stem):
    path = next(NOTEBOOKS.glob(f"{stem}*.ipynb"))
    return json.loads(path.read_text())


def _check_cell(nb, check):
    """Index of the graded cell that calls ``wb.exercises.<check>(``."""
    hits = [i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"
            and f"wb.exercises.{check}(" in "".join(c["source"])]
    graded = [i for i in hits
              if nb["cells"][i].get("metadata", {}).get("nbgrader", {}).get("grade")]
    assert hits, f"no cell calls wb.exercises.{check}"
    return (graded or hits)[-1]


def _widget_texts(nb, model_id):
    """Every string and number in the state of widget ``model_id`` and its children."""
    state = nb.get("metadata", {}).get("widgets", {}).get(
        "application/vnd.jupyter.widget-state+json", {}).get("state", {})
    out, todo, seen = [], [model_id], set()
    while todo:
        mid = todo.pop()
        if mid in seen or mid not in state:
            continue
        seen.add(mid)
        st = state[mid]["state"]
        labels = st.get("_options_labels")
        if labels is not None and "index" in st and isinstance(st["index"], int):
            out.append(f"{st.get('description', '')} = {labels[st['index']]}")   # the default
        for key, v in st.items():
            for item in v if isinstance(v, list) else [v]:
                if isinstance(item, str) and item.startswith("IPY_MODEL_"):
                    todo.append(item[len("IPY_MODEL_"):])
                elif key in ("value", "description") and isinstance(item, (str, int, float)):
                    out.append(f"{st.get('description', '')} = {item}")
    return out


def _outputs_above(nb, index):
    """(cell index, text) of every output of the code cells above ``index``."""
    texts = []
    for i, cell in enumerate(nb["cells"][:index]):
        for o in cell.get("outputs", []):
            if o["output_type"] == "stream":
                texts.append((i, "".join(o["text"])))
            elif o["output_type"] == "error":
                texts.append((i, o["evalue"] + "\n" + "\n".join(o.get("traceback", []))))
            else:
                data = o.get("data", {})
                for mime in ("text/plain", "text/html", "text/markdown"):
                    if mime in data:
                        texts.append((i, "".join(data[mime])))
                view = data.get("application/vnd.jupyter.widget-view+json")
                if view:
                    texts += [(i, t) for t in _widget_texts(nb, view["model_id"])]
    return texts


# ---- renderings of an expected value -------------------------------------------------------

def _sig(text):
    digits = re.sub(r"[^0-9]", "", text).lstrip("0")
    return len(digits)


def number(x, unit=None, percent=False, min_sig=3):
    """Regexes for ``x`` as a student would see it printed: 3 to 5 significant digits,
    0 to 3 decimals (with or without thousands separators); with ``unit``, also fewer
    digits when the unit follows; with ``percent``, 100 x followed by %."""
    forms = {f"{x:.{g}g}" for g in range(min_sig, 6)}
    forms = {f for f in forms if _sig(f) >= min_sig}
    for d in range(4):
        for f in (f"{x:.{d}f}", f"{x:,.{d}f}"):
            if _sig(f) >= min_sig:
                forms.add(f)
    pats = [rf"(?<![\d.,]){re.escape(f)}(?![\d]|[.,]\d)" for f in forms if "e" not in f]
    if unit:                        # "55 GB": fewer digits, but the unit says what it is
        short = {f for d in range(3) for f in (f"{x:.{d}f}", f"{x:,.{d}f}")
                 if _sig(f) >= max(2, min_sig - 1)}
        pats += [rf"(?<![\d.,]){re.escape(f)}\s*{re.escape(unit)}(?![A-Za-z])" for f in short]
    if percent:
        pats += [rf"(?<![\d.,]){re.escape(f'{100 * x:.{d}f}')}\s*%" for d in range(3)
                 if _sig(f"{100 * x:.{d}f}") >= 2]
    return pats


def literal(text):
    return [re.escape(text)]


def expected_of(check, *args, **kwargs):
    """The expected value a wrong answer is told (``CheckError.expected``): the check's
    own derivation of it."""
    reset_tries()
    try:
        check(*args, **kwargs)
    except CheckError as err:
        assert err.expected is not None, f"{check.__name__}{args}: no expected value"
        return err.expected
    finally:
        reset_tries()
    raise AssertionError(f"{check.__name__}{args} accepted a wrong answer")


def floats(text):
    return [float(x) for x in re.findall(r"-?\d+(?:\.\d+)?(?:e[+-]?\d+)?", text.replace(",", ""))]


def _exec_cells(nb, *markers):
    """Run the source (never the outputs) of the code cells containing each marker: the
    inputs an exercise hands its check (a trace, a model class, a measured time)."""
    ns = {}
    for marker in markers:
        cell = next(c for c in nb["cells"] if c["cell_type"] == "code"
                    and marker in "".join(c["source"]))
        exec(compile("".join(cell["source"]), f"<{marker}>", "exec"), ns)
    return ns


# ---- the exercises: notebook, check, needles(notebook) ---------------------------------------

E = wb.exercises


def _tp_group(nb):
    want = expected_of(E.check_tp_group, (0, 1))
    return literal(want)


def _welcome_mesh(nb):
    mesh = wb.Mesh([[0, 1, 2, 3], [4, 5, 6, 7]], dim_names=["dp", "tp"])   # the exercise's
    return literal(str(mesh))


def _numbers_of(check, *args, unit=None, percent=False, **kwargs):
    def needles(nb):
        out = []
        for x in floats(expected_of(check, *args, **kwargs)):
            out += number(x, unit, percent)
        return out
    return needles


def _rank1_layout(nb):
    return literal(expected_of(E.check_rank1_layout, ["R", "R"])) + literal("[S(1), S(0)]")


def _notation(nb):
    return literal(expected_of(E.check_notation, "x").strip("'"))


def _list_of(check, *args):
    return lambda nb: literal(expected_of(check, *args))


def _cheapest_path(nb):
    text = expected_of(E.check_cheapest_path, [["P(sum)", "S(1)"], ["R", "S(1)"],
                                                ["S(0)", "S(1)"], ["S(0)", "R"]])
    return literal(text.split(", ", 1)[1])


def _allgather(nb):
    text = expected_of(E.check_allgather_times, 1.0, 1.0)      # "910B 2118.2 us, A100 ..."
    return [p for x in re.findall(r"(\d+\.\d) us", text) for p in number(float(x), "us")]


def _zero_max_params(nb):
    mem = wb.get_profile("ascend-910b").memory_bytes
    out, right = [], []
    for s, per in enumerate((16, 4 + 12 / 64, 2 + 14 / 64, 16 / 64)):   # ZeRO sec. 3.1
        psi = mem / per
        told = floats(expected_of(E.check_zero_max_params, right + [-1.0] * (4 - s)))[0]
        assert told == pytest.approx(psi, rel=1e-3)
        right.append(psi)
        out += number(psi / 1e9, "e9") + number(psi / 1e9, "B")
    return out


def _zero3_traffic(nb):
    dp = floats(expected_of(E.check_zero3_traffic, 1.0, 1.0))[0]
    z3 = floats(expected_of(E.check_zero3_traffic, dp, 1.0))[-1]
    return [p for x in (dp, z3) for p in number(x / 1e9, "GB") + number(x / 2**30, "GiB")]


def _tp_sp_bytes(nb):
    tp = floats(expected_of(E.check_tp_sp_layer_bytes, 1.0, 1.0))[0]
    return number(tp / 2**20, "MiB") + number(tp / 1e6, "MB") + number(tp, "B")


def _sp_max_mb(nb):
    b = int(expected_of(E.check_sp_max_microbatch, 99))
    return [rf"\bb = {b}\b", rf"\bmicro-batch(es)? of {b}\b fits"]


def _min_microbatches(nb):
    a = expected_of(E.check_min_microbatches, 1, 8)
    b = expected_of(E.check_min_microbatches, int(a.split("m=")[1]), 8)
    return [rf"\bm\s*=\s*{int(t.split('m=')[1])}\b" for t in (a, b)]


def _zb_bubble(nb):
    want = floats(expected_of(E.check_zb_bubble, -1.0))[0]
    return [rf"\b{want:g} time units", rf"bubble[^\n]*\b{want:g}\b"]


def _hybrid_groups(nb):
    text = expected_of(E.check_hybrid_groups, (0, 1), (0, 1), 0)   # "dp (4, 6), tp (6, 7), ..."
    dp, tp = re.findall(r"\(\d+, \d+\)", text)
    # the lesson lists every stage's groups to read the answer from ("let the meshes tell
    # you"); what must not show is rank 6's own groups named as rank 6's
    return [rf"rank 6\b[^\n]{{0,40}}{re.escape(g)}" for g in (dp, tp)]


def _hybrid_state(nb):
    return [p for x in floats(expected_of(E.check_hybrid_state_bytes, 1)) for p in number(x)]


def _best_layout(nb):
    text = expected_of(E.check_best_layout, (1, 4, 2))
    lay, ms = text.split(": ")
    return literal(lay) + number(floats(ms)[0], "ms")


def _window_tiles(nb):
    want = int(floats(expected_of(E.check_window_tiles, 0))[0])
    assert want == checks_fused._window_tiles_by_hand(1024, 256, 128)   # the exercise's text
    return [rf"(?<![\d.]){want}\s+(computed|tiles|of 64)", rf"computed[:=]?\s+{want}\b"]


def _hidden_share(nb):
    return number(floats(expected_of(E.check_hidden_share, -1.0))[0], percent=True, min_sig=2)


def _multi_copy(nb):
    want = checks_overlap_profiling._two_copy_schedule(1.0, 2.0, 1.5)
    return number(want, "ms", min_sig=2)


def _best_chunks(nb):
    k = int(expected_of(E.check_best_chunks, 32).split("= ")[1])

    def total(j, C=1.0, M=2.0, launch=0.005, latency=0.040):     # the exercise's model
        c, m = C / j + launch, M / j + latency
        return c + m + (j - 1) * max(c, m)
    return number(total(k), "ms") + number(total(1), "ms")


def _zero_states(nb):
    cell = "".join(nb["cells"][_check_cell(nb, "check_zero_states_gb")]["source"])
    kwargs = dict(re.findall(r"(\w+)=([\w.]+)", cell))
    stage = int(kwargs.get("stage", 2))
    gb = floats(expected_of(E.check_zero_states_gb, -1.0, stage=stage))[0]
    return number(gb, "GB")


def _least_recompute(nb):
    want = None                                  # the answer: what a wrong guess is told
    for guess in ("none", "full"):               # one of the two is wrong, or both are
        reset_tries()
        try:
            E.check_least_recompute(guess)
        except CheckError as err:
            want = err.expected.strip("'")
            break
    reset_tries()
    defaults = {k: v.default for k, v in
                inspect.signature(E.check_least_recompute).parameters.items()
                if v.default is not inspect.Parameter.empty}
    gb = checks_plan.gpt3_first_stage_gb(want, defaults["micro_batch"], defaults["tp"],
                                         defaults["pp"], defaults["dp"], defaults["zero"])
    return (number(gb, "GB", min_sig=2) +
            [rf"(?i){want} recompute fits", rf"(?i)rc:{want}\b[^\n]*pp{defaults['pp']}\b"
             rf"[^\n]*\bfits\b", rf"(?i)pp{defaults['pp']}\b[^\n]*rc:{want}\b[^\n]*\bfits\b"])


def _biggest_b(nb):
    b = int(expected_of(E.check_biggest_micro_batch, 1).split("= ")[1])
    gb = checks_plan.gpt3_first_stage_gb("selective", b, 8, 16, 8, 1)
    return number(gb, "GB", min_sig=2)


def _fusion(nb):
    p = wb.get_profile("ascend-910b")
    bw = p.memory_bandwidth * p.memory_efficiency
    unfused = floats(expected_of(E.check_fusion_us, -1.0, -1.0))[0]
    assert unfused == pytest.approx(1000 * (4096 / bw + p.launch_overhead) * 1e6, rel=1e-3)
    fused = (1000 * 4096 / bw + p.launch_overhead) * 1e6
    return number(unfused, "us") + number(fused, "us")


def _step_trace(nb):
    return _exec_cells(nb, "import workbench as wb", "strategy = Hybrid(")["tr"]


def _top_op(nb):
    tr = _step_trace(nb)
    name = expected_of(E.check_top_op, "no such op", tr).strip("'")
    per = sum(e.duration for e in tr.events if e.stream == "compute" and e.name == name)
    return number(per * 1e6, "us") + [rf"(?m)^\s*{re.escape(name)}\s+[\d.,]+\s*us"]


def _idle(nb):
    tr = _step_trace(nb)
    want = floats(expected_of(E.check_idle_share, -1.0, tr))[0]
    return number(want, percent=True, min_sig=2)


def _ddp_bytes(nb):
    ns = _exec_cells(nb, "import workbench as wb", "class TinyLM", "class Counted")
    Counted = ns["Counted"]                 # exercise 1 counts this model, not TinyLM
    return number(floats(expected_of(E.check_ddp_bytes, -1.0, Counted))[0], "B")


def _mfu(nb):
    # exercise 1: the MFU of the measured GPT-3 175B run (Narayanan et al. 2021, sec. 3.2)
    step_time = _exec_cells(nb, "step_time =")["step_time"]
    want = floats(expected_of(E.check_mfu, -1.0, step_time, devices=1024, peak_tflops=312))[0]
    return number(want, percent=True, min_sig=3) + [rf"(?<![\d.]){100 * want:.1f}%"]


def _tp_comm(nb):
    ns = _exec_cells(nb, "import workbench as wb", "clusters =", "nbytes =", "t8_ms =")
    t8, t16 = ns["t8_ms"], ns["t16_ms"]
    a = floats(expected_of(E.check_tp_comm_ms, -1.0, -1.0, "A", t8, t16))[0]
    b = floats(expected_of(E.check_tp_comm_ms, a, -1.0, "A", t8, t16))[0]
    return [p for x in (a, b) for p in number(x, "ms")]


def _dropped_slots(nb):
    # the loads the exercise starts from: the router's counts, re-run from the cells' source
    loads = _exec_cells(nb, "import math", "ids = wb.models.data.tokens()[:256]")["loads"]
    want = int(floats(expected_of(E.check_dropped_slots, -1, loads, capacity_factor=1.25))[0])
    return [rf"(?<![\d.,]){want}(?![\d.,])[^\n]{{0,40}}dropped",
            rf"dropped[^\n]{{0,40}}(?<![\d.,]){want}(?![\d.,])"]


def _ep_tp_mb(nb):
    ep = floats(expected_of(E.check_ep_tp_mb, -1.0, -1.0))[0]
    tp = floats(expected_of(E.check_ep_tp_mb, ep, -1.0))[0]
    return number(ep, "MB") + number(tp, "MB")


def _compile_bytes(nb):
    kw = dict(rows=24, cols=64, p=8)
    g = floats(expected_of(E.check_greedy_vs_whole_bytes, -1.0, -1.0, **kw))[0]
    w = floats(expected_of(E.check_greedy_vs_whole_bytes, g, -1.0, **kw))[0]
    return number(g, "B") + number(w, "B")


def _sink_saving(nb):
    # the kernels of the O1 step, as the cell above the check printed them
    text = "".join(t for _, t in _outputs_above(nb, _check_cell(nb, "check_sink_saving_us")))
    kernels = int(re.search(r"O1: step .*?\((\d+) kernels", text).group(1))
    return number(floats(expected_of(E.check_sink_saving_us, -1.0, kernels))[0], "us")


CODE = "code"   # the answer is code the student writes: nothing above can print it
def _decode_floor(nb):
    from workbench.serve.batching import StepPricer
    p = StepPricer("llama2-7b", "ascend-910b")       # the numbers the exercise cell prints
    ms = floats(expected_of(E.check_decode_floor_ms, -1.0, -1.0, p.weight_bytes // 2,
                            p.profile.memory_bandwidth))[0]
    return number(ms, "ms") + number(ms / 2, "ms")


EXERCISES = [
    ("00", "check_welcome_mesh", _welcome_mesh),
    ("00", "check_tp_group", _tp_group),
    ("01", "check_training_days", _numbers_of(E.check_training_days, -1.0, unit="days")),
    ("01", "check_zero2_memory_gb", _numbers_of(E.check_zero2_memory_gb, -1.0, unit="GB")),
    ("01", "check_allreduce_seconds", _numbers_of(E.check_allreduce_seconds, -1.0, unit="s")),
    ("02", "check_rank1_layout", _rank1_layout),
    ("02", "check_notation", _notation),
    ("02", "check_nested_rows", _list_of(E.check_nested_rows, [10, 0, 0, 0])),
    ("03", "check_cheapest_path", _cheapest_path),
    ("03", "check_allgather_times", _allgather),
    ("03", "check_uneven_receive", _list_of(E.check_uneven_receive, [0, 0, 0, 0])),
    ("04", "check_mlp_plan", CODE),
    ("04", "check_cumsum_rule", CODE),
    ("05", "check_bucket_sizes", lambda nb: [p for x in floats(expected_of(
        E.check_bucket_sizes, [1])) for p in number(x, "B")]),
    ("05", "check_zero_max_params", _zero_max_params),
    ("05", "check_zero3_traffic", _zero3_traffic),
    ("06", "check_tp_sp_layer_bytes", _tp_sp_bytes),
    ("06", "check_sp_f_g", CODE),
    ("06", "check_sp_max_microbatch", _sp_max_mb),
    ("06", "check_tp_mlp_plan", CODE),
    ("07", "check_hand_schedule", CODE),
    ("07", "check_min_microbatches", _min_microbatches),
    ("07", "check_zb_bubble", _zb_bubble),
    ("08", "check_hybrid_groups", _hybrid_groups),
    ("08", "check_hybrid_state_bytes", _hybrid_state),
    ("08", "check_best_layout", _best_layout),
    ("09", "check_online_softmax", CODE),
    ("09", "check_window_tiles", _window_tiles),
    ("10", "check_hidden_share", _hidden_share),
    ("10", "check_multi_copy_forward_ms", _multi_copy),
    ("10", "check_best_chunks", _best_chunks),
    ("11", "check_zero_states_gb", _zero_states),
    ("11", "check_least_recompute", _least_recompute),
    ("11", "check_biggest_micro_batch", _biggest_b),
    ("12", "check_fusion_us", _fusion),
    ("12", "check_top_op", _top_op),
    ("12", "check_idle_share", _idle),
    ("13", "check_ddp_bytes", _ddp_bytes),
    ("13", "check_like_one_device", CODE),
    ("14", "check_dropped_slots", _dropped_slots),
    ("14", "check_ep_tp_mb", _ep_tp_mb),
    ("14", "check_ring_kv_mb", _numbers_of(E.check_ring_kv_mb, -1.0, unit="MB")),
    ("14", "check_a2a_mb", _numbers_of(E.check_a2a_mb, -1.0, unit="MB")),
    ("15", "check_decode_floor_ms", _decode_floor),
    ("15", "check_load_reads", _list_of(E.check_load_reads, [0])),
    ("15", "check_static_useful_share", lambda nb: number(
        floats(expected_of(E.check_static_useful_share, -1.0))[0], percent=True)),
    ("16", "check_no_graph_break", CODE),
    ("16", "check_greedy_vs_whole_bytes", _compile_bytes),
    ("16", "check_sink_saving_us", _sink_saving),
    ("17", "check_mfu", _mfu),
    ("17", "check_tp_comm_ms", _tp_comm),
]

def _params():
    for stem, check, needles in EXERCISES:
        yield pytest.param(stem, check, needles, id=f"{stem}-{check}")


def test_every_check_in_the_course_is_listed():
    """A new exercise must come with its needles (or say that its answer is code)."""
    listed = {(s, c) for s, c, _ in EXERCISES}
    found = set()
    for path in NOTEBOOKS.glob("*.ipynb"):
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] == "code":
                for c in re.findall(r"wb\.exercises\.(check_\w+)\(", "".join(cell["source"])):
                    found.add((path.name[:2], c))
    assert found == listed


@pytest.mark.parametrize("stem, check, needles", list(_params()))
def test_answer_not_shown_before_its_check(stem, check, needles):
    if needles is CODE:
        pytest.skip("the answer is code the student writes")
    nb = _load(stem)
    index = _check_cell(nb, check)
    pats = needles(nb)
    if not pats:
        pytest.skip("no rendering of this answer to look for (see its needles function)")
    shown = [(i, m.group(0), text[max(0, m.start() - 60): m.end() + 60])
             for i, text in _outputs_above(nb, index) for p in pats
             for m in [re.search(p, text)] if m]
    assert not shown, (f"{stem} {check} (cell {index}): the answer shows above it: " +
                       "; ".join(f"cell {i}: {hit!r} in ...{ctx!r}..." for i, hit, ctx in shown))


def test_renderings_find_a_printed_answer():
    """The needles do find an answer where it is printed (so the test above can fail)."""
    assert any(re.search(p, "ZeRO-2: 16.64 GB") for p in number(16.64, "GB"))
    assert any(re.search(p, "selective 55.2 GB fits") for p in number(55.2, "GB", min_sig=2))
    assert any(re.search(p, "hidden 45.0%") for p in number(0.45, percent=True, min_sig=2))
    assert any(re.search(p, "37,504 B") for p in number(37504, "B"))
    assert not any(re.search(p, "16.641 GB and 116.64") for p in number(16.64))
    assert not any(re.search(p, "1.138") for p in number(0.138))
