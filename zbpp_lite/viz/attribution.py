"""Figure of a bubble attribution: the timeline with each idle stretch coloured by its cause, and idle
time per blamed stage stacked by cause (causes: :mod:`zbpp_lite.analysis.attribute`, arXiv 2401.10241
sections 2-3)."""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..analysis.attribute import CAUSES, Attribution
from ..schedules.timeline import Timeline
from .figures import BAR_WIDTH, GRID_COLOR, LEGEND_TOP, rank_axis, start_time, timeline_traces

CAUSE_COLOR: dict[str, str] = {
    "warm-up": "#9ECAE9",
    "cool-down": "#9D755D",
    "imbalance": "#E45756",
    "communication": "#EECA3B",
    "no W to fill": "#FF9DA6",
    "W held back": "#72B7B2",
    "overhead": "#D8D8D8",
}
"""Cause (:data:`zbpp_lite.analysis.attribute.CAUSES`) -> bar colour (Tableau 10 tones; the action bars of
this figure are grey, :data:`ACTION_GREY`)."""


ACTION_GREY: dict[str, str] = {"F": "#D4D4D4", "B": "#C2C2C2", "W": "#E8E8E8", "BW": "#C2C2C2",
                               "idle": "#FFFFFF"}
"""Actions are drawn in greys (darker for backward) so that the idle stretches' colours stand out;
hovering a bar still names its action."""


def attribution_figure(attribution: Attribution, timeline: Timeline, title: str | None = None) -> go.Figure:
    """Two panels of ``attribution`` (:func:`zbpp_lite.analysis.attribute.attribute` of ``timeline``): the
    timeline (actions in :data:`ACTION_GREY`) with idle stretches in their cause's colour; below, per blamed
    stage, idle time stacked by cause; ``title`` default "where the bubbles come from (...)".

    Returns a new ``go.Figure``: 5 action traces, one idle trace per cause (:data:`CAUSES` order), then one
    bar trace per cause; times from 0, milliseconds for measured timelines. Raises ValueError: an
    attribution of another timeline (different rank count).
    """
    if attribution.num_ranks != timeline.num_ranks:
        raise ValueError(f"the attribution has {attribution.num_ranks} ranks but the timeline "
                         f"{timeline.num_ranks}")
    scale, unit = (1e3, "ms") if timeline.source == "measured" else (1.0, "units of the costs")
    t0 = start_time(timeline)
    fig = make_subplots(rows=2, cols=1, row_heights=[0.6, 0.4], vertical_spacing=0.22,
                        subplot_titles=("idle stretches by cause", "idle time by the stage it is blamed on"))
    for trace in timeline_traces(timeline, show_idle=False, show_labels=False, showlegend=False, scale=scale):
        trace["marker"].update(color=ACTION_GREY[trace["legendgroup"]], opacity=1.0)
        fig.add_trace(go.Bar(trace), row=1, col=1)
    for cause in CAUSES:
        gaps = [g for g in attribution.gaps if g.cause == cause]
        fig.add_trace(
            go.Bar(
                orientation="h", name=cause, legendgroup=cause, showlegend=bool(gaps),
                base=[(g.start - t0) * scale for g in gaps], x=[g.duration * scale for g in gaps],
                y=[g.rank for g in gaps], width=BAR_WIDTH, marker={"color": CAUSE_COLOR[cause]},
                customdata=[["-" if g.stage is None else g.stage, "end" if g.before is None
                             else str(g.before)] for g in gaps],
                hovertemplate=f"{cause}<br>%{{x:.4~g}} {unit}, blamed on stage %{{customdata[0]}}"
                              "<br>before %{customdata[1]}<extra>%{y}</extra>",
            ),
            row=1, col=1,
        )
    stages = attribution.by_stage()
    labels = ["none" if s is None else f"stage {s}" for s in stages]
    offsets = [0.0] * len(labels)  # stacked by hand: the figure's overlay mode would hide bars
    for cause in CAUSES:
        values = [row[cause] * scale for row in stages.values()]
        fig.add_trace(go.Bar(orientation="h", name=cause, legendgroup=cause, showlegend=False, base=offsets,
                             x=values, y=labels, marker={"color": CAUSE_COLOR[cause]},
                             hovertemplate=f"{cause}: %{{x:.4~g}} {unit}<extra>%{{y}}</extra>"), row=2, col=1)
        offsets = [o + v for o, v in zip(offsets, values)]
    p = timeline.num_ranks
    fig.update_layout(
        title={"text": title or f"where the bubbles come from ({timeline.source}, makespan "
               f"{timeline.makespan * scale:.4g} {unit})"},
        barmode="overlay", plot_bgcolor="white", height=300 + 40 * p + 26 * len(labels),
        legend=LEGEND_TOP, margin={"l": 80, "r": 20, "t": 90, "b": 45},
    )
    fig.update_yaxes(rank_axis(p), row=1, col=1)
    fig.update_xaxes(title_text=f"time ({unit})", gridcolor=GRID_COLOR, row=1, col=1)
    fig.update_xaxes(title_text=f"idle time ({unit})", gridcolor=GRID_COLOR, row=2, col=1)
    fig.update_yaxes(autorange="reversed", row=2, col=1)
    return fig
