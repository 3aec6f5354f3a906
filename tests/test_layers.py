"""The layout's rules: each module imports only from its own layer or the layers below, the
schedule layer never imports JAX, and no modules import each other in a circle.

Layers, from the bottom (README, "Architecture"): schedules, runtime, analysis, training, viz,
cli, course. Inside ``schedules`` the order is strict_json (the one JSON writer), ir, program (the lowered program), costs, timeline, validate, simulate, formulas, builders
(the automatic builders plan by simulating). Every import counts, also those inside functions
(imported lazily, they still make the lower module depend on the higher one).
"""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "zbpp_lite"
LAYERS = ["schedules", "runtime", "analysis", "training", "viz", "cli", "course"]
SCHEDULE_ORDER = ["strict_json", "ir", "program", "costs", "memory", "timeline", "validate", "simulate", "formulas",
                  "fuse", "builders"]


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, path: pathlib.Path) -> list[tuple[str, int]]:
    """Absolute names of the zbpp_lite modules ``path`` imports (with their line numbers)."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "zbpp_lite":
                continue
            known = modules()
            for alias in node.names:  # "from zbpp_lite.training import model" imports a module
                sub = f"{target}.{alias.name}"
                found.append((sub if sub in known else target, node.lineno))
        elif isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "zbpp_lite"]
    return found


def rank(name: str) -> tuple[int, int]:
    """(layer, position within the schedule layer) of a module; the package facade is layer 0."""
    parts = name.split(".")
    if len(parts) == 1 or parts[1] not in LAYERS:
        return (0, 0)  # zbpp_lite, zbpp_lite.__main__
    layer = LAYERS.index(parts[1]) + 1
    if parts[1] == "schedules" and len(parts) > 2:
        return (layer, SCHEDULE_ORDER.index(parts[2]) + 1)
    return (layer, 0)


def upward_imports() -> list[str]:
    bad = []
    for name, path in modules().items():
        here = rank(name)
        for target, line in imports_of(name, path):
            if here == (0, 0):
                if name == "zbpp_lite" and rank(target)[0] > 1:
                    bad.append(f"{name}:{line} (the facade) imports {target}: it may import only the schedule layer")
                continue
            there = rank(target)
            if there > here and not target.startswith(name + "."):
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}, a higher layer")
    return bad


def test_every_subpackage_is_a_known_layer():
    assert sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()) == sorted(LAYERS)
    for sub in (PACKAGE / "schedules").iterdir():
        if sub.suffix == ".py" or sub.is_dir() and (sub / "__init__.py").exists():
            if sub.stem != "__init__":
                assert sub.stem in SCHEDULE_ORDER, f"schedules/{sub.name} has no place in SCHEDULE_ORDER"


def test_no_module_imports_from_a_higher_layer():
    assert upward_imports() == []


def test_the_check_catches_an_upward_import(tmp_path, monkeypatch):
    # the same check on a copy of the package with one upward import added must fail
    import shutil

    copy = tmp_path / "zbpp_lite"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    with open(copy / "schedules" / "simulate.py", "a") as f:
        f.write("\n\ndef _leak():\n    from ..runtime.executor import PipelineExecutor\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", copy)
    bad = upward_imports()
    assert len(bad) == 1 and "schedules/simulate.py" in bad[0] and "zbpp_lite.runtime.executor" in bad[0]


def test_no_import_circles():
    graph = {name: {t for t, _ in imports_of(name, path) if t != name} for name, path in modules().items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if nxt.startswith(node + "."):
                continue  # a package importing its own modules is not a circle
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(trail[trail.index(nxt):] + [nxt]) if nxt in trail else f"{node} -> {nxt}")
            elif nxt in graph and not state.get(nxt):
                visit(nxt, trail + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if not state.get(name):
            visit(name, [name])
    assert cycles == []


def test_the_schedule_layer_imports_no_jax():
    names = [n for n in modules() if n == "zbpp_lite" or n.startswith("zbpp_lite.schedules")] + ["zbpp_lite.viz", "zbpp_lite.course"]
    code = (
        "import importlib, sys\n"
        f"for n in {names!r}: importlib.import_module(n)\n"
        "heavy = sorted(m for m in ('jax', 'jaxlib', 'flax', 'optax') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSTARTUP"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=PACKAGE.parent, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"importing the schedule layer (and viz, course) imported {out.stdout.strip()}"


@pytest.mark.parametrize("sub", LAYERS + ["analysis.profiling", "training.postval"])
def test_every_subpackage_says_what_it_holds_and_may_import(sub):
    doc = ast.get_docstring(ast.parse((PACKAGE / sub.replace(".", "/") / "__init__.py").read_text()))
    assert doc and "import" in doc.lower(), f"zbpp_lite/{sub}/__init__.py needs a docstring naming what it may import"
