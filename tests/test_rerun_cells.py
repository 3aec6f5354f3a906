"""The second pass over every lesson's cells (the repository's root ``conftest.py``) finds a cell
that fails when run again, and replays the live runs it names instead of running them twice.

A small notebook runs under nbval in a child pytest with a copy of that conftest: one of its cells
makes a file that must not exist yet (so its second run fails), two call a "live run" (a function
of a module named in ``REPLAYED``, here one that counts its calls in a file).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).parent.parent


def _notebook(path: Path, *sources: str) -> None:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)


@pytest.mark.slow
def test_the_second_pass_fails_a_cell_that_breaks_when_run_again_and_replays_live_runs(tmp_path):
    conftest = (ROOT / "conftest.py").read_text()
    (tmp_path / "conftest.py").write_text(conftest + '\nREPLAYED = {"slow_run": "train"}\n')
    (tmp_path / "slow_run.py").write_text(
        "from pathlib import Path\n"
        "def train(steps):\n"
        "    with open(Path(__file__).with_name('calls.txt'), 'a') as f:\n"
        "        f.write(f'{steps}\\n')\n"
        "    return {'steps': steps}\n"
    )
    _notebook(tmp_path / "lesson.ipynb", "import sys; sys.path.insert(0, '.')", "open('made.txt', 'x').close()",
              "from slow_run import train\nresult = train(steps=3)\nassert result == {'steps': 3}",
              "other = train(steps=4)")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax", "-rf",
                           "lesson.ipynb"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    summary = out.split("short test summary")[-1]
    assert "1 failed" in out and "lesson.ipynb::Cell 1 again" in summary and "FileExistsError" in out, out
    assert (tmp_path / "calls.txt").read_text().split() == ["3", "4"], "a live run ran again in the second pass"
