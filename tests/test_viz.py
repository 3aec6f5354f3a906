"""Presentation layer: figure content against the simulator, text grid, Chrome trace, slider
figures, and the explorer's callbacks driven headless (no browser)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

import zbpp_lite as zb
from zbpp_lite.schedules.builders import SCHEDULES, register
from zbpp_lite.schedules.timeline import Event, Timeline
from zbpp_lite.viz import (
    KIND_STYLE,
    applicable_options,
    bubble_sweep,
    bubble_sweep_figure,
    compare_figure,
    memory_figure,
    microbatch_slider_figure,
    schedule_slider_figure,
    slider_figure,
    text_grid,
    timeline_figure,
    to_chrome_trace,
    write_chrome_trace,
)
from zbpp_lite.viz.style import BAR_KINDS

UNEVEN = zb.Costs(f=1.0, b=1.5, w=0.5, comm=0.25)


def bars(trace) -> list[tuple[int, float, float]]:
    """(rank, start, end) of every bar of a horizontal bar trace."""
    ys, bases, xs = (list(v) if v is not None else [] for v in (trace.y, trace.base, trace.x))
    return [(int(y), float(base), float(base + x)) for y, base, x in zip(ys, bases, xs)]


def expected_bars(timeline: Timeline, kind: str) -> list[tuple[int, float, float]]:
    if kind == "idle":
        return [(r, a, b) for r, gaps in enumerate(timeline.idle_gaps) for a, b in gaps]
    return [(e.rank, e.start, e.end) for e in timeline.events if e.action.kind == kind]


def assert_figure_matches(fig, timeline: Timeline) -> None:
    """One trace per kind; its bars are exactly the timeline's events of that kind (idle: gaps)."""
    assert [t.legendgroup for t in fig.data] == list(BAR_KINDS)
    for trace in fig.data:
        assert trace.marker.color == KIND_STYLE[trace.legendgroup].color
        got = sorted(bars(trace))
        want = sorted(expected_bars(timeline, trace.legendgroup))
        assert [g[0] for g in got] == [w[0] for w in want]
        assert [x for g in got for x in g[1:]] == pytest.approx([x for w in want for x in w[1:]])


@pytest.fixture
def refusing_schedule():
    """A temporary schedule that takes costs and memory_limit and refuses limits below p M_B."""
    calls = []

    def refusing(num_ranks, num_microbatches, costs=None, memory_limit=None):
        calls.append({"costs": costs, "memory_limit": memory_limit})
        if memory_limit is not None and memory_limit < num_ranks:
            raise ValueError(f"memory limit {memory_limit} is below p * M_B = {num_ranks}; raise it")
        if num_microbatches % 2:
            raise ValueError("test-refusing needs an even number of microbatches")
        return zb.build_schedule("1f1b", num_ranks, num_microbatches)

    register("test-refusing", refusing)
    yield calls
    SCHEDULES.pop("test-refusing")


# --------------------------------------------------------------------------- timeline figure


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "zb-h1", "zb-h2"])
def test_timeline_figure_has_one_bar_per_action_coloured_by_kind_and_the_simulators_gaps(name):
    t = zb.simulate(zb.build_schedule(name, 4, 6), UNEVEN)
    fig = timeline_figure(t, name)
    assert_figure_matches(fig, t)
    assert sum(len(tr.x) for tr in fig.data[:4]) == len(t.events)
    assert len(fig.data[4].x) == sum(len(g) for g in t.idle_gaps)
    assert fig.layout.barmode == "overlay"


