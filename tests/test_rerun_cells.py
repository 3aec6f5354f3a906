"""The second pass over every lesson's cells (the repository's root ``conftest.py``) finds a cell
that fails when run again, and replays the live runs it names instead of running them twice.

Two small notebooks run under nbval in a child pytest with a copy of that conftest: one whose first
cell makes a file that must not exist yet (so its second run fails), one whose cell calls a "live
run" (a function of a module named in ``REPLAYED``, here one that counts its calls in a file).
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
    assert 'REPLAYED = {"zbpp_lite.training.adapt": "adapt"}' in conftest
    (tmp_path / "conftest.py").write_text(conftest.replace('REPLAYED = {"zbpp_lite.training.adapt": "adapt"}',
                                                           'REPLAYED = {"slow_run": "train"}'))
    (tmp_path / "slow_run.py").write_text(
        "from pathlib import Path\n"
        "def train(steps):\n"
        "    with open(Path(__file__).with_name('calls.txt'), 'a') as f:\n"
        "        f.write(f'{steps}\\n')\n"
        "    return {'steps': steps}\n"
    )
    _notebook(tmp_path / "a_once.ipynb", "open('made.txt', 'x').close()", "print('fine')")
    _notebook(tmp_path / "b_live.ipynb", "import sys; sys.path.insert(0, '.')",
              "from slow_run import train\nresult = train(steps=3)\nassert result == {'steps': 3}")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax", "-rf",
                           "a_once.ipynb", "b_live.ipynb"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "1 failed" in out and "a_once.ipynb::Cell 0 again" in out and "FileExistsError" in out, out
    assert "Cell 1 again" not in out.split("short test summary")[-1], out  # only the cell that broke
    assert (tmp_path / "calls.txt").read_text().split() == ["3"], "the live run ran again in the second pass"
