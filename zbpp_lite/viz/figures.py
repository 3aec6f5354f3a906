"""Plotly figures of a Timeline, planned (simulated) or measured; each returns a ``go.Figure`` (none shown).

Terms (makespan, bubble rate, M_B) follow arXiv 2401.10241 sections 2-3; colours come from
:data:`~.style.KIND_STYLE`.
"""

from __future__ import annotations

import math
from dataclasses import replace
from operator import attrgetter
from typing import Any, Iterable, Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..analysis.profiling.timelines import critical_path, producers
from ..schedules.ir import deps
from ..schedules.timeline import Event, Timeline
from .states import plan_or_refusal
from .style import BAR_KINDS, KIND_STYLE

BAR_WIDTH = 0.8
GRID_COLOR = "#E8E8E8"
LEGEND_TOP = {"orientation": "h", "yanchor": "bottom", "y": 1.04, "xanchor": "right", "x": 1.0}
"""The legend of a figure: one row above the plot, right-aligned."""
LEGEND_BOTTOM = {"orientation": "h", "yref": "container", "yanchor": "bottom", "y": 0.0, "xanchor": "left",
                 "x": 0.0}
"""The legend of a figure whose title takes the top: rows at the bottom, under the time axis."""


# ---------------------------------------------------------------------------- pieces


def rank_label(rank: int) -> str:
    """The y-axis category of one rank: ``"rank 0"``."""
    return f"rank {rank}"


def time_unit_of(timeline: Timeline) -> str:
    """Axis unit: seconds for measured timelines, the costs' unit ("T") for simulated ones."""
    return "s" if timeline.source == "measured" else "units of the costs"


def start_time(timeline: Timeline) -> float:
    """Earliest event start (0 for simulated timelines; a clock reading for measured ones)."""
    return min(map(attrgetter("start"), timeline.events), default=0.0)


def end_time(timeline: Timeline) -> float:
    """Latest event end."""
    return max(map(attrgetter("end"), timeline.events), default=0.0)


def stats_text(timeline: Timeline) -> str:
    """``"makespan 27, bubble rate 11.1%"`` (makespan in the timeline's unit)."""
    return f"makespan {timeline.makespan:.4g}, bubble rate {timeline.bubble_rate:.1%}"


def figure_title(timeline: Timeline, title: str | None = None) -> str:
    """Heading used by timeline figures: optional name, the source, makespan and bubble rate."""
    head = f"{title} ({timeline.source})" if title else timeline.source
    return f"{head}: {stats_text(timeline)}"


def _chunk_index(timeline: Timeline) -> dict[tuple[int, int], int]:
    """(rank, stage) -> position of the stage among the rank's stages (0 for the first chunk)."""
    stages: dict[int, set[int]] = {}
    for rank, stage in sorted({(e.rank, e.action.stage) for e in timeline.events}):  # each pair once
        stages.setdefault(rank, set()).add(stage)
    return {(r, s): i for r, ss in stages.items() for i, s in enumerate(sorted(ss))}


NOTE_MARGIN = 80
"""Pixels below a timeline's plot where it carries the chunk note (:func:`_chunk_note`): the time axis'
labels and title, then the note."""


def _chunk_note(*timelines: Timeline) -> list[dict[str, Any]]:
    """The annotation explaining the lighter shades of later chunks, where a rank of ``timelines`` holds
    several stages; else none (so a redrawn figure loses an old note)."""
    if not any(t.several_stages for t in timelines):
        return []
    return [{"text": "lighter shade: a rank's later stage (its 2nd or later chunk, in an interleaved or V "
             "placement)", "xref": "paper", "yref": "paper", "x": 0.0, "y": 0.0, "yanchor": "top",
             "yshift": -46, "xanchor": "left", "showarrow": False,   # below the time axis' labels and title
             "font": {"size": 11, "color": "#555"}}]


