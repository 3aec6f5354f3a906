"""Activation memory per rank *and per stage* at the rank's peak, as numbers and stacked bars (no JAX).

With several stages per rank a rank's memory sums its stages'. The V placement pairs stage r (many
microbatches in flight) with stage 2p-1-r (few), so every rank's sum is the same (arXiv 2405.15362
section 3). Memory model: :meth:`zbpp_lite.Timeline.memory_curve`.
"""

from __future__ import annotations

import plotly.graph_objects as go

from ..schedules.costs import Costs, CostTable
from ..schedules.timeline import Timeline


def _table(timeline: Timeline, costs: Costs | CostTable | None) -> CostTable:
    stages = 1 + max((e.action.stage for e in timeline.events), default=0)
    return costs.table(stages) if isinstance(costs, Costs) else (costs or Costs().table(stages))


def memory_by_stage(timeline: Timeline, costs: Costs | CostTable | None = None) -> list[dict[int, float]]:
    """``result[rank][stage]``: memory each stage holds at the rank's first peak (units of M_B).

    ``costs`` give M_B, M_W per stage (default M_B = 1, M_W = 0); with the costs the timeline was simulated
    with, a rank's values sum to ``timeline.peak_memory[rank]``.
    """
    table = _table(timeline, costs)
    result = []
    for rank in range(timeline.num_ranks):
        changes = []
        for e in timeline.rank_events(rank):
            delta = table.memory_delta(e.action.kind, e.action.stage)
            changes.append((e.start if delta > 0 else e.end, delta, e.action.stage))
        changes.sort(key=lambda c: (c[0], c[1]))
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
    """Stacked bars, one per rank, of :func:`memory_by_stage` (``title`` default: the peaks).

    Returns:
        A new ``go.Figure``, one bar trace per stage position ("first stage", ...), hover naming the stage.
    """
    split = memory_by_stage(timeline, costs)
    depth = max((len(d) for d in split), default=0)
    names = ["first", "second", "third", "fourth"]
    traces = []
    for k in range(depth):
        ranks, values, text = [], [], []
        for rank, held in enumerate(split):
            stages = sorted(held)
            if k < len(stages):
                ranks.append(f"rank {rank}")
                values.append(held[stages[k]])
                text.append(f"stage {stages[k]}")
        label = f"{names[k] if k < len(names) else str(k + 1) + 'th'} stage on the rank"
        traces.append(go.Bar(x=ranks, y=values, name=label, text=text, textposition="inside"))
    fig = go.Figure(traces)
    fig.update_layout(
        barmode="stack",
        title=title or "activation memory at each rank's peak, by stage",
        yaxis_title=f"activation memory ({memory_unit})",
        height=360,
    )
    return fig
