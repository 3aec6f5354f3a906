"""The exact MILP (paper appendix): optimal, never beaten under the same memory limit, and the
heuristic within 2% of it on small pipelines.

Source: Qi et al., arXiv 2401.10241, section 3.2 and appendix (ILP formulation).
"""

from __future__ import annotations

import random

import pytest

import zbpp_lite as zb
from zbpp_lite.schedules.builders.milp import solve_optimal

COSTS_15B = zb.Costs(f=18.522, b=18.086, w=9.337, comm=0.601)  # paper Table 9, 1.5B


def random_costs(rng: random.Random, p: int) -> zb.Costs:
    """Per-stage times that differ from stage to stage, T_comm, and an M_W that W must free."""
    return zb.Costs(
        f=[round(rng.uniform(0.5, 2.0), 2) for _ in range(p)],
        b=[round(rng.uniform(0.5, 2.0), 2) for _ in range(p)],
        w=[round(rng.uniform(0.2, 1.5), 2) for _ in range(p)],
        comm=round(rng.uniform(0.0, 0.3), 2),
        mem_w=rng.choice([0.0, 0.3, 0.5]),
    )


def test_p4_m8_is_proven_optimal_within_the_60_second_limit():
    result = solve_optimal(4, 8, zb.Costs(), memory_limit=4, time_limit=60)
    assert result.status == "optimal" and result.gap == pytest.approx(0.0, abs=1e-6)
    # with unit costs rank 0 can run only p = 4 F before its first B at t = 7: 3 idle units
    assert result.makespan == pytest.approx(8 * 3 + 3)
    t = zb.simulate(zb.validate(result.schedule), zb.Costs())
    assert t.makespan == pytest.approx(result.makespan) and max(t.peak_memory) <= 4


def test_the_optimum_is_never_beaten_by_any_schedule_within_the_same_limit():
    costs = zb.Costs(f=[1.0, 1.4, 0.8], b=[1.2, 1.0, 1.1], w=[0.6, 0.9, 0.5], comm=0.1)
    for limit in (2, 3, 5):
        result = solve_optimal(3, 6, costs, memory_limit=limit)
        assert result.status == "optimal"
        contenders = [zb.build_schedule(n, 3, 6) for n in ("gpipe", "1f1b", "zb-h1", "zb-h2")]
        contenders.append(zb.build_schedule("zb-auto", 3, 6, costs=costs, memory_limit=limit))
        within = [zb.simulate(s, costs) for s in contenders]
        within = [t for t in within if max(t.peak_memory) <= limit]
        assert within, "at least zb-auto fits"
        assert all(result.makespan <= t.makespan + 1e-6 for t in within)
        assert result.lower_bound <= result.makespan + 1e-9


@pytest.mark.parametrize("seed", range(6))
def test_the_heuristic_is_within_two_percent_of_the_optimum_on_small_pipelines(seed):
    rng = random.Random(seed)
    p, m = rng.randint(2, 4), rng.randint(3, 8)
    costs = random_costs(rng, p)
    limit = rng.choice([p - 1 or 1, p, p + 1, 2 * p])
    result = solve_optimal(p, m, costs, memory_limit=limit)
    assert result.status == "optimal"
    heuristic = zb.simulate(zb.build_schedule("zb-auto", p, m, costs=costs, memory_limit=limit), costs)
    assert heuristic.makespan == pytest.approx(result.heuristic_makespan)
    assert result.makespan <= heuristic.makespan + 1e-9
    assert heuristic.makespan <= 1.02 * result.makespan


def test_paper_costs_heuristic_within_two_percent():
    for limit in (4, 8):
        result = solve_optimal(4, 8, COSTS_15B, memory_limit=limit)
        assert result.status == "optimal"
        assert result.heuristic_makespan <= 1.02 * result.makespan


def test_v_placement_optimum_is_never_worse_than_zb_v():
    placement = zb.v_placement(2)
    result = solve_optimal(2, 3, zb.Costs(comm=0.2), memory_limit=3, placement=placement)
    assert result.status == "optimal"
    costs = zb.Costs(comm=0.2)
    greedy = zb.simulate(zb.build_schedule("zb-v", 2, 3, costs=costs, memory_limit=3), costs)
    assert result.makespan <= greedy.makespan + 1e-9
    assert result.schedule.placement == placement


def test_a_time_limit_returns_the_best_found_with_its_proven_gap():
    result = solve_optimal(4, 8, COSTS_15B, memory_limit=8, time_limit=0.05)
    assert result.status in {"optimal", "time_limit", "heuristic"}
    assert 0.0 <= result.gap < 1.0
    assert result.lower_bound <= result.makespan + 1e-9
    assert result.makespan <= result.heuristic_makespan + 1e-9
    zb.validate(result.schedule)


def test_an_infeasible_limit_is_refused_naming_the_smallest_feasible_one():
    with pytest.raises(ValueError, match="smallest feasible limit is 1"):
        solve_optimal(3, 4, zb.Costs(), memory_limit=0.5)