def timeline_traces(
    timeline: Timeline,
    *,
    offset: float | None = None,
    show_idle: bool = True,
    show_labels: bool = True,
    showlegend: bool = True,
    scale: float = 1.0,
) -> list[dict[str, Any]]:
    """Plotly bar traces (dicts of NumPy arrays), one per kind in :data:`BAR_KINDS`, always all present
    so a figure can be updated in place.

    Horizontal bars: ``base`` start, ``x`` duration, ``y`` rank; ``customdata`` rows (stage, microbatch,
    start, end), -1 for idle bars' stage and microbatch; later chunks of a rank drawn lighter. The idle trace
    has one bar per ``timeline.idle_gaps`` entry.

    Args:
        offset: subtracted from every time (default: the earliest start).
        show_idle: draw the idle gaps (the trace stays, empty, when false).
        show_labels: microbatch numbers on the bars.
        showlegend: legend entries for the non-empty kinds.
        scale: times are multiplied by it (1e3: seconds drawn as ms).
    """
    t0 = start_time(timeline) if offset is None else offset
    chunk = _chunk_index(timeline)
    rows: dict[str, list[tuple[float, ...]]] = {k: [] for k in BAR_KINDS}
    for e in timeline.events:  # (rank, start, end, stage, microbatch, chunk)
        a = e.action
        rows[a.kind].append((e.rank, scale * (e.start - t0), scale * (e.end - t0), a.stage, a.microbatch,
                             chunk[e.rank, a.stage]))
    if show_idle:
        rows["idle"] = [(r, scale * (a - t0), scale * (b - t0), -1, -1, 0)
                        for r, gaps in enumerate(timeline.idle_gaps) for a, b in gaps]
    traces = []
    for kind in BAR_KINDS:
        style = KIND_STYLE[kind]
        cols = np.array(rows[kind], dtype=float).reshape(-1, 6)
        rank, start, end, stage, mb, chunk_no = cols.T
        if kind == "idle":
            hover = "idle<br>start %{customdata[2]:.4~g}<br>end %{customdata[3]:.4~g}<extra>%{y}</extra>"
            text = None
        else:
            hover = (
                f"{kind} of stage %{{customdata[0]:d}}, microbatch %{{customdata[1]:d}}"
                f" (%{{customdata[0]:d}}{kind}%{{customdata[1]:d}})"
                "<br>start %{customdata[2]:.4~g}<br>end %{customdata[3]:.4~g}<extra>%{y}</extra>"
            )
            text = mb.astype(int).astype(str) if show_labels else None
        traces.append(
            {
                "type": "bar",
                "orientation": "h",
                "name": style.name,
                "legendgroup": kind,
                "showlegend": showlegend and len(cols) > 0,
                "base": start,
                "x": end - start,
                "y": rank.astype(int),
                "width": BAR_WIDTH,
                "text": text,
                "textposition": "inside",
                "insidetextanchor": "middle",
                "textangle": 0,
                "textfont": {"color": style.text_color},
                "customdata": np.stack([stage, mb, start, end], axis=1),
                "hovertemplate": hover,
                "marker": {
                    "color": style.color,
                    "opacity": 1.0 / (1.0 + 0.6 * chunk_no),
                    "line": {"width": 0.5, "color": "white"},
                    "pattern": {"shape": style.pattern, "fgcolor": "#9A9A9A"} if style.pattern else None,
                },
            }
        )
    return traces


def rank_axis(num_ranks: int) -> dict[str, Any]:
    """Y axis with rank 0 at the top: numeric positions labelled ``rank r``."""
    return {
        "tickmode": "array",
        "tickvals": list(range(num_ranks)),
        "ticktext": [rank_label(r) for r in range(num_ranks)],
        "range": [num_ranks - 0.5, -0.5],
        "zeroline": False,
        "showgrid": False,
    }


