"""Lesson 9's claims beyond the case it shows (``notebooks/09_spmd_pipeline.md``; pure Python, fast).

"How many rows a buffer needs": a buffer of K rows, microbatch j in row j % K, never overwrites a value
still waiting to be read when K is the most microbatches in flight in it on its rank, and K - 1 rows would;
F's before the first B and the W lag are lesson 3's (Qi et al., arXiv 2401.10241, section 3).
"""

from __future__ import annotations

from pathlib import Path

import pytest

import zbpp_lite as zb
from zbpp_lite import course as ex

LESSON = Path(__file__).parent.parent / "notebooks" / "09_spmd_pipeline.md"


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
    rows = ex.buffer_depths(zb.build_schedule("zb-h2", 4, 8))   # an activation may wait a tick
    assert max(rows["act"]) == 2 and max(rows["grad"]) == 1


def test_the_worked_tick_stores_what_the_tick_tables_route():
    table = ex.tick_messages(zb.build_schedule("zb-h1", 4, 8), 8).splitlines()
    assert table[1:] == [
        "rank 0  W0    ins[0], dz[0] -> dA, dc             -                     -                   grad[1] <- rank 1's dx",
        "rank 1  B1    outs[1], grad[1] -> dz[1]           -                     dx, tag 2           -",
        "rank 2  F3    act[3] -> ins[3], outs[3]           y, tag 4              -                   grad[2] <- rank 3's dx",
        "rank 3  B2    outs[2], Y[2] -> dz[2]              -                     dx, tag 3           act[3] <- rank 2's y"]
    after = ex.tick_messages(zb.build_schedule("zb-h1", 4, 8), 9).splitlines()   # tick 9 reads what 8 stored
    assert after[3].startswith("rank 2  B2    outs[2], grad[2] -> dz[2]") and after[4].startswith("rank 3  F3    act[3]")
    fused = ex.tick_messages(zb.build_schedule("1f1b", 4, 8), 9).splitlines()
    assert fused[1].startswith("rank 0  BW1   outs[1], ins[1], grad[1] -> dA, dc")


@pytest.mark.parametrize("p", [2, 3, 4, 5])
def test_1f1b_in_lockstep_with_a_double_length_bw_takes_4m_plus_3p_minus_4(p):
    """Exercise 9.2: of 1F1B's 2(m + p - 1) ticks only the first p hold no BW (T_F = 1, T_BW = 2)."""
    for m in (1, p, 2 * p, 3 * p + 1):
        assert zb.simulate(zb.build_schedule("1f1b", p, m), ex.FUSED, lockstep=True).makespan == 4 * m + 3 * p - 4


def test_the_worked_table_marks_a_clash_with_k_minus_1_rows_and_none_with_k():
    schedule = zb.build_schedule("zb-h1", 4, 8)
    assert "!" not in ex.buffer_rows(schedule, 4) and "!" in ex.buffer_rows(schedule, 3)


@pytest.mark.parametrize("p", [3, 4, 5])   # at p = 2 rank r + 1 is rank r - 1
def test_on_the_v_both_directions_carry_both_kinds_and_the_busiest_stages_rows_serve_every_stage(p):
    """"Several stages per rank": rank r's chunks are stages r and 2p - 1 - r; an activation from rank r + 1
    or a gradient from rank r - 1 goes to chunk 1 (the second leg), the other way round to chunk 0; only
    rank p - 1 keeps a message (the turn, stage p - 1 to p and back); and one array per buffer with its
    busiest stage's rows, microbatch j in row j % rows, overwrites nothing still waiting on any stage."""
    from zbpp_lite.runtime.spmd import ACT_BUFFER, GRAD_BUFFER, tick_tables

    for m in (p, 2 * p, 3 * p + 1):
        schedule = zb.build_schedule("zb-v", p, m)
        assert [schedule.stages_of(r) for r in range(p)] == [(r, 2 * p - 1 - r) for r in range(p)]
        recv = tick_tables(schedule).recv
        for source, act_chunk, grad_chunk in (("left", 0, 1), ("right", 1, 0)):
            buffer, chunk, _ = recv[source]
            assert (chunk[buffer == ACT_BUFFER] == act_chunk).all() and (chunk[buffer == GRAD_BUFFER] == grad_chunk).all()
            assert (buffer == ACT_BUFFER).any() and (buffer == GRAD_BUFFER).any(), (source, m)
        assert recv["self"][0][p - 1].any() and not recv["self"][0][: p - 1].any()
        for buffer, rows in ex.buffer_depths(schedule).items():
            for s in (s for s in range(2 * p) if rows[s]):   # stage 0 receives no act, the last no grad
                assert "!" not in ex.buffer_rows(schedule, max(rows), buffer, s), (m, buffer, s)