def test_timeline_figure_title_labels_and_hover():
    t = zb.simulate(zb.build_schedule("zb-h1", 4, 8))
    fig = timeline_figure(t, "zb-h1")
    # Unit costs: ZB-H1's makespan is 3m + p - 1 (paper section 3.1: bubble (p-1)(T_F+T_B-T_W)).
    assert t.makespan == 3 * 8 + 3
    assert fig.layout.title.text == f"zb-h1 (simulated): makespan 27, bubble rate {t.bubble_rate:.1%}"
    f_trace = fig.data[0]
    f_events = [e for e in t.events if e.action.kind == "F"]
    assert list(f_trace.text) == [str(e.action.microbatch) for e in f_events]
    assert [tuple(c[:2]) for c in f_trace.customdata] == [(e.action.stage, e.action.microbatch) for e in f_events]
    assert "stage" in f_trace.hovertemplate and "microbatch" in f_trace.hovertemplate
    assert "%{customdata[0]:d}B%{customdata[1]:d}" in fig.data[1].hovertemplate  # our text form (1B3), not I
    assert not fig.data[3].showlegend  # ZB-H1 has no fused BW
    assert list(fig.layout.yaxis.ticktext) == [f"rank {r}" for r in range(4)]
    assert list(fig.layout.yaxis.range) == [3.5, -0.5]  # rank 0 on top


def test_timeline_figure_of_a_measured_timeline_starts_at_zero_in_seconds():
    planned = zb.simulate(zb.build_schedule("1f1b", 3, 4), zb.Costs(f=0.01, b=0.02, w=0.0))
    measured = _as_measured(planned, offset=1234.5, stretch=1.2)
    fig = timeline_figure(measured, "1f1b")
    starts = [b[1] for tr in fig.data for b in bars(tr)]
    assert min(starts) == pytest.approx(0.0)
    assert fig.layout.xaxis.title.text == "time (s)"
    assert "(measured)" in fig.layout.title.text


def _as_measured(t: Timeline, offset: float, stretch: float) -> Timeline:
    events = [Event(e.rank, e.action, offset + stretch * e.start, offset + stretch * e.end) for e in t.events]
    return Timeline.from_events(events, t.num_ranks, source="measured")


def test_compare_figure_puts_planned_and_measured_on_one_time_axis():
    planned = zb.simulate(zb.build_schedule("zb-h1", 4, 8), UNEVEN)
    measured = _as_measured(planned, offset=50.0, stretch=1.25)
    fig = compare_figure(planned, measured)
    assert len(fig.data) == 2 * len(BAR_KINDS)
    assert {tr.xaxis for tr in fig.data[:5]} == {"x"} and {tr.xaxis for tr in fig.data[5:]} == {"x2"}
    assert fig.layout.xaxis.matches == "x2" or fig.layout.xaxis2.matches == "x"
    measured_starts = [b[1] for tr in fig.data[5:] for b in bars(tr)]
    assert min(measured_starts) == pytest.approx(0.0)
    assert "1.250" in fig.layout.title.text
    with pytest.raises(ValueError, match="same number of ranks"):
        compare_figure(planned, zb.simulate(zb.build_schedule("zb-h1", 3, 8)))


# --------------------------------------------------------------------------- memory


def test_memory_figure_lines_reach_each_ranks_peak_and_draw_the_limit():
    costs = zb.Costs(f=1, b=1, w=1, mem_b=2.0, mem_w=0.5)
    s = zb.build_schedule("zb-h2", 4, 8)
    t = zb.simulate(s, costs, memory_limit=7.0)
    fig = memory_figure(t, costs)
    assert len(fig.data) == 4
    for rank, line in enumerate(fig.data):
        assert max(line.y) == pytest.approx(t.peak_memory[rank])
        assert line.y[-1] == pytest.approx(0.0)  # every activation freed by the end
    # ZB-H2 holds (2p-1) microbatches' activations on rank 0 (paper section 3.1).
    assert t.peak_memory[0] == pytest.approx((2 * 4 - 1) * 2.0)
    assert [sh.y0 for sh in fig.layout.shapes] == [7.0]
    assert memory_figure(t, costs, memory_limit=20).layout.shapes[0].y0 == 20
    assert not memory_figure(zb.simulate(s, costs), costs).layout.shapes


