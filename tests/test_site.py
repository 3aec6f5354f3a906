"""The built course site: lesson 3, executed and exported by ``tools/build_site.py``, opened in
headless Chromium with every network request refused, shows its Plotly figures drawn. (Lesson 3: the
build runs the lesson again after nbval has, and lesson 3 runs in 10 s where lesson 1's live run takes 60.)

The lesson is built here into a temporary folder (about 10 s on 2 cores), or taken from
``$ZBPP_SITE`` when that folder already holds a build (``python tools/build_site.py`` writes
``_site/``). Skipped, with the reason, where Chromium or Playwright is missing (see
tests/test_browser.py for the set-up).
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest

from test_browser import ARTIFACTS, REPO, _requirements, browser  # noqa: F401  (the fixture)

pytestmark = [pytest.mark.browser, pytest.mark.slow]
LESSON = "03_handcrafted_zero_bubble"


def _build_site():
    spec = importlib.util.spec_from_file_location("build_site", REPO / "tools" / "build_site.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    reason = _requirements()
    if reason:
        pytest.skip(reason)
    given = os.environ.get("ZBPP_SITE")
    if given and (Path(given) / f"{LESSON}.html").exists():
        return Path(given)
    out = tmp_path_factory.mktemp("site")
    _build_site().build(out, only=LESSON[:2])
    return out


def test_the_lesson_page_is_self_contained(site):
    page = (site / f"{LESSON}.html").read_text(encoding="utf-8")
    assert re.findall(r"<script[^>]*\ssrc=\"https?://", page) == []          # no CDN script
    assert page.count("Plotly.newPlot(") >= 2 and '<script src="plotly.min.js">' in page
    assert "Traceback" not in page and "Exercise 3.1: right." in page        # executed, solutions checked
    assert page.count('<details class="zbpp-solution">') == 3                # and folded, output too
    assert all("Exercise 3." in part.split("</details>")[0] for part in page.split('<details class="zbpp-solution">')[1:])
    assert (site / "plotly.min.js").stat().st_size > 1_000_000
    assert f'href="{LESSON}.html"' in (site / "index.html").read_text(encoding="utf-8")


def test_the_lesson_draws_its_plotly_figures_offline_in_chromium(site, browser):  # noqa: F811
    page = browser.new_page()
    asked = []

    def refuse(route):
        asked.append((route.request.resource_type, route.request.url))
        route.abort()

    page.route(re.compile(r"^https?://"), refuse)                                # offline: nothing gets out
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        page.goto((site / f"{LESSON}.html").as_uri())
        page.wait_for_function("() => document.querySelectorAll('.js-plotly-plot .main-svg').length >= 2", timeout=30_000)
        drawn = page.locator(".js-plotly-plot").count()
        title = page.locator(".js-plotly-plot .gtitle").first.text_content()
        bars = page.locator(".js-plotly-plot").first.locator(".barlayer .point").count()
        page.screenshot(path=str(ARTIFACTS / "site_lesson_3.png"))
    finally:
        page.close()
    assert drawn >= 2 and bars >= 4 * 8 * 3          # ZB-H2's timeline: 4 ranks x 8 microbatches x (F, B, W)
    assert title.startswith("ZB-H2")
    # only the Colab and Binder badge images point at the web; no script or stylesheet does
    assert [url for kind, url in asked if kind != "image"] == [] and errors == []
