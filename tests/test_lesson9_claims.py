"""Lesson 9's claims beyond the case it shows (``notebooks/09_spmd_pipeline.md``; pure Python, fast).

Exercise 9.3: a buffer of K rows, microbatch j in row j % K, never overwrites a value still waiting to be read
when K is the most microbatches in flight in it on its rank, and K - 1 rows would; F's before the first B
and the W lag are lesson 3's (Qi et al., arXiv 2401.10241, section 3).
"""

from __future__ import annotations

import pytest

import zbpp_lite as zb
from zbpp_lite import course as ex


@pytest.mark.parametrize("p", [2, 3, 4, 5])
def test_each_buffer_needs_the_microbatches_in_flight_on_its_rank(p):
    """Rank r's outs (F to B) holds its F's before its first B, dz (B to W) the W lag plus one, ins (F to W)
    both less the microbatch in each as its B runs, each at most m, at every m from 1 to 3p + 1: ZB-H1
    p - r, r + 1, p; ZB-H2 2(p - r) - 1, 2r + 1, 2p - 1; 1F1B p - r, 1 (BW reads dz in its own tick), p - r;
    act and grad 1 in ZB-H1 and 1F1B (each read before the next arrives)."""
    for m in range(1, 3 * p + 2):
        for name, outs, dz in (("zb-h1", lambda r: p - r, lambda r: r + 1), ("1f1b", lambda r: p - r, lambda r: 1),
                               ("zb-h2", lambda r: 2 * (p - r) - 1, lambda r: 2 * r + 1)):
            rows = ex.buffer_depths(zb.build_schedule(name, p, m))
            for r in range(p):
                assert [rows[b][r] for b in ("outs", "dz", "ins")] == \
                    [min(m, outs(r)), min(m, dz(r)), min(m, outs(r) + dz(r) - 1)], (name, m, r)
            if name != "zb-h2":
                assert max(rows["act"]) == max(rows["grad"]) == 1
    rows = ex.buffer_depths(zb.build_schedule("zb-h2", 4, 8))   # exercise 9.4's: an activation may wait a tick
    assert max(rows["act"]) == 2 and max(rows["grad"]) == 1


def test_the_worked_tick_stores_what_the_tick_tables_route():
    table = ex.tick_messages(zb.build_schedule("zb-h1", 4, 8), 8).splitlines()
    assert table[1:] == [
        "rank 0  W0    -                     -                   grad[1] <- rank 1's dx",
        "rank 1  B1    -                     dx, tag 2           -",
        "rank 2  F3    y, tag 4              -                   grad[2] <- rank 3's dx",
        "rank 3  B2    -                     dx, tag 3           act[3] <- rank 2's y"]


@pytest.mark.parametrize("p", [2, 3, 4, 5])
def test_1f1b_in_lockstep_with_a_double_length_bw_takes_4m_plus_3p_minus_4(p):
    """Exercise 9.2: of 1F1B's 2(m + p - 1) ticks only the first p hold no BW (T_F = 1, T_BW = 2)."""
    for m in (1, p, 2 * p, 3 * p + 1):
        assert zb.simulate(zb.build_schedule("1f1b", p, m), ex.FUSED, lockstep=True).makespan == 4 * m + 3 * p - 4


def test_the_worked_table_marks_a_clash_with_k_minus_1_rows_and_none_with_k():
    schedule = zb.build_schedule("zb-h1", 4, 8)
    assert "!" not in ex.buffer_rows(schedule, 4) and "!" in ex.buffer_rows(schedule, 3)
