"""Fusion: a B run right before its own W becomes one BW, where no other rank waits for the B.

Splitting has a price on a device (``Costs.bw`` < T_B + T_W), so a split that buys nothing should not be
paid. :func:`fuse_adjacent` is a schedule -> schedule pass; ``build_schedule("zb-h1+fuse", ...)`` applies it
to any builder. Not in the paper (T_BW = T_B + T_W, arXiv 2401.10241 section 2); the search-based variant is
:func:`zbpp_lite.schedules.builders.greedy.fuse_backward`.

Rule: B(s, j) directly followed by W(s, j) becomes BW(s, j) when no other rank needs B's output (stage s is
first, or s-1 is on the same rank). With T_BW <= T_B + T_W this delays nothing in event-driven runs (start
times are maxes of sums of earlier ends, so none grows; peaks neither); in lockstep a BW lengthens its tick.
"""

from __future__ import annotations

from .ir import Action, Schedule, deps, parts

FUSE_SUFFIX = "+fuse"
"""The registry's suffix: ``"zb-h1+fuse"`` is ``fuse_adjacent(build_schedule("zb-h1", ...))``."""


def fuse_adjacent(schedule: Schedule) -> Schedule:
    """``schedule`` with every fusable B, W pair run as one BW (overlapped pairs left alone); a new Schedule,
    same placement and m, named ``name + "+fuse"`` ("" stays "")."""
    S, placement = schedule.num_stages, schedule.placement
    needed_elsewhere = {key for rank, row in enumerate(schedule.actions) for entry in row
                        for a in parts(entry) for key in deps(a, S) if placement[key.stage] != rank}
    rows = []
    for row in schedule.actions:
        out, i = [], 0
        while i < len(row):
            b, w = row[i], row[i + 1] if i + 1 < len(row) else None
            if (isinstance(b, Action) and b.kind == "B" and w == Action("W", b.stage, b.microbatch)
                    and ("B", b.stage, b.microbatch) not in needed_elsewhere):
                out.append(Action("BW", b.stage, b.microbatch))
                i += 2
            else:
                out.append(b)
                i += 1
        rows.append(tuple(out))
    name = schedule.name + FUSE_SUFFIX if schedule.name else ""
    # fusing a B with its W frees M_W no later: the plan's memory promise still holds
    return Schedule(tuple(rows), placement, schedule.num_microbatches, name, schedule.memory_plan)


def split_fused(schedule: Schedule) -> Schedule:
    """The reverse of :func:`fuse_adjacent`: every BW(s, j) run as B(s, j) then W(s, j) in its place, the
    order otherwise unchanged; a new Schedule, same placement and m, named ``name + "+split"`` ("" stays
    ""). With T_BW = T_B + T_W it shows what the split alone buys: the previous rank gets B's output
    T_W earlier (arXiv 2401.10241 section 2)."""
    def parts_of(entry):
        if isinstance(entry, Action) and entry.kind == "BW":
            return (Action("B", entry.stage, entry.microbatch), Action("W", entry.stage, entry.microbatch))
        return (entry,)

    rows = [tuple(x for entry in row for x in parts_of(entry)) for row in schedule.actions]
    name = schedule.name + "+split" if schedule.name else ""
    return Schedule(tuple(rows), schedule.placement, schedule.num_microbatches, name)
