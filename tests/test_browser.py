"""End to end in a real browser: JupyterLab on localhost, the explorer in a notebook, headless
Chromium (Debian's /usr/bin/chromium driven by Playwright), one slider moved.

Checks that the widget renders (no "Error displaying widget", a Plotly plot is drawn), that
moving the microbatches slider redraws the plot (more bars, new title) and that a refused setting
is shown as a message; and that the widget-free slider figure (exported HTML) switches states
with no kernel. Screenshots go to ``artifacts/browser/`` in the repository (git-ignored), with
the JupyterLab log and a screenshot on failure.

Set-up (see the report of issue 5): ``apt-get install -y chromium`` and
``pip install jupyterlab playwright``; never ``playwright install`` (the system Chromium is used).
Skipped, with the reason, only where Chromium, Playwright or JupyterLab is missing.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = REPO / "artifacts" / "browser"
CHROMIUM = os.environ.get("ZBPP_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
CELL = """\
import zbpp_lite as zb
from zbpp_lite.schedules.builders import register
from zbpp_lite.viz import Explorer

def at_most_10(num_ranks, num_microbatches):
    if num_microbatches > 10:
        raise ValueError(f"test-refusing takes at most 10 microbatches, got {num_microbatches}")
    return zb.build_schedule("1f1b", num_ranks, num_microbatches)

