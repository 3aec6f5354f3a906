"""Activation memory figures: planned per rank over time, per stage at each rank's peak, and measured
bytes beside the plan.

Memory model (arXiv 2401.10241 section 2.1): F adds M_B at its start, B frees M_B - M_W and W frees M_W
at their end, BW frees M_B (:meth:`zbpp_lite.Timeline.memory_curve`). With several stages per rank a
rank's memory sums its stages'; the V placement pairs stage r (many microbatches in flight) with stage
2p-1-r (few), so every rank's sum is the same (arXiv 2405.15362 section 3). Measured: bytes a rank's own
actions kept, and those plus received-not-yet-consumed (:class:`~zbpp_lite.schedules.memory.MeasuredMemory`).
"""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..schedules.costs import Costs, CostTable
from ..schedules.memory import MeasuredMemory, add_curves
from ..schedules.timeline import Timeline
from .figures import GRID_COLOR, LEGEND_TOP, end_time, rank_label, start_time, time_unit_of
from .style import MEMORY_LIMIT_COLOR

MEASURED_STYLES = (
    {"name": "measured: kept by the rank's actions", "line": {"color": "#4C78A8", "width": 2.5}},
    {"name": "plan: F +M_B, B -(M_B-M_W), W -M_W (measured M_B, M_W)",
     "line": {"color": "#E45756", "width": 2, "dash": "dash"}},
    {"name": "measured + received, not yet consumed",
     "line": {"color": "#72B7B2", "width": 1.5, "dash": "dot"}},
)
"""Line styles of :func:`measured_memory_figure`'s three curves per rank."""


def _steps(curve: list[tuple[float, float]], timeline: Timeline, scale: float = 1.0) -> dict[str, Any]:
    """A step-line trace of ``curve`` ((time, value) pairs), times from the timeline's first start to its
    last end, times ``scale``."""
    t0, t1 = start_time(timeline), end_time(timeline)
    return {"type": "scatter", "mode": "lines", "x": [scale * max(t - t0, 0.0) for t, _ in [*curve, (t1, 0)]],
            "y": [v for _, v in curve] + [curve[-1][1]]}


def memory_traces(timeline: Timeline, costs: Costs | CostTable | None = None) -> list[dict[str, Any]]:
    """One step line per rank: activation memory over time (times shifted to start at 0)."""
    return [{**_steps(timeline.memory_curve(rank, costs), timeline), "line": {"shape": "hv", "width": 2},
             "name": rank_label(rank),
             "hovertemplate": "time %{x:.4~g}<br>memory %{y:.4~g}<extra>%{fullData.name}</extra>"}
            for rank in range(timeline.num_ranks)]


