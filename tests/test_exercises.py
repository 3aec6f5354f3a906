"""Every exercise's check, twice: a right answer passes and a wrong one fails (with a hint, and
without raising). The right answers are worked out by hand here, from the closed forms and the
definitions, so each check's simulator-computed reference is tested against them."""

from __future__ import annotations

import decimal
import functools
import itertools
import math
import sys

import numpy as np
import pytest

import zbpp_lite as zb
from zbpp_lite import course as ex
from zbpp_lite.schedules.simulate import lockstep_ticks

HAND_30 = "1F0 1F1 1B0 1W0 1B1 1W1 1F2 1B2 1F3 1W2 1F4 1B3 1W3 1B4 1W4".split()
HAND_31 = "1F0 1F1 1B0 1W0 1B1 1W1 1F2 1F3 1B2 1W2 1B3 1W3 1F4 1B4 1W4".split()
"""Exercise 4.2 by hand: rank 1's order with zb-auto's on ranks 0 and 2: B2 before F3 and F4 before B3 (30,
the optimum), or zb-auto's own order (31)."""
def _tied_b(weight, h, dy):          # exercise 2.2's B: dh, dz, dx; W gets dz and dy
    dz = (dy @ weight) * (1 - h ** 2)
    return dz @ weight.T, (dz, dy)


def _tied_w(x, h, handover):         # both uses' gradients
    dz, dy = handover
    return x.T @ dz + dy.T @ h


LEAN = [["0F0", "0F1", "0BW0", "0F2", "0BW1", "0F3", "0BW2", "0BW3"],   # our text form: BW fused
        ["1F0", "1F1", "1BW0", "1BW1", "1F2", "1F3", "1BW2", "1BW3"],   # BW1 before F2: its gradient leaves at once
        ["2F0", "2BW0", "2F1", "2BW1", "2F2", "2BW2", "2F3", "2BW3"]]
SHORT_WARM_UP = [LEAN[0], [f"1{a[1:]}" for a in LEAN[0]], LEAN[2]]   # 1F1B with warm-ups cut to 2: takes 24
ONE_F_ONE_B_3x4 = [["0F0", "0F1", "0F2", "0BW0", "0F3", "0BW1", "0BW2", "0BW3"],   # valid, but rank 0 holds 3
                   ["1F0", "1F1", "1BW0", "1F2", "1BW1", "1F3", "1BW2", "1BW3"],
                   ["2F0", "2BW0", "2F1", "2BW1", "2F2", "2BW2", "2F3", "2BW3"]]
STRICT = [[f"{r}{kind}{k}" for k in range(4) for kind in ("F", "BW")] for r in range(3)]   # F, BW, F, BW ...

# id -> (a right answer, a wrong answer); formula answers are functions, checked at several points
CASES = {
    "1.1": (lambda p, m, s: 6 * m + p - 1 + 2 * s, lambda p, m, s: 6 * m + 2 * s),   # misses the warm-up wait
    "1.2": (lambda m, d, t: (m - 1) * min(d, t),      # the wrong one: right only while d <= t
            lambda m, d, t: (m - 1) * d),
    "1.3": (LEAN, SHORT_WARM_UP),                   # 1F1B with shorter warm-ups: within the limit, but 24
    "1.4": (lambda p, m, r, f, bw: (r + m - 1) * f if m <= p - r else (m - 1) * (f + bw) + r * f,
            lambda p, m, r, f, bw: (min(p, r + m) - 1) * f),    # the wrong one: the first peak's time
    "2.1": (lambda w: (sum(w[:-1]) + sum(w[1:])) / sum(w[:-1]),   # a_l, dz_l over a_l (tanh: no z_l kept)
            lambda w: (sum(w[:-1]) + sum(w[1:])) / (sum(w[:-1]) + sum(w[1:-1]))),   # GELU's: z_l kept too
    "2.2": ((_tied_b, _tied_w), (_tied_b, lambda x, h, handover: x.T @ handover[0])),   # the wrong: one use
    "2.3": (lambda w: sum(a * b for a, b in zip(w[1:], w[2:])) / sum(a * b for a, b in zip(w, w[1:])),
            lambda w: 1.0),                         # B skips the first layer's dx product; 1.0 makes dx too
    "3.1": (lambda p, m, f, b, w: p * (f + b) + w + (m - 1) * (b + max(f, w)),   # the wrong one: right
            lambda p, m, f, b, w: (m + p - 1) * (f + b) + w),                     # only while T_W <= T_F
    "3.2": (lambda p, m, r, mw: max(2 * (p - r) - 1 + 2 * r * mw, 2 * (p - r) - 2 + (2 * r + 1) * mw),
            lambda p, m, r, mw: 2 * (p - r) - 1 + 2 * r * mw),   # warm-up + lag x M_W: wrong once M_W > M_B
    "3.3": (lambda p, m, f, b, w: (p - 1) * max(f + b - 2 * w, b - f, 0.0),
            lambda p, m, f, b, w: (p - 1) * max(f + b - 2 * w, 0.0)),   # ZB-H2's form, clipped at 0
    "4.1": (lambda p, m: {(p - 1, 0)} | {(r, j) for r in range(1, p) for j in range(m - (p - r), m)},   # the
            lambda p, m: {(p - 1, 0), (p - 1, m - 1)}),   # waits; the wrong one: p = 2's answer, no cool-down
    "4.2": (HAND_30, HAND_31),                      # the optimum; zb-auto's own order
    "5.1": (lambda p: ((0, *(r for r in range(1, p) for _ in (0, 1)), 0), 2 * p, 4 * p - 4),   # pairs: 2p
            lambda p: (tuple(s if s < p else 2 * p - 1 - s for s in range(2 * p)), 4 * p - 4, 4 * p - 4)),  # the V
    "5.2": (lambda p, r: _first_m_below_by_hand(p, r),   # rate (2p-1-m)/(5m+2p-1); the wrong one: ZB-V's
            lambda p, r: 2 * p - 1),                     # first zero, 2p - 1
    "5.3": (lambda p, m, t: t * (6 * m + max(4 * p - 1 - 4 * m, 2 * p - 1 - m, 0)),   # m = 1: (4p + 1)t
            lambda p, m, t: 6 * m * t + max(0, 2 * p - 1 - m) * t),   # the old answer: right for m >= p only
    "6.1": (lambda p, v, c: 2 * (v - 1) * p * c,       # the wrong one: looped BFS charged every pass's links
            lambda p, v, c: 2 * (v - 1) * c),
    "6.2": (lambda p, v, m, r: min(v * m, v * p + p - 1 - 2 * r), lambda p, v, m, r: v * (p - r)),   # v(p - r): 1F1B's
    "7.1": (lambda p, m, s, r: 0 if r == s else 3 * m - 1 - r if r < s else 3 * m - 2 * p - 1 + 2 * s - r,
            lambda p, m, s, r: 0 if r == s else 3 * m - 1 - r),   # the wrong one: the front's form for all
    "7.2": (lambda c, a, s, limit: _best_cut(c, a, s, limit),   # the wrong one: the best cut by time alone
            lambda c, a, s, limit: _best_cut(c, [0] * len(a), s, limit)),
    "9.1": (lambda actions: _ticks_one_by_one(actions, lag=1),   # the wrong one: usable in the same tick
            lambda actions: _ticks_one_by_one(actions, lag=0)),
    "9.2": (lambda p, m: 4 * m + 3 * p - 4,          # p ticks of F only, the rest with a BW; the wrong one:
            lambda p, m: 3 * (m + p - 1)),           # event-driven
    "9.3": (lambda actions, ticks: _depths_by_hand(actions, ticks),   # the wrong one: a row busy through
            lambda actions, ticks: _depths_by_hand(actions, ticks, inclusive=True)),   # the end of its last read
    "9.4": (lambda: _step_result(1.0), lambda: _step_result(8.0)),   # 8: each microbatch's loss not over m
    "9.5": (lambda: _gpipe_result(11), lambda: _gpipe_result(8)),   # 8 ticks back: m, not m + p - 1
    "10.1": (lambda p, m: 3 * m + 2 * (p - 1),       # the last rank starts 2(p - 1) ticks in, never waits
             lambda p, m: 3 * m + 3 * (p - 1)),      # the wrong one: the way back paid too
    "10.2": (lambda actions, placement, ticks: _routing_by_hand(actions, placement, ticks),   # the wrong one:
             lambda actions, placement, ticks: _routing_by_hand(actions, placement, ticks, ring=False)),  # no wrap
    "10.3": (lambda: _v_result(1e-6), lambda: _v_result(0.3)),   # 0.3: first/last testing the rank alone
    "10.4": (lambda: _own_result(1e-7), lambda: _own_result(1e-7, [0, 3, 6, 9])),   # B and W rerun F
}


