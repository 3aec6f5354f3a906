"""Interleaved 1F1B and looped BFS: v stages per rank, looped placement (stage s on rank s % p).

Interleaved 1F1B (Narayanan et al., SC 2021, section 2.2): microbatches pass the rank's stages in groups of
p; 1F1B's bubble (p-1)(T_F+T_B+T_W) (whole-rank costs) shrinks to 1/v of it when p divides m; activation
memory grows to about (1 + (p-1)/(p v)) times 1F1B's. Looped BFS (Lamy-Poirier 2023; PyTorch's
ScheduleLoopedBFS): GPipe over the looped placement.
"""

from __future__ import annotations

from ..ir import Action, Schedule, looped_placement
from ..validate import ScheduleError, execution_order
from ._common import as_size, assemble, check_sizes


def _check_v(name: str, stages_per_rank: int) -> None:
    as_size(name, "stages_per_rank", stages_per_rank)


def _interleaved_order(p: int, m: int, v: int, rank: int, backward: bool) -> list[tuple[int, int]]:
    """(stage, microbatch) in a rank's visiting order: groups of p microbatches through its stages (reversed
    for the backward)."""
    order = []
    for g0 in range(0, m, p):
        group = range(g0, min(g0 + p, m))
        chunks = range(v - 1, -1, -1) if backward else range(v)
        for c in chunks:
            order += [(rank + c * p, j) for j in group]
    return order


def interleaved_1f1b(num_ranks: int, num_microbatches: int, stages_per_rank: int = 2) -> Schedule:
    """Interleaved 1F1B with ``stages_per_rank`` (v) stages per rank, looped placement.

    Rank r warms up with 2(p-r-1) + (v-1)p forwards (Megatron-LM's count), then one F one BW, then the
    rest. Any m >= 1: when p does not divide m the warm-up grows by the fewest forwards that avoid a
    deadlock. Raises ValueError: num_ranks, num_microbatches or stages_per_rank below 1."""
    check_sizes("interleaved-1f1b", num_ranks, num_microbatches)
    _check_v("interleaved-1f1b", stages_per_rank)
    p, m, v = num_ranks, num_microbatches, stages_per_rank
    # With a partial last group (m % p != 0) Megatron's warm-up can deadlock; lengthen every
    # rank's warm-up by the fewest extra forwards that make the schedule run.
    for extra in range(m * v + 1):
        rows = [_interleaved_row(p, m, v, r, extra) for r in range(p)]
        schedule = assemble("interleaved-1f1b", rows, looped_placement(p, p * v), m)
        try:
            execution_order(schedule)
            return schedule
        except ScheduleError:
            continue
    raise AssertionError(f"builder bug: interleaved-1f1b found no deadlock-free warm-up for p={p}, m={m}, "
        f"v={v}")


def _interleaved_row(p: int, m: int, v: int, r: int, extra: int) -> list[Action]:
    fwd = [Action("F", s, j) for s, j in _interleaved_order(p, m, v, r, backward=False)]
    bwd = [Action("BW", s, j) for s, j in _interleaved_order(p, m, v, r, backward=True)]
    warmup = min(len(fwd), 2 * (p - r - 1) + (v - 1) * p + extra)
    row = fwd[:warmup]  # warm-up: F x (2(p-r-1) + (v-1)p)
    for f, b in zip(fwd[warmup:], bwd):  # steady: F, BW
        row += [f, b]
    row += bwd[len(fwd) - warmup :]  # cool-down: the remaining BW
    return row


def looped_bfs(num_ranks: int, num_microbatches: int, stages_per_rank: int = 2) -> Schedule:
    """Looped BFS: F of every microbatch stage by stage, then BW in reverse stage and microbatch order
    (PyTorch's ScheduleLoopedBFS); peak v * m stage M_B, bubble GPipe's over v. Raises ValueError:
    num_ranks, num_microbatches or stages_per_rank below 1."""
    check_sizes("looped-bfs", num_ranks, num_microbatches)
    _check_v("looped-bfs", stages_per_rank)
    p, m, v = num_ranks, num_microbatches, stages_per_rank
    rows = []
    for r in range(p):
        stages = [r + c * p for c in range(v)]
        row = [Action("F", s, j) for s in stages for j in range(m)]  # all F, stage by stage
        row += [Action("BW", s, j) for s in reversed(stages) for j in reversed(range(m))]  # all BW, reversed
        rows.append(row)
    return assemble("looped-bfs", rows, looped_placement(p, p * v), m)