def test_the_tick_table_written_in_the_lesson_is_what_the_package_prints():
    """Lesson 9 writes ZB-H1's tick 8 into its source (read on GitHub, no cell has run): the same lines as
    ``ex.tick_messages(schedule, 8)`` prints; without its reads -> keeps column, the same table less that
    column (on the V too)."""
    source = LESSON.read_text(encoding="utf-8")
    written = source.split("```text\n")[1].split("```")[0].rstrip("\n").splitlines()
    assert written == ex.tick_messages(zb.build_schedule("zb-h1", 4, 8), 8).splitlines()
    for schedule, t in ((zb.build_schedule("zb-h1", 4, 8), 8), (zb.build_schedule("zb-v", 4, 8), 14)):
        full = ex.tick_messages(schedule, t).splitlines()
        start, end = full[0].index("reads -> keeps"), full[0].index("sends down")
        assert ex.tick_messages(schedule, t, reads=False).splitlines() == [(x[:start] + x[end:]).rstrip() for x in full]


def test_the_lessons_tables_from_lockstep_ticks_are_the_packages_tick_tables():
    """Lesson 9 builds its (ranks, ticks) kind and microbatch tables from ``lockstep_ticks`` by hand; the
    package's ``spmd.tick_tables`` gives the same two arrays (ZB-H1, 1F1B, ZB-H2)."""
    import numpy as np
    from zbpp_lite.runtime import spmd
    from zbpp_lite.schedules.simulate import lockstep_ticks

    for name in ("zb-h1", "1f1b", "zb-h2"):
        schedule = zb.build_schedule(name, 4, 8)
        ticks, rows = lockstep_ticks(schedule), schedule.actions
        kind = np.array([[0 if t[r] is None else ex.KIND_CODE[rows[r][t[r]].kind] for t in ticks] for r in range(4)])
        microbatch = np.array([[0 if t[r] is None else rows[r][t[r]].microbatch for t in ticks] for r in range(4)])
        tables = spmd.tick_tables(schedule)
        assert (kind == tables.kind).all() and (microbatch == tables.microbatch).all(), name


def test_the_whole_program_cell_uses_nothing_from_the_package():
    """Lesson 9's "The whole program" is ZB-H1's step (1F1B's too) as two functions a reader can write from
    scratch, ``make_tick`` and ``pipeline_step``: their bodies name no package module (zb, ex, bench, spmd,
    lab) and no helper that wraps one (program_of, rank_program...): only JAX, the cells' vary, store and
    stage F, B and W, the sizes, and the tick tables the step is given (the lesson builds them from
    lockstep_ticks); the step scans the cell's own make_tick, which has a branch for each kind code."""
    import ast
    source = LESSON.read_text(encoding="utf-8")
    cell = source.split("## The whole program")[1].split("```{code-cell} ipython3\n")[1].split("```")[0]
    defs = {n.name: n for n in ast.walk(ast.parse(cell)) if isinstance(n, ast.FunctionDef)}
    names = {n.id for f in ("make_tick", "pipeline_step") for n in ast.walk(defs[f]) if isinstance(n, ast.Name)}
    assert not names & {"zb", "ex", "bench", "spmd", "lab", "program_of", "rank_program", "tables"}
    assert {"lax", "jnp", "jax", "shard_map", "P", "vary", "store", "stage_F", "stage_B", "stage_W", "kind", "microbatch",
            "mesh", "p", "m", "samples", "d", "make_tick"} <= names
    assert {"forward", "backward", "weight", "fused", "tick"} <= set(defs)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("name", ["zb-h1", "zb-h2", "1f1b", "gpipe"])
def test_the_rows_a_buffer_needs_are_the_most_values_it_holds_at_once(name, overlap):
    """"Values come and go in microbatch order, so K rows used in turn suffice for a buffer holding at most K
    at once": exercise 9.3's count of the most values held at once (the Solutions' way) equals the fewest
    rows with no clash in row j % K (``ex.buffer_depths``) for every buffer and rank, p = 2..6, m = 1..3p + 1,
    but where a rank keeps nothing past a tick (1F1B's dz: 0 held, 1 row); and so with lesson 10's one-tick
    link (``overlap``: its ticks, an arrival stored a tick after it was made)."""
    from zbpp_lite.schedules.simulate import lockstep_ticks

    for p in range(2, 7):
        for m in range(1, 3 * p + 2):
            schedule = zb.build_schedule(name, p, m)
            ticks, at = lockstep_ticks(schedule, overlap=overlap), {}
            for t, row in enumerate(ticks):
                for r, i in enumerate(row):
                    if i is not None:
                        a = schedule.actions[r][i]
                        at.update({(k, a.stage, a.microbatch): t for k in (("B", "W") if a.kind == "BW" else (a.kind,))})
            depths = ex.buffer_depths(schedule, overlap=overlap)
            for buffer, made, sender, reader in (("act", "F", -1, "F"), ("grad", "B", 1, "B"), ("ins", "F", 0, "W"),
                                                 ("outs", "F", 0, "B"), ("dz", "B", 0, "W")):
                for s in range(max(0, -sender), min(p, p - sender)):
                    spans = [(at[made, s + sender, j] + (overlap and sender != 0), at[reader, s, j]) for j in range(m)]
                    most = max(sum(w <= t < r for w, r in spans) for t in range(len(ticks)))
                    assert depths[buffer][s] == max(most, 1), (name, p, m, buffer, s)