def _first_m_below_by_hand(p, target):
    """Exercise 5.2 by hand, a second way: walk m up from 1 with the exact rate (Fractions), the bubble
    (2p - 1 - m) for m >= 2p/3 and (4p - 1 - 4m) below (exercise 5.3's two waits), over 6m + bubble."""
    from fractions import Fraction
    for m in itertools.count(1):
        bubble = max(4 * p - 1 - 4 * m, 2 * p - 1 - m, 0)
        if Fraction(bubble, 6 * m + bubble) < Fraction(str(target)):   # the target as written
            return m


def test_the_zb_v_first_m_closed_form_beyond_the_sweeps_equals_them_where_both_exist():
    """Exercise 5.2's check takes p past 6 from the closed form floor((2p - 1)(1 - t)/(1 + 5t)) + 1 (a
    sweep there takes 5 s and more): on p = 2 .. 7 and 40 targets it equals the simulator's sweep, and
    at p = 20 .. 60 the walk by hand above."""
    import random
    from zbpp_lite.course import lesson5

    closed = lambda p, t: math.floor((2 * p - 1) * (1 - t) / (1 + 5 * t)) + 1  # noqa: E731
    rng = random.Random(5)
    targets = [rng.uniform(0.002, 0.2) for _ in range(40)]
    swept = lambda p, t: min(m for m, run in lesson5._zb_v_sweep(p).items() if run.bubble_rate < t)  # noqa: E731
    assert all(closed(p, t) == swept(p, t) for p in range(2, 8) for t in targets)
    assert all(lesson5._first_m_below(p, t) == _first_m_below_by_hand(p, t) for p in (20, 37, 60) for t in targets)


def test_the_closed_forms_the_checks_take_past_their_simulations_equal_them():
    """5.3 and 6.2 take their answers past p = 6 and p = 16 from closed forms (a table of simulations
    there would take minutes): ZB-V's makespan 6m + max(4p - 1 - 4m, 2p - 1 - m, 0) equals the sweep for
    p = 2..8 and every m up to 2p + 1, and interleaved 1F1B's peak min(vm, vp + p - 1 - 2r) equals the
    simulator for p = 2..6, v = 1..4, m = p, 2p, 3p, every rank."""
    from zbpp_lite.course import lesson5, lesson6

    assert all(lesson5._zb_v_span(p, m) == lesson5._zb_v_sweep(p)[m].makespan
               for p in range(2, 9) for m in range(1, 2 * p + 2))
    assert all(min(v * k * p, v * p + p - 1 - 2 * r) == lesson6._interleaved_peak(p, v, k * p)[r]
               for p in range(2, 7) for v in range(1, 5) for k in (1, 2, 3) for r in range(p))


def _ticks_one_by_one(actions, lag):
    """Exercise 9.1 by hand, a second way: walk the ticks in order; a rank runs its next action in tick t
    when what it needs from another stage ran in a tick before t - lag + 1 (lag 1: at the latest in t - 1)."""
    S = 1 + max(s for row in actions for _, s, _ in row)
    ran, nxt, table = {}, [0] * len(actions), []
    while any(n < len(row) for n, row in zip(nxt, actions)):
        t, row_t = len(table), [None] * len(actions)
        for r, row in enumerate(actions):
            if nxt[r] < len(row):
                kind, s, j = row[nxt[r]]
                need = {"F": ("F", s - 1, j), "B": ("B", s + 1, j), "BW": ("B", s + 1, j)}.get(kind)
                if need is None or not 0 <= need[1] < S or ran.get(need, t) <= t - lag:
                    row_t[r] = nxt[r]
        for r, i in enumerate(row_t):
            if i is not None:
                kind, s, j = actions[r][i]
                ran["B" if kind == "BW" else kind, s, j] = t
                nxt[r] += 1
        table.append(row_t)
    return table


def _depths_by_hand(actions, ticks, inclusive=False):
    """Exercise 9.3 by hand, a second way: per stage, the fewest rows K with no two microbatches of one row
    (j % K) held at once, a value held from the end of the tick that makes it (an arrival: its sender's)
    through the tick before its last read (``inclusive``: through that read's tick too)."""
    p, at = len(actions), {}
    for t, row in enumerate(ticks):
        for r, i in enumerate(row):
            if i is not None:
                kind, s, j = actions[r][i]
                at.update({(k, s, j): t for k in (("B", "W") if kind == "BW" else (kind,))})
    m = 1 + max(j for row in actions for _, _, j in row)
    out = {}
    for name, made, sender, reader in (("act", "F", -1, "F"), ("grad", "B", 1, "B"), ("ins", "F", 0, "W"),
                                       ("outs", "F", 0, "B"), ("dz", "B", 0, "W")):
        out[name] = []
        for s in range(p):
            if not 0 <= s + sender < p:
                out[name].append(1)   # nothing kept: 1 is right too
                continue
            spans = [(at[made, s + sender, j], at[reader, s, j] + inclusive) for j in range(m)]
            out[name].append(next(K for K in range(1, m + 1) if not any(
                j != k and j % K == k % K and w1 <= w2 < r1
                for j, (w1, r1) in enumerate(spans) for k, (w2, _) in enumerate(spans))))
    return out


def _routing_by_hand(actions, placement, ticks, ring=True, chunk_of="receiver", late=0):
    """Exercise 10.2 by hand, a second way: per rank, what its stages receive, walked from the receiver's side
    (``ring=False``: no hop from rank p - 1 to rank 0; ``chunk_of="sender"``: the sender's chunk; ``late``:
    arrival ticks later)."""
    p, S, T = len(actions), len(placement), len(ticks)
    tick_of = {actions[r][i]: t for t, row in enumerate(ticks) for r, i in enumerate(row) if i is not None}
    recv = {src: tuple([[0] * T for _ in range(p)] for _ in range(3)) for src in ("left", "right", "self")}
    for (kind, s, j), t in tick_of.items():
        to = s + 1 if kind == "F" else s - 1
        if kind == "W" or not 0 <= to < S or t + late >= T:
            continue
        src_rank, dst = placement[s], placement[to]
        hop = (dst - src_rank) % p if ring else dst - src_rank
        source = "self" if hop == 0 else "left" if hop == 1 else "right"
        mine = sorted(x for x in range(S) if placement[x] == (dst if chunk_of == "receiver" else src_rank))
        for table, value in zip(recv[source], (1 if kind == "F" else 2, mine.index(to if chunk_of == "receiver" else s), j)):
            table[dst][t + late] = value
    return recv


def _spmd_result(grad_error=1e-6, shift=False):
    """What lesson 10's ``vlab.try_v`` hands exercise 10.3's check
    for a run where every rank ran the lockstep form's branch (``shift``: each a tick late) and the
    gradients are off by ``grad_error``."""
    runs = {}
    for name in ex.V_RUNS:
        schedule = zb.build_schedule(name, 4, 8)
        ticks = lockstep_ticks(schedule, overlap=True)   # vlab's program sends during the next tick
        ran = [[0 if row[r] is None else ex.KIND_CODE[schedule.actions[r][row[r]].kind] for row in ticks]
               for r in range(4)]
        runs[name] = {"grad_error": grad_error, "stage_errors": [grad_error] * schedule.num_stages,
                      "scale": 1.0, "ran": [[0, *kinds[:-1]] for kinds in ran] if shift else ran}
    return {"error": None, "runs": runs}


def _v_result(grad_error):
    """What lesson 10's ``vlab.try_v`` hands exercise 10.3's check: ZB-V run tick for tick, its gradients off
    by ``grad_error`` on every stage."""
    result = _spmd_result(grad_error=grad_error)
    return {**result, "rows": {"act": 2, "dz": 5, "grad": 1, "ins": 8, "outs": 7}}


def _step_result(factor):
    """What lesson 9's ``lab.try_step`` hands exercise 9.4's check: one shard_map program, nothing of the
    model outside it, a tick's switch running 3 products in F, B and W and none outside it, jax.grad's
    gradients (the head's too), and the loss ``factor`` times the whole model's (1.0625)."""
    return {"error": None, "loss": np.float32(1.0625 * factor), "loss_ref": 1.0625, "shard_maps": 1,
            "outside": [], "grad_error": 1e-6, "stage_errors": [1e-6] * 4, "scale": 1.0, "dH_error": 1e-6,
            "products": [0, 3, 3, 3], "loose": 0}


def _gpipe_result(back):
    """What lesson 9's ``lab.try_gpipe`` hands exercise 9.5's check: one shard_map program, nothing of the
    model outside it, a forward scan of 11 ticks and a backward one of ``back`` (p = 4, m = 8: 11 is right),
    jax's loss and jax.grad's gradients."""
    return {"error": None, "loss": np.float32(1.0625), "loss_ref": 1.0625, "scans": [(11, False), (back, False)],
            "shard_maps": 1, "outside": [], "grad_error": 1e-6, "stage_errors": [1e-6] * 4, "scale": 1.0}


