"""Every lesson's cells run twice: nbval's pass, then each code cell again in the same kernel
(issue 30, part 8: a learner re-runs cells, and a cell that rebinds a name an earlier cell needs,
such as a loop variable that shadows a function, breaks the second time).

The second pass costs no second kernel and no first pass of its own: after nbval's items of a
notebook (``Cell 0``, ``Cell 1``, ...), :func:`pytest_collection_modifyitems` appends one more item
per code cell (``Cell 0 again``, ...) to the same notebook, so they run in nbval's kernel, after the
last cell, with every program the first pass compiled still in JAX's caches.

What keeps the second pass cheap: programs compiled in the first pass are not compiled again (JAX's
in-process caches, and the persistent compilation cache ``tests/conftest.py`` sets up for the
notebook kernels), and the calls named in :data:`REPLAYED`, whole live training runs, give their
first-pass results again: in a lesson that imports one, a hidden step after its set-up cell wraps
the function so that it records its results (with a key made of its arguments, when they are plain
numbers, strings, flags, lists of them or frozen dataclasses such as ``zb.Costs``), and in the second pass a call whose key equals a first-pass call's
returns that call's result without running (each recorded result once). What the second pass
checks is that the cells' code and names still work; the run itself was checked by the first pass.
On this project's 2-core machine, shared (load 12-14), the eight lessons' second pass took 45 s
beside their first pass's 621 s (the hidden recording steps: 13 s, mostly imports the lessons make
later anyway); with every call run again it took 128 s beside 595 s (load 8-11), 75 s of them
lesson 7's ``adapt``.

Two orders (``--nbval-again``): ``in-order`` (the default) runs cell 0, 1, 2, ... again, as a
learner who runs the lesson twice; ``reverse`` runs the last cell first, so that each cell meets the
state the later cells left, as when a learner goes back up and re-runs one cell. ``off`` skips the
second pass. A lesson listed under the order in use is marked xfail (not strict) with the reason, until
the lesson is fixed.

This file sits at the repository's root so that it applies however the notebooks are selected
(``pytest notebooks/08_build_a_pipeline.ipynb`` too).
"""

from __future__ import annotations

import pytest

RERUN_XFAIL: dict[str, dict[str, str]] = {"in-order": {}, "reverse": {}}
"""Per order of the second pass, notebook file name -> why its second pass fails (the cells, for
whoever fixes the lesson; cells counted from 0 among code cells, as nbval names them). Both orders find
none today: every lesson's cells run again in reverse too (checked on all ten)."""

REPLAYED = {
    "zbpp_lite.training.adapt": "adapt",  # lesson 7: 75 s of the second pass, run again
    "zbpp_lite.training.train": "train",  # lessons 1, 3, 5, 6: 2-5 s a call
    "zbpp_lite.viz": "bubble_sweep_figure",  # lesson 5: 12 s of simulations
}
"""Module -> function: the calls whose second-pass runs replay the first pass's results (in a
lesson whose cells call the function by that name)."""

_RECORD = """
import importlib as _il
def _zbpp_replaying(module, name):
    m = _il.import_module(module)
    fn = getattr(m, name)
    if getattr(fn, "_zbpp_replay", None) is not None:
        return
    state = {"calls": [], "replay": False, "used": set()}
    import dataclasses
    def value(v):  # a comparable copy of an argument made of plain values, or a TypeError
        if isinstance(v, (int, float, str, bool, type(None))):
            return v
        if isinstance(v, (list, tuple)):
            return (type(v).__name__, tuple(value(x) for x in v))
        if dataclasses.is_dataclass(v) and not isinstance(v, type) and v.__dataclass_params__.frozen:
            return (type(v).__qualname__, tuple((f.name, value(getattr(v, f.name))) for f in dataclasses.fields(v)))
        raise TypeError(type(v).__name__)
    def wrapper(*args, **kwargs):
        try:
            key = value((args, tuple(sorted(kwargs.items()))))
        except TypeError:
            key = None
        if state["replay"]:
            for k, (recorded, result) in enumerate(state["calls"]):
                if key is not None and recorded == key and k not in state["used"]:
                    state["used"].add(k)
                    return result
            return fn(*args, **kwargs)
        result = fn(*args, **kwargs)
        state["calls"].append((key, result))
        return result
    wrapper._zbpp_replay = state
    wrapper.__wrapped__ = fn
    setattr(m, name, wrapper)
"""

_REPLAY = """
import sys as _sys
for _m, _n in {replayed}.items():
    _f = getattr(_sys.modules.get(_m), _n, None)
    if getattr(_f, "_zbpp_replay", None) is not None:
        _f._zbpp_replay.update(replay=True, used=set())
"""


def pytest_addoption(parser):
    parser.addoption("--nbval-again", choices=("in-order", "reverse", "off"), default="in-order",
                     help="after nbval's pass, run each notebook's code cells again in the same kernel: in order "
                          "(default), last cell first (each cell then meets the state the later cells left, as "
                          "when a learner goes back up and re-runs one), or not at all")


def pytest_collection_modifyitems(session, config, items):
    again_order = config.getoption("--nbval-again")
    if again_order == "off":
        return
    try:
        from nbval.plugin import IPyNbCell
    except ImportError:  # nbval not installed: no notebook items
        return
    out: list = []
    for k, item in enumerate(items):
        out.append(item)
        if not isinstance(item, IPyNbCell):
            continue
        after = items[k + 1] if k + 1 < len(items) else None
        if isinstance(after, IPyNbCell) and after.parent is item.parent:
            continue
        cells = [i for i in items if isinstance(i, IPyNbCell) and i.parent is item.parent]
        reason = RERUN_XFAIL[again_order].get(item.parent.path.name)
        replayed = {m: n for m, n in REPLAYED.items() if any(f"{n}(" in c.cell.source for c in cells)}
        if replayed:  # record from the set-up cell on (JAX's flags are set by then)
            record = _RECORD + "".join(f"_zbpp_replaying({m!r}, {n!r})\n" for m, n in replayed.items())
            out.insert(out.index(cells[0]) + 1, _hidden(IPyNbCell, item.parent, "record live runs", record))
            out.append(_hidden(IPyNbCell, item.parent, "replay live runs", _REPLAY.format(replayed=replayed)))
        for cell in cells if again_order == "in-order" else cells[::-1]:
            again = IPyNbCell.from_parent(item.parent, name=f"{cell.name} again", cell_num=cell.cell_num,
                                          cell=cell.cell, options=cell.options)
            if reason:
                again.add_marker(pytest.mark.xfail(reason=f"re-run: {reason}", strict=False))
            out.append(again)
    items[:] = out


def _hidden(kind, parent, name: str, source: str):
    """An extra item of a notebook that runs ``source`` in its kernel (no cell of the notebook)."""
    from collections import defaultdict

    import nbformat

    return kind.from_parent(parent, name=name, cell_num=-1, cell=nbformat.v4.new_code_cell(source),
                            options=defaultdict(bool, check=False))
