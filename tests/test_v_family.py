"""zb-v, v-half, v-min: the V placement, the paper's figures, memory bounds, small sizes, bad input.

Sources: Qi et al., arXiv 2401.10241, section 6 (ZB-V: zero bubble at 1F1B's memory with
T_F = T_B = T_W) and its profiled per-stage costs (p = 16, m = 48; bubble 0.0697 under p whole-rank
M_B, its Table 8); Qi et al., arXiv 2405.15362 (V-Min, V-Half: (p+4)//3 and (p+2)//2 microbatches of a rank's
layers against 1F1B's p; bubble rates about 2p/(3m) and p/(2m) with T_F = T_B = T_W).

Units: each V stage holds half a rank's layers. Here a stage's mem_b is 1, so a rank's "whole"
M_B is 2 and 1F1B over whole-rank stages (mem_b 2, times doubled) is the reference.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

import pytest

import zbpp_lite as zb
from zbpp_lite.schedules.builders.v_family import _tight_v, tight_v_block
from zbpp_lite.schedules.builders.zero_bubble_v import NARROW_ABOVE, search_v, v_limits
from zbpp_lite.schedules.ir import Schedule

TABLE8 = zb.Costs(f=14.407, b=14.380, w=9.676, comm=1.610)  # per V stage, the paper's profiled setting


@lru_cache(maxsize=None)
def planned(name: str, p: int, m: int) -> zb.Timeline:
    """Build (validated) and simulate with unit costs, once per test session."""
    return zb.simulate(zb.validate(zb.build_schedule(name, p, m)))


def one_f_one_b_reference(p: int, m: int) -> zb.Timeline:
    """1F1B with one whole-rank stage per rank: twice a V stage's time and memory."""
    return zb.simulate(zb.build_schedule("1f1b", p, m), zb.Costs(f=2, b=2, w=2, mem_b=2))


# --------------------------------------------------------------------------- zb-v


def test_zb_v_with_the_papers_times_and_a_w_holding_nothing_beats_its_bubble_rate_within_p_whole_rank_mb():
    costs = dataclasses.replace(TABLE8, mem_w=0.0)  # M_W = 0: every W may wait for the tail at no memory cost
    s = zb.validate(zb.build_schedule("zb-v", 16, 48, costs=costs))
    assert s.placement == zb.v_placement(16)
    t = zb.simulate(s, costs)
    assert t.bubble_rate <= 0.0697
    assert max(t.peak_memory) <= 16 * 2  # p whole-rank M_B (two stages of mem_b 1)


TABLE8_ROWS = [  # (p, m, (T_F, T_B, T_W, T_comm) per V stage in ms, ZB-V's bubble rate at limit p whole-rank M_B)
    # The paper's Table 8 settings (6.2B, 14.6B, 28.3B models). Costs: the authors' arxiv_bubble_rates() in
    # megatron/core/pipeline_parallel/efficiency.py; rates: the ZB-V rates their arxiv_mem() wrote to
    # mem2bubble.npy at that limit, to four decimals (sail-sg/zero-bubble-pipeline-parallelism, branch arxiv,
    # commit f68d387); (16, 48) is the row Table 8 prints as 0.0697
    (16, 48, (14.407, 14.380, 9.676, 1.610), 0.0697), (16, 64, (14.412, 14.393, 9.688, 1.621), 0.0533),
    (16, 128, (14.316, 14.306, 9.639, 1.619), 0.0274), (24, 72, (6.763, 6.969, 5.251, 0.755), 0.0638),
    (24, 96, (6.783, 6.984, 5.259, 0.758), 0.0483), (24, 192, (6.785, 6.990, 5.260, 0.770), 0.0250),
    (32, 96, (9.458, 9.748, 7.288, 0.879), 0.0593), (32, 128, (9.469, 9.744, 7.306, 0.892), 0.0451),
    (32, 256, (9.447, 9.644, 7.193, 0.887), 0.0236),
]


@pytest.mark.parametrize("p, m, times, paper_rate", TABLE8_ROWS)
def test_zb_v_with_the_papers_profiled_costs_and_its_m_w_reaches_its_table_8_rate_within_p_whole_rank_mb(
        p, m, times, paper_rate):
    # M_W = 7/16 M_B (Costs' default, the paper's ratio): W that wait hold memory, as in the paper's planner
    costs = zb.Costs(*times)
    t = zb.simulate(zb.validate(zb.build_schedule("zb-v", p, m, costs=costs)), costs)
    assert max(t.peak_memory) <= p * 2  # p whole-rank M_B (two stages of mem_b 1)
    assert round(t.bubble_rate, 4) <= paper_rate  # the table gives four decimals