def _own_result(embed_error, products=(0, 3, 3, 3)):
    """What ``bench.try_own_step`` hands exercise 10.4's check: one shard_map program, nothing outside it,
    jax's loss, every gradient leaf within 1e-7 of jax.grad's but the embedding's, off by ``embed_error``,
    and ``products`` run by the tick's idle, F, B and W branches."""
    errors = {"['blocks']['W1']": 1e-7, "['embed']": embed_error, "['head']": 1e-7}
    return {"error": None, "loss": np.float32(2.5), "loss_ref": 2.5, "errors": errors, "shard_maps": 1,
            "outside": [], "products": list(products), "loose": 0}


def _stage_totals(costs, counts):
    ends = [sum(counts[: i + 1]) for i in range(len(counts))]
    return [sum(costs[a:b]) for a, b in zip([0, *ends], ends)]


def _best_cut(costs, acts, stages, limit):
    """Exercise 7.2 by hand, a second way (the check bisects on the slowest stage): dynamic programming,
    best[k][i] the cheapest slowest stage of the first i layers cut into k stages, stage k - 1 (rank k - 1,
    holding stages - k + 1 microbatches) within the limit."""
    n, ends, held = len(costs), [0, *itertools.accumulate(costs)], [0, *itertools.accumulate(acts)]
    best = [[math.inf] * (n + 1) for _ in range(stages + 1)]
    last = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):                  # stage k holds layers j .. i - 1
                if (stages - k + 1) * (held[i] - held[j]) > limit:
                    continue
                slowest = max(best[k - 1][j], ends[i] - ends[j])
                if slowest < best[k][i]:
                    best[k][i], last[k][i] = slowest, j
    counts, i = [], n
    for k in range(stages, 0, -1):
        counts.append(i - last[k][i])
        i = last[k][i]
    return counts[::-1]


def _every_cut(costs, acts, stages, limit):
    """Exercise 7.2 by trying every cut: right, and too slow for a model's depth."""
    n = len(costs)
    cuts = [[b - a for a, b in zip((0, *c), (*c, n))]
            for c in itertools.combinations(range(1, n), stages - 1)]
    fit = [counts for counts in cuts
           if all((stages - r) * a <= limit for r, a in enumerate(_stage_totals(acts, counts)))]
    return min(fit, key=lambda counts: max(_stage_totals(costs, counts)))


def _fill_to_share(costs, stages, at_least):
    """A plausible wrong 7.2, memory left out: fill each stage up to (or just past) total / stages."""
    share, counts, i = sum(costs) / stages, [], 0
    for left in range(stages - 1, 0, -1):
        k, total = 1, costs[i]
        while i + k < len(costs) - left and (total < share if at_least else total + costs[i + k] <= share):
            total, k = total + costs[i + k], k + 1
        counts.append(k)
        i += k
    return [*counts, len(costs) - i]


def test_every_lesson_has_at_least_two_exercises_numbered_from_one_and_every_check_is_tested():
    lessons = {}
    for key in ex.EXERCISES:
        lessons.setdefault(key.split(".")[0], []).append(key)
    assert sorted(lessons, key=int) == [str(n) for n in range(1, 11)]
    assert all(sorted(v) == [f"{n}.{i}" for i in range(1, len(v) + 1)] and len(v) >= 2 for n, v in lessons.items())
    assert set(CASES) == {k for k in ex.EXERCISES if not k.startswith("8.")}  # lesson 8's: test_build_lesson.py


def _answer(key, which):
    """CASES' answer; exercises 9.4's, 10.3's and 10.4's (a run's result, not a function) are built here."""
    answer = CASES[key][which]
    return answer() if key in ("9.4", "9.5", "10.3", "10.4") else answer


@pytest.mark.parametrize("key", sorted(CASES))
def test_a_right_answer_passes(key):
    verdict = ex.EXERCISES[key](_answer(key, 0))
    assert verdict.ok and bool(verdict), str(verdict)
    assert str(verdict).startswith(f"Exercise {key}: right.")


@pytest.mark.parametrize("key", sorted(CASES))
def test_a_wrong_answer_fails_with_a_hint(key):
    verdict = ex.EXERCISES[key](_answer(key, 1))
    assert not verdict.ok and not bool(verdict), str(verdict)
    assert str(verdict).startswith(f"Exercise {key}: not yet.") and verdict.hint and "Hint:" in str(verdict)


def test_split_where_it_pays_asks_for_the_shortest_split_plan_at_two_ranks():
    """Exercise 4.1's bar, zb-auto's makespan, is the shortest any set of splits reaches at p = 2 (every one
    of the 2**(2m) sets tried, m = 4 and 5), and rank 1's first and last backwards are the only set that
    reaches it with no split to spare."""
    from zbpp_lite.course import lesson4

    for m in (4, 5):
        cells = [(r, j) for r in range(2) for j in range(m)]
        sets = (frozenset(c for i, c in enumerate(cells) if bits >> i & 1) for bits in range(1 << 2 * m))
        spans = {s: lesson4._split_span(2, m, s) for s in sets}
        best = min(spans.values())
        assert best == pytest.approx(lesson4._auto_span(2, m), abs=1e-6)
        shortest = [s for s, span in spans.items() if span <= best + 1e-6]
        assert [set(s) for s in shortest if not any(t < s for t in shortest)] == [{(1, 0), (1, m - 1)}]


def test_split_where_it_pays_takes_zb_autos_own_choice_too():
    """Exercise 4.1: zb-auto's own splits (the last rank's first backward, and the last microbatch's on every
    rank but 0) are as short as its plan at the check's points, each split paying: right too (checked once by
    hand at every p = 2, 3 and m = 2p .. 6p)."""
    assert ex.split_where_it_pays(lambda p, m: {(p - 1, 0)} | {(r, m - 1) for r in range(1, p)})


def test_split_where_it_pays_names_a_split_that_buys_nothing_and_a_plan_too_long():
    cool_down = lambda p, m: {(r, j) for r in range(1, p) for j in range(m - (p - r), m)}  # noqa: E731
    v = ex.split_where_it_pays(lambda p, m: cool_down(p, m) | {(r, 0) for r in range(1, p)})   # every B0 too
    assert not v and "(1, 0) buys nothing" in v.message and "p = 3, m = 6" in v.message, str(v)
    v = ex.split_where_it_pays(lambda p, m: {(r, j) for r in range(p) for j in range(m)})     # every backward
    assert not v and "104.5 ms" in v.message and "1F1B 98.0" in v.message, str(v)
    assert "no backward (2, 0)" in ex.split_where_it_pays(lambda p, m: {(p, 0)}).message


@pytest.mark.parametrize("key", sorted(CASES))
@pytest.mark.parametrize("junk", [..., None, "many", [1, "x"]], ids=["ellipsis", "none", "word", "list"])
def test_no_answer_or_nonsense_is_not_yet_and_raises_nothing(key, junk):
    verdict = ex.EXERCISES[key](junk)
    assert not verdict.ok
    if junk is ... or junk is None:   # no answer yet: no hint either, so a prediction comes first
        assert not verdict.attempt and verdict.message.startswith("no answer yet") and not verdict.hint and "Hint" not in str(verdict)
    else:
        assert verdict.hint


def test_a_function_check_names_the_failing_input_but_not_the_expected_value():
    verdict = ex.blocking_cost(lambda m, d, t: 0.5)   # nowhere right; at (1, 1.0, 3.0) the cost is 0
    assert not verdict and "at (1, 1.0, 3.0)" in verdict.message and "too high" in verdict.message
    assert "agrees at 0 of the 28 points" in verdict.message and "0.0" not in str(verdict)
    high = ex.peak_memory_1f1b(lambda p, m, r, f, bw: 100.0)
    assert not high and "too high" in high.message and "agrees at 0 of" in high.message


def test_the_schedule_check_passes_on_the_validators_message():
    verdict = ex.lean_schedule([row[:-1] for row in LEAN])
    assert not verdict.ok and "incomplete" in verdict.hint and "microbatch 3" in verdict.hint
    assert not ex.lean_schedule([["0F0", "0BW0", "0F1", "0BW1"], ["1BW0", "1F0", "1F1", "1BW1"]]).ok  # 2 ranks
    slow = ex.lean_schedule(STRICT)                 # valid, holds 1, but waits with room for another F
    assert not slow.ok and "takes 36" in slow.message and "21" not in slow.message   # no target to search for
    assert not ex.lean_schedule(ONE_F_ONE_B_3x4).ok  # 1F1B itself is valid but holds too much
    split = [[f"{r}{a}" for a in row.split()] for r, row in enumerate(   # takes 20, but splits the backward
        ["F0 F1 B0 W0 F2 B1 W1 F3 B2 W2 B3 W3"] * 2 + ["F0 B0 F1 W0 B1 F2 W1 B2 F3 W2 B3 W3"])]
    assert not (refused := ex.lean_schedule(split)).ok and "fuses" in refused.message
    torch_letters = ex.lean_schedule([[a.replace("BW", "B") for a in row] for row in LEAN])   # 1B0 is our B
    assert not torch_letters.ok and "refuses" in torch_letters.message
    for copied in (24, 21, 42, 48):   # (m+p-1)(T_F+T_BW) at equal costs, mean costs; GPipe's; at stage 1's
        assert not ex.makespan_1f1b(copied).ok