@pytest.mark.parametrize("costs", [None, zb.Costs(mem_w=0.0), zb.Costs(mem_b=2.0, mem_w=1.5)])
def test_memory_figure_without_costs_draws_the_memory_the_timeline_was_simulated_with(costs):
    # issue 31: without costs the figure used M_W = 0 while Costs() defaults to 7/16 M_B
    t = zb.simulate(zb.build_schedule("zb-h1", 4, 8), costs)
    for rank, line in enumerate(memory_figure(t).data):
        assert max(line.y) == pytest.approx(t.peak_memory[rank])
        assert line.y == pytest.approx([v for _, v in t.memory_curve(rank, costs)] + [line.y[-1]])


# --------------------------------------------------------------------------- bubble sweeps


def test_bubble_sweep_matches_1f1b_closed_form_on_both_axes():
    # Unit costs: 1F1B's makespan is 3(m + p - 1), busy 3m, so bubble rate (p-1)/(m+p-1).
    axis, xs, rates = bubble_sweep(["1f1b", "zb-h2"], 4, [2, 4, 8, 16])
    assert axis == "num_microbatches" and xs == [2, 4, 8, 16]
    assert rates["1f1b"] == pytest.approx([3 / (m + 3) for m in xs])
    assert rates["zb-h2"][-1] == pytest.approx(0.0)  # ZB-H2: no bubble for m >= 2p - 1, T_F = T_B = T_W
    axis, xs, rates = bubble_sweep(["1f1b"], [2, 3, 6], 8)
    assert axis == "num_ranks"
    assert rates["1f1b"] == pytest.approx([(p - 1) / (8 + p - 1) for p in xs])
    with pytest.raises(ValueError, match="exactly one"):
        bubble_sweep(["1f1b"], [2, 4], [4, 8])


def test_bubble_sweep_figure_leaves_gaps_where_a_schedule_refuses(refusing_schedule):
    fig = bubble_sweep_figure(["1f1b", "test-refusing"], 2, [3, 4, 5, 6])
    by_name = {tr.name: list(tr.y) for tr in fig.data}
    assert by_name["test-refusing"][0] is None and by_name["test-refusing"][2] is None
    assert by_name["test-refusing"][1] == pytest.approx(by_name["1f1b"][1])
    assert fig.layout.xaxis.title.text == "microbatches m"


# --------------------------------------------------------------------------- options


def test_applicable_options_follow_each_builders_signature(refusing_schedule):
    costs = zb.Costs()
    assert applicable_options("interleaved-1f1b", 3, costs, 5.0) == {"stages_per_rank": 3}
    assert applicable_options("zb-h1", 3, costs, 5.0) == {}
    assert applicable_options("test-refusing", 3, costs, 5.0) == {"costs": costs, "memory_limit": 5.0}
    assert applicable_options("test-refusing", 3, None, None) == {}


# --------------------------------------------------------------------------- text grid


def test_text_grid_rows_show_every_action_in_order_and_idle_as_dots():
    s = zb.build_schedule("zb-h1", 4, 6)
    t = zb.simulate(s)  # unit costs, integer times
    cols_per_unit = 3
    grid = text_grid(t, width=int(t.makespan) * cols_per_unit + 3 * cols_per_unit)
    lines = grid.splitlines()
    assert len(lines) == 1 + 4 and "makespan" in lines[0]
    span = max(e.end for e in t.events)
    for rank, line in enumerate(lines[1:]):
        prefix, cells = line.split("|", 1)
        assert prefix.strip() == f"rank {rank}"
        assert re.findall(r"(BW|F|B|W)(\d+)", cells) == [(a.kind, str(a.microbatch)) for a in s.actions[rank]]
        # every column not covered by an action is idle: (whole span - busy) time units
        assert cells.count(".") == round((span - t.busy[rank]) * len(cells) / span)


