"""Lesson 9's claims beyond the case it shows (``notebooks/09_spmd_pipeline.md``; pure Python, fast).

Exercise 9.3: a buffer of K rows, microbatch j in row j % K, never overwrites a value still waiting to be read
when K is the most microbatches in flight, and K - 1 rows would: p for 1F1B and ZB-H1, 2p - 1 for ZB-H2, the
microbatches lesson 3's memory counts (p M_B and (2p - 1) M_B; Qi et al., arXiv 2401.10241, section 3).
"""

from __future__ import annotations

import pytest

import zbpp_lite as zb
from zbpp_lite import course as ex


@pytest.mark.parametrize("p", [2, 3, 4, 5])
def test_the_rows_a_buffer_needs_are_the_microbatches_in_flight(p):
    m = 2 * p + 1
    assert [ex.slots_needed(zb.build_schedule(name, p, m)) for name in ("1f1b", "zb-h1", "zb-h2")] == \
        [p, p, 2 * p - 1]


def test_fewer_microbatches_than_ranks_need_no_more_rows_than_microbatches():
    assert ex.slots_needed(zb.build_schedule("zb-h1", 4, 2)) == 2


@pytest.mark.parametrize("p", [2, 3, 4, 5])
def test_rows_are_the_microbatches_in_flight_capped_by_m_and_gpipe_holds_all(p):
    """Exercise 9.3's rule at every m from 1 to 3p + 1: GPipe m, 1F1B and ZB-H1 min(p, m), ZB-H2 min(2p - 1, m)."""
    for m in range(1, 3 * p + 2):
        assert [ex.slots_needed(zb.build_schedule(name, p, m)) for name in ("gpipe", "1f1b", "zb-h1", "zb-h2")] == \
            [m, min(p, m), min(p, m), min(2 * p - 1, m)]


@pytest.mark.parametrize("p", [2, 3, 4, 5])
def test_1f1b_in_lockstep_with_a_double_length_bw_takes_4m_plus_3p_minus_4(p):
    """Exercise 9.2: of 1F1B's 2(m + p - 1) ticks only the first p hold no BW (T_F = 1, T_BW = 2)."""
    for m in (1, p, 2 * p, 3 * p + 1):
        assert zb.simulate(zb.build_schedule("1f1b", p, m), ex.FUSED, lockstep=True).makespan == 4 * m + 3 * p - 4


def test_the_worked_table_marks_a_clash_with_k_minus_1_rows_and_none_with_k():
    schedule = zb.build_schedule("zb-h1", 4, 8)
    assert "!" not in ex.buffer_rows(schedule, 4) and "!" in ex.buffer_rows(schedule, 3)