def test_the_lesson_1_peak_time_rejects_the_printed_count_the_first_peak_and_the_steady_form_alone():
    assert not ex.peak_memory_1f1b(lambda p, m, r, f, bw: min(p - r, m)).ok          # the peak, not its time
    first = ex.peak_memory_1f1b(lambda p, m, r, f, bw: (min(p, r + m) - 1) * f)      # the old exercise's answer
    assert not first and "first time" in first.message, str(first)
    steady = ex.peak_memory_1f1b(lambda p, m, r, f, bw: (m - 1) * (f + bw) + r * f)  # forgets m <= p - r
    assert not steady and "every F is a warm-up F" in steady.message, str(steady)
    assert not ex.peak_memory_1f1b(lambda p, m, r, f, bw: (m - 1) * (f + bw) + (r + 1) * f).ok   # its end


def test_the_tied_weight_check_names_one_use_b_doing_ws_work_w_redoing_bs_and_autodiff():
    """Exercise 2.2: each use's gradient alone, B making the weight's gradient, W rebuilding dz from dy and a
    weight (handed over, or the notebook's own), jax.vjp, and a sign each get a verdict that says which."""
    import jax

    def greedy_b(weight, h, dy):                    # B makes d_weight too: a third product
        dz = (dy @ weight) * (1 - h ** 2)
        return dz @ weight.T, (dz, dy, h.T @ dy)

    def lazy_b(weight, h, dy):                      # B hands W dy and the weight, W redoes dh
        return ((dy @ weight) * (1 - h ** 2)) @ weight.T, (dy, weight)

    def redo_w(x, h, handover):
        dy, weight = handover
        return x.T @ ((dy @ weight) * (1 - h ** 2)) + dy.T @ h

    stray = jax.numpy.ones((32, 64))                # the notebook's weight, not the check's
    cases = [("second use's gradient alone", (_tied_b, lambda x, h, ho: ho[1].T @ h)),
             ("first use's gradient alone", CASES["2.2"][1]),
             ("tied_b runs 3 matrix products", (greedy_b, _tied_w)),
             ("redoes B's work", (lazy_b, redo_w)),
             ("calls jax.vjp", (lambda w, h, dy: jax.vjp(lambda v: v, dy), _tied_w)),
             ("raised TypeError", (_tied_b, lambda x, h, ho: x.T @ ho[0] + h.T @ ho[1])),   # transposed
             ("tied_b's dx differs", (lambda w, h, dy: ((dy @ w) @ w.T, (dy, dy)), _tied_w)),   # no tanh'
             ("redoes B's work", (_tied_b, lambda x, h, ho: x.T @ ((ho[1] @ stray) * (1 - h ** 2)) + ho[1].T @ h)),
             ("tied_w's d_weight differs", (_tied_b, lambda x, h, ho: x.T @ ho[0] - ho[1].T @ h))]   # a sign
    for said, pair in cases:
        verdict = ex.tied_split(pair)
        assert not verdict and said in verdict.message and verdict.hint, (said, str(verdict))
    assert "expected the pair" in ex.tied_split(_tied_b).message
    assert ex.tied_split(...).message.startswith("no answer yet")
    assert ex.tied_split((lambda w, h, dy: None, _tied_w)).message.startswith("no answer yet")
    assert "96 floats a token" in ex.tied_split(CASES["2.2"][0]).message   # dz (64) and dy (32)


def test_the_ratio_check_rejects_the_printed_mlp_and_the_equal_width_form():
    assert not ex.mw_over_mb(lambda w: 1.2).ok                                     # the MLP's ratio, copied
    assert not ex.mw_over_mb(lambda w: 2 * (len(w) - 1) / (2 * (len(w) - 1) - 1)).ok   # the equal-width form
    as_m_b = ex.mw_over_mb(lambda w: 1.0)                                          # M_W as what F kept alone
    assert not as_m_b.ok and "besides" in as_m_b.message
    assert ex.MLP_RATIO == 1.2
    for copied in (0.36, lambda w: 0.36, lambda w: 0.5):   # the reveal's number, as a number or everywhere
        assert not ex.first_stage_b_ratio(copied).ok
    for natural, says in ((lambda w: 1, "middle stage"), (lambda w: (len(w) - 2) / (len(w) - 1), "as equal")):
        verdict = ex.first_stage_b_ratio(natural)          # the misconceptions the reveal corrects
        assert not verdict.ok and verdict.attempt and says in verdict.message


def test_the_lesson_3_checks_reject_the_printed_forms():
    assert not ex.zb_h2_peak_memory(lambda p, m, r, mw: max(2 * (p - r) - 1 + r * mw,
                                                            2 * (p - r) - 2 + (r + 1) * mw)).ok  # ZB-H1's lag r
    assert not ex.zb_h2_peak_memory(lambda p, m, r, mw: 2 * (p - r) - 1).ok             # forgets M_W
    assert not ex.zb_h2_peak_memory(lambda p, m, r, mw: 2 * (p - r) - 2 + (2 * r + 1) * mw).ok   # after a B only
    assert "1F1B's" in ex.zb_h1_makespan(lambda p, m, f, b, w: (m + p - 1) * (f + b + w)).message
    assert "T_W <= T_F" in ex.zb_h1_makespan(CASES["3.1"][1]).message
    assert not ex.zb_h1_makespan(17) and not ex.zb_h1_makespan(17).attempt       # the drawn case's number
    assert not ex.zb_h2_bubble(lambda p, m, f, b, w: (p - 1) * (f + b - 2 * w)).ok      # the printed form
    assert not ex.zb_h2_bubble(lambda p, m, f, b, w: (p - 1) * max(f + b - w, b)).ok    # ZB-H1's bubble
    assert not ex.zb_h2_bubble(lambda p, m, f, b, w: (p - 1) * max(f + b - 2 * w, b - f)).ok   # no floor at 0
    assert not ex.zb_h2_bubble(lambda p, m, f, b, w: (p - 1) * (max(f + b - 2 * w, 0.0) + (  # round 34: the
        b - f if b > f and w > f else 0.0))).ok                                           # two waits added
    form = ex.zb_h1_makespan(lambda p, m, f, b, w: m * (f + b + w) + (p - 1) * (f + b - w))   # m >= p only
    assert not form and "ZB-H1's form" in form.message
    assert "clipped" in ex.zb_h2_bubble(lambda p, m, f, b, w: (p - 1) * max(f + b - 2 * w, 0.0)).message


def test_the_lesson_1_blocking_cost_names_the_answers_right_on_one_side_and_the_first_call_counted():
    for wrong, said in (((lambda m, d, t: (m - 1) * d), "right only while d <= t"),
                        ((lambda m, d, t: (m - 1) * t), "right only while t <= d"),
                        ((lambda m, d, t: m * min(d, t)), "the first call hides nothing")):
        verdict = ex.blocking_cost(wrong)
        assert not verdict and said in verdict.message, str(verdict)
    blocked_minus_queue = lambda m, d, t: m * (d + t) - (d + t + (m - 1) * max(d, t))  # noqa: E731
    assert ex.blocking_cost(blocked_minus_queue)


def test_the_lesson_1_blocking_cost_is_the_two_stage_pipelines_closed_form():
    """Exercise 1.2's expected values come from the simulator (Python and the device as GPipe's two stages,
    no backward); they equal m (d + t) - (d + t + (m - 1) max(d, t)) = (m - 1) min(d, t) on a grid."""
    from zbpp_lite.course.lesson1 import _blocking_cost
    for m in (1, 2, 5, 13):
        for d, t in ((0.3, 2.0), (2.0, 0.3), (1.0, 1.0), (0.01, 5.0)):
            assert abs(_blocking_cost(m, d, t) - (m - 1) * min(d, t)) < 1e-9