def memory_layout(
    timeline: Timeline,
    memory_limit: float | None = None,
    title: str | None = None,
    memory_unit: str = "M_B",
) -> dict[str, Any]:
    """Layout for :func:`memory_traces`: dashed ``memory_limit`` (default ``timeline.memory_limit``), peak in
    the title."""
    limit = timeline.memory_limit if memory_limit is None else memory_limit
    peak = max(timeline.peak_memory, default=0.0)
    text = f"{title}: " if title else ""
    text += f"activation memory per rank, peak {peak:.4g}"
    shapes, notes = [], []
    if limit is not None:
        text += f" (limit {limit:.4g})"
        line = {"color": MEMORY_LIMIT_COLOR, "dash": "dash", "width": 2}
        shapes.append({"type": "line", "xref": "paper", "x0": 0, "x1": 1, "yref": "y", "y0": limit,
                       "y1": limit, "line": line})
        notes.append({"text": f"memory limit {limit:.4g}", "xref": "paper", "x": 0, "xanchor": "left",
                      "yref": "y", "y": limit, "yanchor": "bottom", "showarrow": False,
                      "font": {"color": MEMORY_LIMIT_COLOR}})
    top = max(peak, limit or 0.0)
    return {
        "title": {"text": text},
        "xaxis": {"title": {"text": f"time ({time_unit_of(timeline)})"}, "gridcolor": GRID_COLOR},
        "yaxis": {"title": {"text": f"activation memory ({memory_unit})"},
                  "range": [0, 1.12 * top if top > 0 else 1], "gridcolor": GRID_COLOR},
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
    """Activation memory over time, one step line per rank, with the memory limit dashed.

    Args:
        costs: M_B and M_W; default those of the timeline's ``peak_memory`` (else ``Costs()``: M_B = 1,
            M_W = 7/16); must match the timeline's stages.
        memory_limit: default ``timeline.memory_limit`` (none if both are None); unit of M_B.
        memory_unit: y-axis unit text.
    """
    return go.Figure(
        data=[go.Scatter(t) for t in memory_traces(timeline, costs)],
        layout=memory_layout(timeline, memory_limit, title, memory_unit),
    )


# ---------------------------------------------------------------------------- per stage


def memory_by_stage(timeline: Timeline, costs: Costs | CostTable | None = None) -> list[dict[int, float]]:
    """``result[rank][stage]``: memory each stage holds at the rank's first peak (units of M_B).

    ``costs`` give M_B, M_W per stage (default ``Costs()``); with the costs the timeline was simulated
    with, a rank's values sum to ``timeline.peak_memory[rank]``.
    """
    result = []
    for rank in range(timeline.num_ranks):
        changes = timeline.memory_changes(rank, costs or Costs())
        held: dict[int, float] = {s: 0.0 for _, _, s in changes}
        best, at_best = -1.0, dict(held)
        for _, delta, stage in changes:
            held[stage] += delta
            if sum(held.values()) > best + 1e-12:
                best, at_best = sum(held.values()), dict(held)
        result.append(at_best)
    return result


def stage_memory_figure(
    timeline: Timeline, costs: Costs | CostTable | None = None, *, title: str | None = None,
    memory_unit: str = "M_B"
) -> go.Figure:
    """Stacked bars, one per rank, of :func:`memory_by_stage`: one bar trace per stage position ("first
    stage", ...), hover naming the stage."""
    split = memory_by_stage(timeline, costs)
    names = ["first", "second", "third", "fourth"]
    fig = go.Figure()
    for k in range(max((len(d) for d in split), default=0)):
        shown = [(rank, sorted(held)[k], held) for rank, held in enumerate(split) if k < len(held)]
        label = f"{names[k] if k < len(names) else str(k + 1) + 'th'} stage on the rank"
        fig.add_trace(go.Bar(x=[rank_label(r) for r, _, _ in shown], y=[held[s] for _, s, held in shown],
                             name=label, text=[f"stage {s}" for _, s, _ in shown], textposition="inside"))
    fig.update_layout(barmode="stack", title=title or "activation memory at each rank's peak, by stage",
                      yaxis_title=f"activation memory ({memory_unit})", height=360)
    return fig


# ---------------------------------------------------------------------------- measured


def _measured(timeline: Timeline) -> MeasuredMemory:
    if timeline.measured_memory is None:
        raise ValueError("this timeline has no measured memory: give a measured Timeline from "
                         "PipelineExecutor (record_memory=True)")
    return timeline.measured_memory


def measured_memory_figure(timeline: Timeline, *, title: str | None = None,
        time_unit: str = "s") -> go.Figure:
    """Measured and planned activation memory, one panel per rank, bytes over ``time_unit`` ("s" or "ms");
    per rank: measured, the plan on the same events with the measured M_B, M_W, measured + received
    (:data:`MEASURED_STYLES`). Panel titles give each rank's measured / planned peak (1: exactly as
    planned) and the measured peak in KiB.

    Raises:
        ValueError: a timeline without ``measured_memory`` (give ``PipelineExecutor``'s).
    """
    memory = _measured(timeline)
    planned, p = timeline.planned_peak_bytes, timeline.num_ranks
    ratios = [m / q if q else float("nan") for m, q in zip(memory.peak_bytes, planned)]
    titles = [f"{rank_label(r)}: peak {memory.peak_bytes[r] / 1024:.4g} KiB measured, "
              f"measured / planned {ratios[r]:.4g}" for r in range(p)]
    fig = make_subplots(rows=p, cols=1, shared_xaxes=True, vertical_spacing=0.06, subplot_titles=titles)
    scale = {"s": 1.0, "ms": 1e3}[time_unit]
    for r in range(p):
        curves = (memory.held[r], timeline.memory_curve(r, memory.costs()),
                  add_curves(memory.held[r], memory.received[r]))
        for curve, style in zip(curves, MEASURED_STYLES):
            fig.add_trace(go.Scatter(
                _steps(curve, timeline, scale), name=style["name"], line={**style["line"], "shape": "hv"},
                legendgroup=style["name"], showlegend=r == 0,
                hovertemplate=f"{rank_label(r)}<br>time %{{x:.4~g}} {time_unit}<br>%{{y:,}} "
                              "bytes<extra>%{fullData.name}</extra>"), row=r + 1, col=1)
        fig.update_yaxes(title_text="bytes", rangemode="tozero", gridcolor=GRID_COLOR, row=r + 1, col=1)
    fig.update_xaxes(gridcolor=GRID_COLOR)
    fig.update_xaxes(title_text=f"time ({time_unit})", row=p, col=1)
    head = f"{title}: " if title else ""
    fig.update_layout(title={"text": f"{head}activation memory per rank, measured beside the plan"},
                      height=140 + 170 * p, plot_bgcolor="white", legend=LEGEND_TOP,
                      margin={"l": 80, "r": 20, "t": 100, "b": 45})
    return fig


def memory_lines(timeline: Timeline) -> list[str]:
    """Per rank a text line: measured and planned peak bytes, their ratio, the peak with received bytes, and
    the device's peak where known; empty without ``measured_memory``."""
    memory = timeline.measured_memory
    if memory is None:
        return []
    planned = timeline.planned_peak_bytes
    lines = ["activation memory per rank (bytes kept for the schedule; plan with measured "
             f"M_B {list(memory.mem_b)}, M_W {list(memory.mem_w)} per stage):"]
    for r in range(timeline.num_ranks):
        device = memory.device_peak[r] if r < len(memory.device_peak) else None
        ratio = memory.peak_bytes[r] / planned[r] if planned[r] else float("nan")
        lines.append(
            f"  {rank_label(r)}: measured peak {memory.peak_bytes[r]:,}  planned {int(planned[r]):,}  "
            f"measured / planned {ratio:.4f}  "
            f"with received {memory.peak_total_bytes[r]:,}  device memory_stats() peak "
            + (f"{device:,}" if device is not None else "n/a")
        )
    return lines
