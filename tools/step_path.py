"""What a reader must read to follow one training step: every zbpp_lite function a small ``train`` run
executes, with its lines (issue 41's measure of the runtime's weight).

    python tools/step_path.py --ranks-as threads     # one process, a thread per rank
    python tools/step_path.py --ranks-as processes   # a pinned process per rank (needs 2 cores)
    python tools/step_path.py --entry train          # from zbpp_lite.training.train.train, the command line left out

Prints the functions by file, each with its source lines, and the totals (all lines, and code lines:
without docstrings, comments and blank lines). Functions run by the rank processes are collected too: a
``sitecustomize`` on ``PYTHONPATH`` records each process's calls into a folder, read back at the end.
Setup (building the schedule, compiling) counts: a reader follows it to reach the step.
"""

from __future__ import annotations

import argparse
import ast
import io
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = str(ROOT / "zbpp_lite")

_RECORDER = '''
import atexit, os, sys, threading
_seen = set()
def _hook(frame, event, arg):
    if event == "call":
        c = frame.f_code
        if c.co_filename.startswith({package!r}):
            _seen.add((c.co_filename, c.co_firstlineno, c.co_qualname))
sys.setprofile(_hook)
threading.setprofile(_hook)
def _dump():
    with open(os.path.join({out!r}, f"calls-{{os.getpid()}}.txt"), "w") as f:
        f.writelines(f"{{a}}\\t{{b}}\\t{{c}}\\n" for a, b, c in _seen)
atexit.register(_dump)
_exit = os._exit
def _exit_after_dump(code):
    _dump()
    _exit(code)
os._exit = _exit_after_dump
'''


_TRAIN = """from zbpp_lite.training.model import ModelConfig, RunConfig
from zbpp_lite.training.train import train
train("zb-h1", 2, 4, 2, model=ModelConfig(d=16, heads=2, blocks=2), run=RunConfig(batch=8, check_grads=False))
"""


def _function_lines(path: str, firstlineno: int) -> tuple[int, int]:
    """(all lines, code lines) of the function or class body starting at ``firstlineno`` in ``path``."""
    source = Path(path).read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                min([node.lineno] + [d.lineno for d in node.decorator_list]) <= firstlineno <= node.lineno:
            start, end = node.lineno, node.end_lineno
            doc = set()
            body0 = node.body[0]
            if isinstance(body0, ast.Expr) and isinstance(getattr(body0, "value", None), ast.Constant) \
                    and isinstance(body0.value.value, str):
                doc = set(range(body0.lineno, body0.end_lineno + 1))
            lines = source.splitlines()[start - 1:end]
            code = 0
            for k, text in enumerate(lines, start):
                if k in doc or not text.strip() or text.strip().startswith("#"):
                    continue
                code += 1
            return end - start + 1, code
    return 0, 0  # a module body or a lambda/comprehension: counted with its function


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks-as", choices=("threads", "processes"), default="threads")
    p.add_argument("--entry", choices=("cli", "train"), default="cli",
                   help="cli: `python -m zbpp_lite train`; train: zbpp_lite.training.train.train from Python (threads, no "
                        "command line, no gradient check)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp, "site")
        site.mkdir()
        (site / "sitecustomize.py").write_text(_RECORDER.format(package=PACKAGE, out=tmp))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]),
               "JAX_NUM_CPU_DEVICES": "2", "JAX_PLATFORMS": "cpu"}
        cmd = [sys.executable, "-m", "zbpp_lite", "train", "--schedule", "zb-h1", "--ranks", "2",
               "--microbatches", "4", "--steps", "2", "--d", "16", "--heads", "2", "--blocks", "2",
               "--batch", "8", "--no-progress", "--ranks-as", args.ranks_as]
        if args.entry == "train":
            cmd = [sys.executable, "-c", _TRAIN]
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
        seen = set()
        for f in Path(tmp).glob("calls-*.txt"):
            for line in f.read_text().splitlines():
                path, first, name = line.split("\t")
                seen.add((path, int(first), name))
    by_file: dict[str, list] = {}
    for path, first, name in sorted(seen):
        total, code = _function_lines(path, first)
        if total:
            by_file.setdefault(os.path.relpath(path, ROOT), []).append((name, total, code))
    out = io.StringIO()
    grand = [0, 0]
    for path, funcs in sorted(by_file.items(), key=lambda kv: -sum(t for _, t, _ in kv[1])):
        lines, code = sum(t for _, t, _ in funcs), sum(c for _, _, c in funcs)
        grand[0] += lines
        grand[1] += code
        out.write(f"{path}: {len(funcs)} functions, {lines} lines ({code} code)\n")
        out.write("    " + ", ".join(n for n, _, _ in funcs) + "\n")
    how = "training.train.train (threads)" if args.entry == "train" else f"ranks as {args.ranks_as}"
    print(out.getvalue() + f"one step from {how}: {len(by_file)} files, "
          f"{sum(len(f) for f in by_file.values())} functions, {grand[0]} lines ({grand[1]} code)")


if __name__ == "__main__":
    main()