def test_the_lesson_5_checks_reject_the_bound_and_the_p4_value():
    v = ex.fewest_sends(CASES["5.1"][1])
    assert not v and "fewer is possible" in v.message and "at p = 3" in v.message, str(v)   # equal at p = 2
    assert "two of the" in str(ex.fewest_sends(lambda p: ((0,) * (2 * p), 2 * p, 4 * p - 4)))   # all on rank 0
    pairs = lambda p: tuple(r for r in range(p) for _ in (0, 1))  # noqa: E731
    assert "first and the last" in str(ex.fewest_sends(lambda p: (pairs(p), 2 * p, 4 * p - 4)))
    assert all(sum(_sends_from_placement(CASES["5.1"][0](p)[0], r) for r in range(p)) == 2 * p for p in range(2, 9))
    right = CASES["5.1"][0]
    for wrong, word in ((lambda p: right(p)[0], "expected (placement, sends, v_sends)"),   # the placement alone
                        (lambda p: (right(p)[0], 2 * p - 2, 4 * p - 4), "you said"),      # p - 1 changes
                        (lambda p: (right(p)[0], 2 * p, 4 * p - 2), "the V does not send")):   # no turn
        assert word in str(ex.fewest_sends(wrong)), (word, str(ex.fewest_sends(wrong)))
    over_work = ex.zb_v_first_m_below(lambda p, r: min(m for m in range(1, 2 * p) if (2 * p - 1 - m) / (6 * m) < r))
    assert not over_work and "divides the bubble by the work" in over_work.message, str(over_work)
    assert not ex.zb_v_first_m_below(9) and not ex.zb_v_first_m_below(9).attempt      # p = 6's number alone
    exact = lambda p, r: math.floor((2 * p - 1) * (1 - r) / (1 + 5 * r)) + 1  # noqa: E731  (the solution's)
    assert all(exact(p, r) == _first_m_below_by_hand(p, r) for p in range(2, 7) for r in (0.2, 0.1, 0.05, 0.001))
    assert ex.zb_v_first_m_below(exact)
    assert not ex.zb_v_makespan(lambda p, m, t: 6 * m * t + max(0, 2 * p - m) * t).ok   # counted to 2p
    assert not ex.zb_v_makespan(lambda p, m, t: t * (6 * m + max(4 * p - 1 - 4 * m, 0))).ok   # m << p only


def test_the_lesson_6_peak_check_rejects_rank_0s_value_everywhere_and_1f1bs_warm_up():
    assert not ex.interleaved_peak(lambda p, v, m, r: min(v * m, v * p + p - 1)).ok   # rank 0's on every rank
    one_f_one_b = ex.interleaved_peak(lambda p, v, m, r: min(v * m, p - r if v == 1 else v * p + p - 1 - 2 * r))
    assert not one_f_one_b.ok and "Megatron" in str(one_f_one_b)               # v = 1 is not 1F1B's warm-up


def test_exercise_6_1_names_the_zero_lead_interleaved_transfers_alone_every_pass_paid_and_links_once():
    """bfs_lead(p, v, c) = 2(v - 1)pc passes (2 at p = 4, v = 2, c = 1/4); T_comm = 0's answer, interleaved
    1F1B's 2(vp - 1)c alone, looped BFS charged p - 1 links every pass, and links counted once are told what
    they miss; a number is not a function."""
    assert ex.bfs_lead(lambda p, v, c: 2 * (v - 1) * p * c).ok
    for wrong, said in (((lambda p, v, c: 0), "T_comm = 0's answer"),
                        ((lambda p, v, c: 2 * (v * p - 1) * c), "every transfer interleaved 1F1B pays"),
                        ((lambda p, v, c: 2 * (v - 1) * c), "on every pass"),
                        ((lambda p, v, c: (v - 1) * p * c), "each link once")):
        verdict = ex.bfs_lead(wrong)
        assert not verdict and said in verdict.message, str(verdict)
    assert not ex.bfs_lead(2.0)


def test_exercise_6_3_tells_patterns_fitted_from_v_1_from_the_derivation():
    """peak(p, v, m, r) = min(vm, vp + p - 1 - 2r) passes; v times v = 1's 2(p - r) - 1 and v = 1's count
    for vp ranks, 2(vp - r) - 1, both right at v = 1 and at some points beyond, are refused with their own
    message, not only the first failing point; so is the m >= 2p count without its cap, which a line fitted
    to m >= 2p gives (rank 0 at p = 4, v = 2, m = 4 runs all 8 forwards first, not 11)."""
    assert ex.interleaved_peak(lambda p, v, m, r: min(v * m, v * p + p - 1 - 2 * r))
    times_v = ex.interleaved_peak(lambda p, v, m, r: v * (2 * (p - r) - 1))
    deep = ex.interleaved_peak(lambda p, v, m, r: 2 * (v * p - r) - 1)
    assert not times_v and "once" in times_v.message and "your function gives" not in times_v.message
    assert not deep and "vp ranks" in deep.message and "your function gives" not in deep.message
    uncapped = ex.interleaved_peak(lambda p, v, m, r: v * p + p - 1 - 2 * r)
    assert not uncapped and "m >= 2p" in uncapped.message and "your function gives" not in uncapped.message
    assert zb.simulate(zb.build_schedule("interleaved-1f1b", 4, 4, stages_per_rank=2), zb.Costs()).peak_memory[0] == 8
    fitted = ex.interleaved_peak(lambda p, v, m, r: min(v * m, 2 * (p - r) - 1 + (v - 1) * 4))   # p = 4's step
    assert not fitted and "your function gives" in fitted.message
    right = lambda p, v, m, r: min(v * m, v * p + p - 1 - 2 * r)   # noqa: E731
    assert not ex.interleaved_peak(lambda p, v, m, r: right(p, v, m, r) + (v == 6))   # every v is a fixed point
    assert ex.interleaved_peak(lambda p, v, m, r: np.int64(right(p, v, m, r)))
    assert ex.interleaved_peak(lambda p, v, m, r: np.array(right(p, v, m, r)))   # a 0-d array is a number


def test_the_lesson_7_split_check_rejects_filling_to_a_share_and_the_cut_by_time_alone():
    """The lesson's numbers: by time alone 3, 2, 3 layers (5, 9, 7), rank 0 then holding 3 x 3 = 9 over the
    limit 8; the best cut that fits, 2, 3, 3, costs 11."""
    first = ex.SPLIT_CASES[0]
    assert first == (ex.LAYER_COSTS, ex.LAYER_ACTS, 3, 8.0) and _stage_totals(ex.LAYER_COSTS, (3, 2, 3)) == [5, 9, 7]
    assert _best_cut(ex.LAYER_COSTS, [0] * 8, 3, 8) == [3, 2, 3]
    assert max(_stage_totals(ex.LAYER_COSTS, _best_cut(*first))) == 11 == max(_stage_totals(ex.LAYER_COSTS, (2, 3, 3)))
    by_time = ex.best_split(lambda c, a, s, limit: _best_cut(c, [0] * len(a), s, limit))
    assert not by_time and "rank 0 holding 3 microbatches of 3, 9, over the limit" in by_time.message, str(by_time)
    assert "given to every rank" in str(ex.slow_stage_idle(CASES["7.1"][1]))
    late = ex.slow_stage_idle(lambda p, m, s, r: 0 if r == s else 3 * m - 1 - r if r < s else 3 * m - 2 - r)
    assert "do not wait for its last backwards" in str(late), str(late)   # the ranks behind end with the front
    idle_of_fast = ex.slow_stage_idle(lambda p, m, s, r: CASES["7.1"][0](p, m, s, r) if r != s else 3 * m)
    assert not idle_of_fast and "too high" in str(idle_of_fast)           # the slow rank is never idle
    assert not ex.slow_stage_idle(16) and not ex.slow_stage_idle(16).attempt   # the drawn case's number alone
    for at_least in (True, False):   # fill each stage up to a third of the total, or just past it
        assert not ex.best_split(lambda c, a, s, limit, at=at_least: _fill_to_share(c, s, at)).ok
    assert not ex.best_split(lambda c, a, s, limit: min(range(1, len(c)), key=lambda k: max(sum(c[:k]), sum(c[k:]))))
    assert ex.best_split(_best_cut).ok and ex.best_split(lambda *case: tuple(_best_cut(*case))).ok   # a tuple too


def test_the_split_check_stops_trying_every_cut_at_a_models_depth_and_its_bisection_is_exact():
    """7.2's last case cuts 96 layers into 8 stages (about 1.1e10 cuts): a function trying them all passes
    every small case and is stopped past 2,000,000 steps, told so, whether it calls functions for each cut
    or runs plain loops; the check's bisection on the slowest stage equals trying every cut on small cases
    drawn at random, and the dynamic programme on large ones."""
    import random
    from zbpp_lite.course import lesson7

    def every_cut_in_loops(costs, acts, stages, limit):     # no call for each cut: lines only
        best, counts = None, None
        for cut in itertools.combinations(range(1, len(costs)), stages - 1):
            slowest, start, fits = 0.0, 0, True
            for r, end in enumerate((*cut, len(costs))):
                total, held = 0.0, 0.0
                for i in range(start, end):
                    total, held = total + costs[i], held + acts[i]
                slowest, start, fits = max(slowest, total), end, fits and (stages - r) * held <= limit
            if fits and (best is None or slowest < best):
                best, counts = slowest, [b - a for a, b in zip((0, *cut), (*cut, len(costs)))]
        return counts

    for brute in (_every_cut, every_cut_in_loops):
        stopped = ex.best_split(brute)
        assert not stopped and "was stopped" in stopped.message and "96 layers" in stopped.message, str(stopped)
        assert "not for a model's depth" in stopped.hint
    rng = random.Random(7)
    for _ in range(300):
        layers = rng.randint(1, 9)
        case = lesson7._split_draw(rng, layers, rng.randint(1, layers))
        assert lesson7._fewest_slowest(*case) == max(_stage_totals(case[0], _every_cut(*case)))
    for _ in range(5):
        case = lesson7._split_draw(rng, 96, 8)
        assert lesson7._fewest_slowest(*case) == max(_stage_totals(case[0], _best_cut(*case)))
        assert lesson7._fewest_slowest(*case) >= lesson7._fewest_slowest(case[0], [0] * 96, 8, 1)   # memory costs time


