"""Property tests over random sizes and costs: every registered builder yields a valid schedule
whose simulated timeline respects every dependency; corrupted schedules are refused; the
memory-limited planners keep their limit whatever m, with W's memory counted (issue 31)."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import zbpp_lite as zb
from zbpp_lite.schedules.builders import options_of
from zbpp_lite.schedules.ir import Action, Schedule, deps, produces

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
costs_st = st.builds(
    zb.Costs,
    f=st.floats(0.1, 3.0),
    b=st.floats(0.1, 3.0),
    w=st.floats(0.1, 3.0),
    comm=st.floats(0.0, 0.5),
    fb=st.one_of(st.none(), st.floats(0.1, 6.0)),  # T_F&B of DualPipeV's overlapped pairs
)


def check_timeline(schedule: Schedule, timeline: zb.Timeline) -> None:
    """Every dependency ends (plus nothing negative) before its consumer starts; no overlap on a rank;
    every rank's events follow its action list (an overlapped pair as its forward then its backward)."""
    end = {}
    for e in timeline.events:
        for key in produces(e.action):
            end[key] = e.end
    for e in timeline.events:
        for key in deps(e.action, schedule.num_stages):
            assert end[key] <= e.start + 1e-9, f"{e.action} starts before {key} ends"
    for r in range(schedule.num_ranks):
        ev = timeline.rank_events(r)
        assert [x.action for x in ev] == list(schedule.rank_actions(r))
        assert all(a.end <= b.start + 1e-9 for a, b in zip(ev, ev[1:])), f"overlap on rank {r}"


@pytest.mark.parametrize("name", sorted(zb.SCHEDULES))
@SETTINGS
@given(p=st.integers(1, 6), m=st.integers(1, 12), costs=costs_st)
def test_every_builder_validates_and_simulates_consistently(name, p, m, costs):
    try:
        s = zb.build_schedule(name, p, m)
    except ValueError as e:  # a size a builder cannot support must say what would work
        assert len(str(e)) > 20
        return
    zb.validate(s)
    assert s.num_ranks == p and s.num_microbatches == m
    t = zb.simulate(s, costs)
    check_timeline(s, t)
    assert 0.0 <= t.bubble_rate < 1.0
    busy = [sum(costs.table(s.num_stages).duration(e) for e in row) for row in s.actions]
    assert t.busy == pytest.approx(busy)


MEMORY_LIMITED = sorted(name for name in zb.SCHEDULES if "costs" in options_of(name))
"""The builders that plan under a memory limit (the ones that take costs)."""