register("test-refusing", at_most_10)
ex = Explorer("zb-h1", num_ranks=4, num_microbatches=8)
ex"""
# JupyterLab asks whether to fetch news in a toast that covers the screenshots: say no.
SETTINGS = {"@jupyterlab/apputils-extension/notification.jupyterlab-settings": '{"fetchNews": "false"}'}


def _requirements() -> str | None:
    """Why the test cannot run here, or None."""
    if not (os.path.exists(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        return f"no Chromium at {CHROMIUM} (Debian: apt-get install -y chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Python Playwright is not installed (pip install playwright)"
    try:
        import jupyterlab  # noqa: F401
    except ImportError:
        return "JupyterLab is not installed (pip install jupyterlab)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_notebook(folder: Path) -> Path:
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(CELL)]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = folder / "explorer.ipynb"
    nbformat.write(nb, path)
    return path


def _start_lab(folder: Path, port: int, token: str) -> subprocess.Popen:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    for var, sub in (("JUPYTER_CONFIG_DIR", "config"), ("JUPYTER_RUNTIME_DIR", "runtime"), ("IPYTHONDIR", "ipython")):
        env[var] = str(folder / sub)
    cmd = [
        sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
        f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={folder}",
        "--ServerApp.port_retries=0", "--LabApp.expose_app_in_browser=True",
        f"--LabApp.user_settings_dir={folder / 'settings'}", f"--LabApp.workspaces_dir={folder / 'workspaces'}",
        "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        "--LabApp.extension_manager=readonly",
    ]  # fmt: skip
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # CI containers run as root
        cmd.append("--allow-root")
    for name, text in SETTINGS.items():
        target = folder / "settings" / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    with open(folder / "jupyterlab.log", "w") as log:  # the child keeps its own copy of the handle
        proc = subprocess.Popen(cmd, cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 40
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"JupyterLab exited: {(folder / 'jupyterlab.log').read_text()[-2000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={token}", timeout=2)
            return proc
        except OSError:
            time.sleep(0.3)
    proc.terminate()
    raise RuntimeError(f"JupyterLab did not answer on port {port} within 40 s")


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """A headless Chromium context (fresh profile), or a skip naming what is missing."""
    reason = _requirements()
    if reason:
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")),
            executable_path=CHROMIUM,
            args=CHROMIUM_ARGS,
            headless=True,
            viewport={"width": 1400, "height": 1300},
        )
        try:
            yield context
        finally:
            context.close()


def test_explorer_renders_and_redraws_in_jupyterlab_in_headless_chromium(browser, tmp_path):
    _write_notebook(tmp_path)
    port, token = _free_port(), secrets.token_hex(16)
    lab = _start_lab(tmp_path, port, token)
    page = browser.new_page()
    try:
        _drive(page, port, token)
    except Exception:
        page.screenshot(path=str(ARTIFACTS / "explorer_failure.png"), full_page=True)
        shutil.copy(tmp_path / "jupyterlab.log", ARTIFACTS / "jupyterlab.log")
        raise
    finally:
        page.close()
        lab.terminate()
        try:
            lab.wait(timeout=15)
        except subprocess.TimeoutExpired:
            lab.kill()


def test_static_slider_figure_moves_without_a_kernel(browser, tmp_path):
    """The widget-free figure (for GitHub, nbviewer, exported HTML) switches schedules in the page."""
    from zbpp_lite.viz import schedule_slider_figure

    path = tmp_path / "schedules.html"
    schedule_slider_figure(["1f1b", "zb-h1", "zb-h2"], 4, 8).write_html(path, include_plotlyjs=True)
    page = browser.new_page()
    page.goto(path.as_uri())
    title = page.locator(".js-plotly-plot .gtitle")
    title.wait_for()
    assert title.text_content().startswith("1f1b (simulated): makespan 33")  # 3(m + p - 1)
    rail = page.locator(".slider-rail-touch-rect").bounding_box()
    page.mouse.click(rail["x"] + rail["width"] - 5, rail["y"] + rail["height"] / 2)  # last step
    page.wait_for_function(
        "() => document.querySelector('.js-plotly-plot .gtitle').textContent.startsWith('zb-h2')"
    )
    # ZB-H2 with unit costs and m >= 2p - 1: no bubble, makespan 3m (paper section 3.1)
    assert title.text_content() == "zb-h2 (simulated): makespan 24, bubble rate 0.0%"
    page.screenshot(path=str(ARTIFACTS / "static_slider_last_step.png"), full_page=True)
    page.close()


def _drive(page, port: int, token: str) -> None:
    page.set_default_timeout(45_000)
    page.set_viewport_size({"width": 1400, "height": 1300})
    page.goto(f"http://127.0.0.1:{port}/lab/tree/explorer.ipynb?token={token}")
    page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
                           " && window.jupyterapp.shell.currentWidget.sessionContext")
    page.evaluate(
        """async () => {
            const panel = window.jupyterapp.shell.currentWidget;
            await panel.context.ready;
            await panel.sessionContext.ready;
            await window.jupyterapp.commands.execute('notebook:run-all-cells');
        }"""
    )
    plot = page.locator(".jp-OutputArea .js-plotly-plot").first
    plot.wait_for(state="visible")
    title = page.locator(".jp-OutputArea .js-plotly-plot .gtitle").first
    page.wait_for_function(
        "() => { const t = document.querySelector('.jp-OutputArea .js-plotly-plot .gtitle');"
        " return t && t.textContent.includes('makespan'); }"
    )
    before_title = title.text_content()
    bars = page.locator(".jp-OutputArea .js-plotly-plot").first.locator(".barlayer .point")
    before_bars = bars.count()
    page.screenshot(path=str(ARTIFACTS / "explorer_initial.png"), full_page=True)
    assert "Error displaying widget" not in page.content()
    assert "zb-h1 (simulated): makespan 27" in before_title  # unit costs: 3m + p - 1 with m = 8
    # ZB-H1, p = 4, m = 8: 96 actions (+ idle bars)
    assert before_bars >= 96

    # Move the microbatches slider with the keyboard: 8 -> 9, then -> 12.
    slider = page.locator(".widget-slider", has_text="microbatches m").locator(".noUi-handle")
    slider.focus()
    t0 = time.perf_counter()
    slider.press("ArrowRight")
    _wait_for_title(page, "makespan 30")  # m = 9: 3 * 9 + 3
    one_step_ms = (time.perf_counter() - t0) * 1e3
    for _ in range(3):
        slider.press("ArrowRight")
    _wait_for_title(page, "makespan 39")  # m = 12: 3 * 12 + 3
    page.wait_for_timeout(300)
    after_bars = bars.count()
    page.screenshot(path=str(ARTIFACTS / "explorer_after_slider.png"), full_page=True)
    assert after_bars >= 4 * 12 * 3 > before_bars
    assert "Error displaying widget" not in page.content()

    # A setting the schedule refuses is a message inside the widget, never a traceback.
    page.locator(".widget-dropdown select").first.select_option("test-refusing")
    error = page.locator(".zbpp-error").first
    error.wait_for(state="visible")
    _wait_for_title(page, "no schedule")
    page.screenshot(path=str(ARTIFACTS / "explorer_refused.png"), full_page=True)
    assert "takes at most 10 microbatches, got 12" in error.text_content()
    output = page.locator(".jp-OutputArea").first.text_content()
    assert "Traceback" not in output and "Error displaying widget" not in page.content()
    assert page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']").count() == 0
    (ARTIFACTS / "timings.txt").write_text(f"one slider key press -> new plot title drawn: {one_step_ms:.0f} ms\n")


def _wait_for_title(page, text: str) -> None:
    page.wait_for_function(
        "(text) => { const t = document.querySelector('.jp-OutputArea .js-plotly-plot .gtitle');"
        " return t && t.textContent.includes(text); }",
        arg=text,
    )