def test_a_function_answer_that_raises_is_not_yet_with_the_error():
    verdict = ex.peak_memory_1f1b(lambda p, m, r, f, bw: 1 / 0)
    assert not verdict.ok and "ZeroDivisionError" in verdict.message


@pytest.mark.parametrize("key", ["1.1", "3.1", "4.1", "5.2", "6.1", "7.1", "9.2", "10.1"])
def test_reveal_shows_the_simulation_only_after_a_real_attempt(key, capsys):
    assert ex.reveal(key, ...) is None and "commit" in capsys.readouterr().out
    assert ex.reveal(key, 1e6) is None and "real attempt" in capsys.readouterr().out   # a throwaway number
    for tried in CASES[key]:                        # the right answer, and a wrong one worked out
        fig = ex.reveal(key, tried)
        assert fig.data and fig.layout.title.text
    if callable(CASES[key][0]):                     # a function whose body is still `return ...`
        assert ex.reveal(key, lambda *args: ...) is None and "real attempt" in capsys.readouterr().out
    assert ex.reveal("2.3", lambda w: 0.5, show=lambda: "shown") == "shown"
    assert ex.reveal("2.3", lambda w: ..., show=lambda: "shown") is None
    assert ex.reveal("2.3", ..., show=lambda: "shown") is None


def _sends_from_placement(place, r):
    down = sum(place[s] == r != place[s + 1] for s in range(len(place) - 1))
    return down + sum(place[s] == r != place[s - 1] for s in range(1, len(place)))


def _simulated_lead(p, v, c):
    """Exercise 6.1 asked of the simulator: interleaved 1F1B's makespan less looped BFS's."""
    stage = zb.Costs(f=1 / v, b=1 / v, w=1 / v, comm=c)
    return (zb.simulate(zb.build_schedule("interleaved-1f1b", p, 2 * p, stages_per_rank=v), stage).makespan
            - zb.simulate(zb.build_schedule("looped-bfs", p, 2 * p, stages_per_rank=v), stage).makespan)


# ZB-V built once per (p, m) for the answers below (its search takes seconds at p = 8): 5.3 asks twice per
# point (two t's). The guard test clears it, so its first call reaches the package.
_zb_v = functools.cache(lambda p, m: zb.build_schedule("zb-v", p, m))

SIMULATED = {  # function answers that ask the package instead of deriving: each exactly right at every point
    "6.1": _simulated_lead,
    "1.1": lambda p, m, s: zb.simulate(zb.build_schedule("1f1b", p, m), zb.Costs(
        f=[2.0 if i == s else 1.0 for i in range(p)], b=[2.0 if i == s else 1.0 for i in range(p)],
        w=[2.0 if i == s else 1.0 for i in range(p)])).makespan,
    "3.3": lambda p, m, f, b, w: (zb.simulate(zb.build_schedule("zb-h2", p, m), zb.Costs(f=f, b=b, w=w)).makespan
                                  - m * (f + b + w)),
    "5.3": lambda p, m, t: zb.simulate(_zb_v(p, m), zb.Costs(f=t, b=t, w=t)).makespan,
    "6.2": lambda p, v, m, r: zb.simulate(zb.build_schedule("interleaved-1f1b", p, m, stages_per_rank=v),
                                          zb.Costs()).peak_memory[r],
    "5.1": lambda p: ((0, *sorted(zb.v_placement(p)[1:-1]), 0), 2 * p, 4 * p - 4),   # the V's middle, sorted
}


@pytest.mark.parametrize("key", sorted(SIMULATED))
def test_a_function_answer_that_calls_the_package_is_refused_by_name(key):
    _zb_v.cache_clear()
    verdict = ex.EXERCISES[key](SIMULATED[key])
    assert not verdict and "called zbpp_lite's" in verdict.message and verdict.hint, str(verdict)


def test_the_package_guard_leaves_the_profile_hook_and_plain_answers_alone():
    before = sys.getprofile()
    assert ex.EXERCISES["3.3"](CASES["3.3"][0])   # the closed form, no package call
    assert sys.getprofile() is before


@pytest.mark.parametrize("key", sorted(SIMULATED))
def test_those_package_answers_are_right_so_only_the_guard_refuses_them(key, monkeypatch):
    monkeypatch.setattr(ex.checks, "_alone", lambda fn, point, steps=None: fn(*point))
    assert ex.EXERCISES[key](SIMULATED[key])


def test_the_routing_check_names_the_field_and_the_neighbour_that_differ():
    by_hand = lambda **kw: lambda actions, placement, ticks: _routing_by_hand(actions, placement, ticks, **kw)  # noqa: E731
    sender = ex.routing(by_hand(chunk_of="sender"))
    assert not sender and "chunk differs" in sender.message and "receiving stage" in sender.message, str(sender)
    late = ex.routing(by_hand(late=1))
    assert not late and "something arrives here" in late.message, str(late)
    no_ring = ex.routing(by_hand(ring=False))
    assert not no_ring and "interleaved-1f1b" in no_ring.message and "from left" in no_ring.message, str(no_ring)
    for junk in (lambda a, pl, t: {}, lambda a, pl, t: [[0]], lambda a, pl, t: None):
        assert not ex.routing(junk)


def test_the_lockstep_check_refuses_the_event_driven_prediction():
    assert "event-driven" in str(ex.lockstep_1f1b(lambda p, m: 3 * (m + p - 1)))   # MPMD's makespan, not lockstep's
    for copied, word in ((lambda p, m: 2 * (m + p - 1), "number of ticks"), (lambda p, m: 4 * (m + p - 1), "last 2")):
        verdict = ex.lockstep_1f1b(copied)
        assert not verdict and word in verdict.message and verdict.hint, str(verdict)
    assert not ex.lockstep_1f1b(40).attempt                       # a number is not yet a function


def test_the_overlapped_ticks_check_names_no_link_the_way_back_paid_and_two_ticks_both_ways():
    for wrong, word in ((lambda p, m: 3 * m + p - 1, "no link"), (lambda p, m: 3 * m + 3 * (p - 1), "way back too"),
                        (lambda p, m: 3 * m + 4 * (p - 1), "both ways")):
        verdict = ex.overlapped_ticks(wrong)
        assert not verdict and word in verdict.message and verdict.hint, str(verdict)
    zb_h1 = lambda p, m: (4 * p - 1) * m // p + 4 * p - 5   # noqa: E731 - ZB-H1's count, m a multiple of p
    verdict = ex.overlapped_ticks(zb_h1)
    assert not verdict and "it agrees at" in verdict.message
    assert ex.overlapped_ticks(lambda p, m: 3 * m + 2 * (p - 1))


def test_the_v_check_names_what_the_v_changes_where_no_particular_mistake_shows():
    off = ex.spmd_v(_v_result(0.3))                                  # every stage off alike
    assert not off and "differ" in off.message and "per chunk" in off.hint and "recv" in off.hint


def test_the_rows_check_names_a_missing_buffer_a_short_list_and_a_non_number():
    short = ex.rows_needed(lambda actions, ticks: {b: [1] for b in ex.BUFFERS})
    assert not short and "act is a list of 1, where 4 ranks need 4 numbers" in short.message, str(short)
    missing = ex.rows_needed(lambda actions, ticks: {"act": [0, 1, 1, 1]})
    assert not missing and "expected a dict of act, grad, ins, outs, dz" in missing.message, str(missing)
    text = ex.rows_needed(lambda actions, ticks: {b: ["two"] * len(actions) for b in ex.BUFFERS})
    assert not text and "expected a dict" in text.message and text.hint


def test_the_tick_check_names_a_branch_run_in_the_wrong_tick_and_gradients_off():
    late = ex.spmd_v(_spmd_result(shift=True))
    assert not late and "zb-v: rank 0 ran branch 0 in tick 0, the table says 1" in late.message, str(late)
    raised = ex.spmd_v({"error": "TypeError: branch outputs differ", "runs": {}})
    assert not raised and "raised" in raised.message
    assert ex.spmd_v(...).message.startswith("no answer yet")
    assert not ex.tick_table(lambda actions: [[0] * len(actions)])   # one tick for everything


def test_lesson_9s_kind_codes_are_the_spmd_executors():
    from zbpp_lite.runtime.spmd import KIND_CODE

    assert ex.KIND_CODE is KIND_CODE and sorted(KIND_CODE.values()) == [1, 2, 3, 4]   # 0 is idle


