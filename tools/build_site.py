"""Build the course as a static site: every notebook executed, its outputs kept, its Plotly figures
interactive, all offline.

    python tools/build_site.py              # all lessons into _site/ (git-ignored)
    python tools/build_site.py --only 01    # lessons whose file name starts with 01

Why nbconvert and not Jupyter Book 2 (mystmd): mystmd is a Node program installed from npm, and its
build fetches its site theme from the network; nbconvert and nbclient are pip packages already in
the test extra and need no network. Each lesson is read from its MyST source (jupytext), executed
in a fresh kernel from ``notebooks/`` (a failing assert fails the build), and exported with
nbconvert's "lab" template. Plotly figures are written as ``application/vnd.plotly.v1+json`` by the
kernel (``PLOTLY_RENDERER=plotly_mimetype``) and turned here into ``Plotly.newPlot`` calls; plotly.js
comes from the installed ``plotly`` package, written once as ``plotly.min.js`` beside the pages; the
lessons' committed SVG figures are copied into ``figures/`` beside them. The template's require.js
and MathJax (both fetched from a CDN) are left out, so no page asks the network for anything.
ipywidgets (the explorer) need a kernel: a page shows their text form instead; the notebooks draw
the same figures with plain Plotly sliders for such pages.

Layer: outside the package (a build tool; it imports zbpp_lite only through the notebooks).
"""

from __future__ import annotations

import argparse
import html
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"
PLOTLY_MIME = "application/vnd.plotly.v1+json"
_NO_SCRIPT = "about:blank#offline"


def _plotly_js() -> str:
    import plotly

    return (Path(plotly.__file__).parent / "package_data" / "plotly.min.js").read_text(encoding="utf-8")


def _figures_to_html(nb) -> int:
    """Replace every Plotly JSON output by an HTML div drawn with Plotly.newPlot; returns how many."""
    import plotly.io as pio

    count = 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if PLOTLY_MIME in data:
                spec = data[PLOTLY_MIME]
                fig = pio.from_json(json.dumps(spec), skip_invalid=True)
                div = pio.to_html(fig, include_plotlyjs=False, full_html=False, div_id=f"zbpp-figure-{count}")
                out["data"] = {"text/html": div, "text/plain": data.get("text/plain", "<Figure>")}
                count += 1
    return count


