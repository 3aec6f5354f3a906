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
