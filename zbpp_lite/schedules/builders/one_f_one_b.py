"""1F1B (PipeDream-Flush, Narayanan et al., 2021): warm-up forwards, then one F one BW.

Rank r holds stage r. Bubble (p-1)(T_F+T_B+T_W) with T_comm = 0, like GPipe, but peak activation
memory min(p - r, m) * M_B on rank r, p * M_B at most (arXiv 2401.10241, section 2).
"""

from __future__ import annotations

from ..ir import Schedule, looped_placement
from ._common import Next, assemble, check_sizes


def one_f_one_b(num_ranks: int, num_microbatches: int) -> Schedule:
    """1F1B for p ranks and m microbatches (any m >= 1; for m < p the warm-up is shorter). Raises
    ValueError: num_ranks or num_microbatches below 1."""
    check_sizes("1f1b", num_ranks, num_microbatches)
    p, m = num_ranks, num_microbatches
    rows = []
    for r in range(p):
        nxt = Next(m)
        warmup = min(p - 1 - r, m)  # with the steady state's first F: the lessons' warm-up of p - r F's
        row = [nxt.f(r) for _ in range(warmup)]  # F x (p-r-1)
        while nxt.left("F", r):  # steady: F, BW
            row += [nxt.f(r), nxt.bw(r)]
        while nxt.left("BW", r):  # cool-down: BW x (p-r-1)
            row.append(nxt.bw(r))
        rows.append(row)
    return assemble("1f1b", rows, looped_placement(p, p), m)
