"""The course's explanation helpers: per-stage memory (notebook 05) and zb-auto's heuristic read
step by step (notebook 04)."""

from __future__ import annotations

import zbpp_lite as zb
from zbpp_lite.schedules.builders.auto import auto_plan
from zbpp_lite.viz.memory import memory_by_stage, stage_memory_figure
from zbpp_lite.course.walkthrough import eight_choices, narrate


def test_zb_v_balances_memory_stage_against_stage():
    p = 4
    t = zb.simulate(zb.build_schedule("zb-v", p, 8), zb.Costs())
    split = memory_by_stage(t)
    # rank r: stage r holds 2p-1-r microbatches, its partner 2p-1-r holds r+1; the sum is 2p everywhere
    assert split == [{r: 2 * p - 1 - r, 2 * p - 1 - r: r + 1} for r in range(p)]
    assert [sum(d.values()) for d in split] == list(t.peak_memory) == [2 * p] * p


def test_looped_placement_is_uneven_and_sums_match_the_peaks():
    t = zb.simulate(zb.build_schedule("interleaved-1f1b", 4, 8), zb.Costs(mem_b=[1, 2, 1, 2, 1, 2, 1, 2]))
    split = memory_by_stage(t, zb.Costs(mem_b=[1, 2, 1, 2, 1, 2, 1, 2]))
    assert [sum(d.values()) for d in split] == list(t.peak_memory)
    assert t.peak_memory[0] > t.peak_memory[-1]
    fig = stage_memory_figure(t)
    assert len(fig.data) == 2 and list(fig.data[0].x) == [f"rank {r}" for r in range(4)]


def test_eight_choices_are_the_papers_runs_and_the_search_keeps_the_best():
    c = zb.Costs(f=1.0, b=1.3, w=0.6, comm=0.1)
    runs = eight_choices(3, 6, c, 4)
    assert len(runs) == 8 and len({(r.prefer, r.fill_partial, r.fit_f) for r in runs}) == 8
    assert [r.makespan for r in runs] == sorted(r.makespan for r in runs)
    assert all(r.peak_memory <= 4 for r in runs)
    assert runs[0].makespan > runs[-1].makespan - 5 and runs[0].makespan < runs[-1].makespan  # the choices matter
    assert auto_plan(3, 6, c, 4).makespan <= runs[0].makespan + 1e-9


def test_narrate_gives_one_reason_per_action():
    c = zb.Costs(f=1.0, b=1.3, w=0.6, comm=0.1)
    s = auto_plan(3, 6, c, 4).schedule
    lines = narrate(s, c, 0, 4)
    assert len(lines) == len(s.actions[0])
    assert sum("warm-up F" in x for x in lines) == next(i for i, a in enumerate(s.actions[0]) if a.kind != "F")
    assert lines[-1].endswith("W left for the end")
    assert any("W fills idle time" in x for x in lines)
    assert "memory 4 of 4" in lines[3]  # the warm-up stops at the limit


def test_dependency_arrows_are_the_transfers_and_point_forward_in_time():
    from zbpp_lite.viz.figures import dependency_arrows, dependency_figure

    p, m = 3, 4
    t = zb.simulate(zb.build_schedule("1f1b", p, m), zb.Costs(comm=0.25))
    arrows = dependency_arrows(t)
    # every microbatch's F crosses p-1 links down and its backward p-1 links up
    assert len(arrows) == 2 * m * (p - 1)
    assert all(a["x"] >= a["ax"] + 0.25 - 1e-9 for a in arrows)          # each waits at least T_comm
    assert all(abs(a["y"] - a["ay"]) == 1 for a in arrows)                # neighbours only
    with_own = dependency_arrows(t, same_rank=True)
    assert len(with_own) == len(arrows) + p * m                            # + each BW's own F
    assert len(dependency_figure(t).layout.annotations) == len(arrows)


def test_postvalidation_figure_shows_the_wait_and_the_speculative_forwards():
    from zbpp_lite.viz.figures import postvalidation_figure

    p = 4
    t = zb.simulate(zb.build_schedule("zb-h2", p, 8), zb.Costs())
    fig = postvalidation_figure(t)
    wait = next(tr for tr in fig.data if tr.name == "waiting for the global check")
    assert list(wait.x) == [t.sync_bubble] * p == [(p - 1) * 1.0] * p   # every rank waits (p-1) T_F for the others
    spec = next(tr for tr in fig.data if tr.name.startswith("speculative F"))
    # post-validated, rank r starts step 2 at its own end; forwards before the last rank's end are speculative
    assert len(spec.x) == sum(range(p)) and set(spec.y) == set(range(p - 1))


def test_layer_dependency_figure_has_no_arrow_out_of_a_w():
    from zbpp_lite.viz.figures import layer_dependency_figure

    fig = layer_dependency_figure(3)
    names = {tr.name.split(":")[0] for tr in fig.data}
    assert names == {"F", "B", "W", "loss"}
    xy = {(x, y): text for tr in fig.data for x, y, text in zip(tr.x, tr.y, tr.text)}
    tails = [xy[(a.ax, a.ay)] for a in fig.layout.annotations]
    heads = [xy[(a.x, a.y)] for a in fig.layout.annotations]
    assert not any(t.startswith("W") for t in tails)
    assert sorted(h for h in heads if h.startswith("W")) == ["W1", "W1", "W2", "W2", "W3", "W3"]   # its input and its output gradient
