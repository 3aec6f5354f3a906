"""Plotly figures of a Timeline, planned (simulated) or measured. Nothing here displays anything:
every function returns a ``plotly.graph_objects.Figure`` for the caller to show, save or test.

Terms and definitions (makespan, bubble rate, M_B) follow Qi et al., "Zero Bubble Pipeline
Parallelism", arXiv 2401.10241, sections 2-3; colours come from :data:`~.style.KIND_STYLE`.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..schedules.costs import Costs, CostTable
from ..schedules.ir import TORCH_CODE
from ..schedules.timeline import Timeline
from .states import plan_timeline
from .style import BAR_KINDS, KIND_STYLE, MEMORY_LIMIT_COLOR

BAR_WIDTH = 0.8
GRID_COLOR = "#E8E8E8"


# ---------------------------------------------------------------------------- pieces


def rank_label(rank: int) -> str:
    """The y-axis category of one rank: ``"rank 0"``."""
    return f"rank {rank}"


def time_unit_of(timeline: Timeline) -> str:
    """Axis unit: seconds for measured timelines, the costs' unit ("T") for simulated ones."""
    return "s" if timeline.source == "measured" else "units of the costs"


def start_time(timeline: Timeline) -> float:
    """Earliest event start (0 for simulated timelines; a clock reading for measured ones)."""
    return min((e.start for e in timeline.events), default=0.0)


def end_time(timeline: Timeline) -> float:
    """Latest event end."""
    return max((e.end for e in timeline.events), default=0.0)


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
    for e in timeline.events:
        stages.setdefault(e.rank, set()).add(e.action.stage)
    return {(r, s): i for r, ss in stages.items() for i, s in enumerate(sorted(ss))}


CHUNK_NOTE = "lighter shade: a rank's later stage (its 2nd or later chunk, in an interleaved or V placement)"


def chunk_note(*timelines: Timeline) -> str | None:
    """The legend's note for the lighter shades, when some rank of ``timelines`` holds several
    stages (otherwise ``None``: every bar is full colour)."""
    return CHUNK_NOTE if any(max(_chunk_index(t).values(), default=0) > 0 for t in timelines) else None


def _add_chunk_note(fig: go.Figure, *timelines: Timeline) -> None:
    note = chunk_note(*timelines)
    if note:
        fig.add_annotation(text=note, xref="paper", yref="paper", x=0.0, y=-0.02, yanchor="top", xanchor="left",
                           showarrow=False, font={"size": 11, "color": "#555"})
        fig.update_layout(margin={"b": 70})


def timeline_traces(
    timeline: Timeline,
    *,
    offset: float | None = None,
    show_idle: bool = True,
    show_labels: bool = True,
    showlegend: bool = True,
    xaxis: str = "x",
    yaxis: str = "y",
) -> list[dict[str, Any]]:
    """Plotly bar traces (as plain dicts of NumPy arrays) for a timeline: one per kind in
    :data:`BAR_KINDS`.

    Every trace is always present (possibly empty), so a figure can be updated in place when the
    timeline changes. Bars are horizontal: ``base`` is the start, ``x`` the duration, ``y`` the
    rank (an integer; the axis labels it ``rank r``); ``customdata`` rows are
    (stage, microbatch, start, end), -1 for the stage and microbatch of idle bars. Ranks that hold several stages (interleaved, V) draw later chunks lighter.
    The idle trace has exactly one bar per entry of ``timeline.idle_gaps``.

    Args:
        timeline: the timeline to draw.
        offset: subtracted from every time (default: the earliest start, so bars start at 0).
        show_idle: draw the idle gaps (the trace stays, empty, when false).
        show_labels: print microbatch numbers on the bars.
        showlegend: legend entries for the non-empty kinds.
        xaxis, yaxis: axis ids for subplots.
    """
    t0 = start_time(timeline) if offset is None else offset
    chunk = _chunk_index(timeline)
    rows: dict[str, list[tuple[float, ...]]] = {k: [] for k in BAR_KINDS}
    for e in timeline.events:  # (rank, start, end, stage, microbatch, chunk)
        a = e.action
        rows[a.kind].append((e.rank, e.start - t0, e.end - t0, a.stage, a.microbatch, chunk[e.rank, a.stage]))
    if show_idle:
        rows["idle"] = [(r, a - t0, b - t0, -1, -1, 0) for r, gaps in enumerate(timeline.idle_gaps) for a, b in gaps]
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
                f" (%{{customdata[0]:d}}{TORCH_CODE[kind]}%{{customdata[1]:d}})"
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
                "xaxis": xaxis,
                "yaxis": yaxis,
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


