"""The course's committed figures (``notebooks/figures/NN_name.svg``, drawn by ``tools/make_figures.py``)
still show what the package draws, and the lessons show them.

Each SVG carries the fingerprint of the Plotly figure it was exported from; here every figure is rebuilt
with the package (no browser, no JAX: a few seconds) and its fingerprint compared. A change to a
schedule, the simulator or a figure function that alters a committed picture fails here, naming the
file and the command that draws it again.
"""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

import zbpp_lite as zb
from zbpp_lite.schedules import strict_json

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"
REQUIRE_EVERY_LESSON = True
"""True: every lesson ``notebooks/NN_*.md`` must show a figure ``figures/NN_*.svg`` (set at the merge of
the lessons that add the references; until then the lessons without one are listed, as a skip)."""
FIGURE_LINK = re.compile(r"!\[[^\]]+\]\((figures/[^)\s]+)\)")
MAX_BYTES = 200 * 1024


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make = _tool("make_figures")


@pytest.mark.parametrize("name", list(make.SPECS))
def test_committed_figure_is_what_the_package_draws(name):
    assert make.problem(name) is None


def test_a_changed_cost_makes_the_headline_stale(monkeypatch):
    simulate = make._sim
    monkeypatch.setattr(make, "_sim", lambda name, p, m, costs=None, **options: simulate(
        name, p, m, replace(costs or zb.Costs(), w=0.9), **options))      # T_W 0.9 instead of 1
    message = make.problem("01_headline")
    assert message.startswith("notebooks/figures/01_headline.svg is stale")
    assert "python tools/make_figures.py 01" in message
    assert make.problem("08_transfers").startswith("notebooks/figures/08_transfers.svg is stale")
    assert make.problem("09_lockstep") is None                           # simulated with its own costs


def test_a_changed_measured_run_makes_figure_06_stale(monkeypatch, tmp_path):
    run = json.loads(make.MEASURED.read_text(encoding="utf-8"))
    run["trace"][-1]["end"] += 1e-4                                      # the last action 0.1 ms longer
    changed = tmp_path / make.MEASURED.name
    strict_json.write(changed, run)
    monkeypatch.setattr(make, "MEASURED", changed)
    assert make.problem("06_planned_measured").startswith("notebooks/figures/06_planned_measured.svg is stale")


def test_a_missing_figure_is_named_with_the_command(monkeypatch, tmp_path):
    monkeypatch.setattr(make, "FIGURES", tmp_path)
    message = make.problem("03_zb_h2")
    assert "03_zb_h2.svg is missing" in message and "python tools/make_figures.py 03" in message


def test_figure_06_plans_with_the_recorded_runs_costs():
    """The plan drawn beside the measured timeline is the one the run itself simulated (ms vs s)."""
    schedule, measured, run = make.load_measured()
    planned = make.build("06_planned_measured").layout.annotations[0].text
    assert measured.makespan == pytest.approx(1e3 * run["measured"]["makespan"], rel=1e-9)
    assert f"makespan {1e3 * run['simulated']['makespan']:.4g}" in planned
    assert schedule.name == "zb-h2" and run["config"]["processes"] == "one per rank, pinned"


def test_every_figure_file_is_drawn_by_the_script_and_small():
    files = sorted(p.stem for p in (NOTEBOOKS / "figures").glob("*.svg"))
    assert files == sorted(make.SPECS)
    big = {p.name: p.stat().st_size for p in (NOTEBOOKS / "figures").glob("*.svg") if p.stat().st_size > MAX_BYTES}
    assert big == {}


def _lessons() -> dict[str, list[str]]:
    return {md.name: FIGURE_LINK.findall(md.read_text(encoding="utf-8"))
            for md in sorted(NOTEBOOKS.glob("[0-9][0-9]_*.md"))}


def test_figures_the_lessons_show_exist():
    broken = {lesson: link for lesson, links in _lessons().items() for link in links
              if not (NOTEBOOKS / link).is_file()}
    assert broken == {}


def test_every_lesson_shows_its_own_figure():
    missing = [lesson for lesson, links in _lessons().items()
               if not any(Path(link).name.startswith(lesson[:3]) and link.endswith(".svg") for link in links)]
    if missing and not REQUIRE_EVERY_LESSON:
        pytest.skip(f"lessons without their figure yet (REQUIRE_EVERY_LESSON is off): {', '.join(missing)}")
    assert missing == []


def test_the_site_copies_the_figures_beside_the_pages(tmp_path):
    import nbformat

    site = _tool("build_site")
    assert site.copy_figures(tmp_path) == len(make.SPECS)
    assert (tmp_path / "figures" / "01_headline.svg").read_bytes() == (
        NOTEBOOKS / "figures" / "01_headline.svg").read_bytes()
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(
        "![1F1B, ZB-H1 and ZB-H2 on one time axis](figures/01_headline.svg)")])
    page = site.export(nb, "figure")
    assert 'src="figures/01_headline.svg"' in page