def test_text_grid_keeps_every_action_when_narrow_and_names_stages_when_ranks_hold_several():
    t = zb.simulate(zb.build_schedule("interleaved-1f1b", 2, 4, stages_per_rank=2))
    wide = text_grid(t, width=200, header=False).splitlines()
    assert len(wide) == 2
    # rank 0 holds stages 0 and 2: labels carry the stage
    assert re.findall(r"\d+F\d+", wide[0])[:2] == ["0F0", "0F1"]
    narrow = text_grid(t, width=10, header=False).splitlines()
    assert all(len(line.split("|", 1)[1]) == 10 for line in narrow[:2])
    assert narrow[2].startswith("note: ") and "shared by several actions" in narrow[2]  # it says what it folded
    with pytest.raises(ValueError, match="width"):
        text_grid(t, width=0)


def _cells_column_by_column(starts, ends, t0, scale, width):
    """The text grid's columns of one rank counted action by action, column by column (Python's round):
    (cells, owners), owners the (index, c0, c1) of each action holding some column alone."""
    count, ranges = [0] * width, []
    for start, end in zip(starts, ends):
        c0 = min(round((start - t0) * scale), width - 1)
        c1 = round((end - t0) * scale)
        c1 = c0 + 1 if c1 <= c0 + 1 else min(c1, width)
        for c in range(c0, c1):
            count[c] += 1
        ranges.append((c0, c1))
    cells = [(".", None, "*")[min(n, 2)] for n in count]
    owners = [(i, c0, c1) for i, (c0, c1) in enumerate(ranges) if any(count[c] == 1 for c in range(c0, c1))]
    return cells, owners


@pytest.mark.parametrize("seed", range(6))
def test_text_grid_columns_counted_in_numpy_equal_counting_them_one_by_one(seed):
    """The grid counts a rank's columns in NumPy (thousands of actions a rank at p = 256): the same cells
    and the same actions holding a column alone as counting column by column, halves rounded to even as
    Python's round() does, on random actions, overlapping or not, some a column wide or less."""
    import numpy as np

    from zbpp_lite.viz.text import _rank_cells

    rng = np.random.default_rng(seed)
    n, width = int(rng.integers(1, 60)), int(rng.integers(1, 40))
    starts = np.sort(rng.integers(0, 80, n) / 4.0)  # quarters: many columns' edges fall on a half
    ends = starts + rng.integers(0, 12, n) / 4.0
    scale = width / float(ends.max()) if ends.max() > 0 else 0.0
    events = [Event(0, zb.Action("F", 0, i), float(a), float(b)) for i, (a, b) in enumerate(zip(starts, ends))]
    cells, owners = _rank_cells(events, (starts, ends), scale, width)
    want_cells, want_owners = _cells_column_by_column(starts.tolist(), ends.tolist(), 0.0, scale, width)
    assert cells == want_cells
    assert [(e.action.microbatch, c0, c1) for e, c0, c1 in owners] == want_owners


def test_text_grid_of_clock_readings_in_integer_nanoseconds_is_the_grid_of_their_differences():
    """Times are taken from the grid's start before NumPy sees them: time.time_ns() readings (above 2**53,
    where a float64 has no unit digit) draw as their differences do; a time not finite is named."""
    t0 = 1_700_000_000_000_000_000
    f, b = zb.Action("F", 0, 0), zb.Action("B", 0, 0)
    stamps = Timeline.from_events([Event(0, f, t0 + 1, t0 + 100), Event(0, b, t0 + 300, t0 + 400)], 1, source="measured")
    shifted = Timeline.from_events([Event(0, f, 1.0, 100.0), Event(0, b, 300.0, 400.0)], 1, source="measured")
    assert text_grid(stamps, 8) == text_grid(shifted, 8)
    assert _rows(text_grid(stamps, 8)) == ["F0....B0"]
    with pytest.raises(ValueError, match=r"^text_grid: rank 0's 0F0 runs from 0.0 to nan; times must be finite"):
        text_grid(Timeline.from_events([Event(0, f, 0.0, float("nan"))], 1), 8)


