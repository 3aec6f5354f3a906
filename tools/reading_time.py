"""Print each lesson's reading time and the course's total.

Minutes = prose words / 120 + non-blank code lines / 5 + 2 per figure. Prose is the markdown
outside code cells (the jupytext header and image lines left out); a figure is an image
reference, `![alt](path)`; code is every code cell's non-blank lines except the solutions, which
the lessons tag `hide-input`. Run: `python tools/reading_time.py [notebooks/NN_*.md ...]`.
"""

import re
import sys
from pathlib import Path

FIGURE = re.compile(r"!\[[^\]]*\]\([^)]*\)")


def split_cells(text: str) -> tuple[list[str], list[list[str]]]:
    """Return (markdown lines, code-cell bodies shown to the reader) of a MyST notebook."""
    if text.startswith("---\n"):
        text = text.split("\n---\n", 1)[1]
    lines, prose, code, i = text.split("\n"), [], [], 0
    while i < len(lines):
        if not lines[i].startswith("```{code-cell}"):
            prose.append(lines[i])
            i += 1
            continue
        i, meta, body = i + 1, [], []
        if lines[i] == "---":
            i += 1
            while lines[i] != "---":
                meta.append(lines[i])
                i += 1
            i += 1
        while not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        if not any("hide-input" in m for m in meta):
            code.append(body)
        i += 1
    return prose, code


def measure(path: Path) -> tuple[int, int, int, float]:
    """(prose words, code lines, figures, minutes) of one lesson."""
    prose, code = split_cells(path.read_text())
    figures = sum(len(FIGURE.findall(line)) for line in prose if line.lstrip().startswith("!["))
    words = sum(len(line.split()) for line in prose if not line.lstrip().startswith("!["))
    lines = sum(1 for body in code for line in body if line.strip())
    return words, lines, figures, words / 120 + lines / 5 + 2 * figures


if __name__ == "__main__":
    paths = [Path(a) for a in sys.argv[1:]] or sorted(Path("notebooks").glob("[0-9][0-9]_*.md"))
    total = 0.0
    print(f"{'lesson':32} {'words':>6} {'code':>5} {'figs':>4} {'min':>6}")
    for path in paths:
        words, lines, figures, minutes = measure(path)
        total += minutes
        print(f"{path.name:32} {words:6d} {lines:5d} {figures:4d} {minutes:6.1f}")
    print(f"{'total':32} {'':6} {'':5} {'':4} {total:6.1f}")
