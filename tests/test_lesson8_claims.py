"""Lesson 8's claims over more cases than the lesson shows (moved from the lesson, issue 40): each rank's
ZB-H1 order from lesson 3's rule, ZB-H1's per-rank peak memory in closed form over a grid, the bytes F
and B of the lesson's own stages keep, and the plan's per-rank peaks equal to those of a run of the
lesson's loop.

The lesson's code runs as in ``test_build_lesson.py`` (its set-up and the definitions of its Solutions).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from test_build_lesson import lesson  # noqa: F401  (the fixture: the lesson's namespace)

import zbpp_lite as zb
from zbpp_lite import course as ex
from zbpp_lite.course import bench


@pytest.mark.parametrize("p", [2, 3, 4, 5])
def test_each_ranks_zb_h1_order_follows_lesson_3s_rule(p, lesson):  # noqa: F811
    """The lesson's ``zb_h1_order`` (lesson 3's rule, shown at p = 4, m = 8) is the package's ZB-H1 at
    every p and m."""
    zb_h1_order = lesson["zb_h1_order"]
    for m in range(1, 2 * p + 2):
        schedule = zb.build_schedule("zb-h1", p, m)
        for r in range(p):
            assert zb_h1_order(p, m, r) == [a.label for a in schedule.actions[r]], (p, m, r)


def zb_h1_peak(p, m, r, mem_b, mem_w):
    """Rank r's peak under ZB-H1 (arXiv 2401.10241, section 2.1): its W of microbatch j runs after its B
    of microbatch j + r, so after an F of the steady state it holds p - r microbatches past F (M_B each)
    and r past B (M_W each); with few microbatches only min(m, p - r) are ever past F at once, and only
    the m - (p - r) left over (if any, at most r) wait past B for their W."""
    return min(m, p - r) * mem_b + max(0, min(r, m - (p - r))) * mem_w


@pytest.mark.parametrize("p", [2, 3, 4, 5])
def test_zb_h1_peak_in_closed_form_for_every_m(p):
    for m in range(1, 2 * p + 2):
        for mem_b, mem_w in ((1.0, 0.5), (5.0, 1.0), (2.0, 1.5)):
            planned = zb.simulate(zb.build_schedule("zb-h1", p, m), zb.Costs(mem_b=mem_b, mem_w=mem_w)).peak_memory
            assert list(planned) == pytest.approx([zb_h1_peak(p, m, r, mem_b, mem_w) for r in range(p)]), (p, m)


def _stage_bytes(lesson):  # noqa: F811
    """(M_B, M_W) of each stage in bytes: what the lesson's F keeps (its parameters left out) and B keeps,
    one microbatch."""
    F, B, lab = lesson["F"], lesson["B"], lesson["lab"]
    mem_b, mem_w = [], []
    for s in range(lab.S):
        x = jax.device_put(jnp.ones((lab.rows, lab.X.shape[1])), lab.devices[lab.placement[s]])
        y, saved = F(s, x, lab.targets_mb[0] if s == lab.S - 1 else None)
        mem_b.append(bench.nbytes(saved, leave_out=lab.stage_params[s]))
        mem_w.append(bench.nbytes(B(saved, jnp.float32(1 / lab.m) if s == lab.S - 1 else jnp.ones_like(y))[1]))
    return mem_b, mem_w


def test_what_f_and_b_keep_in_bytes(lesson):  # noqa: F811
    mem_b, mem_w = _stage_bytes(lesson)
    c = ex.BUILD_CASE
    per = c["layers"] // c["ranks"]
    assert mem_w[1] == per * 2 * c["microbatch_size"] * c["width"] * c["itemsize"]   # x and dz of 2 layers
    assert all(w <= b for w, b in zip(mem_w, mem_b))
    assert mem_b[-1] > max(mem_b[:-1])          # the last stage's F keeps what its loss's backward needs


def test_planned_peaks_equal_a_measured_runs(lesson):  # noqa: F811
    mem_b, mem_w = _stage_bytes(lesson)
    memory = zb.Costs(mem_b=[float(v) for v in mem_b], mem_w=[float(v) for v in mem_w])
    lab, schedule = lesson["lab"], zb.build_schedule("zb-h1", 4, 8)
    _, measured = lab.run(schedule, lesson["rank_loop"])
    assert all([e.action for e in measured.rank_events(r)] == list(schedule.actions[r]) for r in range(4))
    replayed = zb.Timeline.from_events(measured.events, 4, costs=memory, num_stages=4)
    assert replayed.peak_memory == zb.simulate(schedule, memory).peak_memory
    assert list(replayed.peak_memory) == [zb_h1_peak(4, 8, r, mem_b[r], mem_w[r]) for r in range(4)]