def timeline_layout(timeline: Timeline, title: str | None = None, time_unit: str | None = None) -> dict[str, Any]:
    """Layout for :func:`timeline_traces`: ranks top to bottom, time axis, stats in the title."""
    return {
        "title": {"text": figure_title(timeline, title)},
        "barmode": "overlay",
        "bargap": 0.1,
        "height": 140 + 34 * timeline.num_ranks,
        "margin": {"l": 70, "r": 20, "t": 60, "b": 45},
        "xaxis": {
            "title": {"text": f"time ({time_unit or time_unit_of(timeline)})"},
            "range": [0, max(end_time(timeline) - start_time(timeline), 1e-12)],
            "zeroline": False,
            "gridcolor": GRID_COLOR,
        },
        "yaxis": rank_axis(timeline.num_ranks),
        "uniformtext": {"minsize": 8, "mode": "hide"},
        "legend": {"orientation": "h", "yanchor": "bottom", "y": 1.0, "xanchor": "right", "x": 1.0},
        "plot_bgcolor": "white",
    }


# ---------------------------------------------------------------------------- figures


def timeline_figure(
    timeline: Timeline,
    title: str | None = None,
    *,
    show_idle: bool = True,
    show_labels: bool = True,
    time_unit: str | None = None,
) -> go.Figure:
    """The pipeline timeline: one row per rank, one bar per action, idle gaps hatched.

    Colours by kind (F, B, W, BW) from :data:`KIND_STYLE`; microbatch numbers on the bars; hover
    gives the action (PyTorch text form), stage, microbatch, start and end. The title names the
    schedule (``title``), the source, the makespan and the bubble rate (arXiv 2401.10241, sec. 3).

    Args:
        timeline: simulated or measured.
        title: usually the schedule name.
        show_idle: draw ``timeline.idle_gaps`` as grey hatched bars.
        show_labels: microbatch numbers on the bars.
        time_unit: x-axis unit text (default: "s" for measured, "units of the costs" otherwise).

    Returns:
        A new ``go.Figure`` with 5 traces, in :data:`BAR_KINDS` order. Times start at 0.
    """
    traces = timeline_traces(timeline, show_idle=show_idle, show_labels=show_labels)
    fig = go.Figure(data=[go.Bar(t) for t in traces], layout=timeline_layout(timeline, title, time_unit))
    _add_chunk_note(fig, timeline)
    return fig


def compare_figure(
    planned: Timeline,
    measured: Timeline,
    *,
    titles: tuple[str, str] = ("planned", "measured"),
    title: str | None = None,
    time_unit: str | None = None,
) -> go.Figure:
    """Planned above measured on one shared time axis, each shifted to start at 0.

    Both timelines must use the same time unit (e.g. simulate with costs profiled in seconds).
    The title gives both makespans and measured / planned.

    Raises:
        ValueError: timelines with different numbers of ranks.
    """
    if planned.num_ranks != measured.num_ranks:
        raise ValueError(
            f"compare_figure needs the same number of ranks, got {planned.num_ranks} planned and "
            f"{measured.num_ranks} measured"
        )
    fig = make_subplots(
        rows=2,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.12,
        subplot_titles=[f"{name}: {stats_text(t)}" for name, t in zip(titles, (planned, measured))],
    )
    for row, (t, legend) in enumerate(((planned, True), (measured, False)), start=1):
        for trace in timeline_traces(t, showlegend=legend):
            fig.add_trace(go.Bar(trace), row=row, col=1)
    for row in (1, 2):
        fig.update_yaxes(rank_axis(planned.num_ranks), row=row, col=1)
    ratio = measured.makespan / planned.makespan if planned.makespan > 0 else float("nan")
    head = f"{title}: " if title else ""
    unit = time_unit or time_unit_of(measured)
    span = max(end_time(t) - start_time(t) for t in (planned, measured))
    fig.update_xaxes(range=[0, max(span, 1e-12)], zeroline=False, gridcolor=GRID_COLOR)
    fig.update_xaxes(title_text=f"time ({unit})", row=2, col=1)
    fig.update_layout(
        title={"text": f"{head}measured / planned makespan = {ratio:.3f}"},
        barmode="overlay",
        height=220 + 2 * 34 * planned.num_ranks,
        uniformtext={"minsize": 8, "mode": "hide"},
        plot_bgcolor="white",
        legend={"orientation": "h", "yanchor": "bottom", "y": 1.04, "xanchor": "right", "x": 1.0},
        margin={"l": 70, "r": 20, "t": 80, "b": 45},
    )
    _add_chunk_note(fig, planned, measured)
    return fig


