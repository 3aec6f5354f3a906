"""Lesson 3's claims over many cases (notebooks/03_handcrafted_zero_bubble.md shows one case of each
with its assert): ZB-H1's and ZB-H2's orders, the three closed forms and their domains, the synchronous
optimizer step's wait, and T_comm's forms (Qi et al., ICLR 2024, sections 2 and 4)."""

from __future__ import annotations

import itertools

import pytest

import zbpp_lite as zb
from zbpp_lite.schedules import formulas

GRID = (0.5, 1.0, 1.5, 2.0)
COST_SETS = [(1.2, 1.5, 0.8), (1.0, 1.0, 1.0), (2.0, 1.0, 0.5), (1.0, 2.0, 0.5), (1.5, 0.5, 1.0)]


def _order(schedule, rank):
    return [(a.kind, a.microbatch) for a in schedule.actions[rank]]


def zb_h2_by_rule(p, m, r):
    """The lesson's words: 2(p-r)-1 forwards; then B, W once more than 2r W's are owed, F while any is
    left; then the W's still owed."""
    order, f, b, w = [], 0, 0, 0
    while f < min(2 * (p - r) - 1, m):
        order, f = order + [("F", f)], f + 1
    while b < m:
        order, b = order + [("B", b)], b + 1
        if b - w > 2 * r:
            order, w = order + [("W", w)], w + 1
        if f < m:
            order, f = order + [("F", f)], f + 1
    return order + [("W", i) for i in range(w, m)]


def _bubble_time(name, p, m, f, b, w, comm=0.0):
    return zb.simulate(zb.build_schedule(name, p, m), zb.Costs(f=f, b=b, w=w, comm=comm)).makespan - m * (f + b + w)


@pytest.mark.parametrize("p", range(2, 7))
def test_zb_h1_is_1f1b_with_w_of_i_right_after_b_of_i_plus_r(p):
    for m in range(p, 3 * p + 2):
        h1, one = zb.build_schedule("zb-h1", p, m), zb.build_schedule("1f1b", p, m)
        for r in range(p):
            row = _order(h1, r)
            fused = [("B" if k == "BW" else k, i) for k, i in _order(one, r)]
            assert [a for a in row if a[0] != "W"] == fused, (p, m, r)
            last_b = max(k for k, a in enumerate(row) if a[0] == "B")
            for i in range(m):
                k = row.index(("W", i))
                assert row[k - 1] == ("B", i + r) if i + r < m else k > last_b, (p, m, r, i)


@pytest.mark.parametrize("p", range(2, 7))
def test_zb_h2_follows_the_lessons_rule_and_never_idles_with_equal_costs(p):
    for m in range(2 * p - 1, 4 * p + 1):
        schedule = zb.build_schedule("zb-h2", p, m)
        t = zb.simulate(schedule)
        assert max(t.idle_time) == 0.0, (p, m)
        for r in range(p):
            row = _order(schedule, r)
            assert row == zb_h2_by_rule(p, m, r), (p, m, r)
            assert next(k for k, a in enumerate(row) if a[0] == "B") == 2 * (p - r) - 1
            for i in range(m):   # B's of i + 1 .. i + 2r before its W
                assert sum(a[0] == "B" for a in row[:row.index(("W", i))]) == min(i + 2 * r, m - 1) + 1
            # the last B leaves 2r + 1 slots to the span's end: the last microbatch's W and 2r held back
            events = t.rank_events(r)
            last_b = max(e.end for e in events if e.action.kind == "B")
            assert max(e.end for e in events) - last_b == 2 * r + 1, (p, m, r)


@pytest.mark.parametrize("costs", COST_SETS)
def test_the_three_closed_forms_and_peaks(costs):
    f, b, w = costs
    forms = {"1f1b": f + b + w, "zb-h1": f + b - w, "zb-h2": f + b - 2 * w}
    for p, name in itertools.product(range(2, 7), forms):
        peak = 2 * p - 1 if name == "zb-h2" else p
        for m in (2 * p - 1, 2 * p, 3 * p + 1):
            t = zb.simulate(zb.build_schedule(name, p, m), zb.Costs(f=f, b=b, w=w))
            assert abs(t.makespan - m * (f + b + w) - (p - 1) * forms[name]) < 1e-9, (name, p, m)
            assert max(t.peak_memory) == peak, (name, p, m, t.peak_memory)
            if name != "zb-h2":   # rank r: p - r forwards, and in ZB-H1 the r W's its lag owes
                lag = name == "zb-h1"
                assert t.peak_memory == tuple(p - r + lag * r * zb.Costs().mem_w for r in range(p)), (name, p, m)


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-h2"])
def test_sync_bubble_is_the_stagger_less_the_bubble(name):
    for p in range(2, 7):
        for m in (2 * p, 3 * p):
            for tf, tb, tw in itertools.product(GRID, GRID, GRID):
                t = zb.simulate(zb.build_schedule(name, p, m), zb.Costs(f=tf, b=tb, w=tw))
                bubble = t.makespan - m * (tf + tb + tw)
                assert abs(t.sync_bubble - max(0.0, (p - 1) * tf - bubble)) < 1e-9, (name, p, m, tf, tb, tw)
                if name == "zb-h2":   # its last rank never idles; equal costs: the whole (p-1) T_F waited
                    assert t.idle_time[-1] < 1e-9, (p, m, tf, tb, tw)
                    assert tf != tb or tb != tw or (bubble < 1e-9 and abs(t.sync_bubble - (p - 1) * tf) < 1e-9)