def timeline_layout(
    timeline: Timeline, title: str | None = None, time_unit: str | None = None
) -> dict[str, Any]:
    """Layout for :func:`timeline_traces`: ranks top to bottom, time axis, stats in the title, the chunk note
    where a rank holds several stages."""
    note = _chunk_note(timeline)
    return {
        "title": {"text": figure_title(timeline, title)},
        "barmode": "overlay",
        "bargap": 0.1,
        "height": 140 + 34 * timeline.num_ranks,
        "margin": {"l": 70, "r": 20, "t": 60, "b": NOTE_MARGIN if note else 45},
        "xaxis": {
            "title": {"text": f"time ({time_unit or time_unit_of(timeline)})"},
            "range": [0, max(end_time(timeline) - start_time(timeline), 1e-12)],
            "zeroline": False,
            "gridcolor": GRID_COLOR,
        },
        "yaxis": rank_axis(timeline.num_ranks),
        "uniformtext": {"minsize": 8, "mode": "hide"},
        "legend": {**LEGEND_TOP, "y": 1.0},
        "plot_bgcolor": "white",
        "annotations": note,
    }


def stacked_figure(panels: Sequence[Sequence[tuple[Timeline, float | None]]], titles: Sequence[str],
                   time_unit: str, *, show_idle: bool = True, spacing: float = 0.12) -> go.Figure:
    """Timeline panels one above the other on a shared time axis; panel ``i`` draws each (timeline,
    offset) of ``panels[i]`` (:func:`timeline_traces`), legend from the first; ``titles``: one per panel."""
    fig = make_subplots(rows=len(panels), cols=1, shared_xaxes=True, vertical_spacing=spacing,
                        subplot_titles=list(titles))
    for row, panel in enumerate(panels, start=1):
        for i, (t, offset) in enumerate(panel):
            legend = (row, i) == (1, 0)
            for trace in timeline_traces(t, offset=offset, show_idle=show_idle, showlegend=legend):
                fig.add_trace(go.Bar(trace), row=row, col=1)
    fig.update_yaxes(rank_axis(panels[0][0][0].num_ranks))
    fig.update_xaxes(zeroline=False, gridcolor=GRID_COLOR)
    fig.update_xaxes(title_text=f"time ({time_unit})", row=len(panels), col=1)
    fig.update_layout(barmode="overlay", bargap=0.1, uniformtext={"minsize": 8, "mode": "hide"},
                      plot_bgcolor="white", legend=LEGEND_TOP, margin={"l": 70, "r": 20, "t": 80, "b": 45})
    return fig


# ---------------------------------------------------------------------------- figures


def timeline_figure(
    timeline: Timeline,
    title: str | None = None,
    *,
    show_idle: bool = True,
    show_labels: bool = True,
    time_unit: str | None = None,
) -> go.Figure:
    """The pipeline timeline, simulated or measured: one row per rank, one bar per action coloured by kind,
    ``timeline.idle_gaps`` hatched grey (``show_idle``), microbatch numbers on the bars (``show_labels``).

    Hover gives the action (PyTorch text), stage, microbatch, start and end; the title names ``title``, the
    source, makespan and bubble rate (arXiv 2401.10241 section 3); ``time_unit``: the x-axis unit (default
    "s" measured, else "units of the costs"). Returns a new ``go.Figure``, 5 traces in :data:`BAR_KINDS`
    order, times from 0.
    """
    traces = timeline_traces(timeline, show_idle=show_idle, show_labels=show_labels)
    return go.Figure(data=[go.Bar(t) for t in traces], layout=timeline_layout(timeline, title, time_unit))


def compare_figure(
    planned: Timeline,
    measured: Timeline,
    *,
    titles: tuple[str, str] = ("planned", "measured"),
    title: str | None = None,
    time_unit: str | None = None,
    ratio_name: str = "measured / planned makespan",
) -> go.Figure:
    """Planned above measured on one shared time axis (same unit), each from 0; the title gives both
    makespans and their ratio, named ``ratio_name`` (e.g. "lockstep / event-driven makespan" for other
    pairs). Raises ValueError: timelines with different numbers of ranks."""
    if planned.num_ranks != measured.num_ranks:
        raise ValueError(
            f"compare_figure needs the same number of ranks, got {planned.num_ranks} planned and "
            f"{measured.num_ranks} measured"
        )
    ratio = measured.makespan / planned.makespan if planned.makespan > 0 else float("nan")
    head = f"{title}: " if title else ""
    fig = stacked_figure([[(planned, None)], [(measured, None)]],
                         [f"{name}: {stats_text(t)}" for name, t in zip(titles, (planned, measured))],
                         time_unit or time_unit_of(measured))
    span = max(end_time(t) - start_time(t) for t in (planned, measured))
    fig.update_xaxes(range=[0, max(span, 1e-12)])
    fig.update_layout(title={"text": f"{head}{ratio_name} = {ratio:.3f}"},
                      height=220 + 2 * 34 * planned.num_ranks)
    for note in _chunk_note(planned, measured):
        fig.add_annotation(note)
        fig.update_layout(margin={"b": NOTE_MARGIN})
    return fig