def memory_traces(timeline: Timeline, costs: Costs | CostTable | None = None) -> list[dict[str, Any]]:
    """One step line per rank: activation memory over time (times shifted to start at 0)."""
    t0, t1 = start_time(timeline), end_time(timeline)
    traces = []
    for rank in range(timeline.num_ranks):
        curve = timeline.memory_curve(rank, costs)
        times = [max(t, t0) - t0 for t, _ in curve] + [t1 - t0]
        values = [v for _, v in curve] + [curve[-1][1]]
        traces.append(
            {
                "type": "scatter",
                "mode": "lines",
                "line": {"shape": "hv", "width": 2},
                "name": rank_label(rank),
                "x": times,
                "y": values,
                "hovertemplate": "time %{x:.4~g}<br>memory %{y:.4~g}<extra>%{fullData.name}</extra>",
            }
        )
    return traces


def memory_layout(
    timeline: Timeline,
    memory_limit: float | None = None,
    title: str | None = None,
    memory_unit: str = "M_B",
) -> dict[str, Any]:
    """Layout for :func:`memory_traces`: the memory limit as a dashed line, peak in the title.

    ``memory_limit`` defaults to ``timeline.memory_limit``; none drawn if both are None.
    """
    limit = timeline.memory_limit if memory_limit is None else memory_limit
    peak = max(timeline.peak_memory, default=0.0)
    text = f"{title}: " if title else ""
    text += f"activation memory per rank, peak {peak:.4g}"
    shapes, notes = [], []
    if limit is not None:
        text += f" (limit {limit:.4g})"
        line = {"color": MEMORY_LIMIT_COLOR, "dash": "dash", "width": 2}
        shapes.append({"type": "line", "xref": "paper", "x0": 0, "x1": 1, "yref": "y", "y0": limit, "y1": limit, "line": line})
        notes.append(
            {"text": f"memory limit {limit:.4g}", "xref": "paper", "x": 0, "xanchor": "left", "yref": "y", "y": limit,
             "yanchor": "bottom", "showarrow": False, "font": {"color": MEMORY_LIMIT_COLOR}}
        )
    top = max(peak, limit or 0.0)
    return {
        "title": {"text": text},
        "xaxis": {"title": {"text": f"time ({time_unit_of(timeline)})"}, "gridcolor": GRID_COLOR},
        "yaxis": {"title": {"text": f"activation memory ({memory_unit})"}, "range": [0, 1.12 * top if top > 0 else 1],
                  "gridcolor": GRID_COLOR},
        "shapes": shapes,
        "annotations": notes,
        "height": 320,
        "margin": {"l": 70, "r": 20, "t": 60, "b": 45},
        "plot_bgcolor": "white",
    }


def memory_figure(
    timeline: Timeline,
    costs: Costs | CostTable | None = None,
    memory_limit: float | None = None,
    *,
    title: str | None = None,
    memory_unit: str = "M_B",
) -> go.Figure:
    """Activation memory over time, one line per rank, with the memory limit drawn.

    Memory model (arXiv 2401.10241, section 2.1): F adds M_B at its start, B frees M_B - M_W and
    W frees M_W at their end, BW frees M_B.

    Args:
        timeline: simulated or measured.
        costs: the memory fields M_B and M_W (default M_B = 1, M_W = 0, so the unit is "one
            stage's activations for one microbatch"); must match the timeline's stages.
        memory_limit: dashed horizontal line; default ``timeline.memory_limit`` (none if both
            are None). Same unit as M_B.
        title: usually the schedule name.
        memory_unit: y-axis unit text.

    Returns:
        A new ``go.Figure`` with one step-line trace per rank.
    """
    return go.Figure(
        data=[go.Scatter(t) for t in memory_traces(timeline, costs)],
        layout=memory_layout(timeline, memory_limit, title, memory_unit),
    )