def execute(md: Path, timeout: int = 900):
    """The lesson read from its MyST source and run top to bottom in a fresh kernel (cwd notebooks/)."""
    import jupytext
    from nbclient import NotebookClient

    nb = jupytext.read(md)
    env = {"PLOTLY_RENDERER": "plotly_mimetype"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return nb


def _pre(text: str) -> str:
    """Text in a <pre> on one source line (newlines as character references), so that Markdown
    never ends the surrounding HTML block at a blank line."""
    return "<pre>" + html.escape(text).replace("\n", "&#10;") + "</pre>"


def _outputs_html(cell) -> str:
    """A code cell's outputs as one line of HTML: printed text and plain results in <pre>, HTML
    (a Plotly figure, after :func:`_figures_to_html`) as it is, PNG images inline."""
    parts = []
    for out in cell.get("outputs", []):
        kind = out.get("output_type")
        if kind == "stream":
            parts.append(_pre(out.get("text", "")))
        elif kind == "error":
            parts.append(_pre("\n".join(out.get("traceback", []))))
        else:
            data = out.get("data", {})
            if "text/html" in data:
                parts.append(data["text/html"].replace("\n", " "))
            elif "image/png" in data:
                parts.append(f'<img src="data:image/png;base64,{data["image/png"]}">')
            elif "text/plain" in data:
                parts.append(_pre(data["text/plain"]))
    return "".join(parts)


def _collapse_solutions(nb) -> int:
    """Each cell tagged ``hide-input`` (the Solutions) becomes one folded <details> element holding
    its code *and* its output, so a reader sees neither (the verdict a solution prints is the
    answer) until they open it; returns how many."""
    import nbformat

    cells, count = [], 0
    for cell in nb.cells:
        if cell.cell_type == "code" and "hide-input" in cell.metadata.get("tags", []):
            cells.append(nbformat.v4.new_markdown_cell(
                f'<details class="zbpp-solution"><summary>Our solution (click to show)</summary>{_pre(cell.source)}'
                f'<div class="zbpp-solution-output">{_outputs_html(cell)}</div></details>'))
            count += 1
            continue
        cells.append(cell)
    nb.cells = cells
    return count


def export(nb, title: str) -> str:
    """The executed notebook as one HTML page: figures drawn by ``plotly.min.js`` beside it, the
    solutions folded, no script from a CDN."""
    from nbconvert import HTMLExporter

    figures = _figures_to_html(nb)
    _collapse_solutions(nb)
    nb.metadata["title"] = title
    nb.metadata.pop("widgets", None)
    exporter = HTMLExporter(template_name="lab")
    exporter.require_js_url = _NO_SCRIPT
    exporter.mathjax_url = _NO_SCRIPT
    body, _ = exporter.from_notebook_node(nb)
    body = re.sub(r'<script src="' + re.escape(_NO_SCRIPT) + r'">\s*</script>', "", body)
    if figures:  # plotly.js sits beside the pages (written once by build), before any other script
        body = body.replace("<head>", '<head>\n<script src="plotly.min.js"></script>', 1)
    nav = '<p class="zbpp-nav"><a href="index.html">zbpp_lite course: all lessons</a></p>'
    return re.sub(r"(<body[^>]*>)", lambda m: m.group(1) + nav, body, count=1)


def copy_figures(out: Path) -> int:
    """Copy the lessons' committed figures (``notebooks/figures/*.svg``, shown by their markdown as
    ``figures/NN_name.svg``) into ``out/figures``, so the pages show them; returns how many."""
    (out / "figures").mkdir(parents=True, exist_ok=True)
    count = 0
    for svg in sorted((NOTEBOOKS / "figures").glob("*.svg")):
        shutil.copyfile(svg, out / "figures" / svg.name)
        count += 1
    return count


def _title(md: Path) -> str:
    for line in md.read_text(encoding="utf-8").splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return md.stem


def build(out: Path, only: str | None = None) -> dict[str, float]:
    """Build the lessons (those whose name starts with ``only``, or all) and the index into ``out``.

    Returns:
        Seconds spent on each lesson (execution and export).

    Raises:
        nbclient.exceptions.CellExecutionError: a cell failed (e.g. an assert), naming the cell.
    """
    out.mkdir(parents=True, exist_ok=True)
    (out / "plotly.min.js").write_text(_plotly_js(), encoding="utf-8")
    copy_figures(out)
    lessons = sorted(p for p in NOTEBOOKS.glob("*.md") if only is None or p.name.startswith(only))
    if not lessons:
        raise SystemExit(f"no lesson in {NOTEBOOKS} starts with {only!r}")
    seconds = {}
    for md in lessons:
        t0 = time.perf_counter()
        page = export(execute(md), _title(md))
        (out / f"{md.stem}.html").write_text(page, encoding="utf-8")
        seconds[md.stem] = time.perf_counter() - t0
        print(f"{md.stem}: {seconds[md.stem]:.0f} s", flush=True)
    items = "\n".join(
        f'<li><a href="{p.stem}.html">{html.escape(_title(p))}</a></li>'
        for p in sorted(NOTEBOOKS.glob("*.md")) if (out / f"{p.stem}.html").exists()
    )
    (out / "index.html").write_text(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>zbpp_lite: the course</title></head>\n"
        f"<body><h1>zbpp_lite: zero-bubble pipeline parallelism, the course</h1>\n<ol>\n{items}\n</ol>\n"
        "<p>Built offline from <code>notebooks/*.md</code> with every cell executed.</p></body></html>\n",
        encoding="utf-8",
    )
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "_site", help="output folder (default _site/)")
    parser.add_argument("--only", help="build only lessons whose file name starts with this, e.g. 01")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    build(args.out, args.only)
    print(f"site in {args.out} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