# ---------------------------------------------------------------------------- bubble sweeps


def bubble_sweep(names: Iterable[str], num_ranks: int | Sequence[int], num_microbatches: int | Sequence[int],
                 **options: Any) -> tuple[str, list[int], dict[str, list[float | None]]]:
    """Bubble rate of several schedules as p or m varies; exactly one of ``num_ranks`` and
    ``num_microbatches`` is a sequence; ``options``: :func:`~.states.plan_timeline`'s (``costs``,
    ``stages_per_rank``, ``memory_limit``).

    Returns:
        (axis name "num_ranks" or "num_microbatches", x values, name -> bubble rates, None where refused).

    Raises:
        ValueError: both or neither of num_ranks and num_microbatches are sequences.
    """
    ranks_swept = not isinstance(num_ranks, int)
    if ranks_swept == (not isinstance(num_microbatches, int)):
        raise ValueError(
            "bubble_sweep sweeps one axis: give a sequence for exactly one of num_ranks and "
            f"num_microbatches, got num_ranks={num_ranks!r}, num_microbatches={num_microbatches!r}"
        )
    axis = "num_ranks" if ranks_swept else "num_microbatches"
    xs = [int(x) for x in (num_ranks if ranks_swept else num_microbatches)]  # type: ignore[union-attr]
    sizes = [(x, num_microbatches) if ranks_swept else (num_ranks, x) for x in xs]
    plans = {name: [plan_or_refusal(name, p, m, **options) for p, m in sizes] for name in names}
    rates = {name: [None if isinstance(t, ValueError) else t.bubble_rate for t in row]
             for name, row in plans.items()}
    return axis, xs, rates


def bubble_sweep_figure(names: Iterable[str], num_ranks: int | Sequence[int] = 4,
                        num_microbatches: int | Sequence[int] = (4, 8, 12, 16, 24, 32), *,
                        title: str | None = None, **options: Any) -> go.Figure:
    """Bubble rate against m (or p) for several schedules, one line each (:func:`bubble_sweep`, with
    ``options``); refused sizes leave gaps."""
    axis, xs, rates = bubble_sweep(names, num_ranks, num_microbatches, **options)
    xlabel = "ranks p" if axis == "num_ranks" else "microbatches m"
    fixed = f"m = {num_microbatches}" if axis == "num_ranks" else f"p = {num_ranks}"
    hover = f"<br>{xlabel} %{{x}}<br>bubble rate %{{y:.1%}}<extra></extra>"
    fig = go.Figure([go.Scatter(x=xs, y=ys, mode="lines+markers", name=name, hovertemplate=name + hover)
                     for name, ys in rates.items()])
    fig.update_layout(
        title={"text": title or f"bubble rate against {xlabel} ({fixed})"},
        xaxis={"title": {"text": xlabel}, "gridcolor": GRID_COLOR},
        yaxis={"title": {"text": "bubble rate"}, "tickformat": ".0%", "rangemode": "tozero",
               "gridcolor": GRID_COLOR},
        height=380, plot_bgcolor="white", margin={"l": 70, "r": 20, "t": 60, "b": 45},
    )
    return fig


# ---------------------------------------------------------------------------- dependencies, post-validation


