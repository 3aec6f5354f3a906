"""Lesson 5's claims over many cases (the lesson shows p = 4 or 8 and asserts that case beside it).

ZB-V's memory and bubble, its order's three phases, V-Half's and V-Min's memory forms and V-Min's
lifespans, DualPipeV's pair counts, refusals and published bubble, with where that form breaks.
Units: per-stage T_F = T_B = T_W = 1 and M_B/2 per V stage, so peaks are in M_B (the lesson's one unit).
Sources: arXiv 2401.10241 section 6; arXiv 2405.15362 section 3; arXiv 2412.19437 section 3.2.1.
"""

from __future__ import annotations

import pytest

import zbpp_lite as zb

HALF = zb.Costs(f=1.0, b=1.0, w=1.0, mem_b=0.5)   # a V stage: half a rank's layers
WHOLE = zb.Costs(f=2.0, b=2.0, w=2.0)             # one stage per rank


@pytest.mark.parametrize("p", [2, 3, 4])
def test_zb_v_keeps_1f1b_memory_and_has_no_bubble_from_2p_minus_1(p):
    """Peak at most p M_B for every m (exactly p from m = 2p); no bubble from m = 2p - 1, a bubble below."""
    for m in range(1, 3 * p + 1):
        t = zb.simulate(zb.build_schedule("zb-v", p, m), HALF)
        peak = max(t.peak_memory)
        assert peak <= p and (peak == p or m < 2 * p), (p, m, peak)
        assert (t.bubble_rate == 0.0) == (m >= 2 * p - 1), (p, m, t.bubble_rate)
    assert max(zb.simulate(zb.build_schedule("zb-v", p, 16 * p), HALF).peak_memory) == p


@pytest.mark.parametrize("p", [5, 6])
def test_zb_v_first_bubble_free_m_is_2p_minus_1(p):
    rates = {m: zb.simulate(zb.build_schedule("zb-v", p, m), HALF).bubble_rate for m in range(p, 2 * p + 1)}
    assert min(m for m, r in rates.items() if r == 0.0) == 2 * p - 1
    assert all(a >= b for a, b in zip(rates.values(), list(rates.values())[1:]))   # never grows with m


@pytest.mark.parametrize("p", [2, 3, 4, 5, 6])
def test_zb_v_order_warm_up_and_steady_state(p):
    """Rank r: 2(p-r) - 1 forwards of stage r first, 2p forwards before its first B (stage 2p-1-r's B of
    microbatch 0), and never more than 2p forwards ahead of its B's."""
    for m in (2 * p, 3 * p):
        for r, row in enumerate(zb.build_schedule("zb-v", p, m).actions):
            kinds = [a.kind for a in row]
            first_b = kinds.index("B")
            assert next(i for i, a in enumerate(row) if a.stage != r) == 2 * (p - r) - 1, (p, m, r)
            assert first_b == 2 * p and row[first_b] == zb.Action("B", 2 * p - 1 - r, 0), (p, m, r)
            ahead = max(kinds[:i].count("F") - kinds[:i].count("B") for i in range(len(row)))
            assert ahead == 2 * p, (p, m, r)


def test_v_half_and_v_min_memory_forms():
    """V-Half: exactly p/2 + 1 M_B for even p (its share of 1F1B's p strictly above 1/2, falling towards
    it), at most that for odd p; V-Min: at most p/3 + 1 from p = 3, 2 at p = 2; the same at m = 2p and 3p (p = 16: m = 2p only, to stay fast)."""
    shares = {}
    for p in (2, 3, 4, 5, 6, 8, 16):
        for m in ((2 * p,) if p == 16 else (2 * p, 3 * p)):
            wide = max(zb.simulate(zb.build_schedule("1f1b", p, m), WHOLE).peak_memory)
            peak_half, peak_min = (max(zb.simulate(zb.build_schedule(n, p, m), HALF).peak_memory)
                                   for n in ("v-half", "v-min"))
            assert wide == p and peak_half <= p / 2 + 1, (p, m, peak_half)
            assert p % 2 or peak_half == p / 2 + 1, (p, m, peak_half)
            assert peak_min <= p / 3 + 1 if p >= 3 else peak_min == 2, (p, m, peak_min)
            assert shares.setdefault(p, peak_half / wide) == peak_half / wide
    even = [shares[p] for p in (2, 4, 8, 16)]
    assert even == [1.0, 0.75, 0.625, 0.5625] and all(a > b > 0.5 for a, b in zip(even, even[1:]))


def test_the_family_trades_memory_for_bubble_at_p_8():
    rates = [zb.simulate(zb.build_schedule(n, 8, 24), HALF).bubble_rate for n in ("zb-v", "v-half", "v-min")]
    assert rates[0] == 0.0 < rates[1] < rates[2]
    v_min = zb.simulate(zb.build_schedule("v-min", 8, 24), HALF)
    assert max(v_min.peak_memory) == 6 * HALF.mem_b + 2 * HALF.mem_w   # 6 stage activations, 2 W's pending


