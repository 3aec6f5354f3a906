"""A text grid of a Timeline for terminals: one row per rank, time left to right.

Each action fills the columns of its time span and is labelled with its kind and microbatch
(``F3``, ``B3``, ``W3``, ``BW3``; with ``{stage}`` in front where a rank holds several stages,
e.g. ``5F3``); columns where a rank runs nothing are ``.``. Used by ``python -m zbpp_lite plan``.
"""

from __future__ import annotations

from ..schedules.timeline import Event, Timeline

IDLE = "."
DEFAULT_MAX_WIDTH = 160


def _label(e: Event, with_stage: bool) -> str:
    base = f"{e.action.kind}{e.action.microbatch}"
    return f"{e.action.stage}{base}" if with_stage else base


def text_grid(timeline: Timeline, width: int | None = None, *, header: bool = True) -> str:
    """Render ``timeline`` as text, one line per rank.

    Args:
        timeline: simulated or measured.
        width: number of time columns. Default: wide enough that the shortest action shows its
            whole label plus one column, capped at 160 columns.
        header: first line with the makespan, bubble rate and the time per column.

    Returns:
        The grid as one string (lines joined by ``\\n``, no trailing newline). Row ``r`` reads
        ``"rank r |"`` followed by ``width`` columns. An action shorter than one column still
        takes one column so no action disappears; where the label does not fit, the kind alone
        (``F``, ``B``, ``W``, ``BW``) or its first letter is shown.

    Raises:
        ValueError: ``width`` below 1.
    """
    if width is not None and width < 1:
        raise ValueError(f"text_grid: width must be >= 1 column, got {width}")
    events = timeline.events
    t0 = min((e.start for e in events), default=0.0)
    t1 = max((e.end for e in events), default=0.0)
    span = t1 - t0
    stages: dict[int, set[int]] = {}
    for e in events:
        stages.setdefault(e.rank, set()).add(e.action.stage)
    with_stage = any(len(s) > 1 for s in stages.values())
    if width is None:
        shortest = min((e.duration for e in events if e.duration > 0), default=1.0)
        longest_label = max((len(_label(e, with_stage)) for e in events), default=1)
        width = int(round(span * (longest_label + 1) / shortest)) if span > 0 else 1
        width = max(1, min(width, DEFAULT_MAX_WIDTH))
    scale = width / span if span > 0 else 0.0
    rows = []
    for rank in range(timeline.num_ranks):
        cells = [IDLE] * width
        for e in timeline.rank_events(rank):
            c0 = min(int(round((e.start - t0) * scale)), width - 1)
            c1 = min(max(int(round((e.end - t0) * scale)), c0 + 1), width)
            text = _label(e, with_stage)
            n = c1 - c0
            if n < len(text):  # the label does not fit: the kind alone, or its first letter
                text = e.action.kind if n >= len(e.action.kind) else e.action.kind[0]
            fill = (text + " " * n)[:n]
            cells[c0:c1] = list(fill)
        rows.append(f"rank {rank:<{len(str(timeline.num_ranks - 1))}} |" + "".join(cells))
    if header:
        per_col = span / width if width else 0.0
        rows.insert(
            0,
            f"{timeline.source}: makespan {timeline.makespan:.4g}, bubble rate {timeline.bubble_rate:.1%}, "
            f"1 column = {per_col:.3g} time units, '{IDLE}' = idle",
        )
    return "\n".join(rows)