# ---------------------------------------------------------------------------- bubble sweeps


def bubble_sweep(
    names: Iterable[str],
    num_ranks: int | Sequence[int],
    num_microbatches: int | Sequence[int],
    *,
    costs: Costs | None = None,
    stages_per_rank: int | None = None,
    memory_limit: float | None = None,
) -> tuple[str, list[int], dict[str, list[float | None]]]:
    """Bubble rate of several schedules as p or m varies (the other held fixed).

    Exactly one of ``num_ranks`` and ``num_microbatches`` is a sequence: the swept axis.

    Returns:
        (axis name "num_ranks" or "num_microbatches", the x values, name -> bubble rates),
        with None where the schedule refuses that size.

    Raises:
        ValueError: both or neither of num_ranks and num_microbatches are sequences.
    """
    ranks_swept = not isinstance(num_ranks, int)
    mbs_swept = not isinstance(num_microbatches, int)
    if ranks_swept == mbs_swept:
        raise ValueError(
            "bubble_sweep sweeps one axis: give a sequence for exactly one of num_ranks and "
            f"num_microbatches, got num_ranks={num_ranks!r}, num_microbatches={num_microbatches!r}"
        )
    axis = "num_ranks" if ranks_swept else "num_microbatches"
    xs = [int(x) for x in (num_ranks if ranks_swept else num_microbatches)]  # type: ignore[union-attr]
    rates: dict[str, list[float | None]] = {}
    for name in names:
        row: list[float | None] = []
        for x in xs:
            p, m = (x, num_microbatches) if ranks_swept else (num_ranks, x)
            try:
                t = plan_timeline(
                    name, p, m, stages_per_rank=stages_per_rank, costs=costs, memory_limit=memory_limit  # type: ignore[arg-type]
                )
                row.append(t.bubble_rate)
            except ValueError:
                row.append(None)
        rates[name] = row
    return axis, xs, rates


def bubble_sweep_figure(
    names: Iterable[str],
    num_ranks: int | Sequence[int] = 4,
    num_microbatches: int | Sequence[int] = (4, 8, 12, 16, 24, 32),
    *,
    costs: Costs | None = None,
    stages_per_rank: int | None = None,
    memory_limit: float | None = None,
    title: str | None = None,
) -> go.Figure:
    """Bubble rate against microbatches (or against ranks) for several schedules, one line each.

    Exactly one of ``num_ranks`` / ``num_microbatches`` is a sequence (see :func:`bubble_sweep`);
    sizes a schedule refuses leave a gap in its line.
    """
    axis, xs, rates = bubble_sweep(
        names, num_ranks, num_microbatches, costs=costs, stages_per_rank=stages_per_rank, memory_limit=memory_limit
    )
    xlabel = "ranks p" if axis == "num_ranks" else "microbatches m"
    fixed = f"m = {num_microbatches}" if axis == "num_ranks" else f"p = {num_ranks}"
    fig = go.Figure(
        data=[
            go.Scatter(
                x=xs,
                y=ys,
                mode="lines+markers",
                name=name,
                hovertemplate=f"{name}<br>{xlabel} %{{x}}<br>bubble rate %{{y:.1%}}<extra></extra>",
            )
            for name, ys in rates.items()
        ]
    )
    fig.update_layout(
        title={"text": title or f"bubble rate against {xlabel} ({fixed})"},
        xaxis={"title": {"text": xlabel}, "gridcolor": GRID_COLOR},
        yaxis={"title": {"text": "bubble rate"}, "tickformat": ".0%", "rangemode": "tozero", "gridcolor": GRID_COLOR},
        height=380,
        plot_bgcolor="white",
        margin={"l": 70, "r": 20, "t": 60, "b": 45},
    )
    return fig
