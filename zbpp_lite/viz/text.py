"""A text grid of a Timeline for terminals (``python -m zbpp_lite plan``): one row per rank, time left to
right, idle columns ``.``."""

from __future__ import annotations

import math
from operator import attrgetter

import numpy as np

from ..schedules.timeline import Event, Timeline

IDLE = "."
FOLDED = "*"
SHORT = {"F": "F", "B": "B", "W": "W", "BW": "X"}
"""One letter per kind, for an action too narrow for its label (BW would read as B)."""
DEFAULT_MAX_WIDTH = 160


def _label(e: Event, with_stage: bool) -> str:
    base = f"{e.action.kind}{e.action.microbatch}"
    return f"{e.action.stage}{base}" if with_stage else base


def text_grid(timeline: Timeline, width: int | None = None, *, header: bool = True) -> str:
    """Render ``timeline`` as text: ``width`` time columns (default: the shortest action shows its label
    plus one column, at most 160), after a ``header`` line with makespan, bubble rate and time per column.

    Returns one string (lines joined by ``\n``, no trailing newline); row ``r`` is ``"rank r |"`` then
    ``width`` columns. Every action shows, in order: its label (``F12``; ``5F3`` plus a blank where a rank
    holds several stages) if it fits, else its kind (``F``, ``B``, ``W``, ``X`` for ``BW``); columns shared
    by several actions show ``*``, and a last line says how many and which ``width`` shows all labels.
    An optimizer instruction (an instant in a lowered program's timeline) is not drawn. Raises ValueError:
    ``width`` below 1, or an action's time not finite.
    """
    if width is not None and width < 1:
        raise ValueError(f"text_grid: width must be >= 1 column, got {width}")
    ranks = timeline.action_rows  # an optimizer instruction is an instant: not drawn
    events = [e for row in ranks for e in row]
    t0 = min(map(attrgetter("start"), events), default=0.0)
    span = max(map(attrgetter("end"), events), default=0.0) - t0
    rank_times = [_times(row, t0) for row in ranks]
    with_stage = timeline.several_stages
    extents = _extents(events, with_stage)
    if width is None:
        shortest = min((d for _, d in extents if d > 0), default=1.0)
        longest_label = max((n for n, _ in extents), default=1)
        width = int(round(span * (longest_label + 1) / shortest)) if span > 0 else 1
        width = max(1, min(width, DEFAULT_MAX_WIDTH))
    scale = width / span if span > 0 else 0.0
    rows, shortened, shared = [], 0, 0
    for rank in range(timeline.num_ranks):
        cells, owner = _rank_cells(ranks[rank], rank_times[rank], scale, width)
        for e, c0, c1 in owner:
            own = [c for c in range(c0, c1) if cells[c] is None]  # columns no other action touches
            text = _label(e, with_stage)
            # "F12B12" reads unambiguously, "0F12F0" does not: with stages, a blank before the next action
            room = len(own) - (1 if with_stage and own[-1] + 1 < width and cells[own[-1] + 1] != IDLE else 0)
            if len(text) > room:
                text, shortened = SHORT[e.action.kind], shortened + 1
            fill = (text + " " * len(own))[: len(own)]
            for c, ch in zip(own, fill, strict=True):
                cells[c] = ch
        shared += sum(c == FOLDED for c in cells)
        rows.append(f"rank {rank:<{len(str(timeline.num_ranks - 1))}} |" + "".join(cells))
    if header:
        per_col = span / width if width else 0.0
        rows.insert(
            0,
            f"{timeline.source}: makespan {timeline.makespan:.4g}, bubble rate {timeline.bubble_rate:.1%}, "
            f"1 column = {per_col:.3g} time units, '{IDLE}' = idle",
        )
    if shortened or shared:
        extra = 2 if with_stage else 1  # the blank, and one column that rounding may take
        need = max((span * (n + extra) / d for n, d in extents if d > 0), default=1)
        parts = ([f"{shortened} label(s) shortened to the kind (X = BW)"] if shortened else []) + (
            [f"{shared} column(s) shared by several actions ('{FOLDED}')"] if shared else []
        )
        rows.append(f"note: {'; '.join(parts)}; width {math.ceil(need)} shows every label")
    return "\n".join(rows)


def _extents(events, with_stage: bool) -> list[tuple[int, float]]:
    """(label length, duration) of every event, each pair once: what the width and the note depend on.
    Per (kind, stage, duration) only the largest microbatch's label counts, the longest of them (the
    microbatch's digits grow with it): one pass over ``events``, one :func:`_label` per pair."""
    top: dict[tuple[str, int, float], Event] = {}
    get = top.get
    for e in events:
        a = e.action
        key = (a.kind, a.stage, e.end - e.start)
        best = get(key)
        if best is None or a.microbatch > best.action.microbatch:
            top[key] = e
    pairs = {(len(_label(e, with_stage)), d) for (_, _, d), e in top.items()}
    return sorted(pairs)


def _times(events, t0) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends) of ``events`` less ``t0``, float64 arrays: subtracted before the conversion, so large
    integer clock readings (``time.time_ns()``) keep their differences. Raises ValueError: a time that is
    not finite."""
    starts = np.array([e.start - t0 for e in events], float)
    ends = np.array([e.end - t0 for e in events], float)
    if not (np.isfinite(starts).all() and np.isfinite(ends).all()):
        e = next(e for e in events if not (math.isfinite(e.start) and math.isfinite(e.end)))
        raise ValueError(f"text_grid: rank {e.rank}'s {e.action} runs from {e.start} to {e.end}; times must "
                         "be finite numbers")
    return starts, ends


def _rank_cells(events, times, scale: float, width: int) -> tuple[list, list]:
    """One rank's columns (IDLE, FOLDED where actions share one, None where one action holds it) and, for
    each action holding a column alone, (event, c0, c1): its column range [c0, c1). An action covers the
    columns its start and end (``times``: :func:`_times`, from the grid's start) round to, at least one;
    the others show only as ``*``, so they are counted here (in NumPy: a rank holds thousands of actions at
    p = 256, m = 512) and never reach the labels."""
    if not events:
        return [IDLE] * width, []
    c0 = np.minimum(np.rint(times[0] * scale), width - 1).astype(np.int64)  # rint: round()'s halves
    c1 = np.rint(times[1] * scale)
    c1 = np.where(c1 <= c0 + 1, c0 + 1, np.minimum(c1, width)).astype(np.int64)
    count = np.cumsum(np.bincount(c0, minlength=width + 1) - np.bincount(c1, minlength=width + 1))[:width]
    alone = np.concatenate(([0], np.cumsum(count == 1)))  # columns held by one action, before each column
    owners = np.flatnonzero(alone[c1] > alone[c0])
    cells = [(IDLE, None, FOLDED)[n] for n in np.minimum(count, 2).tolist()]  # by how many actions touch it
    starts, ends = c0.tolist(), c1.tolist()
    return cells, [(events[i], starts[i], ends[i]) for i in owners.tolist()]
