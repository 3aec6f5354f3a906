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
    assert "XLA_FLAGS" in nb.cells[1].source and "google.colab" in nb.cells[1].source
    assert any(line.lstrip().startswith("assert ") for c in code(nb) for line in c.splitlines())