def dependency_arrows(timeline: Timeline, *, same_rank: bool = False,
        offset: float | None = None) -> list[dict[str, Any]]:
    """Plotly annotations, one arrow per :func:`~zbpp_lite.schedules.ir.deps` edge, from the producer's end
    to the consumer's start: transfers between ranks solid; with ``same_rank`` a rank's own F -> B -> W
    dotted."""
    t0 = start_time(timeline) if offset is None else offset
    num_stages = 1 + max((e.action.stage for e in timeline.events), default=0)
    made = producers(timeline)
    arrows = []
    for e in timeline.events:
        for key in deps(e.action, num_stages):
            src = made.get(key)
            if src is None or src is e or (src.rank == e.rank and not same_rank):
                continue
            cross = src.rank != e.rank
            arrows.append({
                "x": e.start - t0, "y": e.rank, "ax": src.end - t0, "ay": src.rank,
                "xref": "x", "yref": "y", "axref": "x", "ayref": "y", "text": "", "showarrow": True,
                "arrowhead": 2, "arrowsize": 1, "arrowwidth": 1.2 if cross else 0.8,
                "arrowcolor": "#333333" if cross else "#888888", "opacity": 0.8,
                "standoff": 0, "startstandoff": 0,
            })
    return arrows


def dependency_figure(timeline: Timeline, title: str | None = None, *, same_rank: bool = False) -> go.Figure:
    """:func:`timeline_figure` with :func:`dependency_arrows` (best for p, m up to about 4 and 8)."""
    fig = timeline_figure(timeline, title)
    for arrow in dependency_arrows(timeline, same_rank=same_rank):
        fig.add_annotation(**arrow)
    return fig


def postvalidation_figure(timeline: Timeline, title: str | None = None) -> go.Figure:
    """Two consecutive steps of one schedule (paper section 4): above with a synchronous optimizer step
    (the wait hatched), below post-validated, each rank starting step 2 once it ended step 1 (valid when
    every rank's span is the makespan, as ZB-H1/H2). Step 2's forwards before the dashed line (the last
    rank's end of step 1) run on speculative parameters, outlined red; a rollback redoes them."""
    t0, t_end, p = start_time(timeline), end_time(timeline), timeline.num_ranks
    titles = (f"synchronous step: wait {timeline.sync_bubble:.4g} on the earliest rank",
              "post-validated: no wait; red F's are speculative, redone on a rollback")
    sync, post = timeline.global_span, timeline.makespan  # when step 2 starts after step 1
    fig = stacked_figure([[(_shifted(timeline, k * shift), t0) for k in (0, 1)] for shift in (sync, post)],
                         titles, time_unit_of(timeline), show_idle=False, spacing=0.14)
    ranks = [r for r in range(p) if timeline.rank_events(r)]  # the wait: a rank's end of step 1 to step 2
    ends = {r: max(e.end for e in timeline.rank_events(r)) for r in ranks}
    starts = {r: min(e.start for e in timeline.rank_events(r)) + sync for r in ranks}
    fig.add_trace(go.Bar(
        orientation="h", base=[ends[r] - t0 for r in ranks], x=[starts[r] - ends[r] for r in ranks],
        y=ranks, width=BAR_WIDTH, name="waiting for the global check",
        marker={"color": "white", "line": {"color": "#E45756", "width": 1},
                "pattern": {"shape": "x", "fgcolor": "#E45756"}}), row=1, col=1)
    spec = [e for e in _shifted(timeline, post).events if e.action.kind == "F" and e.start < t_end]
    fig.add_trace(go.Bar(
        orientation="h", base=[e.start - t0 for e in spec], x=[e.end - e.start for e in spec],
        y=[e.rank for e in spec], width=BAR_WIDTH, name="speculative F (redone on a rollback)",
        marker={"color": "rgba(0,0,0,0)", "line": {"color": "#E45756", "width": 2.5}}), row=2, col=1)
    fig.add_vline(x=t_end - t0, line_dash="dash", line_color="#E45756", row=2, col=1)
    fig.update_layout(height=2 * (120 + 34 * p), title={"text": title or "post-validation: two steps"})
    return fig


