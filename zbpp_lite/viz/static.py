"""Widget-free explorers: one Plotly figure with a layout slider over precomputed timelines, so it moves
where ipywidgets do not render (GitHub, nbviewer, HTML) with no kernel."""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import plotly.graph_objects as go

from ..schedules.builders import SCHEDULES
from ..schedules.timeline import Timeline
from .figures import timeline_layout, timeline_traces
from .states import plan_or_refusal


def slider_figure(
    states: Sequence[tuple[str, Timeline]],
    *,
    slider_label: str = "",
    titles: Sequence[str] | None = None,
    active: int = 0,
) -> go.Figure:
    """A timeline figure with a slider step per (label, timeline) in ``states`` (``[("m=4", t4), ("m=8",
    t8)]``); step ``i`` shows state ``i``'s 5 :func:`~.figures.timeline_traces` and sets title (``titles[i]``,
    default the label), time range and ranks; ``slider_label`` precedes the step's label (``"microbatches:
    "``); step ``active`` shows first. Raises ValueError: no states, or ``titles`` / ``active`` not matching.
    """
    if not states:
        raise ValueError("slider_figure needs at least one (label, timeline) state")
    titles = list(titles) if titles is not None else [label for label, _ in states]
    if len(titles) != len(states):
        raise ValueError(f"slider_figure: {len(titles)} titles for {len(states)} states")
    if not 0 <= active < len(states):
        raise ValueError(f"slider_figure: active must be in 0 .. {len(states) - 1}, got {active}")
    per_state = len(timeline_traces(states[0][1]))
    data = []
    for i, (_, t) in enumerate(states):
        for trace in timeline_traces(t):
            trace["visible"] = i == active
            data.append(go.Bar(trace))
    layout = timeline_layout(states[active][1], titles[active])
    layout["height"] = 140 + 34 * max(t.num_ranks for _, t in states) + 80
    steps = []
    for i, ((label, t), head) in enumerate(zip(states, titles)):
        visible = [j // per_state == i for j in range(len(data))]
        own = timeline_layout(t, head)  # what the step changes: title, time range, ranks
        relayout = {"title.text": own["title"]["text"], "xaxis.range": own["xaxis"]["range"],
                    **{f"yaxis.{k}": own["yaxis"][k] for k in ("tickvals", "ticktext", "range")}}
        steps.append({"method": "update", "label": label, "args": [{"visible": visible}, relayout]})
    layout["sliders"] = [
        {"active": active, "currentvalue": {"prefix": slider_label}, "pad": {"t": 50}, "steps": steps}
    ]
    return go.Figure(data=data, layout=layout)


def microbatch_slider_figure(name: str, num_ranks: int = 4,
                             num_microbatches: Iterable[int] = (1, 2, 4, 8, 12, 16), **options: Any
                             ) -> go.Figure:
    """One schedule's timeline with a slider over m (``options``: :func:`~.states.plan_timeline`'s
    ``costs``, ``stages_per_rank``, ``memory_limit``); sizes the schedule refuses are left out. Raises
    ValueError: the schedule refuses every m given (the last refusal's message)."""
    return _planned_slider([(f"m={m}", name, m) for m in num_microbatches], num_ranks, options,
                           f"{name} refused every microbatch count given", "microbatches ", name)


def schedule_slider_figure(names: Iterable[str] | None = None, num_ranks: int = 4, num_microbatches: int = 8,
                           **options: Any) -> go.Figure:
    """One slider step per schedule (default: all registered) at the same p, m and ``options`` (as
    :func:`microbatch_slider_figure`'s); refusing ones are left out. Raises ValueError: every schedule
    refused (the last refusal's message)."""
    steps = [(name, name, num_microbatches) for name in (SCHEDULES if names is None else names)]
    return _planned_slider(steps, num_ranks, options, f"every schedule refused p={num_ranks}, "
                           f"m={num_microbatches}", "schedule: ")


def _planned_slider(steps: list[tuple], num_ranks: int, options: dict, refused: str, slider_label: str,
                    title: str | None = None) -> go.Figure:
    """:func:`slider_figure` of each (label, schedule, m) of ``steps`` the schedule accepts (titles:
    ``title``, else the labels); ValueError ``refused: <last refusal>`` when none does."""
    planned = [(label, plan_or_refusal(name, num_ranks, m, **options)) for label, name, m in steps]
    states = [(label, t) for label, t in planned if not isinstance(t, ValueError)]
    if not states:
        raise ValueError(f"{refused}: {planned[-1][1] if planned else None}")
    titles = [title] * len(states) if title else None
    return slider_figure(states, slider_label=slider_label, titles=titles)
