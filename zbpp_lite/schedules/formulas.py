"""The papers' closed forms: bubble time, bubble rate and peak activation memory of the
one-stage-per-rank schedules, against which the simulator is tested.

With p ranks, m >= p microbatches (m >= 2p - 1 for ZB-H2), one stage per rank and uniform costs,
a rank's work is m (T_F + T_B + T_W) and its bubble is the makespan minus that work
(Qi et al., arXiv 2401.10241, section 3, Table 1):

============  =============================  ======================
schedule      bubble time                    peak memory (in M_B)
============  =============================  ======================
gpipe         (p - 1)(T_F + T_B + T_W)       m
1f1b          (p - 1)(T_F + T_B + T_W)       p
zb-h1         (p - 1)(T_F + T_B - T_W)       p
zb-h2         (p - 1)(T_F + T_B - 2 T_W)     2p - 1
============  =============================  ======================

The zero-bubble forms hold where each W fits the gap it fills: T_W <= T_F and T_W <= T_B for
ZB-H1, and 2 T_W <= T_F + T_B for ZB-H2 (the paper's setting). Outside that, a W can no longer
shrink the bubble further and the form would undercount (for ZB-H2 it even goes negative): the
functions here refuse such costs rather than return a number the simulator would not reproduce.
All are for T_comm = 0; with transfers the makespan depends on the schedule's wait pattern and
only the simulator gives it (GPipe's bubble grows to (p - 1)(T_F + T_B + T_W + 2 T_comm)).

Layer: schedules (pure Python).
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
    if name == "zb-h1" and w > min(f, b):
        raise ValueError(f"ZB-H1's form needs T_W <= T_F and T_W <= T_B, got T_F={f}, T_B={b}, T_W={w}")
    if name == "zb-h2" and 2 * w > f + b:
        raise ValueError(f"ZB-H2's form needs 2 T_W <= T_F + T_B (it would be negative), got 2 T_W = {2 * w} "
            f"> {f + b}")


def bubble_time(name: str, p: int, m: int, f: float = 1.0, b: float = 1.0, w: float = 1.0) -> float:
    """Idle time of each rank per step, in the units of the costs (e.g. seconds).

    Args:
        name: one of ``gpipe``, ``1f1b``, ``zb-h1``, ``zb-h2``.
        p, m: ranks (= stages) and microbatches.
        f, b, w: T_F, T_B, T_W of one stage and microbatch (T_comm = 0).

    Raises:
        ValueError: a schedule without a closed form, bad sizes, or costs outside the form's
            regime (see the module docstring).
    """
    _check(name, p, m, f, b, w)
    per_rank = {"gpipe": f + b + w, "1f1b": f + b + w, "zb-h1": f + b - w, "zb-h2": f + b - 2 * w}[name]
    return (p - 1) * per_rank


def bubble_rate(name: str, p: int, m: int, f: float = 1.0, b: float = 1.0, w: float = 1.0) -> float:
    """Bubble rate, bubble / makespan = bubble / (bubble + m (T_F + T_B + T_W)); for 1F1B and
    GPipe with equal costs it is (p - 1) / (m + p - 1). Raises as :func:`bubble_time`."""
    bubble = bubble_time(name, p, m, f, b, w)
    work = m * (f + b + w)
    return bubble / (bubble + work) if bubble + work > 0 else 0.0


def makespan(name: str, p: int, m: int, f: float = 1.0, b: float = 1.0, w: float = 1.0) -> float:
    """m (T_F + T_B + T_W) plus the bubble. Raises as :func:`bubble_time`."""
    return m * (f + b + w) + bubble_time(name, p, m, f, b, w)


def peak_memory(name: str, p: int, m: int) -> int:
    """Peak activation memory of rank 0, in units of M_B (one stage-microbatch's activations):
    GPipe m, 1F1B and ZB-H1 p, ZB-H2 2p - 1 (each at most m). Raises as :func:`bubble_time`."""
    _check(name, p, max(m, 2 * p - 1) if name == "zb-h2" else max(m, p), 1.0, 1.0, 0.0)
    return min(m, {"gpipe": m, "1f1b": p, "zb-h1": p, "zb-h2": 2 * p - 1}[name])