def test_text_grid_of_a_program_with_optimizer_instructions_draws_its_actions():
    """A lowered program's timeline holds the optimizer's instants (stage -1, no microbatch): they take no
    time and are not drawn (the grid raised AttributeError on them)."""
    from zbpp_lite.schedules.program import lower

    s = zb.build_schedule("zb-h1", 2, 4)
    with_step = zb.simulate(lower(s, "synchronous"))
    assert any(e.action.kind == "STEP" for e in with_step.events)
    assert _rows(text_grid(with_step, 40)) == _rows(text_grid(zb.simulate(s), 40))


def test_optimizer_instants_do_not_make_a_rank_hold_several_stages():
    """The instants' stage -1 is not a stage: a lowered one-stage-per-rank program keeps the grid's plain
    labels and draws no chunk note, while the V's two stages a rank do."""
    from zbpp_lite.schedules.program import lower
    from zbpp_lite.viz.figures import _chunk_note

    with_step = zb.simulate(lower(zb.build_schedule("zb-h1", 2, 4), "synchronous"))
    assert not with_step.several_stages and _chunk_note(with_step) == []
    v = zb.simulate(lower(zb.build_schedule("zb-v", 2, 4), "synchronous"))
    assert v.several_stages and len(_chunk_note(v)) == 1


def _rows(grid: str) -> list[str]:
    return [line.split("|", 1)[1] for line in grid.splitlines() if line.startswith("rank ")]


def test_a_narrow_grid_folds_into_marked_columns_and_never_shows_an_action_out_of_order():
    # the repro: p = 16, m = 64 at 40 columns showed rank 15 starting "...B", a B before any F
    s = zb.build_schedule("zb-h1", 16, 64)
    t = zb.simulate(s)
    grid = text_grid(t, width=40)
    for row in _rows(grid):
        assert row.strip(".")[0] in "F*"
    note = grid.splitlines()[-1]
    width = int(re.search(r"width (\d+) shows every label", note).group(1))
    assert "column(s) shared by several actions ('*')" in note
    full = text_grid(t, width=width)
    assert "note:" not in full  # the width the note names shows every label, microbatches >= 10 too
    for rank, row in enumerate(_rows(full)):
        assert re.findall(r"(F|B|W)(\d+)", row) == [(a.kind, str(a.microbatch)) for a in s.actions[rank]]


@pytest.mark.parametrize("width", [400, None])
def test_labels_that_do_not_fit_are_shortened_to_their_kind_and_the_grid_says_so(width):
    s = zb.build_schedule("zb-h1", 16, 64)
    t = zb.simulate(s)  # at 400 columns an action has 1 or 2
    grid = text_grid(t, width=width)
    assert "label(s) shortened to the kind" in grid.splitlines()[-1]
    for rank, row in enumerate(_rows(grid)):  # what is shown is in the rank's order
        shown = re.findall(r"(F|B|W)(\d*)", row)
        real = iter((a.kind, str(a.microbatch)) for a in s.actions[rank])
        assert all(any(k == kind and (not j or j == mb) for kind, mb in real) for k, j in shown)


def test_interleaved_labels_are_separated_so_stage_and_microbatch_read_back():
    # at 400 columns interleaved labels ran together: "0F12F0" for 0F1 then 2F0
    s = zb.build_schedule("interleaved-1f1b", 4, 16, stages_per_rank=2)
    t = zb.simulate(s)
    for width in (400, 200, 100):  # 400 ran labels together before
        for rank, row in enumerate(_rows(text_grid(t, width=width))):
            labels = re.findall(r"(\d+)(BW|F|B|W)(\d+)", row)
            real = [(str(a.stage), a.kind, str(a.microbatch)) for a in s.actions[rank]]
            it = iter(real)
            assert all(label in it for label in labels)  # each label is a real action, in order


# --------------------------------------------------------------------------- Chrome trace


