"""Handcrafted zero-bubble schedules ZB-H1 and ZB-H2 (arXiv 2401.10241 sections 2.1 and 2.2).

1F1B's shape of F and B with the W moved into the bubbles; rank r holds stage r. T_comm = 0, T_W <= T_F, T_B:

- ZB-H1: bubble (p-1)(T_F + T_B - T_W) for m >= p, peak p * M_B; rank r warms up with p-r F, then B [W] F
  cycles with W delayed by r microbatches.
- ZB-H2: bubble (p-1)(T_F + T_B - 2 T_W) for m >= 2p-1, peak (2p-1) * M_B; warm-up 2(p-r)-1 F, W delayed
  by 2r.

For smaller m the warm-up is capped at m: still valid, bubble above the formula.
"""

from __future__ import annotations

from ..ir import Schedule, looped_placement
from ._common import Next, assemble, check_sizes


def _delayed_w(name: str, p: int, m: int, warmup: list[int], delay: list[int]) -> Schedule:
    rows = []
    for r in range(p):
        nxt = Next(m)
        row = [nxt.f(r) for _ in range(min(warmup[r], m))]  # warm-up: F x warmup[r]
        pending_w = 0
        while nxt.left("B", r):  # steady: B, then W once `delay[r]` are pending, then F
            row.append(nxt.b(r))
            pending_w += 1
            if pending_w > delay[r]:
                row.append(nxt.w(r))
                pending_w -= 1
            if nxt.left("F", r):
                row.append(nxt.f(r))
        row += [nxt.w(r) for _ in range(nxt.left("W", r))]  # cool-down: the delayed W
        rows.append(row)
    return assemble(name, rows, looped_placement(p, p), m)


def zb_h1(num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-H1 (paper section 2.1, figure 3 top): 1F1B's memory, bubble (p-1)(T_F+T_B-T_W). Raises
    ValueError: num_ranks or num_microbatches below 1."""
    check_sizes("zb-h1", num_ranks, num_microbatches)
    p = num_ranks
    return _delayed_w("zb-h1", p, num_microbatches, [p - r for r in range(p)], list(range(p)))


def zb_h2(num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-H2 (paper section 2.2, figure 3 bottom): (2p-1) M_B memory, bubble (p-1)(T_F+T_B-2T_W). Raises
    ValueError: num_ranks or num_microbatches below 1."""
    check_sizes("zb-h2", num_ranks, num_microbatches)
    p = num_ranks
    return _delayed_w("zb-h2", p, num_microbatches, [2 * (p - r) - 1 for r in range(p)],
        [2 * r for r in range(p)])