@pytest.mark.parametrize("p, m", [(4, 8), (8, 24), (5, 7)])
def test_the_papers_v_heuristic_plans_the_simulated_times_within_the_limit_and_zb_v_keeps_the_shorter(p, m):
    from zbpp_lite.schedules.builders import zero_bubble_v as zb_v_module

    limits, table = zb_v_module.v_limits("zb-v", p, p, TABLE8, None)
    placement = zb.v_placement(p)
    heuristic = zb_v_module.paper_v(p, m, table, limits)
    t = zb.simulate(zb.validate(heuristic.schedule(placement, m, "paper-v")), TABLE8)
    assert t.makespan == pytest.approx(heuristic.makespan, rel=1e-12) and t.peak_memory == heuristic.peak_memory
    assert max(t.peak_memory) <= limits[0]
    greedy = zb_v_module.search_v(placement, m, table, limits).makespan
    chosen = zb.simulate(zb.build_schedule("zb-v", p, m, costs=TABLE8), TABLE8).makespan
    assert chosen <= min(greedy, heuristic.makespan) * (1 + 1e-12)


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 13), (8, 16), (8, 24), (16, 32)])
def test_zb_v_is_bubble_free_at_1f1bs_memory_with_equal_times_and_m_at_least_2p(p, m):
    t = zb.simulate(zb.validate(zb.build_schedule("zb-v", p, m)))
    assert t.bubble_rate == pytest.approx(0.0, abs=1e-12)
    assert max(t.peak_memory) == 2 * p  # p whole-rank M_B, 1F1B's peak
    assert max(t.peak_memory) / 2 == max(one_f_one_b_reference(p, m).peak_memory) / 2


@pytest.mark.parametrize("p, m", [(1, 1), (1, 3), (2, 1), (3, 2), (4, 5), (8, 7), (5, 9)])
def test_zb_v_below_2p_microbatches_is_still_valid_and_within_memory(p, m):
    s = zb.validate(zb.build_schedule("zb-v", p, m))
    assert s.num_ranks == p and s.num_stages == 2 * p and s.num_microbatches == m
    assert max(zb.simulate(s).peak_memory) <= 2 * p


def test_zb_v_default_limit_follows_the_costs_per_stage_memory():
    # unequal halves: rank r's whole M_B is mem_b[r] + mem_b[2p-1-r]; the default limit is p of those
    p, m = 3, 8
    mem = [3.0, 1.0, 2.0, 2.0, 1.0, 1.0]
    costs = zb.Costs(mem_b=mem)
    whole = [mem[r] + mem[2 * p - 1 - r] for r in range(p)]
    peaks = zb.simulate(zb.build_schedule("zb-v", p, m, costs=costs), costs).peak_memory
    assert all(peak <= p * w for peak, w in zip(peaks, whole))


def test_zb_v_honours_an_explicit_memory_limit_and_refuses_one_below_a_whole_microbatch():
    t = zb.simulate(zb.build_schedule("zb-v", 4, 12, memory_limit=4))
    assert max(t.peak_memory) <= 4
    with pytest.raises(ValueError, match=r"smallest feasible limit is 2 "):
        zb.build_schedule("zb-v", 4, 12, memory_limit=1.5)


def test_zb_v_refuses_costs_with_the_wrong_number_of_stages():
    with pytest.raises(ValueError, match="4 per-stage values but the schedule has 8 stages"):
        zb.build_schedule("zb-v", 4, 8, costs=zb.Costs(f=[1, 1, 1, 1]))


# --------------------------------------------------------------------------- v-half and v-min


@pytest.mark.parametrize("p, m", [(4, 12), (8, 24), (16, 48)])
def test_v_half_keeps_its_memory_bound_with_bubble_within_the_papers_estimate(p, m):
    t = planned("v-half", p, m)
    bound = (p + 2) // 2  # whole-rank M_B
    assert max(t.peak_memory) <= 2 * bound
    assert max(t.peak_memory) / max(one_f_one_b_reference(p, m).peak_memory) <= bound / p
    assert t.bubble_rate <= p / (2 * m)


@pytest.mark.parametrize("p, m", [(4, 12), (6, 18), (8, 24), (16, 48)])
def test_v_min_keeps_its_memory_bound_with_bubble_within_the_papers_estimate(p, m):
    t = planned("v-min", p, m)
    bound = (p + 4) // 3  # whole-rank M_B
    assert max(t.peak_memory) <= 2 * bound
    assert max(t.peak_memory) / max(one_f_one_b_reference(p, m).peak_memory) <= bound / p
    assert t.bubble_rate <= 2 * p / (3 * m)


def test_at_16_ranks_the_memory_is_about_a_half_and_a_third_of_1f1bs():
    ref = max(one_f_one_b_reference(16, 48).peak_memory)
    half = max(planned("v-half", 16, 48).peak_memory) / ref
    third = max(planned("v-min", 16, 48).peak_memory) / ref
    assert half == pytest.approx(9 / 16) and third == pytest.approx(6 / 16)