def test_chrome_trace_has_one_complete_event_per_action_on_a_named_track_per_rank(tmp_path):
    t = zb.simulate(zb.build_schedule("zb-h1", 3, 4), UNEVEN)
    trace = to_chrome_trace(t)
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(t.events)
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == {0: "rank 0", 1: "rank 1", 2: "rank 2"}
    # simulated: one cost unit = 1000 us by default
    for e, ev in zip(complete, t.events):
        assert e["tid"] == ev.rank and e["cat"] == ev.action.kind
        assert e["ts"] == pytest.approx(ev.start * 1000) and e["dur"] == pytest.approx(ev.duration * 1000)
    path = write_chrome_trace(t, tmp_path / "sub" / "t.json", time_unit_us=10)
    loaded = json.loads(path.read_text())
    assert [e["dur"] for e in loaded["traceEvents"] if e["ph"] == "X"] == pytest.approx(
        [ev.duration * 10 for ev in t.events]
    )
    with pytest.raises(ValueError, match="time_unit_us"):
        to_chrome_trace(t, time_unit_us=0)


@pytest.mark.parametrize("unit", [float("nan"), float("inf"), float("-inf"), -1.0])
def test_chrome_trace_refuses_a_non_finite_or_negative_time_unit(tmp_path, unit):
    """NaN or Infinity in the JSON would be refused by Perfetto: refuse them here, in one line."""
    t = zb.simulate(zb.build_schedule("1f1b", 2, 2))
    with pytest.raises(ValueError, match=r"time_unit_us must be a finite number > 0") as err:
        write_chrome_trace(t, tmp_path / "t.json", time_unit_us=unit)
    assert len(str(err.value).splitlines()) == 1
    assert not (tmp_path / "t.json").exists()


def test_chrome_trace_of_measured_seconds_and_of_several_timelines():
    planned = zb.simulate(zb.build_schedule("1f1b", 2, 3), zb.Costs(f=0.002, b=0.004, w=0.0))
    measured = _as_measured(planned, offset=100.0, stretch=1.0)
    trace = to_chrome_trace({"planned": planned, "measured": measured}, time_unit_us=1e6)
    x = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in x} == {0, 1}
    firsts = [min(e["ts"] for e in x if e["pid"] == pid) for pid in (0, 1)]
    assert firsts == pytest.approx([0.0, 0.0])
    assert [e["dur"] for e in x if e["pid"] == 1] == pytest.approx([ev.duration * 1e6 for ev in measured.events])
    assert to_chrome_trace(measured)["otherData"]["pipeline (measured)"]["time_unit_us"] == 1e6
    procs = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"]
    assert procs == ["planned", "measured"]


# --------------------------------------------------------------------------- static slider figures


def test_slider_figure_steps_show_exactly_one_states_bars():
    states = [(f"m={m}", zb.simulate(zb.build_schedule("zb-h1", 3, m))) for m in (2, 4, 6)]
    fig = slider_figure(states, slider_label="microbatches ")
    assert len(fig.data) == 3 * len(BAR_KINDS)
    steps = fig.layout.sliders[0].steps
    assert [s.label for s in steps] == ["m=2", "m=4", "m=6"]
    for i, (step, (_, t)) in enumerate(zip(steps, states)):
        visible = step.args[0]["visible"]
        shown = [tr for tr, v in zip(fig.data, visible) if v]
        assert len(shown) == len(BAR_KINDS)
        assert sum(len(tr.x) for tr in shown[:4]) == len(t.events)
        assert f"makespan {t.makespan:.4g}" in step.args[1]["title.text"]
    assert [tr.visible for tr in fig.data[:5]] == [True] * 5 and not any(tr.visible for tr in fig.data[5:])
    with pytest.raises(ValueError, match="at least one"):
        slider_figure([])


def test_slider_figures_leave_out_refused_settings(refusing_schedule):
    fig = microbatch_slider_figure("test-refusing", 2, [3, 4, 5, 6])
    assert [s.label for s in fig.layout.sliders[0].steps] == ["m=4", "m=6"]
    fig = schedule_slider_figure(["1f1b", "test-refusing", "zb-h1"], 2, 3)
    assert [s.label for s in fig.layout.sliders[0].steps] == ["1f1b", "zb-h1"]
    with pytest.raises(ValueError, match="refused every"):
        microbatch_slider_figure("test-refusing", 2, [3, 5])


