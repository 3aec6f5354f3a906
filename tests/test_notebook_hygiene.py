"""The course's notebooks: each .ipynb is paired with its MyST .md source (jupytext), stores no
outputs, opens with a title, what the reader will learn and the Colab / Binder badges, has a set-up
cell, and checks its claims with assert cells. (nbval runs them: see pyproject's addopts.)"""

from __future__ import annotations

from pathlib import Path

import jupytext
import nbformat
import pytest

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 5


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_paired_clean_and_checks_its_claims(path):
    nb = nbformat.read(path, as_version=4)
    md = path.with_suffix(".md")
    assert md.exists(), f"{path.name} has no MyST source {md.name} (jupytext --to myst)"
    source = jupytext.read(md)
    code = lambda n: [c.source.strip() for c in n.cells if c.cell_type == "code"]  # noqa: E731
    assert code(nb) == code(source), f"{path.name} differs from {md.name}: run jupytext --sync"
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "stored outputs"
    first = nb.cells[0]
    assert first.cell_type == "markdown" and first.source.startswith("# ")
    assert "colab.research.google.com" in first.source and "mybinder.org" in first.source
    assert "What you will learn" in first.source
    assert "docs/GLOSSARY.md" in first.source, "every lesson links to the glossary"
    assert "XLA_FLAGS" in nb.cells[1].source and "google.colab" in nb.cells[1].source
    assert any(line.lstrip().startswith("assert ") for c in code(nb) for line in c.splitlines())


