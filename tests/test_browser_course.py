"""The course in a real browser: JupyterLab and headless Chromium, driven by Playwright.

JupyterLab serves the repository's notebooks; Chromium opens the pipeline notebook (07),
runs it (Run > Run All Cells), then moves the "micro-batches m" slider of the pipeline
explorer and checks that the live kernel redrew: the figure (its image's ``src``) and the
printed bubble fraction change to what the simulator gives for the new m, and the figure
was replaced in place (its image never left the page, so the page does not jump).  The
same for a placement picker (02).  In 00, a wrong exercise answer shows a short message,
not a traceback through the checker.  nbval cannot test this: without a front end,
widget callbacks never fire.

Needs Chromium from the system (``apt-get install chromium``; Playwright never downloads
one here) and the ``playwright`` Python package.  Where either is missing the test is
skipped with that message, unless ``WORKBENCH_REQUIRE_BROWSER=1`` (set by ``.ci/run``),
which turns the skip into a failure.

JupyterLab runs with its own temporary config, data, runtime, settings and workspace
directories, checkpoints in a temporary directory and autosave off (the stored notebook
is never written: checked), and is always shut down, kernels included.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
NOTEBOOK = "07_pipeline_parallel.ipynb"
JUPYTER = Path(sys.executable).with_name("jupyter")          # the venv's jupyter
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
REQUIRE = os.environ.get("WORKBENCH_REQUIRE_BROWSER") == "1"
TIMEOUT_S = 90                    # for Run All; the whole test takes about 30 s on 2 cores


def _unavailable(reason: str) -> None:
    if REQUIRE:
        pytest.fail(f"{reason} (WORKBENCH_REQUIRE_BROWSER=1 makes this a failure, not a skip)")
    pytest.skip(reason)


def _chromium() -> str:
    for path in ("/usr/bin/chromium", shutil.which("chromium"), shutil.which("chromium-browser")):
        if path and os.access(path, os.X_OK):
            return path
    _unavailable("no Chromium found (/usr/bin/chromium): install it with "
                 "`apt-get install chromium` to run the browser test of the course")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_settings(settings_dir: Path) -> None:
    """User settings for this JupyterLab only: no autosave, no news or update checks, every
    cell in the page (no virtual scrolling, so cell i is the i-th cell element)."""
    for plugin, values in {
        "@jupyterlab/docmanager-extension/plugin": {"autosave": False},
        "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
        "@jupyterlab/apputils-extension/notification": {"fetchNews": "false",
                                                        "checkForUpdates": False},
    }.items():
        path = settings_dir / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))


@pytest.fixture(scope="module")
def chromium():
    """The system Chromium's path, once Playwright's Python package is importable too."""
    path = _chromium()
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        _unavailable("the playwright Python package is missing: pip install playwright "
                     "(the browser itself comes from apt-get install chromium)")
    return path


@pytest.fixture(scope="module")
def lab(chromium, tmp_path_factory):
    """(base URL, token) of a JupyterLab serving notebooks/; shut down afterwards."""
    if not JUPYTER.exists():
        _unavailable(f"no jupyter next to {sys.executable}: install the course extras "
                     "(pip install 'workbench[course]')")
    tmp = tmp_path_factory.mktemp("jupyterlab")
    _write_settings(tmp / "settings")
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ, OMP_NUM_THREADS="1",
               JUPYTER_CONFIG_DIR=str(tmp / "config"), JUPYTER_DATA_DIR=str(tmp / "data"),
               JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
               JUPYTERLAB_SETTINGS_DIR=str(tmp / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp / "workspaces"))
    cmd = [str(JUPYTER), "lab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
           f"--IdentityProvider.token={token}", "--ServerApp.open_browser=False",
           f"--ServerApp.root_dir={NOTEBOOKS}", "--LabApp.expose_app_in_browser=True",
           # JupyterLab checkpoints a notebook when it opens it: keep that out of the repo
           f"--FileCheckpoints.checkpoint_dir={tmp / 'checkpoints'}"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")                  # containers and CI often run as root
    log = open(tmp / "jupyterlab.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)   # its own process group: kernels too
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"JupyterLab exited with {proc.returncode}:\n"
                                   + (tmp / "jupyterlab.log").read_text()[-3000:])
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("JupyterLab did not answer within 60 s:\n"
                                       + (tmp / "jupyterlab.log").read_text()[-3000:])
                time.sleep(0.2)
        yield base, token
    finally:
        _shutdown(proc)
        log.close()


def _shutdown(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (the server shuts its kernels down), then
    SIGKILL to whatever of the group is left.  The server is reaped only at the end, so
    that its pid, the group's id, cannot have been reused by another process."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and not _exited(proc):
        time.sleep(0.1)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


def _exited(proc: subprocess.Popen) -> bool:
    """Whether the server has exited, without reaping it (a zombie keeps its pid)."""
    if not hasattr(os, "waitid"):
        return proc.poll() is not None
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


KERNEL_READY = """() => {
    const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
    const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
    return Boolean(k && k.connectionStatus === 'connected' && k.status === 'idle');
}"""

RUN_STATE = """() => {
    const w = window.jupyterapp.shell.currentWidget;
    const cells = w.content.widgets.filter(c => c.model.type === 'code');
    const errors = [];
    for (const c of cells) {
        if ((c.model.getMetadata('tags') || []).includes('raises-exception')) continue;
        for (let i = 0; i < c.model.outputs.length; i++) {
            const o = c.model.outputs.get(i);
            if (o.type === 'error') {
                const v = o.toJSON();
                errors.push(`${v.ename}: ${v.evalue}`);
            }
        }
    }
    const done = cells.every(c => c.model.executionCount !== null)
                 && w.sessionContext.session.kernel.status === 'idle';
    const ran = cells.filter(c => c.model.executionCount !== null).length;
    return {done, errors, ran, total: cells.length};
}"""


def _run_all(page) -> None:
    """Run > Run All Cells, and wait until every code cell has run (or one failed that
    is not tagged raises-exception)."""
    page.wait_for_function(KERNEL_READY, timeout=60_000)
    # clear the stored execution counts first, so that "ran" means ran now
    page.evaluate("""() => window.jupyterapp.commands.execute('notebook:clear-all-cell-outputs')""")
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.locator("li[data-command='runmenu:run-all']").click()
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        state = page.evaluate(RUN_STATE)
        if state["errors"]:
            pytest.fail("a cell of the notebook failed in the browser: "
                        + "; ".join(state["errors"]))
        if state["done"]:
            return
        if time.monotonic() > deadline:
            if os.environ.get("WORKBENCH_BROWSER_SHOT"):
                page.screenshot(path=os.environ["WORKBENCH_BROWSER_SHOT"])
            pytest.fail(f"Run All did not finish within {TIMEOUT_S} s: {state['ran']} of "
                        f"{state['total']} code cells ran")
        time.sleep(0.5)


WATCH = """(el) => {
    el.__removed = 0;
    new MutationObserver(ms => ms.forEach(m => m.removedNodes.forEach(n => {
        if (n.nodeType === 1 && (n.matches('img') || n.querySelector('img')))
            el.__removed++;
    }))).observe(el, {childList: true, subtree: true});
}"""


def _watch_removals(widget) -> None:
    """Count, from now on, every image removed from ``widget``'s subtree (an emptied
    output; the text below the image is replaced in place, which is fine)."""
    widget.evaluate(WATCH)


def _removals(widget) -> int:
    return widget.evaluate("(el) => el.__removed")


def _open(browser, base, token, notebook):
    """A page with ``notebook`` open and current (``reset``: no tab restored from an
    earlier page's workspace, which Run All could otherwise reach first)."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(30_000)
    page.goto(f"{base}/lab/tree/{notebook}?reset&token={token}")
    page.wait_for_selector(".jp-Notebook .jp-Cell")
    page.wait_for_function("""(name) => {
        const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
        return Boolean(w && w.context && w.context.path.endsWith(name));
    }""", arg=notebook)
    return page


def _cell_index(notebook, text) -> int:
    cells = json.loads((NOTEBOOKS / notebook).read_text())["cells"]
    return next(i for i, c in enumerate(cells)
                if c["cell_type"] == "code" and text in "".join(c["source"]))


def _expected_caption(**controls) -> str:
    """What the explorer's printed line must say for these controls (the library decides)."""
    from workbench.parallel.schedules import SCHEDULES, simulate
    from workbench.viz.pipeline import bubble_caption
    sched = SCHEDULES[controls["schedule"]](controls["p"], controls["m"], controls["v"])
    return bubble_caption(simulate(sched, f=1.0, b=1.0, w=1.0))


def test_pipeline_widget_redraws_through_the_live_kernel(chromium, lab):
    from playwright.sync_api import expect, sync_playwright
    expect.set_options(timeout=30_000)      # a redraw is a kernel round trip; CI may be busy
    base, token = lab
    nb_path = NOTEBOOKS / NOTEBOOK
    before = hashlib.sha256(nb_path.read_bytes()).hexdigest()
    had_checkpoint = (NOTEBOOKS / ".ipynb_checkpoints").exists()
    cells = json.loads(nb_path.read_text())["cells"]
    widget_cell = next(i for i, c in enumerate(cells)
                       if c["cell_type"] == "code" and "pipeline_widget(" in "".join(c["source"]))

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(30_000)
            page.goto(f"{base}/lab/tree/{NOTEBOOK}?token={token}")
            page.wait_for_selector(".jp-Notebook .jp-Cell")
            _run_all(page)

            expect(page.locator(".jp-Notebook .jp-Cell")).to_have_count(len(cells))
            cell = page.locator(".jp-Notebook .jp-Cell").nth(widget_cell)
            explorer = cell.locator(".widget-vbox").first
            figure = explorer.locator("img.widget-image")
            printed = explorer.locator(".widget-html pre")
            expect(figure).to_have_count(1)
            _watch_removals(explorer)
            src0 = figure.get_attribute("src")
            assert src0.startswith("blob:")              # an image widget's PNG, in place
            defaults = dict(schedule="1F1B", p=4, m=8, v=2)
            expect(printed).to_have_text(_expected_caption(**defaults))

            # move the "micro-batches m" slider one step right: m = 8 -> 9
            slider = explorer.locator(".widget-slider", has_text="micro-batches m")
            handle = slider.locator(".noUi-handle")
            handle.focus()
            handle.press("ArrowRight")
            expect(slider.locator(".widget-readout")).to_have_text("9")
            after = _expected_caption(**dict(defaults, m=9))
            assert after != _expected_caption(**defaults)
            expect(printed).to_have_text(after)               # the kernel re-simulated
            expect(figure).not_to_have_attribute("src", src0)  # ... and redrew
            src1 = figure.get_attribute("src")

            # and the schedule dropdown: ZB-H1 at m = 9
            explorer.locator(".widget-dropdown select").select_option("ZB-H1")
            expect(printed).to_have_text(_expected_caption(**dict(defaults, m=9,
                                                                  schedule="ZB-H1")))
            expect(figure).not_to_have_attribute("src", src1)
            assert _removals(explorer) == 0, "the explorer emptied its output to redraw"
        finally:
            browser.close()
    assert hashlib.sha256(nb_path.read_bytes()).hexdigest() == before, \
        "the browser session wrote the stored notebook"
    assert not (NOTEBOOKS / ".ipynb_checkpoints" / NOTEBOOK.replace(".ipynb", "-checkpoint.ipynb")
                ).exists() or had_checkpoint, "the browser session left a checkpoint in notebooks/"


def test_wrong_answer_and_placement_picker_in_the_browser(chromium, lab):
    """00: the on-purpose wrong answer shows a short message (no traceback through the
    checker's source).  02: changing a placement picker's dropdown redraws its figure in
    place and prints the new notation."""
    from playwright.sync_api import expect, sync_playwright
    expect.set_options(timeout=30_000)
    base, token = lab
    stored = {n: hashlib.sha256((NOTEBOOKS / n).read_bytes()).hexdigest()
              for n in ("00_welcome.ipynb", "02_meshes_and_placements.ipynb")}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
        try:
            page = _open(browser, base, token, "00_welcome.ipynb")
            _run_all(page)
            cell = page.locator(".jp-Notebook .jp-Cell").nth(
                _cell_index("00_welcome.ipynb", "check_tp_group((1, 5))"))
            error = cell.locator(".jp-OutputArea-output")
            expect(error).to_contain_text("Not yet:")
            text = error.inner_text().strip()
            assert len(text.splitlines()) <= 3, text             # the message, not a traceback
            assert "Traceback" not in text and "checks.py" not in text and "raise " not in text
            assert "dp group" in text and "(4, 5, 6, 7)" not in text   # a hint, not the answer
            page.evaluate("() => window.jupyterapp.commands.execute('application:close-all')")
            page.close()

            page = _open(browser, base, token, "02_meshes_and_placements.ipynb")
            _run_all(page)
            cell = page.locator(".jp-Notebook .jp-Cell").nth(
                _cell_index("02_meshes_and_placements.ipynb", "placement_picker("))
            picker = cell.locator(".widget-vbox").first
            figure = picker.locator("img.widget-image")
            printed = picker.locator(".widget-html pre")
            expect(printed).to_have_text("f32[I_x, J_y]")
            src0 = figure.get_attribute("src")
            _watch_removals(picker)
            picker.locator(".widget-dropdown select").nth(1).select_option("R")
            expect(printed).to_have_text("f32[I_x, J]")
            expect(figure).not_to_have_attribute("src", src0)
            assert _removals(picker) == 0, "the picker emptied its output to redraw"
        finally:
            browser.close()
    for n, digest in stored.items():
        assert hashlib.sha256((NOTEBOOKS / n).read_bytes()).hexdigest() == digest, n