def test_the_tight_v_block_holds_v_mins_memory_exactly():
    # ceil((4p-2r)/6) + ceil((2r+2)/6) stage activations on rank r (each held from its F to its B,
    # so counted with M_W = 0), at most 2 * ((p+4)//3); W's share (default M_W) keeps that maximum
    for p in (4, 7, 10, 16):
        table = zb.Costs().table(2 * p)
        s = zb.validate(Schedule(tight_v_block(p, 3 * p, table), zb.v_placement(p), 3 * p))
        peaks = zb.simulate(s, zb.Costs(mem_w=0.0)).peak_memory
        expected = [-(-(4 * p - 2 * r) // 6) - (-(2 * r + 2) // 6) for r in range(p)]
        assert list(peaks) == expected
        assert max(peaks) <= 2 * ((p + 4) // 3)
        assert max(zb.simulate(s).peak_memory) == max(expected)


@pytest.mark.parametrize("p, m, costs", [
    (4, 12, zb.Costs()), (16, 48, zb.Costs()), (3, 5, zb.Costs(w=0.0)), (7, 21, zb.Costs(comm=0.3)),
    (6, 10, zb.Costs(f=[1.0 + 0.1 * s for s in range(12)], b=1.3, w=0.7, comm=0.2)), (16, 48, TABLE8),
])
def test_the_tight_v_blocks_bound_from_its_planned_times_is_at_least_its_simulated_makespan(p, m, costs):
    # v-min's search stops runs longer than this bound; None where some action found no overlap-free slot
    rows, bound = _tight_v(p, m, costs.table(2 * p))
    span = zb.simulate(Schedule(rows, zb.v_placement(p), m), costs).makespan
    assert bound is None or span <= bound <= span * 1.05
    assert bound is not None or costs.comm != 0.0  # unit costs: always overlap-free


@pytest.mark.parametrize("p, m, costs", [(4, 900, zb.Costs()), (2, 2000, zb.Costs(mem_w=0.0))])
def test_v_mins_search_above_the_narrow_size_stops_at_the_blocks_makespan_and_picks_as_before(p, m, costs):
    # there the search keeps one cap and polishes nothing: v-min hands it the tight block's makespan and
    # runs stop once longer. At p = 4 the block is the shorter (the search returns None, no run within it);
    # at p = 2 with M_W = 0 the greedy plan is (the full search's plan)
    limits, table = v_limits("v-min", (p + 4) // 3, p, costs, None)
    placement = zb.v_placement(p)
    assert 3 * len(placement) * m > NARROW_ABOVE
    block = Schedule(tight_v_block(p, m, table), placement, m, "v-min")
    span = zb.simulate(block, costs).makespan
    full = search_v(placement, m, table, limits)
    capped = search_v(placement, m, table, limits, longest=span + 2e-9 * max(1.0, span))
    built = zb.build_schedule("v-min", p, m, costs=costs).to_csv()
    if full.makespan < span:
        assert capped == full
        assert built == full.schedule(placement, m, "v-min").to_csv()
    else:
        assert capped is None
        assert built == block.to_csv()


def test_above_the_huge_size_the_v_search_starts_no_run_once_that_many_actions_are_simulated(monkeypatch):
    # planning at p = 256, m = 512 (786,432 actions) is capped so: HUGE_ABOVE made 100 here to test it small
    from zbpp_lite.schedules.builders import greedy, zero_bubble_v
    made = []

    class Recorded(greedy.Runs):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    p, m = 8, 24  # at unit costs and v-half's limit the search tries more than one run
    limits, table = v_limits("v-half", (p + 2) // 2, p, zb.Costs(), None)
    placement = zb.v_placement(p)
    actions = 3 * len(placement) * m
    monkeypatch.setattr(zero_bubble_v, "Runs", Recorded)
    full = search_v(placement, m, table, limits)
    assert made[-1].effort == float("inf") and made[-1].greedy_runs > 2
    monkeypatch.setattr(zero_bubble_v, "HUGE_ABOVE", 100)
    capped = search_v(placement, m, table, limits)
    runs = made[-1]
    assert runs.effort == 100 and runs.skipped > 0 and runs.greedy_runs >= 1
    # runs start only below the effort, so at most the last one started passes it (by at most a run)
    assert 100 <= runs.simulated <= 100 + actions
    assert capped.makespan >= full.makespan - 1e-9 and max(capped.peak_memory) <= max(limits) + 1e-9
    assert zb.validate(capped.schedule(placement, m, "v-half"))


@pytest.mark.parametrize("name", ["v-half", "v-min"])
def test_v_family_with_non_uniform_costs_stays_within_its_limit(name):
    costs = zb.Costs(f=[1.0 + 0.1 * s for s in range(12)], b=1.3, w=0.7, comm=0.2)
    p = 6
    bound = (p + 2) // 2 if name == "v-half" else (p + 4) // 3
    t = zb.simulate(zb.validate(zb.build_schedule(name, p, 10, costs=costs)), costs)
    assert max(t.peak_memory) <= 2 * bound