def test_jupytext_pairing_is_declared_and_syncs_both_ways(tmp_path):
    """jupytext.toml pairs notebooks/*.ipynb with notebooks/*.md: ``jupytext --sync`` carries an
    edit made in the .md to the .ipynb, and one made in the .ipynb (JupyterLab, Colab) to the .md."""
    import os
    import shutil
    import subprocess
    import sys
    import time

    repo = Path(__file__).parent.parent
    shutil.copy(repo / "jupytext.toml", tmp_path / "jupytext.toml")
    (tmp_path / "notebooks").mkdir()
    md, ipynb = tmp_path / "notebooks" / "lesson.md", tmp_path / "notebooks" / "lesson.ipynb"
    shutil.copy(repo / "notebooks" / "01_pipeline_bubbles.md", md)
    shutil.copy(repo / "notebooks" / "01_pipeline_bubbles.ipynb", ipynb)
    env = {**os.environ, "JUPYTEXT_CEILING_DIRECTORIES": str(tmp_path.parent)}

    def sync(path: Path) -> str:
        done = subprocess.run([sys.executable, "-m", "jupytext", "--sync", str(path)], capture_output=True, text=True, env=env, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        return done.stdout + done.stderr

    assert "not a paired notebook" not in sync(md)
    # an edit in the Markdown source reaches the notebook
    md.write_text(md.read_text().replace("p, m = 4, 8", "p, m = 4, 9"))
    os.utime(md, (time.time() + 5, time.time() + 5))
    sync(md)
    assert any("p, m = 4, 9" in c.source for c in nbformat.read(ipynb, as_version=4).cells)
    # an edit in the notebook (as JupyterLab or Colab saves it) reaches the Markdown source
    nb = nbformat.read(ipynb, as_version=4)
    for cell in nb.cells:
        cell.source = cell.source.replace("p, m = 4, 9", "p, m = 4, 7")
    nbformat.write(nb, ipynb)
    os.utime(ipynb, (time.time() + 10, time.time() + 10))
    sync(ipynb)
    assert "p, m = 4, 7" in md.read_text() and "p, m = 4, 9" not in md.read_text()
    # other Markdown files (the README) are not paired
    (tmp_path / "README.md").write_text("# readme\n")
    assert "not a paired notebook" in sync(tmp_path / "README.md")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_lesson_has_exercises_with_checks_and_hidden_solutions(path):
    """Each lesson has at least two exercises, whose checks the learner calls with ``...`` to
    replace (an ``answer_... = ...`` line, the body of a function the check calls at several points,
    or, where the learner writes code, a function body ``...``), and at least one to predict first,
    whose reveal cell draws the simulation only once answered; the Solutions section runs each check
    with our answer, collapsed, and asserts it said right."""
    import re

    from zbpp_lite.course import EXERCISES

    nb = nbformat.read(path, as_version=4)
    lesson = str(int(path.name[:2]))
    ours = {k: f.__name__ for k, f in EXERCISES.items() if k.split(".")[0] == lesson}
    assert len(ours) >= 2
    headings = [line for c in nb.cells if c.cell_type == "markdown" for line in c.source.splitlines() if line.startswith("## ")]
    assert "## Exercises" in headings and "## Solutions" in headings
    solutions_at = next(i for i, c in enumerate(nb.cells) if c.cell_type == "markdown" and "## Solutions" in c.source.splitlines())
    for key, name in ours.items():
        asked = [c for c in nb.cells[:solutions_at] if c.cell_type == "code" and f"ex.{name}(" in c.source]
        placeholder = r"^(answer_\w+ = \.\.\.|\s+return \.\.\.|\s+\.\.\.)(\s*#.*)?$"
        assert len(asked) == 1 and re.search(placeholder, asked[0].source, re.M), f"exercise {key} ({name})"
        solved = [c for c in nb.cells[solutions_at:] if c.cell_type == "code" and f"ex.{name}(" in c.source]
        assert len(solved) == 1, f"no solution cell for exercise {key}"
        cell = solved[0]
        assert cell.metadata.get("jupyter", {}).get("source_hidden") is True and "hide-input" in cell.metadata.get("tags", [])
        assert "assert verdict" in cell.source
    predicted = [line for c in nb.cells[:solutions_at] if c.cell_type == "markdown" for line in c.source.splitlines()
                 if "(predict first)" in line]
    reveals = [c for c in nb.cells[:solutions_at] if c.cell_type == "code" and "ex.reveal(" in c.source]
    assert predicted and len(reveals) >= 1, "no exercise to predict first, with its reveal cell"


def test_the_site_folds_a_solutions_code_and_output_together():
    """tools/build_site.py: a solution cell's printed verdict is the answer, so on the built page
    it sits inside the folded <details> with the code, and nowhere outside it."""
    import importlib.util

    import nbformat

    spec = importlib.util.spec_from_file_location("build_site", Path(__file__).parent.parent / "tools" / "build_site.py")
    site = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(site)
    nb = nbformat.v4.new_notebook()
    solution = nbformat.v4.new_code_cell("print(ex.check(42))", metadata={"tags": ["hide-input"]})
    solution.outputs = [nbformat.v4.new_output("stream", text="Exercise 9.9: right. The answer is 42.\n")]
    shown = nbformat.v4.new_code_cell("1 + 1")
    shown.outputs = [nbformat.v4.new_output("execute_result", data={"text/plain": "2"}, execution_count=1)]
    nb.cells = [nbformat.v4.new_markdown_cell("**Exercise 9.9.**"), shown, solution]
    assert site._collapse_solutions(nb) == 1
    page = site.export(nb, "test")
    before, folded = page.split('<details class="zbpp-solution">')
    assert "The answer is 42" not in before and "print(ex.check(42))" not in before
    inside = folded.split("</details>")[0]
    assert "The answer is 42" in inside and "print(ex.check(42))" in inside


def test_the_glossary_defines_the_terms_the_lessons_use():
    glossary = (Path(__file__).parent.parent / "docs" / "GLOSSARY.md").read_text(encoding="utf-8")
    for term in ("**makespan**", "**bubble rate**", "**M_B**", "**M_W**", "**T_comm**", "**placement**",
                 "busiest", "**SPMD, MPMD**", "**post-validation**"):
        assert term in glossary, term


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_wrapped_prose_line_opens_a_list_by_accident(path):
    """Markdown reads a line starting "- ", "+ ", "* " or "1. " as a list item even inside a paragraph, so
    a sentence wrapped before "- 1" or "+ 1)" turns into a bullet. A list item may only follow a blank
    line, another item (or its indented continuation), or a line ending in a colon."""
    import re

    item = re.compile(r"^(- |\+ |\* |\d+\. )")
    lines, code, stray = path.with_suffix(".md").read_text(encoding="utf-8").split("\n"), False, []
    for i, line in enumerate(lines):
        if line.startswith("```"):
            code = not code
            continue
        before = lines[i - 1] if i else ""
        if not code and item.match(line) and before.strip() and not (
                item.match(before) or before.startswith("  ") or before.rstrip().endswith(":")):
            stray.append(f"line {i + 1}: {line[:40]!r} after {before[-40:]!r}")
    assert not stray, f"{path.with_suffix('.md').name}: a wrapped line starts a list: {stray}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_two_blank_lines_in_a_row(path):
    """Two blank lines in a row, in prose or between cells, read as a section taken out and not closed
    up (a reader asked what was removed from lesson 6)."""
    lines = path.with_suffix(".md").read_text(encoding="utf-8").split("\n")
    doubled = [i + 1 for i in range(1, len(lines)) if not lines[i].strip() and not lines[i - 1].strip()]
    assert not doubled, f"{path.with_suffix('.md').name}: two blank lines at {doubled}"


def test_the_course_stays_within_its_word_budget():
    """Issue 40's budget, counted as `wc -w notebooks/*.md` counts (whitespace-separated words, code and
    Solutions included): no lesson over 4,000 words, the course at most 24,000."""
    words = {p.name: len(p.with_suffix(".md").read_text(encoding="utf-8").split()) for p in NOTEBOOKS}
    assert max(words.values()) <= 4000 and sum(words.values()) <= 24000, words
