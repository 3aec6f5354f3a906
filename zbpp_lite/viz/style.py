"""One colour and label table for every action kind, shared by figures, grids and traces: colour-blind-safe
Tableau 10; idle time hatched light grey."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KindStyle:
    """How one kind of bar looks.

    Attributes:
        name: legend entry.
        color: fill colour (CSS hex).
        text_color: colour of the microbatch label drawn on the bar.
        pattern: Plotly bar pattern shape ("" for solid, "/" for hatched).
    """

    name: str
    color: str
    text_color: str
    pattern: str = ""


KIND_STYLE: dict[str, KindStyle] = {
    "F": KindStyle("F (forward)", "#4C78A8", "white"),
    "B": KindStyle("B (input gradient)", "#F58518", "black"),
    "W": KindStyle("W (weight gradient)", "#54A24B", "white"),
    "BW": KindStyle("BW (fused backward)", "#B279A2", "white"),
    "idle": KindStyle("idle", "#D9D9D9", "black", "/"),
}
"""Kind ("F", "B", "W", "BW", or "idle") -> :class:`KindStyle`. The only colour table."""

BAR_KINDS = ("F", "B", "W", "BW", "idle")
"""Trace order in timeline figures: one trace per kind, idle last."""

MEMORY_LIMIT_COLOR = "#E45756"
"""Colour of the memory-limit line."""
