"""The summary of a comparison: step time and bubble rate per schedule, measured beside planned (no JAX)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .figures import GRID_COLOR

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
    ranked = sorted(rows, key=lambda r: r.step_ms,
                    reverse=True)  # Plotly draws the first category at the bottom
    names = [r.name for r in ranked]
    fig = make_subplots(rows=1, cols=2, shared_yaxes=True, horizontal_spacing=0.04,
                        subplot_titles=["step time (ms), median of the timed steps", "bubble rate"])
    for col, (meas, plan, fmt) in enumerate(
        ((lambda r: r.step_ms, lambda r: r.planned_ms, ".1f"),
         (lambda r: r.bubble_rate, lambda r: r.planned_bubble_rate, ".3f")), start=1
    ):
        fig.add_trace(go.Bar(y=names, x=[meas(r) for r in ranked], orientation="h", name="measured",
                             marker_color=MEASURED_COLOR,
                             legendgroup="measured", showlegend=col == 1,
                             text=[format(meas(r), fmt) for r in ranked],
                             textposition="outside",
                             hovertemplate="%{y}: %{x:" + fmt + "} measured<extra></extra>"), row=1, col=col)
        fig.add_trace(go.Bar(y=names, x=[plan(r) for r in ranked], orientation="h",
                             name="planned (simulator, measured costs)",
                             marker_color=PLANNED_COLOR, legendgroup="planned", showlegend=col == 1,
                             text=[format(plan(r), fmt) for r in ranked], textposition="outside",
                             hovertemplate="%{y}: %{x:" + fmt + "} planned<extra></extra>"), row=1, col=col)
    if reference is not None:
        fig.add_vline(x=reference[1], line_dash="dash", line_color="#555", row=1, col=1,
                      annotation_text=f"{reference[0]}: {reference[1]:.1f} ms", annotation_position="top")
    fig.update_xaxes(gridcolor=GRID_COLOR, zeroline=False)
    fig.update_layout(barmode="group", height=140 + 46 * len(rows), plot_bgcolor="white",
                      title={"text": title or "schedules ranked"},
                      legend={"orientation": "h", "yanchor": "bottom", "y": 1.06, "xanchor": "right",
                              "x": 1.0},
                      margin={"l": 120, "r": 30, "t": 90, "b": 40})
    return fig