# --------------------------------------------------------------------------- explorer, headless


def test_explore_state_returns_the_simulated_timeline_or_the_refusal(refusing_schedule):
    from zbpp_lite.viz import ExplorerSettings, explore_state

    state = explore_state(ExplorerSettings("interleaved-1f1b", 4, 8, 3, 1.0, 2.0, 0.5, 0.1, 0))
    want = zb.simulate(zb.build_schedule("interleaved-1f1b", 4, 8, stages_per_rank=3), zb.Costs(1.0, 2.0, 0.5, 0.1))
    assert state.ok and state.timeline.events == want.events and state.memory_limit is None
    assert_figure_matches(state.figure(), want)
    bad = explore_state(ExplorerSettings("test-refusing", 4, 8, None, 1, 1, 1, 0, 2.0))
    assert not bad.ok and bad.timeline is None and "below p * M_B" in bad.error
    assert refusing_schedule[-1]["memory_limit"] == 2.0 and refusing_schedule[-1]["costs"] == zb.Costs(1, 1, 1, 0)
    assert bad.figure() is None


def test_explorer_sliders_redraw_the_figures_to_match_the_simulator(refusing_schedule):
    from zbpp_lite.viz import Explorer

    ex = Explorer("zb-h1", num_ranks=4, num_microbatches=8)
    c = ex.controls
    assert_figure_matches(ex.figure, zb.simulate(zb.build_schedule("zb-h1", 4, 8)))
    assert c["stages_per_rank"].disabled

    c["num_microbatches"].value = 12
    c["b"].value = 2.0
    c["comm"].value = 0.5
    want = zb.simulate(zb.build_schedule("zb-h1", 4, 12), zb.Costs(f=1.0, b=2.0, w=1.0, comm=0.5))
    assert_figure_matches(ex.figure, want)
    assert f"makespan {want.makespan:.4g}" in ex.figure.layout.title.text
    assert ex.last_redraw_ms > 0

    c["schedule"].value = "interleaved-1f1b"
    assert not c["stages_per_rank"].disabled
    c["stages_per_rank"].value = 3
    c["num_ranks"].value = 3
    want = zb.simulate(
        zb.build_schedule("interleaved-1f1b", 3, 12, stages_per_rank=3), zb.Costs(f=1.0, b=2.0, w=1.0, comm=0.5)
    )
    assert_figure_matches(ex.figure, want)
    assert list(ex.figure.layout.yaxis.ticktext) == ["rank 0", "rank 1", "rank 2"]
    assert ex.figure.layout.title.text.startswith("interleaved-1f1b (simulated): makespan")
    assert len(ex.memory.data) == 3
    assert [max(line.y) for line in ex.memory.data] == pytest.approx(list(want.peak_memory))

    c["memory_limit"].value = 5.0
    assert [sh.y0 for sh in ex.memory.layout.shapes] == [5.0]
    assert "over the limit" in ex.message.value
    c["memory_limit"].value = 0.0  # 0 = no limit: the line goes
    assert not ex.memory.layout.shapes and "over the limit" not in ex.message.value


def test_explorer_shows_a_refusal_as_a_message_not_a_traceback(refusing_schedule):
    from zbpp_lite.viz import Explorer

    ex = Explorer("1f1b", num_ranks=4, num_microbatches=8)
    c = ex.controls
    c["schedule"].value = "test-refusing"
    assert ex.state.ok and refusing_schedule[-1]["costs"] is not None
    c["memory_limit"].value = 2.0  # below p * M_B = 4: refused
    assert not ex.state.ok
    assert "below p * M_B = 4" in ex.message.value and "Traceback" not in ex.message.value
    assert all(len(tr.x) == 0 for tr in ex.figure.data)
    assert "no schedule" in ex.figure.layout.title.text
    c["memory_limit"].value = 6.0  # accepted again: the bars come back
    assert ex.state.ok
    assert_figure_matches(ex.figure, zb.simulate(zb.build_schedule("1f1b", 4, 8), memory_limit=6.0))
    with pytest.raises(ValueError, match="choose one of"):
        Explorer("no-such-schedule")