def default_limit(name: str, p: int) -> int:
    """Each planner's default per-rank limit in units of one stage's M_B (mem_b 1): p M_B as 1F1B
    (arXiv 2401.10241 section 5: zb-1p, zb-auto), 2p M_B (zb-2p); p, (p+2)//2 and (p+4)//3 whole-rank
    M_B of two stages each (arXiv 2405.15362: zb-v, v-half, v-min)."""
    return {"zb-auto": p, "zb-1p": p, "zb-2p": 2 * p, "zb-v": 2 * p, "v-half": 2 * ((p + 2) // 2),
            "v-min": 2 * ((p + 4) // 3)}[name]


# the default share (7/16 of M_B) and a larger one (issue 31 used 0.8; 3/4 is as exact in binary as
# 7/16, so the peaks compare with <= and no tolerance)
@pytest.mark.parametrize("mem_w", [None, 0.75])
@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("name", MEMORY_LIMITED)
def test_memory_limited_plans_keep_their_limit_with_ws_memory_whatever_m(name, p, mem_w):
    costs = zb.Costs(mem_w=mem_w)
    limit = default_limit(name, p)
    for m in (2 * p, 8 * p):
        peak = max(zb.simulate(zb.build_schedule(name, p, m, costs=costs), costs).peak_memory)
        assert peak <= limit, f"{name} p={p} m={m}: peak {peak} over its limit {limit}"


def test_zb_v_with_default_costs_holds_the_same_peak_at_8_32_and_64_microbatches():
    # issue 31's repro: planned with M_W = 0, zb-v (p = 4) deferred every W to the tail, so under
    # M_W = 0.8 its peak went 14.4, 52.8, 104 for m = 8, 32, 64 while the plan said 8
    costs = zb.Costs(mem_w=7 / 16)
    peaks = [max(zb.simulate(zb.build_schedule("zb-v", 4, m), costs).peak_memory) for m in (8, 32, 64)]
    assert peaks == [8, 8, 8]  # p whole-rank M_B, 1F1B's peak (arXiv 2401.10241, section 6)


def _corrupt(schedule: Schedule, rng: random.Random) -> Schedule:
    rows = [list(r) for r in schedule.actions]
    rank = rng.choice([r for r in range(len(rows)) if rows[r]])
    i = rng.randrange(len(rows[rank]))
    how = rng.choice(["drop", "duplicate", "early"])
    if how == "drop":
        rows[rank].pop(i)
    elif how == "duplicate":
        rows[rank].insert(rng.randrange(len(rows[rank]) + 1), rows[rank][i])
    else:  # move an action before something it needs on its own rank
        a = rows[rank][i]
        needed = [j for j, x in enumerate(rows[rank]) if set(produces(x)) & set(deps(a, schedule.num_stages))]
        if not needed:
            rows[rank].pop(i)  # nothing to jump over: drop instead
        else:
            rows[rank].pop(i)
            rows[rank].insert(rng.randrange(min(needed) + 1), a)
    return Schedule(rows, schedule.placement, schedule.num_microbatches)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2"])
@SETTINGS
@given(p=st.integers(1, 5), m=st.integers(1, 8), seed=st.integers(0, 10_000))
def test_corrupted_schedules_are_refused(name, p, m, seed):
    s = _corrupt(zb.build_schedule(name, p, m), random.Random(seed))
    with pytest.raises(zb.ScheduleError):
        zb.validate(s)


# --------------------------------------------------------------------------- CSV input as people write it

_ENDINGS = st.sampled_from(["\n", "\r\n", "\r"])
_BLANK = st.sampled_from(["", " ", "\t", "  \t "])


@pytest.mark.parametrize("name", ["1f1b", "interleaved-1f1b", "zb-h1", "zb-v"])
@SETTINGS
@given(p=st.integers(1, 4), m=st.integers(1, 6), data=st.data())
def test_csv_with_any_line_endings_and_blank_lines_reads_back_the_same_schedule(tmp_path_factory, name, p, m, data):
    """Mixed LF / CRLF / CR endings and blank (or whitespace-only) lines anywhere: same ranks,
    same actions, same placement, from text and from a file."""
    s = zb.build_schedule(name, p, m)
    lines: list[str] = []
    for row in s.to_rows():
        lines += data.draw(st.lists(_BLANK, max_size=2), label="blank lines before")
        lines.append(",".join(row))
    lines += data.draw(st.lists(_BLANK, max_size=3), label="blank lines at the end")
    text = "".join(line + data.draw(_ENDINGS) for line in lines)
    back = Schedule.from_csv_text(text)
    assert back.actions == s.actions and back.placement == s.placement and back.num_ranks == p
    path = tmp_path_factory.mktemp("csv") / "s.csv"
    path.write_bytes(text.encode())
    assert Schedule.from_csv(path).actions == s.actions


@SETTINGS
@given(
    p=st.integers(1, 4),
    m=st.integers(1, 6),
    bad=st.text(alphabet="0123456789FIWBXxyz;()", min_size=1, max_size=5),
    ending=_ENDINGS,
    seed=st.integers(0, 10_000),
)
def test_a_bad_csv_cell_gets_one_line_naming_its_line_and_rank(p, m, bad, ending, seed):
    try:
        Action.from_str(bad)
        return  # a valid action: not garbage
    except ValueError:
        pass
    rng = random.Random(seed)
    rows = zb.build_schedule("1f1b", p, m).to_rows()
    rank = rng.randrange(p)
    rows[rank].insert(rng.randrange(len(rows[rank]) + 1), bad)
    text = ending.join(",".join(row) for row in rows)
    with pytest.raises(ValueError) as err:
        Schedule.from_csv_text(text)
    message = str(err.value)
    assert len(message.splitlines()) == 1
    assert message.startswith(f"CSV line {rank + 1} (rank {rank}): cannot parse action {bad!r}")