def _shifted(timeline: Timeline, dt: float) -> Timeline:
    return replace(timeline,
                   events=tuple(e._replace(start=e.start + dt, end=e.end + dt) for e in timeline.events))


def layer_dependency_figure(num_layers: int = 3, title: str | None = None) -> go.Figure:
    """The per-layer dependency graph of one stage's F, B and W (paper section 2, figure 1): F(l) feeds
    F(l+1); B(l) needs B(l+1) and F(l); W(l) needs F(l) and B(l+1); nothing but the optimizer waits for a W.
    """
    L = int(num_layers)
    if L < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers!r}")
    loss = ("loss", 0)
    pos = {loss: (L + 1, 2.0)}
    edges = [(("F", L), loss), (loss, ("B", L)), (loss, ("W", L))]
    for l in range(1, L + 1):
        pos["F", l], pos["B", l], pos["W", l] = (l, 2.0), (2 * L + 1 - l, 1.0), (2 * L + 1 - l, 0.0)
        edges += [(("F", l), ("B", l)), (("F", l), ("W", l))]  # what F keeps for B and W
        if l < L:
            edges += [(("F", l), ("F", l + 1)), (("B", l + 1), ("B", l)), (("B", l + 1), ("W", l))]
    fig = go.Figure()
    for a, b in edges:
        (x0, y0), (x1, y1) = pos[a], pos[b]
        kept = a[0] == "F" and b[0] in ("B", "W")
        fig.add_annotation(x=x1, y=y1, ax=x0, ay=y0, xref="x", yref="y", axref="x", ayref="y", text="",
                           showarrow=True, arrowhead=2, arrowwidth=1.0 if kept else 1.6, standoff=14,
                           startstandoff=14, arrowcolor="#BBBBBB" if kept else "#333333")
    for kind, name, color in (("F", "F: forward", KIND_STYLE["F"].color),
                              ("B", "B: input gradient", KIND_STYLE["B"].color),
                              ("W", "W: weight gradient", KIND_STYLE["W"].color),
                              ("loss", "loss", "#777777")):
        nodes = [(k, v) for k, v in pos.items() if k[0] == kind]
        fig.add_trace(go.Scatter(x=[v[0] for _, v in nodes], y=[v[1] for _, v in nodes], mode="markers+text",
                                 text=[kind if kind == "loss" else f"{kind}{k[1]}" for k, _ in nodes],
                                 textposition="middle center", marker={"size": 34, "color": color},
                                 textfont={"color": "white"}, name=name))
    fig.update_layout(title={"text": title or f"one stage of {L} layers: what each F, B and W waits for"},
                      xaxis={"visible": False}, yaxis={"visible": False, "range": [-0.6, 2.6]},
                      height=320, plot_bgcolor="white", legend={"orientation": "h", "y": -0.05})
    return fig


# ---------------------------------------------------------------------------- schedules on one time axis

CHAIN_COLOR = "#111111"
"""Outline of the actions on a timeline's critical path."""

PANEL_COLORS = ("#333333", "#C0392B", "#1F6FB2", "#7B4173")
"""Memory line of the first, second, ... panel of :func:`schedules_figure`."""


def chain_trace(timeline: Timeline, comm: float = 0.0) -> dict[str, Any]:
    """A bar trace outlining every action on ``timeline``'s critical path, F's, B's and W's alike
    (:func:`~zbpp_lite.analysis.profiling.timelines.critical_path`; times from the first start)."""
    t0 = start_time(timeline)
    chain = critical_path(timeline, comm)
    return {"type": "bar", "orientation": "h", "name": "critical path (sets the end)",
            "legendgroup": "chain", "base": [e.start - t0 for e in chain], "x": [e.duration for e in chain],
            "y": [e.rank for e in chain], "width": BAR_WIDTH, "hoverinfo": "skip",
            "marker": {"color": "rgba(0,0,0,0)", "line": {"color": CHAIN_COLOR, "width": 3}}}


