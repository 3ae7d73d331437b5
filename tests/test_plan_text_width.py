"""The planner's printed text fits a JupyterLab output (``plan.text_width``): every line of
``Ranking.table``, ``Ranking.explain``, ``str(Ranking)`` and ``Estimate.explain`` at most
100 characters, one table row per layout with each of its numbers, and the wrapped text
holding the same words as the unwrapped one.  Before: table rows of 115-123 characters,
explain lines of 150 and more (the assumptions' line: over 1,500)."""
import importlib

import pytest

from workbench.models.config import get_config as model_config
from workbench.plan import Cluster, search
from workbench.plan.presets import get_config
from workbench.plan.search import _RC, _SCHED, TIE, _cp
from workbench.plan.text_width import WIDTH, wrap

# the modules (``workbench.plan`` binds the names ``search`` and ``estimate`` to functions)
search_mod = importlib.import_module("workbench.plan.search")
estimate_mod = importlib.import_module("workbench.plan.estimate")

# (model, profile, devices, global batch): interleaved pipelines on 910Bs, ep and cp
# columns (Mixtral), dp = 1 with ZeRO 2 (the note under the table), a dense Llama
CASES = [(model_config("gpt3-175b"), "ascend-910b", 1024, 1536),
         (get_config("mixtral-8x7b"), "h100", 64, 256),
         (model_config("llama2-7b"), "a100", 8, 7),
         (model_config("gpt-22b"), "a100", 64, 64)]


@pytest.fixture(scope="module", params=range(len(CASES)),
                ids=["gpt3-910b", "mixtral-h100", "llama2-7b-dp1", "gpt22b-a100"])
def ranking(request):
    cfg, prof, n, gb = CASES[request.param]
    return search(cfg, Cluster(prof, n), global_batch=gb, top=4)


def _unwrapped(monkeypatch, make):
    """``make()`` as it prints without wrapping (the words the wrapped text must hold)."""
    with monkeypatch.context() as m:
        m.setattr(search_mod, "wrap", lambda text: text)
        m.setattr(estimate_mod, "wrap", lambda text: text)
        return make()


def _longest(text):
    return max(len(line) for line in text.splitlines())


def test_every_line_fits(ranking):
    assert len(ranking) == 4
    for text in (ranking.table(), str(ranking), *ranking.explain(),
                 *(e.explain() for _, e in ranking)):
        assert _longest(text) <= WIDTH, text


def test_the_table_keeps_a_row_per_layout_and_every_number(ranking):
    lines = ranking.table().splitlines()
    xc = any(lay.ep > 1 or lay.cp > 1 for lay, _ in ranking)
    head = lines[0].split()
    assert head[:4] == ["#", "dp", "tp", "pp"] and (head[4:6] == ["ep", "cp"]) == xc
    for i, (lay, e) in enumerate(ranking, 1):
        b = e.breakdown
        want = ([str(i), str(lay.dp), str(lay.tp), str(lay.pp)]
                + ([str(lay.ep), _cp(lay)] if xc else [])
                + [_SCHED[lay.schedule], str(lay.v), "yes" if lay.sp else "no", str(lay.zero),
                   _RC.get(lay.recompute, lay.recompute), str(lay.micro_batch),
                   f"{e.step_time:.3f}", f"{e.tflops_per_device:.1f}", f"{e.mfu:.1%}",
                   f"{e.memory['total'] / 1e9:.1f}", f"{b['compute']:.3f}",
                   f"{b['communication']:.3f}", f"{b['bubble']:.3f}"])
        assert lines[i].split() == want and len(want) == len(head)
    legend = " ".join(lines[len(ranking) + 1:])
    for full, short in (*_SCHED.items(), *_RC.items()):
        if full != short:
            assert f"{short}: {full}" in legend
    assert "seconds per step" in legend and "busiest rank" in legend


def test_wrapping_loses_no_word(ranking, monkeypatch):
    flat = _unwrapped(monkeypatch, lambda: [str(ranking), *ranking.explain(),
                                            *(e.explain() for _, e in ranking)])
    got = [str(ranking), *ranking.explain(), *(e.explain() for _, e in ranking)]
    assert any(_longest(t) > WIDTH for t in flat)       # the lines this test is about
    for was, now in zip(flat, got):
        assert now.split() == was.split()


def test_a_tie_still_reads_as_a_tie(ranking):
    """One entry per pair, its first line naming the pair and the verdict whole."""
    why = ranking.explain()
    assert len(why) == len(ranking) - 1
    for i, text in enumerate(why):
        ea, eb = ranking[i][1], ranking[i + 1][1]
        gap = eb.step_time - ea.step_time
        first = text.splitlines()[0]
        if gap < TIE * eb.step_time:
            assert first.startswith(f"#{i + 1} and #{i + 2} tie"), text
        else:
            assert first.startswith(f"#{i + 1} beats #{i + 2} by {gap:.3f} s/step"), text
        assert all(line.startswith("    ") for line in text.splitlines()[1:])


def test_wrap_keeps_a_figure_beside_its_name_and_indents_continuations():
    line = "  " + "word " * 17 + "bubble 0.109 s, tp 2 -> 1, changes from #4: micro_batch 2 -> 4"
    out = wrap(line).splitlines()
    assert len(out) > 1 and all(len(x) <= WIDTH for x in out)
    assert out[0].startswith("  word") and all(x.startswith(" " * 6) for x in out[1:])
    assert " ".join(out).split() == line.split()
    joined = [x.strip() for x in out]
    for unit in ("bubble 0.109 s,", "tp 2 -> 1,", "#4:", "micro_batch 2 -> 4"):
        assert any(unit in x for x in joined), (unit, out)
    short = "a line of 100 characters or fewer stays as it is"
    assert wrap(short) == short and wrap(line) == wrap(wrap(line))


def test_none_fits_says_so_within_the_width(monkeypatch):
    r = search(model_config("gpt3-175b"), Cluster("a100", 8), global_batch=8, top=3)
    assert not r and r.least is not None
    text = str(r)
    flat = _unwrapped(monkeypatch, lambda: str(r))
    assert _longest(flat) > WIDTH >= _longest(text) and text.split() == flat.split()
    assert f"{r.least[0] / 1e9:.1f} GB on the busiest rank" in " ".join(text.split())


def test_cluster_names_one_node_in_the_singular():
    """'8 x a100 (1 nodes of 8, ...)' read wrong (left by tablewidth)."""
    from workbench.plan.layout import Cluster
    assert str(Cluster("a100", 8)) == "8 x a100 (1 node of 8, 85.1 GB each)"
    assert str(Cluster("a100", 16)).startswith("16 x a100 (2 nodes of 8,")
