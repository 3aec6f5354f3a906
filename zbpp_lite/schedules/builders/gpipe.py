"""GPipe (Huang et al., 2019): all forwards, then all fused backwards.

Rank r holds stage r. Peak activation memory m * M_B; bubble (p-1)(T_F+T_B+T_W) with T_comm = 0
(arXiv 2401.10241, section 2).
"""

from __future__ import annotations

from ..ir import Schedule, looped_placement
from ._common import Next, assemble, check_sizes


def gpipe(num_ranks: int, num_microbatches: int) -> Schedule:
    """GPipe for p ranks and m microbatches: ``F x m`` then ``BW x m`` on every rank. Raises ValueError:
    num_ranks or num_microbatches below 1."""
    check_sizes("gpipe", num_ranks, num_microbatches)
    p, m = num_ranks, num_microbatches
    rows = []
    for r in range(p):
        nxt = Next(m)
        # all forwards: F x m, then all backwards: BW x m
        rows.append([nxt.f(r) for _ in range(m)] + [nxt.bw(r) for _ in range(m)])
    return assemble("gpipe", rows, looped_placement(p, p), m)
