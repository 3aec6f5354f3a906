"""The summary of a run or a comparison: step time and bubble rate per schedule, measured beside planned;
the loss over the steps beside the held-out loss (no JAX)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .figures import GRID_COLOR, LEGEND_TOP

MEASURED_COLOR = "#1F5FAD"
PLANNED_COLOR = "#9DB9DE"


@dataclass(frozen=True)
class SummaryRow:
    """One schedule of a comparison.

    Attributes:
        name: the schedule's name.
        step_ms: measured median step time, ms.
        planned_ms: the simulator's makespan for the measured action costs, ms.
        bubble_rate: measured median bubble rate (0..1).
        planned_bubble_rate: the simulator's bubble rate for the same costs (0..1).
    """

    name: str
    step_ms: float
    planned_ms: float
    bubble_rate: float
    planned_bubble_rate: float


def summary_figure(rows: Sequence[SummaryRow], title: str | None = None,
        reference: tuple[str, float] | None = None) -> go.Figure:
    """Two panels, fastest schedule on top: step time (ms) and bubble rate, measured (dark) beside planned
    (light); ``reference`` ``(name, ms)``, a single-device step, is a dashed line. Raises ValueError: no
    rows."""
    if not rows:
        raise ValueError("summary_figure needs at least one schedule")
    ranked = sorted(rows, key=lambda r: r.step_ms, reverse=True)  # Plotly draws the first category lowest
    names = [r.name for r in ranked]
    fig = make_subplots(rows=1, cols=2, shared_yaxes=True, horizontal_spacing=0.04,
                        subplot_titles=["step time (ms), median of the timed steps", "bubble rate"])
    panels = ((".1f", [r.step_ms for r in ranked], [r.planned_ms for r in ranked]),
              (".3f", [r.bubble_rate for r in ranked], [r.planned_bubble_rate for r in ranked]))
    bars = (("measured", "measured", MEASURED_COLOR),
            ("planned", "planned (simulator, measured costs)", PLANNED_COLOR))
    for col, (fmt, *values) in enumerate(panels, start=1):
        for xs, (group, name, color) in zip(values, bars):
            fig.add_trace(go.Bar(
                y=names, x=xs, orientation="h", name=name, marker_color=color, legendgroup=group,
                showlegend=col == 1, text=[format(x, fmt) for x in xs], textposition="outside",
                hovertemplate=f"%{{y}}: %{{x:{fmt}}} {group}<extra></extra>"), row=1, col=col)
    if reference is not None:
        fig.add_vline(x=reference[1], line_dash="dash", line_color="#555", row=1, col=1,
                      annotation_text=f"{reference[0]}: {reference[1]:.1f} ms", annotation_position="top")
    fig.update_xaxes(gridcolor=GRID_COLOR, zeroline=False)
    fig.update_layout(barmode="group", height=140 + 46 * len(rows), plot_bgcolor="white",
                      title={"text": title or "schedules ranked"},
                      legend={**LEGEND_TOP, "y": 1.06},
                      margin={"l": 120, "r": 30, "t": 90, "b": 40})
    return fig


def learning_figure(losses: Sequence[float], validation: Sequence[tuple[int, float]],
                    baseline: float | None = None, title: str | None = None) -> go.Figure:
    """The training loss of every step (light) and the held-out loss after ``k`` steps (dark, ``(k, loss)``
    pairs, e.g. ``TrainResult.validation``) over the steps; ``baseline`` (same unit, e.g. the unigram
    entropy in nats per byte) is a dashed line. Raises ValueError: no held-out point."""
    if not validation:
        raise ValueError("learning_figure needs at least one (step, held-out loss) pair; a run records "
                         "them with RunConfig(eval_every=N)")
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=list(range(1, len(losses) + 1)), y=list(losses), mode="lines",
                             name="training loss (step's batch, before its update)",
                             line={"color": PLANNED_COLOR, "width": 1}))
    fig.add_trace(go.Scatter(x=[k for k, _ in validation], y=[v for _, v in validation], mode="lines+markers",
                             name="validation loss (held-out files, no dropout)",
                             line={"color": MEASURED_COLOR, "width": 2.5}))
    if baseline is not None:
        fig.add_hline(y=baseline, line_dash="dash", line_color="#555",
                      annotation_text=f"unigram baseline {baseline:.3f}", annotation_position="top right")
    fig.update_xaxes(title="steps", gridcolor=GRID_COLOR, zeroline=False)
    fig.update_yaxes(title="loss (nats)",
                     gridcolor=GRID_COLOR, zeroline=False)
    fig.update_layout(height=380, plot_bgcolor="white", title={"text": title or "loss over the steps"},
                      legend={**LEGEND_TOP, "y": 1.02}, margin={"l": 70, "r": 30, "t": 90, "b": 50})
    return fig