def moved_w(before: Timeline, after: Timeline) -> list[tuple[Event, Event]]:
    """(where the W ran in ``before``, the W in ``after``) for each W of ``after`` moved into its rank's
    cool-down: run after the rank's last B, later than right after its own B, where the rank would
    otherwise idle waiting for the other ranks' B's (arXiv 2401.10241 section 3). ``before``'s event is the
    W of the same stage and microbatch, or the BW holding it; a W ``before`` lacks is left out."""
    where = {(e.action.kind, e.action.stage, e.action.microbatch): e for e in before.events}
    own_b = {(e.action.stage, e.action.microbatch): e for e in after.events if e.action.kind == "B"}
    moved = []
    for r in range(after.num_ranks):
        row = after.rank_events(r)
        last_b = max((e.end for e in row if e.action.kind in ("B", "BW")), default=math.inf)
        for w in (e for e in row if e.action.kind == "W" and e.start >= last_b - 1e-9):
            key = (w.action.stage, w.action.microbatch)
            old = where.get(("W", *key)) or where.get(("BW", *key))
            if old is not None and key in own_b and w.start > own_b[key].end + 1e-9:
                moved.append((old, w))
    return moved


def _domain_y(domains: tuple[Sequence[float], Sequence[float]], num_ranks: int, rank: float, panel: int
              ) -> float:
    """``rank``'s place on panel ``panel`` (0 or 1) of two rank axes (:func:`rank_axis`) drawn over
    ``domains`` (paper coordinates), as a fraction of the second panel's domain (Plotly's "y2 domain")."""
    d = domains[panel]
    paper = d[0] + (d[1] - d[0]) * (num_ranks - 0.5 - rank) / num_ranks
    return (paper - domains[1][0]) / (domains[1][1] - domains[1][0])


def move_arrows(before: Timeline, after: Timeline, domains: tuple[Sequence[float], Sequence[float]],
                yref: str = "y2") -> list[dict[str, Any]]:
    """Arrows of :func:`moved_w`, from the W's share of its old bar (``before``'s panel, y ``domains[0]``)
    to the W in ``after``'s panel (``domains[1]``, y axis ``yref``), on the shared time axis."""
    b0, a0, p = start_time(before), start_time(after), after.num_ranks
    arrows = []
    for old, w in moved_w(before, after):
        tail = old.end - (old.duration if old.action.kind == "W" else w.duration) / 2 - b0
        arrows.append({"x": (w.start + w.end) / 2 - a0, "y": _domain_y(domains, p, w.rank - 0.25, 1),
                       "ax": tail, "ay": _domain_y(domains, p, old.rank + 0.3, 0), "xref": "x",
                       "axref": "x", "yref": f"{yref} domain", "ayref": f"{yref} domain", "text": "",
                       "showarrow": True, "arrowhead": 2, "arrowwidth": 1.3, "arrowcolor": "#2F6B29",
                       "opacity": 0.85, "standoff": 0, "startstandoff": 0})
    return arrows


def _panel_title(name: str, timeline: Timeline) -> str:
    return f"{name}: {stats_text(timeline)}, peak memory {max(timeline.peak_memory, default=0):.4g} M_B"


