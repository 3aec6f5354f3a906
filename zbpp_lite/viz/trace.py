"""Chrome-trace (Perfetto) JSON of a Timeline: one named track per rank.

Trace Event Format (https://ui.perfetto.dev, chrome://tracing): ``{"traceEvents": [...]}`` with complete
events (``"ph": "X"``, ``ts``/``dur`` in microseconds) and ``"ph": "M"`` metadata naming process and rank
threads. ``time_unit_us`` is microseconds per timeline unit: default 1e6 measured (seconds), 1000 simulated.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Mapping

from ..schedules import strict_json
from ..schedules.timeline import Timeline


def default_time_unit_us(timeline: Timeline) -> float:
    """Microseconds per timeline unit: 1e6 for measured (seconds), 1000 for simulated."""
    return 1e6 if timeline.source == "measured" else 1000.0


def _meta(kind: str, pid: int, tid: int, **args: Any) -> dict[str, Any]:
    return {"ph": "M", "name": kind, "pid": pid, "tid": tid, "args": args}


def _process_events(timeline: Timeline, pid: int, label: str, scale: float,
                    relative: bool) -> list[dict[str, Any]]:
    t0 = min((e.start for e in timeline.events), default=0.0) if relative else 0.0
    out = [_meta("process_name", pid, 0, name=label), _meta("process_sort_index", pid, 0, sort_index=pid)]
    for rank in range(timeline.num_ranks):
        out += [_meta("thread_name", pid, rank, name=f"rank {rank}"),
                _meta("thread_sort_index", pid, rank, sort_index=rank)]
    for e in timeline.events:
        a = e.action
        out.append({
            "name": f"{a.kind}{a.microbatch} (stage {a.stage})", "cat": a.kind, "ph": "X",
            "ts": (e.start - t0) * scale, "dur": (e.end - e.start) * scale, "pid": pid, "tid": e.rank,
            "args": {"action": str(a), "kind": a.kind, "stage": a.stage, "microbatch": a.microbatch,
                     "start": e.start, "end": e.end},
        })
    return out


def to_chrome_trace(
    timeline: Timeline | Mapping[str, Timeline],
    *,
    time_unit_us: float | None = None,
    name: str | None = None,
    relative: bool = True,
) -> dict[str, Any]:
    """The Chrome-trace JSON object of a Timeline (one process, a track per rank; ``name`` its label,
    default ``"pipeline (<source>)"``) or of label -> Timeline, a process each; ``relative``: each starts at
    ts = 0; ``time_unit_us``: default by source.

    Returns ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}``: an ``"X"`` event per
    action (``F3 (stage 1)``, cat = kind, pid = timeline index, tid = rank, ``args`` with action, stage,
    microbatch, start/end); ``otherData`` holds each makespan, bubble rate and source. Raises ValueError: a
    ``time_unit_us`` that is not a finite number > 0.
    """
    if isinstance(timeline, Timeline):
        timeline = {name or f"pipeline ({timeline.source})": timeline}
    events: list[dict[str, Any]] = []
    other: dict[str, Any] = {}
    for pid, (label, t) in enumerate(timeline.items()):
        scale = default_time_unit_us(t) if time_unit_us is None else float(time_unit_us)
        if not (math.isfinite(scale) and scale > 0):  # NaN / Infinity would be invalid JSON for Perfetto
            raise ValueError("time_unit_us must be a finite number > 0 of microseconds per timeline unit, "
                             f"got {time_unit_us}")
        events += _process_events(t, pid, label, scale, relative)
        other[label] = {"source": t.source, "makespan": t.makespan, "bubble_rate": t.bubble_rate,
                        "time_unit_us": default_time_unit_us(t) if time_unit_us is None else time_unit_us}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def write_chrome_trace(
    timeline: Timeline | Mapping[str, Timeline], path: str | os.PathLike, **options: Any
) -> Path:
    """Write :func:`to_chrome_trace` (``options``) as JSON to ``path`` (parents created); return the path.
    Open it in https://ui.perfetto.dev or chrome://tracing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(strict_json.dumps(to_chrome_trace(timeline, **options)))
    return path
