"""Fusion: a B run right before its own W becomes one BW, where no other rank waits for the B.

Splitting the backward has a price on a real device (``Costs.bw`` below T_B + T_W: W reads back
what B wrote, two programs launch instead of one), so a split that buys nothing should not be
paid. :func:`fuse_adjacent` is a schedule -> schedule pass (the shape of the zero-bubble
scheduler's passes, ``(schedule) -> schedule``); ``build_schedule("zb-h1+fuse", ...)`` applies it
to any registered builder. Not in the paper, whose costs have T_BW = T_B + T_W (Qi et al., arXiv
2401.10241, section 2); the search-based cousin the automatic planner uses is
:func:`zbpp_lite.schedules.builders.greedy.fuse_backward`.

The rule, cost-free and structural: B(s, j) directly followed by W(s, j) on a rank becomes
BW(s, j) when no action on another rank needs B(s, j)'s output (by :func:`~.ir.deps`: stage s
is the first stage, or stage s-1 sits on the same rank, as at the V's turn). Why it delays
nothing when T_BW <= T_B + T_W: the fused BW ends no later than the W did, its other output (the
input gradient) is needed only later on the same rank, after the W's old place, and the
simulator's start times never grow when a duration shrinks (each is a max of sums of earlier
ends). So every event of every rank starts no later, the makespan does not grow, and each
rank's memory peak does not either (the rank runs nothing between B and W). A B whose gradient
goes to another rank is left alone: fused, it would send T_BW - T_B later. This holds for the
event-driven runs (threads, processes, :func:`~.simulate.simulate`); in lockstep (the SPMD
program) a fused BW lengthens its tick to T_BW and may cost there.
"""

from __future__ import annotations

from .ir import Action, Schedule, deps, parts

FUSE_SUFFIX = "+fuse"
"""The registry's suffix: ``"zb-h1+fuse"`` is ``fuse_adjacent(build_schedule("zb-h1", ...))``."""


def fuse_adjacent(schedule: Schedule) -> Schedule:
    """``schedule`` with every fusable B, W pair run as one BW (see the module's rule).

    Args:
        schedule: any schedule (overlapped pairs are left as they are).

    Returns:
        A new Schedule, same placement and m, named ``name + "+fuse"`` ("" stays "").
    """
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
    return Schedule(tuple(rows), placement, schedule.num_microbatches, name)