def test_a_table_of_the_fixed_points_fails_where_the_checks_draw_new_ones():
    """6.2, 7.2 and 9.1 also check cases drawn afresh at every call (checks._with_fresh: p up to 12 to 24,
    new cost lists), so a table of answers written for the fixed cases fails, while the rules by hand pass
    every draw."""
    from zbpp_lite.course import lesson6, lesson9

    peaks = {(p, v, k * p, r): lesson6._interleaved_peak(p, v, k * p)[r]
             for p in (2, 3, 4, 5) for v in (1, 2, 3, 4) for k in (1, 2, 3) for r in range(p)}
    cuts = {case: _best_cut(*case) for case in ex.SPLIT_CASES}
    schedules = [zb.build_schedule(name, p, m) for name, p, m in ex.TICK_CASES]
    ticks = {repr(lesson9._rows(s)): lockstep_ticks(s) for s in schedules}
    for _ in range(3):  # new draws each time
        assert ex.interleaved_peak(lambda p, v, m, r: min(v * m, v * p + p - 1 - 2 * r))
        assert ex.best_split(_best_cut)
        assert not ex.interleaved_peak(lambda *point: peaks.get(point, -1))
        assert not ex.best_split(lambda c, a, s, limit: cuts.get((tuple(c), tuple(a), s, limit), [len(c)]))
        tick_table = ex.tick_table(lambda actions: ticks.get(repr(actions), [[None] * len(actions)]))
        assert not tick_table and all(f"{n} (p = {p}, m = {m})" not in tick_table.message for n, p, m in ex.TICK_CASES)


def test_the_mlps_ratio_copied_to_every_stack_is_told_what_it_misses():
    constant = ex.mw_over_mb(lambda widths: 1.2)
    assert not constant and "two-layer GELU MLP" in constant.message and "other widths" in constant.message, str(constant)
    four_arrays = ex.mw_over_mb(lambda w: (w[0] + 2 * w[1] + w[-1]) / (w[0] + 2 * w[1]))
    assert not four_arrays and "at every depth" in four_arrays.message, str(four_arrays)
    gelu = ex.mw_over_mb(lambda w: (sum(w[:-1]) + sum(w[1:])) / (sum(w[:-1]) + sum(w[1:-1])))   # z_l kept
    assert not gelu and "tanh's derivative reads its output" in gelu.message, str(gelu)
    assert ex.mw_over_mb(lambda w: (sum(w[:-1]) + sum(w[1:])) / sum(w[:-1]))


def test_a_plan_by_hand_slower_than_the_optimum_or_invalid_is_told_which():
    """4.2: the MILP proves 30 for HAND_CASE and zb-auto's plan takes 31; with zb-auto's orders on ranks 0
    and 2, rank 1's order B2 before F3 and F4 before B3 reaches 30, each alone does not, and zb-auto's own
    order is named; an order the validator refuses, unreadable text and a whole plan are named."""
    from zbpp_lite.course import lesson4
    from zbpp_lite.schedules.builders.milp import solve_optimal

    c = ex.HAND_CASE
    best = solve_optimal(c["num_ranks"], c["num_microbatches"], c["costs"], list(c["memory_limit"]), time_limit=30)
    assert best.makespan == best.lower_bound == 30.0 and best.status == "optimal"
    greedy, span = lesson4._greedy()
    assert span == 31.0 and greedy[1] == HAND_31
    assert ex.plan_around(HAND_30)
    own = ex.plan_around(HAND_31)
    assert not own and "takes 31 (zb-auto's own order); an order of rank 1 takes 30" in own.message, str(own)
    b2_first = [*HAND_31[:7], "1B2", "1F3", *HAND_31[9:]]                       # B2 before F3 alone
    f4_first = [*HAND_31[:10], "1F4", "1B3", "1W3", *HAND_31[13:]]             # F4 before B3 alone
    assert all(not ex.plan_around(order) for order in (b2_first, f4_first))
    assert "zb.validate refuses it" in ex.plan_around(["1B0", *HAND_30[1:]]).message
    assert "could not read" in ex.plan_around(["1X0", *HAND_30[1:]]).message
    assert "expected a list of rank 1's actions" in ex.plan_around("1F0 1F1").message


def test_a_function_that_switches_the_watch_off_before_asking_the_simulator_is_refused():
    """The guard is a profile hook: a function that calls sys.setprofile (or sys.settrace), even one that
    puts the hook back before it returns, is refused, whatever it computes after."""

    def simulated(p, m, f, b, w):
        return zb.simulate(zb.build_schedule("zb-h2", p, m), zb.Costs(f=f, b=b, w=w)).makespan - m * (f + b + w)

    def off(p, m, f, b, w):
        sys.setprofile(None)
        return simulated(p, m, f, b, w)

    def off_and_back(p, m, f, b, w):
        hook = sys.getprofile()
        sys.setprofile(None)
        try:
            return simulated(p, m, f, b, w)
        finally:
            sys.setprofile(hook)

    for cheat in (off, off_and_back):
        verdict = ex.zb_h2_bubble(cheat)
        assert not verdict and "sys.setprofile, sys.settrace or threading" in verdict.message, str(verdict)
    assert sys.getprofile() is None


def test_a_second_try_of_4_2_plans_nothing_again(monkeypatch):
    """The checks keep their plans from one try to the next (checks.course_cache): 4.2's second try, right or
    wrong, neither plans with zb-auto nor solves the MILP again."""
    from zbpp_lite.course import lesson4
    from zbpp_lite.schedules.builders import milp

    assert ex.plan_around(HAND_30)
    planned = []
    monkeypatch.setattr(lesson4, "auto_plan", lambda *a: planned.append(a))
    monkeypatch.setattr(milp, "solve_optimal", lambda *a, **k: planned.append(a))
    assert ex.plan_around(HAND_30) and not ex.plan_around(HAND_31)
    assert planned == []


def test_a_function_reading_the_checks_own_cache_is_refused_even_after_a_run_filled_it():
    """6.2's expected peaks are cached (lesson6._interleaved_peak, a checks.course_cache): a cache hit runs a
    package frame too, so a function reading the cache is refused, however full the cache is."""
    from zbpp_lite.course import lesson6

    assert ex.interleaved_peak(lambda p, v, m, r: min(v * m, v * p + p - 1 - 2 * r))   # fills the cache
    for _ in range(2):
        reads_cache = ex.interleaved_peak(lambda p, v, m, r: lesson6._interleaved_peak(p, v, m)[r])
        assert not reads_cache and "called zbpp_lite's _interleaved_peak" in reads_cache.message, str(reads_cache)


def test_round_40s_ways_round_the_package_guard_are_refused_and_a_helper_beside_the_package_is_not_it():
    """Round 40 (a hostile tester on lessons 1-7): a formula answer that asks the simulator from a thread it
    starts, or returns a number whose float() asks it only once the check reads it, or switches threading's
    hook off, is refused as calling the package; a learner's module whose path merely begins with the
    package folder's (zbpp_lite_helpers.py beside it) is not the package; SystemExit is an answer."""
    import os
    import threading

    from zbpp_lite.course import checks

    def simulated(p, m, f, b, w):                  # ZB-H2's bubble from the simulator: the package's answer
        return zb.simulate(zb.build_schedule("zb-h2", p, m), zb.Costs(f=f, b=b, w=w)).makespan - m * (f + b + w)

    def in_a_thread(*point):
        out = []
        worker = threading.Thread(target=lambda: out.append(simulated(*point)))
        worker.start()
        worker.join()
        return out[0]

    class Lazy:                                    # a number worked out when float() reads it
        def __init__(self, point):
            self.point = point

        def __float__(self):
            return float(simulated(*self.point))

    import numbers
    numbers.Real.register(Lazy)
    unhooked = lambda *point: (threading.setprofile(None), 0.0)[1]  # noqa: E731
    for answer in (in_a_thread, lambda *point: Lazy(point), unhooked):
        verdict = ex.zb_h2_bubble(answer)
        assert not verdict and "your function called" in verdict.message, str(verdict)
    right = CASES["3.3"][0]
    beside = os.path.dirname(checks._PACKAGE.rstrip(os.sep)) + os.sep + "zbpp_lite_helpers.py"
    helpers = {}
    exec(compile("def clip(x):\n    return max(x, 0.0)\n", beside, "exec"), helpers)
    verdict = ex.zb_h2_bubble(lambda p, m, f, b, w: (p - 1) * helpers["clip"](max(f + b - 2 * w, b - f)))
    assert verdict, str(verdict)

    def leaves(*point):
        raise SystemExit(1)
    verdict = ex.zb_h2_bubble(leaves)
    assert not verdict and "SystemExit" in verdict.message, str(verdict)
    assert ex.zb_h2_bubble(right)


