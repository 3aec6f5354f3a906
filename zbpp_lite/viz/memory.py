"""Measured activation memory beside the plan: one panel per rank, bytes over time.

Per rank: bytes its own actions kept (measured), the plan's curve on the same events with the measured
per-stage M_B, M_W (arXiv 2401.10241 section 2.1), and measured plus received-not-yet-consumed bytes
(:class:`~zbpp_lite.schedules.memory.MeasuredMemory`).
"""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..schedules.memory import add_curves
from ..schedules.timeline import Timeline
from .figures import GRID_COLOR, end_time, rank_label, start_time

MEASURED_STYLE = {"name": "measured: kept by the rank's actions", "line": {"color": "#4C78A8", "width": 2.5}}
PLANNED_STYLE = {"name": "plan: F +M_B, B -(M_B-M_W), W -M_W (measured M_B, M_W)",
                 "line": {"color": "#E45756", "width": 2, "dash": "dash"}}
RECEIVED_STYLE = {"name": "measured + received, not yet consumed",
                  "line": {"color": "#72B7B2", "width": 1.5, "dash": "dot"}}


def _steps(curve, t0: float, t1: float) -> tuple[list[float], list[float]]:
    times = [max(t - t0, 0.0) for t, _ in curve] + [max(t1 - t0, 0.0)]
    values = [v for _, v in curve] + [curve[-1][1]]
    return times, values


_SCALE = {"s": 1.0, "ms": 1e3}
"""Time units the memory figures draw in (the timeline's seconds times the factor)."""


def measured_memory_traces(timeline: Timeline, rank: int, showlegend: bool = True,
        time_unit: str = "s") -> list[dict[str, Any]]:
    """Three step lines (bytes) for one rank: measured, plan, measured + received; times from the first
    event. Raises ValueError: a timeline without ``measured_memory``."""
    memory = timeline.measured_memory
    if memory is None:
        raise ValueError("this timeline has no measured memory: give a measured Timeline from "
                         "PipelineExecutor (record_memory=True)")
    t0, t1 = start_time(timeline), end_time(timeline)
    plan = timeline.memory_curve(rank, memory.costs())
    curves = [(memory.held[rank], MEASURED_STYLE), (plan, PLANNED_STYLE),
              (add_curves(memory.held[rank], memory.received[rank]), RECEIVED_STYLE)]
    traces = []
    for curve, style in curves:
        x, y = _steps(curve, t0, t1)
        x = [v * _SCALE[time_unit] for v in x]
        traces.append({
            "type": "scatter", "mode": "lines", **style, "line": {**style["line"], "shape": "hv"}, "x": x,
            "y": y,
            "legendgroup": style["name"], "showlegend": showlegend,
            "hovertemplate": f"{rank_label(rank)}<br>time %{{x:.4~g}} {time_unit}<br>%{{y:,}} "
            f"bytes<extra>%{{fullData.name}}</extra>",
        })
    return traces


def measured_memory_figure(timeline: Timeline, *, title: str | None = None,
        time_unit: str = "s") -> go.Figure:
    """Measured and planned activation memory, one panel per rank, bytes over seconds; the title gives each
    rank's measured / planned peak (1: exactly as planned) and the measured peak in KiB.

    Args:
        timeline: a measured timeline with ``measured_memory`` (``PipelineExecutor``'s).

    Raises:
        ValueError: a timeline without ``measured_memory``.
    """
    memory = timeline.measured_memory
    if memory is None:
        raise ValueError("this timeline has no measured memory: give a measured Timeline from "
                         "PipelineExecutor (record_memory=True)")
    planned = timeline.planned_peak_bytes
    ratios = [m / p if p else float("nan") for m, p in zip(memory.peak_bytes, planned)]
    titles = [f"{rank_label(r)}: peak {memory.peak_bytes[r] / 1024:.4g} KiB measured, "
              f"measured / planned {ratios[r]:.4g}" for r in range(timeline.num_ranks)]
    fig = make_subplots(rows=timeline.num_ranks, cols=1, shared_xaxes=True, vertical_spacing=0.06,
                        subplot_titles=titles)
    for r in range(timeline.num_ranks):
        for trace in measured_memory_traces(timeline, r, showlegend=r == 0, time_unit=time_unit):
            fig.add_trace(go.Scatter(trace), row=r + 1, col=1)
        fig.update_yaxes(title_text="bytes", rangemode="tozero", gridcolor=GRID_COLOR, row=r + 1, col=1)
    fig.update_xaxes(gridcolor=GRID_COLOR)
    fig.update_xaxes(title_text=f"time ({time_unit})", row=timeline.num_ranks, col=1)
    head = f"{title}: " if title else ""
    fig.update_layout(
        title={"text": f"{head}activation memory per rank, measured beside the plan"},
        height=140 + 170 * timeline.num_ranks, plot_bgcolor="white",
        legend={"orientation": "h", "yanchor": "bottom", "y": 1.04, "xanchor": "right", "x": 1.0},
        margin={"l": 80, "r": 20, "t": 100, "b": 45},
    )
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