def test_viz_imports_no_jax_and_colab_helper_is_a_no_op_elsewhere():
    code = (
        "import sys, zbpp_lite.viz as v, zbpp_lite.viz.widgets;"
        "print('jax' in sys.modules, v.enable_colab_widgets())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_explorer_offers_dualpipe_v_with_a_t_fb_slider_and_its_refusal_below_2p():
    from zbpp_lite.viz import Explorer

    ex = Explorer("dualpipe-v", num_ranks=4, num_microbatches=8)
    c = ex.controls
    assert "dualpipe-v" in c["schedule"].options
    s = zb.build_schedule("dualpipe-v", 4, 8)
    assert_figure_matches(ex.figure, zb.simulate(s))  # T_F&B slider at 0: no overlap
    c["fb"].value = 2.0
    want = zb.simulate(s, zb.Costs(fb=2.0))
    assert_figure_matches(ex.figure, want)
    assert want.makespan == 44 and f"makespan {want.makespan:.4g}" in ex.figure.layout.title.text
    c["num_microbatches"].value = 7
    assert not ex.state.ok and "use m &gt;= 8" in ex.message.value  # HTML-escaped


def test_explorer_adds_and_drops_the_chunk_note_as_the_schedule_changes():
    from zbpp_lite.viz import Explorer
    from zbpp_lite.viz.figures import NOTE_MARGIN

    note = "lighter shade: a rank's later stage"
    ex = Explorer("1f1b", num_ranks=4, num_microbatches=8)
    assert not any(note in a.text for a in ex.figure.layout.annotations)
    ex.controls["schedule"].value = "zb-v"  # two stages per rank: the note appears
    assert [a.text for a in ex.figure.layout.annotations if note in a.text] and ex.figure.layout.margin.b == NOTE_MARGIN
    ex.controls["schedule"].value = "zb-h1"  # one stage per rank again: the old note goes
    assert not any(note in a.text for a in ex.figure.layout.annotations) and ex.figure.layout.margin.b == 45


# ---------------------------------------------------------------------------- schedules on one time axis


def test_headline_figure_moves_each_cool_down_w_and_outlines_the_critical_path():
    from zbpp_lite.analysis.profiling.timelines import critical_path
    from zbpp_lite.viz.figures import moved_w, schedules_figure

    p, m = 4, 8
    one, h1, h2 = (zb.simulate(zb.build_schedule(n, p, m)) for n in ("1f1b", "zb-h1", "zb-h2"))
    moved = moved_w(one, h1)
    # rank r > 0 ends with its last B, then the W's of microbatches m-1-r .. m-1, where 1F1B's rank idled
    assert sorted((w.rank, w.action.microbatch) for _, w in moved) == [
        (r, j) for r in range(1, p) for j in range(m - 1 - r, m)]
    assert all(old.action.kind == "BW" and old.rank == w.rank for old, w in moved)
    fig = schedules_figure([("1F1B", one), ("ZB-H1", h1), ("ZB-H2", h2)], moves=(0,), chain=True)
    assert len(fig.layout.annotations) == 4 + len(moved)          # 4 panel titles, one arrow a moved W
    chains = [tr for tr in fig.data if tr.name.startswith("critical path")]
    for tr, t in zip(chains, (one, h1, h2)):
        assert sum(tr.x) == sum(e.duration for e in critical_path(t))
    memory = [tr for tr in fig.data if tr.name.startswith("memory: ")]
    assert [max(tr.y) for tr in memory] == [p, p, 2 * p - 1]       # rank 0: 1F1B's, ZB-H1's, ZB-H2's peak
    with pytest.raises(ValueError, match="one number of ranks"):
        schedules_figure([("a", one), ("b", zb.simulate(zb.build_schedule("1f1b", 2, 4)))])