def test_round_40s_answers_that_change_their_input_or_give_non_counts_or_huge_numbers_get_a_verdict():
    """Round 40: the checks hand the learner a copy of each point, so an answer that rewrites the widths
    list does not change what it is compared with (wrong ones fail, right ones that reverse or pop it pass);
    counts must be whole (5.1 no longer rounds 2.9 down to 2, nor take text); 7.2 takes whole floats
    and an array but not text, 4.2 an array of actions; 10**400 and infinity get a verdict, not an
    OverflowError; 7.2 refuses filling to the nearest share then moving boundaries (15 where 13 is possible)."""
    import math

    for check, wrong in ((ex.mw_over_mb, lambda w: (w.__setitem__(slice(None), [1, 1]), 2)[1]),
                         (ex.first_stage_b_ratio, lambda w: (w.__setitem__(slice(None), [1, 1, 1]), 0.5)[1])):
        verdict = check(wrong)
        assert not verdict, str(verdict)

    def reversed_ratio(w):                         # 2.3 right, with the list reversed first
        w.reverse()
        return CASES["2.3"][0](w[::-1])

    def popped_ratio(w):                           # 2.1 right, with the output width popped off
        out = w.pop()
        return CASES["2.1"][0]([*w, out])
    assert ex.first_stage_b_ratio(reversed_ratio) and ex.mw_over_mb(popped_ratio)

    right_51 = CASES["5.1"][0]
    for answer in (lambda p: (right_51(p)[0], right_51(p)[1] + 0.99, right_51(p)[2]),
                   lambda p: (tuple(r + 0.7 for r in right_51(p)[0]), *right_51(p)[1:]),
                   lambda p: (right_51(p)[0], str(right_51(p)[1]), right_51(p)[2]),
                   lambda p: (right_51(p)[0], math.inf, right_51(p)[2])):
        verdict = ex.fewest_sends(answer)
        assert not verdict and "whole" in verdict.message, str(verdict)
    assert ex.fewest_sends(lambda p: (np.array(right_51(p)[0]), *map(np.int64, right_51(p)[1:])))

    assert ex.best_split(lambda *case: np.array(_best_cut(*case)))
    assert ex.best_split(lambda *case: [float(k) for k in _best_cut(*case)])
    assert not ex.best_split(lambda *case: [10 ** 400] + _best_cut(*case)[1:])
    assert not ex.best_split(lambda *case: "".join(map(str, _best_cut(*case))))
    assert ex.plan_around(np.array(HAND_30))
    assert not ex.makespan_1f1b(lambda p, m, s: 10 ** 400)

    def slowest(costs, counts):
        ends = list(itertools.accumulate(counts))
        return max(sum(costs[a:b]) for a, b in zip([0, *ends], ends))

    def nearest_then_moved(costs, acts, stages, limit):        # each stage filled to its share of what is left, then
        counts, i = [], 0                          # one boundary moved at a time while the slowest falls
        for left in range(stages, 1, -1):
            share, k, total = sum(costs[i:]) / left, 1, costs[i]
            while i + k < len(costs) - (left - 1) and abs(total + costs[i + k] - share) <= abs(total - share):
                total, k = total + costs[i + k], k + 1
            counts, i = counts + [k], i + k
        counts.append(len(costs) - i)
        moved = True
        while moved:
            moved = False
            for i, d in itertools.product(range(stages - 1), (-1, 1)):
                other = counts[:i] + [counts[i] + d, counts[i + 1] - d] + counts[i + 2:]
                if min(other) >= 1 and slowest(costs, other) < slowest(costs, counts):
                    counts, moved = other, True
        return counts
    assert slowest([7, 8, 5, 7, 6], nearest_then_moved([7.0, 8.0, 5.0, 7.0, 6.0], [1.0] * 5, 3, 9.0)) == 15
    from zbpp_lite.course import lesson7
    case = ex.SPLIT_CASES[3]                        # [7, 8, 5, 7, 6] into 3, limit 9: memory does not bind
    assert case[0] == (7.0, 8.0, 5.0, 7.0, 6.0) and "13 is possible" in lesson7._split_problem(case, nearest_then_moved(*case))
    assert not ex.best_split(nearest_then_moved)


def test_round_41s_lazy_returns_hidden_hooks_and_other_processes_are_refused_and_bools_count():
    """Round 41 (the guard retested): an answer whose returned float subclass, int subclass or list
    subclass asks the package only when read, one that switches the hook off through a method wrapper, one
    that runs the simulator in another process, and a 1.2 answer that compares equal to anything, are
    refused; a count written as a
    bool (p > 1 and ...) counts; an answer's trace hooks are gone after the check."""
    import subprocess
    import threading

    def simulated(p, m, f, b, w):
        return zb.simulate(zb.build_schedule("zb-h2", p, m), zb.Costs(f=f, b=b, w=w)).makespan - m * (f + b + w)

    class LazyFloat(float):
        def __float__(self):
            return float(simulated(*self.point))

    def lazy_float(*point):
        x = LazyFloat(0.0)
        x.point = point
        return x

    def hidden_off(*point):
        hook = sys.getprofile()
        sys.setprofile.__call__(None)
        try:
            return simulated(*point)
        finally:
            sys.setprofile(hook)

    def elsewhere(*point):
        code = f"import zbpp_lite as zb; print(zb.simulate(zb.build_schedule('zb-h2', {point[0]}, {point[1]}), " \
               f"zb.Costs(f={point[2]}, b={point[3]}, w={point[4]})).makespan)"
        return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout) \
            - point[1] * sum(point[2:])

    for answer, word in ((lazy_float, "your function called zbpp_lite's"), (hidden_off, "switch the check's"),
                         (elsewhere, "another process")):
        verdict = ex.zb_h2_bubble(answer)
        assert not verdict and word in verdict.message, str(verdict)

    class LazyCounts(list):
        def __iter__(self):
            return iter(_best_cut(*self.args)) if zb.build_schedule("1f1b", 2, 2) else iter(())

        def __len__(self):
            return len(list(iter(self)))

    def lazy_cut(costs, acts, stages, limit):
        out = LazyCounts()
        out.args = (costs, acts, stages, limit)
        return out
    verdict = ex.best_split(lazy_cut)
    assert not verdict and "your function called" in verdict.message, str(verdict)

    class Lazy51(int):
        def __int__(self):
            return 2 * len(set(zb.v_placement(4)))
    verdict = ex.fewest_sends(lambda p: (CASES["5.1"][0](p)[0], Lazy51(0), CASES["5.1"][0](p)[2]))
    assert not verdict and "your function called" in verdict.message, str(verdict)

    class Anything(int):
        def __ne__(self, other):
            return False

        def __eq__(self, other):
            return True
    verdict = ex.blocking_cost(lambda m, d, t: Anything(1))   # equal to anything
    assert not verdict, str(verdict)

    def traces(*point):
        sys.settrace(lambda *a: None)
        threading.settrace(lambda *a: None)
        return CASES["3.3"][0](*point)
    assert not ex.zb_h2_bubble(traces)
    assert sys.gettrace() is None and threading.gettrace() is None and sys.getprofile() is None


def test_round_45s_lazy_or_unreadable_tables_get_a_verdict_and_a_generator_of_right_rows_passes():
    """Round 45 (a hostile tester on lessons 8-10): 9.1 answered by an object that builds the package's
    lockstep form only when the check iterates it, and 10.2 by one that hands out the package's routing tables
    only when indexed, are refused (the first read while the guard watches, the second no mapping); tables
    holding infinity, 2**70, 2.5 or an object whose int() raises get a verdict, not an exception; 9.1's right
    rows handed out by a generator pass."""
    from zbpp_lite.runtime.spmd import tick_tables

    def package_schedule(actions):
        rows = tuple(tuple(zb.Action(k, s, j) for k, s, j in row) for row in actions)
        stages = 1 + max(a.stage for row in rows for a in row)
        placement = tuple(next(r for r, row in enumerate(rows) if any(a.stage == s for a in row))
                          for s in range(stages))
        return zb.Schedule(rows, placement, 1 + max(a.microbatch for row in rows for a in row), "lazy")

    class LazyTicks:
        def __init__(self, actions):
            self.actions = actions

        def __iter__(self):
            return iter(lockstep_ticks(package_schedule(self.actions)))

    class LazyRoutes:
        def __init__(self, actions):
            self.actions = actions

        def __getitem__(self, source):
            return tick_tables(package_schedule(self.actions)).recv[source]

    class Bomb:
        def __int__(self):
            raise RuntimeError("boom")

    verdict = ex.tick_table(LazyTicks)
    assert not verdict and "zbpp_lite" in verdict.message, str(verdict)
    verdict = ex.routing(lambda actions, placement, ticks: LazyRoutes(actions))
    assert not verdict and "expected {source" in verdict.message, str(verdict)
    for entry in (float("inf"), 2 ** 70, 2.5, Bomb()):
        assert not ex.tick_table(lambda actions, x=entry: [[x]])
        assert not ex.routing(lambda a, pl, ticks, x=entry: {s: ([[x] * len(ticks)] * len(a),) * 3
                                                                 for s in ("left", "right", "self")})
    assert ex.tick_table(lambda actions: (row for row in _ticks_one_by_one(actions, lag=1)))
    assert ex.lockstep_1f1b(lambda p, m: decimal.Decimal(4 * m + 3 * p - 4))   # a Decimal is a number
    assert ex.tick_table(lambda actions: map(tuple, _ticks_one_by_one(actions, lag=1)))   # rows as tuples