def schedules_figure(named: Sequence[tuple[str, Timeline]], *, moves: Sequence[int] = (), chain: bool = False,
                     memory_rank: int | None = 0, title: str | None = None, time_unit: str | None = None
                     ) -> go.Figure:
    """Several timelines one above the other on one time axis (the course's headline picture), and beneath
    them one rank's activation memory, one line per timeline.

    Args:
        named: (panel name, timeline) pairs, top to bottom; the same number of ranks.
        moves: panels ``k`` with arrows to panel ``k + 1`` for :func:`moved_w` (W's moved into the
            cool-down, where the rank would idle).
        chain: outline each timeline's critical path (:func:`chain_trace`).
        memory_rank: the rank whose memory is drawn (units of M_B, the timeline's memory limit dashed);
            None: no memory panel.
        time_unit: the x-axis unit (default :func:`time_unit_of`).

    Raises ValueError: no timeline, or timelines with different numbers of ranks.
    """
    p = {t.num_ranks for _, t in named}
    if len(p) != 1:
        raise ValueError("schedules_figure needs one or more timelines with one number of ranks, got "
                         f"{sorted(p) or 'none'}")
    p, n = p.pop(), len(named)
    rows = n + (memory_rank is not None)
    titles = [_panel_title(name, t) for name, t in named]
    if memory_rank is not None:
        titles.append(f"activation memory of rank {memory_rank} (units of M_B)")
    fig = make_subplots(rows=rows, cols=1, shared_xaxes=True, vertical_spacing=0.22 / rows,
                        subplot_titles=titles, row_heights=[1.0] * n + [0.9] * (rows - n))
    seen: set[str] = set()
    for row, (name, t) in enumerate(named, start=1):
        for trace in timeline_traces(t):
            trace["showlegend"] = trace["showlegend"] and trace["legendgroup"] not in seen
            trace["legendrank"] = 100 + BAR_KINDS.index(trace["legendgroup"])
            if len(trace["x"]):
                seen.add(trace["legendgroup"])
            fig.add_trace(go.Bar(trace), row=row, col=1)
        if chain:
            fig.add_trace(go.Bar(chain_trace(t), showlegend=row == 1, legendrank=200), row=row, col=1)
        fig.update_yaxes(rank_axis(p), row=row, col=1)
    if memory_rank is not None:
        _memory_panel(fig, named, memory_rank, rows)
    domains = [fig.get_subplot(row, 1).yaxis.domain for row in range(1, n + 1)]
    for k in moves:
        yref = fig.get_subplot(k + 2, 1).yaxis.plotly_name.replace("axis", "")
        for arrow in move_arrows(named[k][1], named[k + 1][1], (domains[k], domains[k + 1]), yref):
            fig.add_annotation(arrow)
    span = max(end_time(t) - start_time(t) for _, t in named)
    fig.update_xaxes(range=[0, span], zeroline=False, gridcolor=GRID_COLOR)
    fig.update_xaxes(title_text=f"time ({time_unit or time_unit_of(named[0][1])})", row=rows, col=1)
    fig.update_layout(title={"text": title or "schedules on one time axis"}, barmode="overlay", bargap=0.1,
                      uniformtext={"minsize": 8, "mode": "hide"}, plot_bgcolor="white", legend=LEGEND_BOTTOM,
                      height=200 + n * (60 + 30 * p) + (rows - n) * 190,
                      margin={"l": 70, "r": 20, "t": 110, "b": 120})
    return fig


def _memory_panel(fig: go.Figure, named: Sequence[tuple[str, Timeline]], rank: int, row: int) -> None:
    """One rank's memory step line per timeline in ``row`` (colours :data:`PANEL_COLORS`), each timeline's
    memory limit dashed in its colour."""
    top = 0.0
    for k, (name, t) in enumerate(named):
        color = PANEL_COLORS[k % len(PANEL_COLORS)]
        curve = t.memory_curve(rank)
        t0 = start_time(t)
        fig.add_trace(go.Scatter(x=[max(x - t0, 0.0) for x, _ in curve] + [end_time(t) - t0],
                                 y=[v for _, v in curve] + [curve[-1][1]], mode="lines",
                                 line={"shape": "hv", "width": 2.5, "color": color,
                                       "dash": ("solid", "dash", "dot", "dashdot")[k % 4]},
                                 name=f"memory: {name}", legendgroup=f"memory{k}", legendrank=300 + k,
                                 hovertemplate=f"time %{{x:.4~g}}<br>%{{y:.4~g}} M_B<extra>{name}</extra>"),
                      row=row, col=1)
        top = max(top, *(v for _, v in curve), t.memory_limit or 0.0)
        if t.memory_limit is not None:
            fig.add_hline(y=t.memory_limit, line={"color": color, "dash": "dash", "width": 1}, row=row, col=1,
                          annotation_text=f"limit {t.memory_limit:g}", annotation_position="top left",
                          annotation_font_color=color)
    fig.update_yaxes(title_text="M_B", range=[0, 1.15 * top or 1], gridcolor=GRID_COLOR, row=row, col=1)