@pytest.mark.parametrize("p", [4, 8])
def test_v_min_lifespans_are_the_round_trip(p):
    """Where V-Min is the tight block, stage r's activations live 4p - 2r time units, stage 2p-1-r's
    2r + 2: in steady state (microbatch 0, and 3 on; microbatches 1 and 2 wait longer)."""
    t = zb.simulate(zb.build_schedule("v-min", p, 3 * p), HALF)
    ev = {(e.action.kind, e.action.stage, e.action.microbatch): e for e in t.events}
    for j in [0, *range(3, 3 * p)]:
        life = [[ev["B", s, j].end - ev["F", s, j].start for s in (r, 2 * p - 1 - r)] for r in range(p)]
        assert life == [[4 * p - 2 * r, 2 * r + 2] for r in range(p)], (p, j)


def test_v_half_rank_0_runs_out_of_forwards_and_waits():
    for p in (4, 6, 8):
        s = zb.build_schedule("v-half", p, 3 * p)
        first_b = [a.kind for a in s.actions[0]].index("B")
        assert first_b < 2 * p - 1 and zb.simulate(s, HALF).idle_time[0] > 0, p


def test_dualpipe_v_pair_counts_and_refusals():
    for p in range(2, 7):
        for m in range(2 * p, 4 * p + 1):
            rows = zb.build_schedule("dualpipe-v", p, m).actions
            counts = [sum(isinstance(e, zb.Overlap) for e in row) for row in rows]
            assert counts == [2 * m - 3 * p + r + 1 - (r == p - 1) for r in range(p)], (p, m, counts)
        for m in range(1, 2 * p):
            with pytest.raises(ValueError, match=f"use m >= {2 * p}"):
                zb.build_schedule("dualpipe-v", p, m)


def test_dualpipe_v_published_bubble_is_the_makespan_less_the_last_ranks_busy_time():
    """The makespan less the last rank's busy time (its late start plus its idle time) is
    (p-1)(T_F&B + T_BW - 3 T_W); less rank 0's (the busiest), (p-2)(3 - T_F&B) smaller; the default
    T_F&B = T_F + T_BW gives the same timeline as T_F&B = 3; DualPipeV and ZB-V's makespans."""
    for p in range(2, 7):
        for m in (2 * p, 2 * p + 1, 3 * p):
            plan = zb.build_schedule("dualpipe-v", p, m)
            for fb in (3.0, 2.75, 2.5, 2.25, 2.0):
                t = zb.simulate(plan, zb.Costs(f=1.0, b=1.0, w=1.0, fb=fb))
                published = (p - 1) * (fb + 2.0 - 3.0)
                assert abs(t.makespan - t.busy[-1] - published) <= 1e-9, (p, m, fb)
                assert t.busy.index(max(t.busy)) == 0, (p, m, fb)
                assert abs(t.makespan - max(t.busy) - (published - (p - 2) * (3.0 - fb))) <= 1e-9, (p, m, fb)
    plan = zb.build_schedule("dualpipe-v", 4, 8)
    assert zb.simulate(plan, HALF) == zb.simulate(plan, zb.Costs(f=1.0, b=1.0, w=1.0, fb=3.0, mem_b=0.5))
    spans = [zb.simulate(plan, zb.Costs(fb=fb)).makespan for fb in (3.0, 2.0)]
    t2 = zb.simulate(plan, zb.Costs(fb=2.0))
    assert spans == [54, 44] and zb.simulate(zb.build_schedule("zb-v", 4, 8)).makespan == 48
    assert t2.busy == (43, 42, 41, 41)


def test_dualpipe_v_published_form_needs_its_three_conditions():
    """Holds with T_F = T_B and T_W below T_F (with and without overlap); T_F != T_B, T_W > T_F or a
    transfer cost each break it: the makespan less the last rank's busy time grows."""
    p, plan = 4, zb.build_schedule("dualpipe-v", 4, 8)
    for tf, tw in ((1.0, 0.25), (1.0, 0.5), (1.0, 0.75), (2.0, 1.0)):
        for fb in (2 * tf + tw, tf + tw):
            t = zb.simulate(plan, zb.Costs(f=tf, b=tf, w=tw, fb=fb))
            assert abs(t.makespan - t.busy[-1] - (p - 1) * (fb + tf + tw - 3 * tw)) < 1e-9, (tf, tw, fb)
    for c in (zb.Costs(f=2.0), zb.Costs(w=2.0), zb.Costs(comm=0.25)):
        t = zb.simulate(plan, c)
        published = (p - 1) * ((c.f + c.b + c.w) + c.b + c.w - 3 * c.w)   # no overlap
        assert t.makespan - t.busy[-1] > published, c


def test_dualpipe_v_holds_one_more_stage_than_zb_v():
    for p, m in ((4, 8), (8, 16)):
        dual = zb.simulate(zb.build_schedule("dualpipe-v", p, m), HALF).peak_memory
        v = zb.simulate(zb.build_schedule("zb-v", p, m), HALF).peak_memory
        assert dual == (p + 0.5,) * p and v == (p,) * p


@pytest.mark.parametrize("p", [3, 4, 5])
def test_the_looped_placement_peaks_fall_from_rank_to_rank_where_the_v_balances_them(p):
    """Lesson 5 prints the looped placement's peaks (interleaved 1F1B, 2 stages per rank) beside ZB-V's
    balanced p M_B: on the looped one each rank holds strictly more than the next."""
    for m in (2 * p, 3 * p):
        looped = zb.simulate(zb.build_schedule("interleaved-1f1b", p, m), HALF).peak_memory
        assert all(a > b for a, b in zip(looped, looped[1:])), (p, m, looped)
        assert zb.simulate(zb.build_schedule("zb-v", p, m), HALF).peak_memory == (p,) * p
