"""The papers' closed forms for the one-stage-per-rank schedules, against which the simulator is tested.

p ranks, m >= p microbatches (ZB-H2: m >= 2p - 1), uniform costs, T_comm = 0; bubble = makespan - m (T_F +
T_B + T_W) (arXiv 2401.10241 section 2):

============  =============================  ======================
schedule      bubble time                    peak memory (in M_B)
============  =============================  ======================
gpipe         (p - 1)(T_F + T_B + T_W)       m
1f1b          (p - 1)(T_F + T_B + T_W)       p
zb-h1         (p - 1)(T_F + T_B - T_W)       p
zb-h2         (p - 1)(T_F + T_B - 2 T_W)     2p - 1
============  =============================  ======================

The zero-bubble forms need each W to fit its gap (ZB-H1: T_W <= T_F, whatever T_B; ZB-H2: T_W <= T_F and
2 T_W <= T_F + T_B); other costs are refused. With T_comm > 0 only the simulator gives the makespan.
"""

from __future__ import annotations

SCHEDULES_WITH_A_FORM = ("gpipe", "1f1b", "zb-h1", "zb-h2")


def _check(name: str, p: int, m: int, f: float, b: float, w: float) -> None:
    if name not in SCHEDULES_WITH_A_FORM:
        raise ValueError(f"no closed form for {name!r}; there is one for {', '.join(SCHEDULES_WITH_A_FORM)} "
            "(simulate the others)")
    if not (isinstance(p, int) and isinstance(m, int) and p >= 1 and m >= 1):
        raise ValueError(f"ranks and microbatches must be integers >= 1, got p={p!r}, m={m!r}")
    if min(f, b, w) < 0:
        raise ValueError(f"costs must be >= 0, got T_F={f}, T_B={b}, T_W={w}")
    least = 2 * p - 1 if name == "zb-h2" else p
    if m < least and name != "gpipe":
        raise ValueError(f"the closed form of {name} needs m >= {least} microbatches at p={p}, got m={m}")
    if name == "zb-h1" and w > f:
        raise ValueError(f"ZB-H1's form needs T_W <= T_F (else it undercounts), got T_F={f}, T_B={b}, "
                         f"T_W={w}")
    if name == "zb-h2" and (w > f or 2 * w > f + b):
        raise ValueError(f"ZB-H2's form needs T_W <= T_F and 2 T_W <= T_F + T_B (else it undercounts or goes "
                         f"negative), got T_F={f}, T_B={b}, T_W={w}")


def bubble_time(name: str, p: int, m: int, f: float = 1.0, b: float = 1.0, w: float = 1.0) -> float:
    """The paper's bubble: makespan minus one rank's busy time m (T_F + T_B + T_W), in the costs' unit (not
    :attr:`Timeline.idle_time`'s idle time inside each rank's own span, which differs from rank to rank).

    Args:
        name: ``gpipe``, ``1f1b``, ``zb-h1`` or ``zb-h2``.
        p, m: ranks (= stages) and microbatches.
        f, b, w: T_F, T_B, T_W of one stage and microbatch.

    Raises:
        ValueError: a schedule without a closed form, bad sizes, or costs outside the form's regime.
    """
    _check(name, p, m, f, b, w)
    per_rank = {"gpipe": f + b + w, "1f1b": f + b + w, "zb-h1": f + b - w, "zb-h2": f + b - 2 * w}[name]
    return (p - 1) * per_rank


def bubble_rate(name: str, p: int, m: int, f: float = 1.0, b: float = 1.0, w: float = 1.0) -> float:
    """bubble / (bubble + m (T_F + T_B + T_W)); (p - 1) / (m + p - 1) for 1F1B and GPipe at equal costs.
    Raises as :func:`bubble_time`."""
    bubble = bubble_time(name, p, m, f, b, w)
    work = m * (f + b + w)
    return bubble / (bubble + work) if bubble + work > 0 else 0.0


def makespan(name: str, p: int, m: int, f: float = 1.0, b: float = 1.0, w: float = 1.0) -> float:
    """m (T_F + T_B + T_W) plus the bubble. Raises as :func:`bubble_time`."""
    return m * (f + b + w) + bubble_time(name, p, m, f, b, w)


def peak_memory(name: str, p: int, m: int) -> int:
    """Rank 0's peak activation memory in M_B: GPipe m, 1F1B and ZB-H1 p, ZB-H2 2p - 1 (each at most m).
    Raises as :func:`bubble_time`."""
    _check(name, p, max(m, 2 * p - 1) if name == "zb-h2" else max(m, p), 1.0, 1.0, 0.0)
    return min(m, {"gpipe": m, "1f1b": p, "zb-h1": p, "zb-h2": 2 * p - 1}[name])