def test_gpipe_pays_t_comm_only_on_the_first_way_down_and_the_last_way_back():
    for (f, b, w), p, m, x in itertools.product(((1.0, 1.0, 1.0), (1.2, 1.5, 0.8), (2.0, 0.5, 0.3)),
                                                range(1, 7), range(1, 13), (0.1, 0.7, 3.0)):
        assert abs(_bubble_time("gpipe", p, m, f, b, w, x) - (p - 1) * (f + b + w + 2 * x)) < 1e-9


def test_1f1b_bubble_grows_with_m_when_transfers_cost():
    for x in (0.05, 0.1, 0.2, 0.4):
        assert _bubble_time("1f1b", 4, 12, 1, 1, 1, x) > _bubble_time("1f1b", 4, 8, 1, 1, 1, x)


def test_interleaved_form_holds_up_to_its_t_comm_limit_and_not_past_it():
    for (f, b, w), (p, m) in itertools.product(((0.5, 0.5, 0.5), (0.4, 0.6, 0.5), (0.8, 0.5, 0.2)),
                                               ((2, 4), (3, 6), (4, 8), (4, 12), (5, 10))):
        limit = min(f, b + w)
        links = [k * limit / 4 for k in range(5)] + [limit + 0.025]
        spans = [zb.simulate(zb.build_schedule("interleaved-1f1b", p, m), zb.Costs(f=f, b=b, w=w, comm=x))
                 .makespan for x in links]
        form = [(2 * m + p - 1) * (f + b + w) + 2 * (2 * p - 1) * x for x in links]
        assert all(abs(y - z) < 1e-9 for y, z in zip(spans[:-1], form)), (f, b, w, p, m, spans)
        assert spans[-1] > form[-1] + 1e-9


def test_zb_h1_bubble_is_p_minus_1_t_b_once_t_w_exceeds_t_f():
    for tf, tb in ((1.0, 2.0), (1.5, 1.0), (0.5, 1.5)):
        for tw in (tf + 0.25, tf + 0.5, 1.5 * tf + 0.3, 2 * tf, 3 * tf):
            for p in range(2, 7):
                for m in (2 * p, 3 * p):
                    assert abs(_bubble_time("zb-h1", p, m, tf, tb, tw) - (p - 1) * tb) < 1e-9, (tf, tb, tw, p, m)


def _refused(name, p, m, f, b, w):
    try:
        formulas.bubble_time(name, p, m, f=f, b=b, w=w)
    except ValueError:
        return True
    return False


def test_zb_h1_form_exactly_on_its_domain_and_refused_outside():
    for (tf, tb, tw), p in itertools.product(itertools.product(GRID, GRID, GRID), (2, 4, 5)):
        for m in (p - 1, p, 2 * p):
            gap = _bubble_time("zb-h1", p, m, tf, tb, tw) - (p - 1) * (tf + tb - tw)
            inside = m >= p and tw <= tf
            assert abs(gap) < 1e-9 if inside else gap > 1e-9, (tf, tb, tw, p, m, gap)
            assert _refused("zb-h1", p, m, tf, tb, tw) == (not inside), (tf, tb, tw, p, m)


def test_zb_h2_form_refused_exactly_outside_its_domain_and_exact_inside():
    for (tf, tb, tw), p in itertools.product(itertools.product(GRID, GRID, GRID), (2, 4, 5)):
        for m in (2 * p - 2, 2 * p - 1, 2 * p):
            outside = m < 2 * p - 1 or tw > tf or 2 * tw > tf + tb
            assert _refused("zb-h2", p, m, tf, tb, tw) == outside, (tf, tb, tw, p, m)
    for tf, tb, tw in itertools.product((0.5, 1.0, 2.0), (0.5, 1.0, 2.0), (0.25, 0.5, 1.0)):
        if tw <= tf and 2 * tw <= tf + tb:
            for p in range(2, 6):
                assert abs(_bubble_time("zb-h2", p, 2 * p, tf, tb, tw) - (p - 1) * (tf + tb - 2 * tw)) < 1e-9
    assert _bubble_time("zb-h2", 4, 12, 1.0, 2.0, 1.4) > 3 * (1.0 + 2.0 - 2.8) + 1e-9   # T_W > T_F only


@pytest.mark.parametrize("p", range(2, 7))
def test_at_equal_costs_zb_h1_is_a_trapezoid_and_zb_h2_a_parallelogram(p):
    """The lesson's 'why r': rank r's last B comes r slots before rank 0's, and its last 1 + r W's fill the
    slots to the common end (ZB-H1's trapezoid); ZB-H2's spans each start and end T_F after the one above."""
    for m in range(p, 3 * p + 2):
        t = zb.simulate(zb.build_schedule("zb-h1", p, m))
        for r in range(p):
            events = t.rank_events(r)
            last_b = max(e.end for e in events if e.action.kind == "B")
            assert max(e.end for e in events) - last_b == 1 + r, (p, m, r)
            assert max(e.end for e in events) == t.makespan, (p, m, r)
    for m in range(2 * p - 1, 4 * p + 1):
        t = zb.simulate(zb.build_schedule("zb-h2", p, m))
        spans = [(t.rank_events(r)[0].start, t.rank_events(r)[-1].end) for r in range(p)]
        assert spans == [(r * 1.0, t.makespan + r * 1.0) for r in range(p)], (p, m, spans)
