"""Draw the course's committed figures, ``notebooks/figures/NN_name.svg``, with the package's own Plotly
figures of the simulator's timelines (and, for 06, of one recorded live run).

    apt-get install -y chromium                      # kaleido >= 1 drives a Chrome or Chromium
    pip install -e '.[figures]'                      # kaleido, into an environment of its own, or:
    pip install --target /tmp/figkaleido kaleido     # beside the project's environment, then
    export PYTHONPATH=$PWD:/tmp/figkaleido           # (kaleido's browser wrapper needs it on the path)
    python tools/make_figures.py             # every figure (about 30 s)
    python tools/make_figures.py 01 06       # those whose name starts so
    python tools/make_figures.py --record    # re-record 06's live run (JAX, about a minute), then draw

Each SVG opens with an XML comment holding a fingerprint: the SHA-256 of a canonical JSON of what the
figure draws (its Plotly data and layout, the template left out, floats to 6 significant digits).
``tests/test_figures_committed.py`` rebuilds every figure with the package (no browser, no JAX) and
fails where a fingerprint differs, so a change to a schedule, the simulator or a figure function that
alters a committed picture fails until the figures are drawn again. Figure 06 is drawn from a JSON file
in ``notebooks/figures/data/``, written by ``python -m zbpp_lite train --json`` (strict JSON).

Layer: outside the package (a build tool, like tools/build_site.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np

import zbpp_lite as zb
from zbpp_lite.analysis.attribute import attribute
from zbpp_lite.analysis.profiling.timelines import measured_costs
from zbpp_lite.schedules import strict_json
from zbpp_lite.schedules.fuse import split_fused
from zbpp_lite.schedules.ir import Action
from zbpp_lite.schedules.timeline import Event, Timeline
from zbpp_lite.viz.attribution import attribution_figure
from zbpp_lite.viz.figures import compare_figure, dependency_figure, schedules_figure

REPO = Path(__file__).resolve().parents[1]
FIGURES = REPO / "notebooks" / "figures"
DATA = FIGURES / "data"
MEASURED = DATA / "06_measured_zb_h2_p2_m8.json"
REGENERATE = "python tools/make_figures.py"
RECORD = ["-m", "zbpp_lite", "train", "--schedule", "zb-h2", "--ranks", "2", "--microbatches", "8",
          "--steps", "4", "--no-progress", "--json", str(MEASURED)]
WIDTH = 900
"""Pixels: about the width GitHub shows a markdown image at."""
FONT = "Arial, Helvetica, sans-serif"
"""System fonts only (the SVG names them; the reader's machine draws them)."""
UNIT = "T_F = T_B = T_W = 1, T_comm = 0"
FINGERPRINT = re.compile(r"<!-- zbpp_lite figure fingerprint sha256:([0-9a-f]{64})")


def _titled(head: str, *lines: str) -> str:
    """A title: ``head``, then ``lines`` in smaller type, one a line (Plotly's HTML subset)."""
    return head + "".join(f'<br><span style="font-size:12px">{line}</span>' for line in lines)


def _sim(name: str, p: int, m: int, costs: zb.Costs | None = None, **options: Any) -> Timeline:
    """``name``'s plan simulated under ``costs``; ``options`` go to the builder (a memory limit is drawn)."""
    return zb.simulate(zb.build_schedule(name, p, m, **options), costs, options.get("memory_limit"))


# ---------------------------------------------------------------------------- the figures, one a lesson


def headline():
    p, m = 4, 8
    kept = zb.Costs(mem_w=0.0)                             # memory: what F keeps, freed by B (lesson 1)
    named = [(n, _sim(s, p, m, kept)) for n, s in (("1F1B", "1f1b"), ("ZB-H1", "zb-h1"), ("ZB-H2", "zb-h2"))]
    return schedules_figure(
        named, moves=(0,), chain=True, memory_rank=0, time_unit=UNIT,
        title=_titled(f"1F1B, ZB-H1 and ZB-H2 at p = {p}, m = {m} on one time axis",
                      "green arrows: W's that ZB-H1 moves out of 1F1B's fused backward BW to the end, "
                      "where the rank would idle;",
                      "outlined: the critical path, the actions that each wait for the one before and set "
                      "the end; memory: what F keeps, in M_B"))


def split():
    p, m = 4, 4
    fused = zb.build_schedule("1f1b", p, m)
    named = [("1F1B, fused backward BW", zb.simulate(fused)),
             ("the same order, each BW run as B then W", zb.simulate(split_fused(fused)))]
    return schedules_figure(
        named, chain=True, memory_rank=None, time_unit=UNIT,
        title=_titled(f"Splitting the backward, p = {p}, m = {m}",
                      "the previous rank waits for B only, not for B and W:",
                      "W leaves the chain that crosses the ranks (the critical path, outlined)"))


def zb_h2():
    p, m = 4, 8
    kept = zb.Costs(mem_w=0.0)                             # memory: what F keeps (exercise 3.2 adds M_W)
    named = [("ZB-H1", _sim("zb-h1", p, m, kept)), ("ZB-H2", _sim("zb-h2", p, m, kept))]
    return schedules_figure(
        named, chain=True, memory_rank=0, time_unit=UNIT,
        title=_titled(f"ZB-H1 and ZB-H2 at p = {p}, m = {m}",
                      "ZB-H2 runs more F's before its first B, filling the start with F's and the end "
                      "with W's:", "no idle time, for more memory (what F keeps, in M_B)"))


def _plan_auto(p: int, m: int, limit: float) -> Timeline:
    costs = zb.Costs()
    return zb.simulate(zb.build_schedule("zb-auto", p, m, costs=costs, memory_limit=limit), costs, limit)


def zb_auto():
    p, m = 4, 8
    named = [(f"zb-auto, memory limit {lim:g} M_B", _plan_auto(p, m, lim)) for lim in (p, 1.5 * p, 2 * p)]
    return schedules_figure(
        named, memory_rank=0, time_unit=UNIT,
        title=_titled(f"zb-auto's plans at memory limits p, 1.5p and 2p M_B (p = {p}, m = {m})",
                      "more memory lets more F's run ahead and gives the W's more room:",
                      "the idle time shrinks to none"))


def zb_v():
    p, m = 4, 8
    whole = zb.Costs(f=2.0, b=2.0, w=2.0)                  # one stage a rank: a rank's layers, M_B
    half = zb.Costs(f=1.0, b=1.0, w=1.0, mem_b=0.5)      # two stages a rank: half the layers each
    named = [("ZB-H1, one stage a rank", _sim("zb-h1", p, m, whole)),
             ("ZB-V, two half stages a rank on the V placement", _sim("zb-v", p, m, half))]
    return schedules_figure(
        named, memory_rank=0, time_unit="T_F = 2 for a rank's layers, 1 for a half stage",
        title=_titled(f"ZB-V beside ZB-H1, p = {p}, m = {m}",
                      f"rank r holds stages r and {2 * p - 1} - r (a later stage drawn lighter); memory in "
                      "M_B of a rank's layers (a half stage keeps 0.5):",
                      "ZB-V has ZB-H1's (and 1F1B's) peak and no idle time"))


def load_measured(path: Path | None = None) -> tuple[zb.Schedule, Timeline, dict]:
    """(the schedule, the measured timeline in milliseconds, the JSON) of a ``train --json`` file (default
    :data:`MEASURED`)."""
    run = json.loads((path or MEASURED).read_text(encoding="utf-8"))
    schedule = zb.build_schedule(run["schedule"], run["ranks"], run["microbatches"])
    events = [Event(e["rank"], Action.from_str(e["action"]), 1e3 * e["start"], 1e3 * e["end"])
              for e in run["trace"]]
    measured = Timeline.from_events(events, run["ranks"], num_stages=run["stages"], source="measured")
    return schedule, measured, run


def planned_measured():
    schedule, measured, run = load_measured()
    planned = zb.simulate(schedule, measured_costs(measured, schedule.num_stages))
    p, m = schedule.num_ranks, schedule.num_microbatches
    return compare_figure(
        planned, measured, time_unit="ms",
        titles=("planned: the simulator with the run's mean F, B, W times", "measured"),
        title=f"ZB-H2, p = {p}, m = {m}: the digits model, measured on simulated CPU devices")


def attribution():
    p, m = 4, 8
    slow = [2.0] + [1.0] * (p - 1)
    costs = zb.Costs(f=slow, b=slow, w=slow)
    schedule = zb.build_schedule("zb-h1", p, m)
    timeline = zb.simulate(schedule, costs)
    return attribution_figure(
        attribute(timeline, schedule, costs), timeline,
        title=f"ZB-H1, p = {p}, m = {m}, stage 0 twice as slow as the others: every idle stretch coloured "
              "by its cause")


def transfers():
    p, m = 4, 4
    return dependency_figure(
        _sim("zb-h1", p, m, zb.Costs(comm=0.25)),
        title=f"ZB-H1's sends and receives, p = {p}, m = {m}, T_comm = 0.25")


def lockstep():
    p, m = 4, 8
    costs = zb.Costs(f=1.0, b=1.0, w=0.5, comm=0.1)
    plan = zb.build_schedule("zb-h1", p, m)
    return compare_figure(
        zb.simulate(plan, costs), zb.simulate(plan, costs, lockstep=True), time_unit="T_F = 1",
        titles=("event-driven (MPMD): each rank at its own pace", "lockstep (SPMD): ticks as long as their "
                                                                    "slowest action"),
        title=f"ZB-H1, p = {p}, m = {m}, T_W = 0.5, T_comm = 0.1", ratio_name="lockstep / event-driven makespan")


def v_messages():
    p, m = 4, 2
    plan = zb.build_schedule("zb-v", p, m)
    return dependency_figure(zb.simulate(plan, zb.Costs(f=1.0, b=1.0, w=1.0), lockstep=True),
                             f"ZB-V in lockstep, p = {p}, m = {m}: each arrow a value sent to another rank")


SPECS: dict[str, Callable[[], Any]] = {
    "01_headline": headline,
    "02_split": split,
    "03_zb_h2": zb_h2,
    "04_zb_auto": zb_auto,
    "05_zb_v": zb_v,
    "06_planned_measured": planned_measured,
    "07_attribution": attribution,
    "08_transfers": transfers,
    "09_lockstep": lockstep,
    "10_v_messages": v_messages,
}
"""File stem -> the function drawing it (a ``go.Figure``)."""


# ---------------------------------------------------------------------------- fingerprint and export


def build(name: str):
    """The figure ``name`` as exported: the spec's figure at :data:`WIDTH`, in :data:`FONT`."""
    fig = SPECS[name]()
    for i, trace in enumerate(fig.data):  # fixed trace ids: the same figure, the same SVG bytes
        trace.uid = f"{name[:2]}-{i}"
    fig.update_layout(width=WIDTH, font={"family": FONT},
                      title={"x": 0.01, "y": 1.0, "yanchor": "top", "pad": {"t": 18},
                             "font": {"size": 15}})
    return fig


def _canonical(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, np.ndarray):
        return _canonical(value.tolist())
    if isinstance(value, np.generic):
        return _canonical(value.item())
    if isinstance(value, float):
        return float(f"{value:.6g}")
    return value


def fingerprint(fig) -> str:
    """SHA-256 of the canonical JSON of ``fig``'s data and layout (template left out, floats to 6
    significant digits, sorted keys)."""
    spec = fig.to_plotly_json()
    layout = {k: v for k, v in spec.get("layout", {}).items() if k != "template"}
    text = strict_json.dumps(_canonical({"data": spec.get("data", []), "layout": layout}), sort_keys=True,
                             separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def stored_fingerprint(path: Path) -> str | None:
    """The fingerprint written into a committed SVG, or None (no file, or none in it)."""
    if not path.exists():
        return None
    found = FINGERPRINT.search(path.read_text(encoding="utf-8")[:400])
    return found.group(1) if found else None


def problem(name: str) -> str | None:
    """What is wrong with the committed figure ``name``, with the command that draws it again; None: it
    is what the package draws now (its fingerprint matches :func:`build`'s)."""
    path = FIGURES / f"{name}.svg"
    where = f"notebooks/figures/{name}.svg"
    redraw = f"draw it again with `{REGENERATE} {name[:2]}` (needs the [figures] extra and Chromium)"
    stored = stored_fingerprint(path)
    if stored is None:
        return f"{where} is missing or has no fingerprint: {redraw}"
    if stored != fingerprint(build(name)):
        return f"{where} is stale: the package now draws another figure; {redraw}"
    return None


def _tidy(svg: str) -> str:
    """Kaleido's SVG made byte-stable and smaller: its random ids numbered in order, numbers inside attribute
    values (coordinates, styles) to 2 decimals; text the figure shows (titles, labels) is left as drawn."""
    for token in set(re.findall(r'id="defs-([0-9a-f]+)"', svg)):
        svg = svg.replace(token, "zbpp")
    patterns: dict[str, str] = {}
    svg = re.sub(r"(pzbpp-(?:legend-)?)([0-9a-f]+)\b",
                 lambda m: m.group(1) + patterns.setdefault(m.group(2), str(len(patterns))), svg)
    return re.sub(r'"[^"]*"', lambda value: re.sub(r"(-?\d+\.\d{2})\d+", r"\1", value.group(0)), svg)


def svg_of(name: str) -> str:
    """The SVG of figure ``name``, its fingerprint in an XML comment first (needs kaleido and Chromium)."""
    import plotly.io as pio

    fig = build(name)
    svg = _tidy(pio.to_image(fig, format="svg", width=WIDTH, height=fig.layout.height).decode("utf-8"))
    head = (f"<!-- zbpp_lite figure fingerprint sha256:{fingerprint(fig)} (drawn by {REGENERATE} {name[:2]}; "
            "tests/test_figures_committed.py compares it) -->\n")
    return head + svg


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("only", nargs="*", help="figure name prefixes, e.g. 01 06 (default: all)")
    parser.add_argument("--record", action="store_true",
                        help=f"first re-record 06's live run into {MEASURED.relative_to(REPO)} (needs JAX)")
    args = parser.parse_args(argv)
    if args.record:
        subprocess.run([sys.executable, *RECORD], cwd=REPO, check=True)
    names = [n for n in SPECS if not args.only or any(n.startswith(o) for o in args.only)]
    if not names:
        raise SystemExit(f"no figure starts with {args.only}; the figures: {', '.join(SPECS)}")
    FIGURES.mkdir(parents=True, exist_ok=True)
    for name in names:
        svg = svg_of(name)
        (FIGURES / f"{name}.svg").write_text(svg, encoding="utf-8")
        print(f"wrote notebooks/figures/{name}.svg ({len(svg.encode()) / 1024:.0f} KiB)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
