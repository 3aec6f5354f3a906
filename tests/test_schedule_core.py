"""Schedule core: IR text form, closed forms, the paper's Table 5, validator refusals."""

from __future__ import annotations

import subprocess
import sys

import pytest

import zbpp_lite as zb
from zbpp_lite.schedules import formulas
from zbpp_lite.schedules.ir import Action, Schedule

HANDCRAFTED = ["gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "zb-h1", "zb-h2"]


# --------------------------------------------------------------------------- IR


def test_importing_the_schedule_layers_does_not_import_jax():
    code = "import sys, zbpp_lite as zb; zb.simulate(zb.build_schedule('zb-h1', 4, 8)); print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize("text, kind", [("2F0", "F"), ("1I3", "B"), ("1W3", "W"), ("0B1", "BW")])
def test_action_text_round_trip(text, kind):
    a = Action.from_str(text)
    assert a.kind == kind and str(a) == text


@pytest.mark.parametrize("torch, ours, kind", [("2F0", "2F0", "F"), ("1I3", "1B3", "B"), ("1W3", "1W3", "W"),
                                               ("0B1", "0BW1", "BW")])
def test_our_text_form_names_the_kind_and_pytorchs_keeps_its_letters(torch, ours, kind):
    a = Action.from_text(ours)
    assert a == Action.from_str(torch) and a.kind == kind and a.text == ours and str(a) == torch
    pair = zb.Overlap(Action("F", 0, 7), Action("BW", 7, 3))
    assert pair.text == "0F7&7BW3" and str(pair) == "(0F7;7B3)OVERLAP_F_B"
    with pytest.raises(ValueError, match="our text form"):
        Action.from_text("1I3")                     # PyTorch's letter for B is not ours


@pytest.mark.parametrize("bad", ["F0", "1X2", "", "1F", "a1F2"])
def test_action_from_str_refuses_garbage(bad):
    with pytest.raises(ValueError, match="expected"):
        Action.from_str(bad)


def test_csv_round_trip_keeps_every_action_and_placement(tmp_path):
    s = zb.build_schedule("interleaved-1f1b", 3, 6, stages_per_rank=2)
    path = tmp_path / "s.csv"
    s.to_csv(path)
    back = Schedule.from_csv(path)
    assert back.actions == s.actions
    assert back.placement == s.placement == (0, 1, 2, 0, 1, 2)
    assert back.num_microbatches == 6


@pytest.mark.parametrize(
    "text",
    [
        "0F0,0B0\n1F0,1B0\n",  # LF
        "0F0,0B0\r\n1F0,1B0\r\n",  # CRLF
        "0F0,0B0\r1F0,1B0\r",  # CR only (old Mac): used to give a raw _csv.Error
        "0F0,0B0\n1F0,1B0\n\n\n",  # blank lines at the end: used to add an empty rank 2
        "0F0,0B0\n\n  \t\n1F0,1B0",  # blank lines between rows: used to move stage 1 to rank 3
        "\ufeff\r\n0F0,0B0\r\n\r\n1F0,1B0",  # a byte-order mark, a leading blank line, CRLF
    ],
)
def test_csv_text_reads_any_line_ending_and_skips_blank_lines(text):
    s = Schedule.from_csv_text(text)
    assert s.num_ranks == 2 and s.placement == (0, 1) and s.num_microbatches == 1
    assert s.to_rows() == [["0F0", "0B0"], ["1F0", "1B0"]]


@pytest.mark.parametrize("ending", ["\n", "\r\n", "\r"])
def test_csv_file_reads_any_line_ending_and_skips_blank_lines(tmp_path, ending):
    s = zb.build_schedule("zb-h1", 3, 4)
    path = tmp_path / "s.csv"
    path.write_bytes((ending * 2).join(",".join(row) for row in s.to_rows()).encode() + ending.encode() * 3)
    back = Schedule.from_csv(path)
    assert back.actions == s.actions and back.placement == s.placement and back.num_ranks == 3


def test_from_csv_takes_a_path_only_and_from_csv_text_text_only(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"'0F0,0B0': no such file; to parse CSV text use Schedule.from_csv_text"):
        Schedule.from_csv("0F0,0B0")
    with pytest.raises(FileNotFoundError, match=r"^schedule CSV '.*missing.csv': no such file$"):
        Schedule.from_csv(tmp_path / "missing.csv")
    with pytest.raises(IsADirectoryError, match="is a directory; expected a CSV file"):
        Schedule.from_csv(tmp_path)
    with pytest.raises(TypeError, match="from_csv takes a file path"):
        Schedule.from_csv(3)
    with pytest.raises(TypeError, match="for a file use Schedule.from_csv"):
        Schedule.from_csv_text(tmp_path / "s.csv")
    # text that names an existing file is still text: a bad action, not the file's content
    (tmp_path / "0F0").write_text("1F0\n")
    assert Schedule.from_csv_text("0F0").to_rows() == [["0F0"]]


@pytest.mark.parametrize(
    "text, message",
    [
        ("0F0,0B0\n\n1F0,1X0\n", r"^CSV line 3 \(rank 1\): cannot parse action '1X0'"),
        ("0F0,0B0\r1F0,oops\r", r"^CSV line 2 \(rank 1\): cannot parse action 'oops'"),
        ('0F0,"0B0\n', r"^CSV line 1 \(rank 0\): unexpected end of data"),
        ("0F0,1B0\n1F0\n", r"^stage 1 appears on rank 0 and on rank 1"),
    ],
)
def test_csv_errors_are_one_line_naming_line_and_rank(tmp_path, text, message):
    with pytest.raises(ValueError, match=message) as err:
        Schedule.from_csv_text(text)
    assert len(str(err.value).splitlines()) == 1
    path = tmp_path / "bad.csv"
    path.write_text(text, newline="")
    with pytest.raises(ValueError, match=str(path)) as err:
        Schedule.from_csv(path)
    assert len(str(err.value).splitlines()) == 1
    path.write_bytes(b"0F0,\xff\xfe\n")
    with pytest.raises(ValueError, match="is not UTF-8 text"):
        Schedule.from_csv(path)


def test_placement_is_inferred_from_rows_and_v_shape_is_recognised():
    s = Schedule.from_rows([["0F0", "3F0", "3B0", "0B0"], ["1F0", "2F0", "2B0", "1B0"]])
    assert s.placement == zb.v_placement(2) == (0, 1, 1, 0)
    zb.validate(s)


def test_a_stage_on_two_ranks_is_refused():
    with pytest.raises(ValueError, match="stage 0 appears on rank 0 and on rank 1"):
        Schedule.from_rows([["0F0"], ["0B0"]])


# --------------------------------------------------------------------------- closed forms

COSTS = [(1.0, 1.0, 1.0), (3.0, 2.0, 1.0), (2.0, 3.0, 1.5), (1.3, 1.1, 0.7)]


def _bubble(name, p, m, f, b, w, **kw):
    t = zb.simulate(zb.build_schedule(name, p, m, **kw), zb.Costs(f=f, b=b, w=w))
    return t, t.makespan - m * (f + b + w)


@pytest.mark.parametrize("f, b, w", COSTS)
@pytest.mark.parametrize("p, m", [(2, 4), (3, 9), (4, 8), (5, 15), (8, 24)])
def test_bubble_closed_forms(p, m, f, b, w):
    assert _bubble("1f1b", p, m, f, b, w)[1] == pytest.approx((p - 1) * (f + b + w))
    assert _bubble("gpipe", p, m, f, b, w)[1] == pytest.approx((p - 1) * (f + b + w))
    assert _bubble("zb-h1", p, m, f, b, w)[1] == pytest.approx((p - 1) * (f + b - w))
    assert _bubble("zb-h2", p, m, f, b, w)[1] == pytest.approx((p - 1) * (f + b - 2 * w))
    for name in formulas.SCHEDULES_WITH_A_FORM:  # the package's closed forms say the same as the simulator
        t, bubble = _bubble(name, p, m, f, b, w)
        assert formulas.bubble_time(name, p, m, f, b, w) == pytest.approx(bubble)
        assert formulas.bubble_rate(name, p, m, f, b, w) == pytest.approx(t.bubble_rate)
        assert formulas.makespan(name, p, m, f, b, w) == pytest.approx(t.makespan)


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 12), (6, 12)])
def test_closed_form_memory_matches_the_simulator(p, m):
    for name in formulas.SCHEDULES_WITH_A_FORM:
        assert formulas.peak_memory(name, p, m) == zb.simulate(zb.build_schedule(name, p, m)).peak_memory[0]


def test_closed_forms_refuse_costs_outside_their_regime():
    # where 2 T_W > T_F + T_B, ZB-H2's form goes negative while the simulated bubble stays >= 0
    assert _bubble("zb-h2", 4, 12, 1.0, 1.0, 3.0)[1] == pytest.approx(0.0)
    with pytest.raises(ValueError, match="2 T_W <= T_F \\+ T_B"):
        formulas.bubble_time("zb-h2", 4, 12, 1.0, 1.0, 3.0)
    with pytest.raises(ValueError, match="T_W <= T_F"):
        formulas.bubble_time("zb-h1", 4, 12, 1.0, 1.0, 1.5)
    # T_B < T_W <= T_F is inside ZB-H1's domain: the form holds there and equals the simulator
    assert formulas.bubble_time("zb-h1", 4, 12, 2.0, 0.5, 1.0) == pytest.approx(_bubble("zb-h1", 4, 12, 2.0, 0.5, 1.0)[1])
    with pytest.raises(ValueError, match="no closed form for 'zb-v'"):
        formulas.bubble_time("zb-v", 4, 12)
    with pytest.raises(ValueError, match="m >= 7"):
        formulas.bubble_time("zb-h2", 4, 6)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_zb_h2_has_exactly_zero_bubble_with_equal_costs(p):
    t, bubble = _bubble("zb-h2", p, 2 * p + 3, 1.0, 1.0, 1.0)
    assert bubble == 0.0 and t.bubble_rate == 0.0


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 12), (6, 12)])
def test_peak_activation_memory(p, m):
    peak = {n: max(zb.simulate(zb.build_schedule(n, p, m)).peak_memory) for n in ("1f1b", "gpipe", "zb-h1", "zb-h2")}
    assert peak == {"1f1b": p, "gpipe": m, "zb-h1": p, "zb-h2": min(2 * p - 1, m)}


@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize("p, m", [(2, 8), (4, 8), (4, 12)])
def test_interleaving_divides_the_1f1b_bubble_by_v(p, m, v):
    # each of a rank's v stages holds 1/v of its layers, so per-stage costs are 1/v
    f, b, w = 1.5, 1.2, 0.9
    t = zb.simulate(zb.build_schedule("interleaved-1f1b", p, m, stages_per_rank=v), zb.Costs(f=f / v, b=b / v, w=w / v))
    bubble = t.makespan - m * (f + b + w)  # a rank's work: v stages of 1/v each
    assert bubble == pytest.approx((p - 1) * (f + b + w) / v)


# The paper's Table 5 (arXiv 2401.10241) from its Table 9 costs, 1.5B model, p = 8, m = 24 (ms).
TABLE5_15B = zb.Costs(f=18.522, b=18.086, w=9.337, comm=0.601)


def test_paper_table5_bubble_rates():
    rate = {n: zb.simulate(zb.build_schedule(n, 8, 24), TABLE5_15B).bubble_rate for n in ("1f1b", "zb-h1", "zb-h2")}
    assert rate["1f1b"] == pytest.approx(0.2431, abs=5e-4)
    assert rate["zb-h1"] == pytest.approx(0.1585, abs=5e-4)
    assert rate["zb-h2"] <= 0.1083 + 5e-4


def test_bubble_rate_matches_the_papers_definition():
    # (makespan - m (T_F + T_B + T_W)) / makespan with uniform costs, one stage per rank
    t = zb.simulate(zb.build_schedule("zb-h1", 8, 24), TABLE5_15B)
    work = 24 * (18.522 + 18.086 + 9.337)
    assert t.bubble_rate == pytest.approx((t.makespan - work) / t.makespan)


def test_comm_is_paid_only_between_ranks():
    # interleaved-1f1b with p = 1 keeps every stage on one rank: T_comm never counts
    s = zb.build_schedule("interleaved-1f1b", 1, 4, stages_per_rank=3)
    assert zb.simulate(s, zb.Costs(comm=5.0)).makespan == zb.simulate(s, zb.Costs()).makespan == 4 * 3 * 3


def test_per_stage_costs_are_honoured_and_checked():
    s = zb.build_schedule("1f1b", 2, 4)
    slow_last = zb.simulate(s, zb.Costs(f=[1, 2], b=[1, 2], w=[1, 2]))
    assert slow_last.busy == (12.0, 24.0)
    with pytest.raises(ValueError, match="3 per-stage values but the schedule has 2 stages"):
        zb.simulate(s, zb.Costs(f=[1, 2, 3]))


def test_the_default_m_w_is_the_papers_share_of_each_stages_m_b():
    # arXiv 2401.10241, table 1: M_W / M_B = 32h / (34h + 5as) = 16/37 at s = 1024, h/a = 128, to 1/16: 7/16
    assert zb.Costs().mem_w == 7 / 16 and zb.Costs(mem_b=2.0).mem_w == 7 / 8
    assert zb.Costs(mem_b=[4, 0, 16]).mem_w == (1.75, 0.0, 7.0)
    assert zb.Costs(mem_w=0).mem_w == 0.0 and zb.Costs(mem_b=[1, 2], mem_w=[0.5, 1]).mem_w == (0.5, 1.0)
    # 1F1B's W is fused into its B, so W's share never shows: p M_B on rank 0 whatever M_W
    assert zb.simulate(zb.build_schedule("1f1b", 4, 8)).peak_memory == (4, 3, 2, 1)


# --------------------------------------------------------------------------- builders: bad input


@pytest.mark.parametrize("name", HANDCRAFTED)
@pytest.mark.parametrize("p, m", [(0, 4), (2, 0), (-1, 3)])
def test_builders_refuse_bad_sizes_with_a_message(name, p, m):
    with pytest.raises(ValueError, match="must be an integer >= 1"):
        zb.build_schedule(name, p, m)


def test_unknown_schedule_lists_the_valid_names():
    with pytest.raises(ValueError, match="choose one of: .*zb-h1"):
        zb.build_schedule("zb-h3", 2, 2)


def test_unknown_option_is_refused():
    with pytest.raises(ValueError, match="takes no option"):
        zb.build_schedule("1f1b", 2, 2, stages_per_rank=2)


# --------------------------------------------------------------------------- validator


def _one_f_one_b_rows(p=2, m=2):
    return [list(r) for r in zb.build_schedule("1f1b", p, m).actions]


def test_missing_action_is_named():
    rows = _one_f_one_b_rows()
    rows[1].remove(Action("BW", 1, 1))
    with pytest.raises(zb.ScheduleError, match="missing B \\(or BW\\) of stage 1, microbatch 1"):
        zb.validate(Schedule(rows, (0, 1), 2))


def test_duplicate_action_is_named_with_rank_and_step():
    rows = _one_f_one_b_rows()
    rows[0].append(Action("F", 0, 0))
    with pytest.raises(zb.ScheduleError, match="rank 0, step 4: F\\(stage 0, microbatch 0\\)") as e:
        zb.validate(Schedule(rows, (0, 1), 2))
    assert e.value.rank == 0 and e.value.step == 4 and "[0F0]" in str(e.value)


def test_b_before_its_own_f_breaks_the_rule():
    rows = [["0I0", "0F0", "0W0"], ["1F0", "1I0", "1W0"]]
    with pytest.raises(zb.ScheduleError, match="rule: F before B"):
        zb.validate(Schedule.from_rows(rows))


def test_w_before_b_breaks_the_rule():
    rows = [["0F0", "0W0", "0I0"], ["1F0", "1B0"]]
    with pytest.raises(zb.ScheduleError, match="rule: B before W"):
        zb.validate(Schedule.from_rows(rows))


def test_cross_rank_cycle_is_a_deadlock_naming_stuck_heads():
    # rank 0 waits for 1I0 before sending 0F1; rank 1 waits for 0F1 before running 1I0
    rows = [["0F0", "0I0", "0F1", "0W0", "0I1", "0W1"], ["1F0", "1F1", "1I0", "1W0", "1I1", "1W1"]]
    with pytest.raises(zb.ScheduleError, match="deadlock") as e:
        zb.validate(Schedule.from_rows(rows))
    assert "rank 0 step 1" in str(e.value) and "rank 1 step 1" in str(e.value)


def test_action_on_the_wrong_rank_is_refused():
    s = Schedule([[Action("F", 0, 0), Action("BW", 0, 0)], [Action("F", 1, 0), Action("BW", 1, 0)]], (1, 0), 1)
    with pytest.raises(zb.ScheduleError, match="stage 0 is placed on rank 1"):
        zb.validate(s)


def test_out_of_range_microbatch_is_refused():
    rows = _one_f_one_b_rows()
    with pytest.raises(zb.ScheduleError, match="microbatches are 0 .. 0"):
        zb.validate(Schedule(rows, (0, 1), 1))


# --------------------------------------------------------------------------- PyTorch's own schedules

ARTIFACTS = __import__("pathlib").Path(__file__).parent / "artifacts"
# PyTorch 2.13's Schedule1F1B._get_pipeline_order numbers the last rank's forwards from 1 (3F1 ..
# 3F8 for m = 8): it never runs 3F0 and runs a 3F8 that does not exist. The validator must refuse it.
TORCH_BROKEN = {"torch_1F1B.csv"}
TORCH_CSVS = sorted(p.name for p in ARTIFACTS.glob("torch_*.csv") if p.name not in TORCH_BROKEN)


def test_pytorch_golden_files_are_present():
    # written by PyTorch 2.13's own generators (tests/artifacts/generate_torch_csv.py)
    assert {"torch_GPipe.csv", "torch_1F1B.csv", "torch_Interleaved1F1B.csv", "torch_LoopedBFS.csv",
            "torch_InterleavedZeroBubble.csv", "torch_ZBVZeroBubble.csv", "torch_DualPipeV.csv"} <= set(TORCH_CSVS) | TORCH_BROKEN


@pytest.mark.parametrize("fname", TORCH_CSVS)
def test_schedules_written_by_pytorch_load_validate_and_simulate(fname):
    s = Schedule.from_csv(ARTIFACTS / fname)
    zb.validate(s)
    t = zb.simulate(s, zb.Costs(f=1.0, b=1.0, w=1.0))
    assert t.makespan > 0 and len(t.events) == len(s)
    stages_per_rank = s.num_stages // s.num_ranks
    if "ZBV" in fname or "DualPipe" in fname:
        assert s.placement == zb.v_placement(s.num_ranks) and stages_per_rank == 2
    if "Interleaved" in fname or "LoopedBFS" in fname:
        assert s.placement == zb.looped_placement(s.num_ranks, s.num_stages)


def test_pytorchs_1f1b_order_is_refused_for_its_off_by_one_on_the_last_rank():
    with pytest.raises(zb.ScheduleError, match="3F8.* names microbatch 8, but microbatches are 0 .. 7"):
        zb.validate(Schedule.from_csv(ARTIFACTS / "torch_1F1B.csv", num_microbatches=8))
    rows = [row[:-2] + row[-1:] if r == 3 else row for r, row in enumerate(Schedule.from_csv(ARTIFACTS / "torch_1F1B.csv").to_rows())]
    with pytest.raises(zb.ScheduleError, match="missing F of stage 3, microbatch 0"):  # without 3F8
        zb.validate(Schedule.from_rows(rows, num_microbatches=8))


def test_our_builders_match_pytorchs_gpipe_1f1b_and_looped_bfs():
    assert Schedule.from_csv(ARTIFACTS / "torch_GPipe.csv").actions == zb.build_schedule("gpipe", 4, 8).actions
    torch_1f1b = Schedule.from_csv(ARTIFACTS / "torch_1F1B.csv", num_microbatches=8)
    assert torch_1f1b.actions[:3] == zb.build_schedule("1f1b", 4, 8).actions[:3]  # all but the broken rank
    assert Schedule.from_csv(ARTIFACTS / "torch_LoopedBFS.csv").actions == zb.build_schedule("looped-bfs", 4, 8).actions


def test_pytorch_lowered_form_with_comms_and_overlaps_reads_as_compute_only_with_its_pairs():
    lowered = Schedule.from_csv(ARTIFACTS / "torch_DualPipeV_comms.csv")
    assert lowered.has_pairs and str(lowered.actions[0][17]) == "(0F7;7B3)OVERLAP_F_B"
    assert lowered.actions[0][17] == zb.Overlap(zb.Action("F", 0, 7), zb.Action("BW", 7, 3))
    # PyTorch's compute-only CSV (tests/artifacts/generate_torch_csv.py) wrote each pair as two actions
    assert lowered.split_pairs().actions == Schedule.from_csv(ARTIFACTS / "torch_DualPipeV.csv").actions


# --------------------------------------------------------------------------- lockstep (SPMD) timing


def test_lockstep_matches_free_running_when_every_action_costs_the_same():
    # ZB-H1/H2 with T_F = T_B = T_W: every tick holds equal actions, so lockstep loses nothing
    for name in ("zb-h1", "zb-h2"):
        s = zb.build_schedule(name, 4, 8)
        assert zb.simulate(s, lockstep=True).makespan == zb.simulate(s).makespan


def test_lockstep_pays_for_its_slowest_action_per_tick():
    from zbpp_lite.schedules.simulate import lockstep_ticks

    s = zb.build_schedule("1f1b", 4, 8)
    c = zb.Costs(f=1.0, b=2.0, w=0.5)
    ticks = lockstep_ticks(s)
    expected = sum(max(c.table(4).time(s.actions[r][i].kind, 0) for r, i in enumerate(row) if i is not None) for row in ticks)
    assert zb.simulate(s, c, lockstep=True).makespan == pytest.approx(expected)
    assert zb.simulate(s, c, lockstep=True).makespan > zb.simulate(s, c).makespan
    # every rank keeps its order and each tick runs at most one action per rank
    for r in range(4):
        assert [row[r] for row in ticks if row[r] is not None] == list(range(len(s.actions[r])))


@pytest.mark.parametrize("p", [2, 4, 8])
def test_a_synchronous_optimizer_step_turns_zb_h2s_parallelogram_into_a_trapezoid(p):
    # paper section 4: ZB-H2's ranks end (p-1) T_F apart; waiting for all of them costs exactly that
    f = 1.5
    t = zb.simulate(zb.build_schedule("zb-h2", p, 3 * p), zb.Costs(f=f, b=1.5, w=1.5))
    assert t.bubble_rate == 0.0
    assert t.sync_bubble == pytest.approx((p - 1) * f)
    for name in ("1f1b", "zb-h1"):  # rank 0 starts first and ends last: nothing to lose
        assert zb.simulate(zb.build_schedule(name, p, 3 * p)).sync_bubble == 0.0


def test_zb_h2s_closed_form_is_refused_where_it_would_undercount_the_simulator():
    """T_F < T_W <= (T_F + T_B) / 2 (T_F = 1, T_B = 2, T_W = 1.4): the form (p-1)(T_F + T_B - 2 T_W)
    gives 0.6 at p = 4 while the simulated bubble is larger; formulas refuses it, in one line."""
    p, m = 4, 8
    simulated = zb.simulate(zb.build_schedule("zb-h2", p, m), zb.Costs(f=1.0, b=2.0, w=1.4)).makespan - m * 4.4
    assert simulated > (p - 1) * (1.0 + 2.0 - 2 * 1.4) + 1e-9
    with pytest.raises(ValueError, match=r"^ZB-H2's form needs T_W <= T_F and 2 T_W <= T_F \+ T_B [^\n]*$"):
        formulas.bubble_time("zb-h2", p, m, f=1.0, b=2.0, w=1.4)
    assert formulas.bubble_time("zb-h2", p, m, f=1.0, b=2.0, w=1.0) == (p - 1) * 1.0  # inside: accepted


# --------------------------------------------------------------------------- planning large sizes: one pass each


def test_a_checked_simulation_finds_the_execution_order_once(monkeypatch):
    import zbpp_lite.schedules.simulate as simulate_module
    import zbpp_lite.schedules.validate as validate_module

    calls = []
    real = validate_module.execution_order

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(validate_module, "execution_order", counted)
    monkeypatch.setattr(simulate_module, "execution_order", counted)
    s = zb.build_schedule("zb-h1", 4, 8)
    t = zb.simulate(s)
    assert len(calls) == 1  # the check's order is the one timed, not found again
    assert t.makespan == zb.simulate(s, check=False).makespan


def test_every_ranks_events_come_from_one_pass_over_the_timeline():
    import dataclasses

    class Counted(tuple):
        passes = 0

        def __iter__(self):
            Counted.passes += 1
            return super().__iter__()

    t = zb.simulate(zb.build_schedule("1f1b", 8, 16))
    counted = dataclasses.replace(t, events=Counted(t.events))
    rows = [counted.rank_events(r) for r in range(counted.num_ranks)]
    assert Counted.passes == 1  # not once per rank: the text grid asks for every rank
    assert [e for row in rows for e in row] == list(t.events)
    assert all(e.rank == r for r, row in enumerate(rows) for e in row)


def test_a_timeline_of_events_in_any_order_is_the_timeline_of_them_sorted_and_ranks_outside_are_refused():
    import random

    costs = zb.Costs(comm=0.25)
    t = zb.simulate(zb.build_schedule("zb-v", 4, 8), costs)
    shuffled = list(t.events)
    random.Random(0).shuffle(shuffled)
    again = zb.Timeline.from_events(shuffled, t.num_ranks, costs)
    assert again.events == t.events
    assert (again.makespan, again.bubble_rate, again.busy, again.peak_memory, again.idle_gaps) == (
        t.makespan, t.bubble_rate, t.busy, t.peak_memory, t.idle_gaps)
    assert [again.rank_events(r) for r in range(4)] == [tuple(e for e in t.events if e.rank == r) for r in range(4)]
    with pytest.raises(ValueError, match="event ranks run from 0 to 3; with num_ranks = 3 they must be 0 to 2"):
        zb.Timeline.from_events(t.events, 3, costs)
    with pytest.raises(ValueError, match="event ranks run from -1 to 3"):
        zb.Timeline.from_events([*t.events, t.events[0]._replace(rank=-1)], 4, costs)
    assert zb.Timeline.from_events((e for e in shuffled), 4, costs) == t  # any iterable, read once


@pytest.mark.parametrize("name, rank, step, to, named", [
    ("zb-h1", 3, 1, 0, r"B\(stage 3, microbatch 0\) \[3B0\] needs F of stage 3, microbatch 0"),
    ("dualpipe-v", 0, 17, 16, r"\[0F7&7BW3\] needs F of stage 7, microbatch 3")])
def test_an_unchecked_simulation_names_an_entry_run_before_what_it_needs_on_its_own_rank(name, rank, step, to,
                                                                                         named):
    """check=False finds deadlock only: the last stage's B (or a pair whose BW is the last stage's) moved
    one place, before the F it needs on its own rank, is named by the timing with the F it lacks."""
    s = zb.build_schedule(name, 4, 8)
    rows = [list(row) for row in s.actions]
    rows[rank].insert(to, rows[rank].pop(step))
    with pytest.raises(zb.ScheduleError, match=named + ", which is not there before it"):
        zb.simulate(zb.Schedule(rows, s.placement, 8), check=False)


def test_an_unchecked_action_is_the_action_made_with_its_checks():
    made = zb.Action.unchecked("B", 3, 7)
    assert made == zb.Action("B", 3, 7) and hash(made) == hash(zb.Action("B", 3, 7))
    assert zb.Action("B", 3, 6) < made < zb.Action("B", 4, 0) and str(made) == "3I7"


@pytest.mark.parametrize("name", ["1f1b", "zb-h2", "zb-v", "interleaved-1f1b"])
def test_early_starts_is_empty_when_simulated_and_names_an_action_moved_before_its_input(name):
    """A simulated timeline starts nothing before its inputs; move one B a unit earlier than the B it
    needs (or its own F) and it is the one event named; with tol at least the move, none."""
    import dataclasses

    from zbpp_lite.schedules.timeline import early_starts

    s = zb.build_schedule(name, 4, 8)
    t = zb.simulate(s, zb.Costs(comm=0.25))
    assert early_starts(t, s.num_stages) == []
    events = list(t.events)
    i = next(i for i, e in enumerate(events) if e.action.kind in ("B", "BW") and e.action.stage == 1)
    moved = events[i]._replace(start=events[i].start - 1.0, end=events[i].end - 1.0)
    events[i] = moved
    shifted = dataclasses.replace(t, events=tuple(events))
    assert early_starts(shifted, s.num_stages) == [moved]
    assert early_starts(shifted, s.num_stages, tol=1.0) == []


def test_overlapped_lockstep_reads_a_sent_value_two_ticks_on_and_hides_transfers_as_event_driven_timing():
    from zbpp_lite.schedules.simulate import lockstep_ticks

    for p in range(2, 7):  # ZB-H2: the last rank starts 2(p - 1) ticks in, then never waits
        for m in range(2 * p - 1, 3 * p + 2):
            assert len(lockstep_ticks(zb.build_schedule("zb-h2", p, m), overlap=True)) == 3 * m + 2 * (p - 1)
    s = zb.build_schedule("zb-h1", 4, 8)
    at = {(r, s.actions[r][i].label): t for t, row in enumerate(lockstep_ticks(s, overlap=True))
          for r, i in enumerate(row) if i is not None}
    assert at[1, "F0"] == at[0, "F0"] + 2 and at[3, "B0"] == at[3, "F0"] + 1  # across ranks 2, on one 1
    for name in ("zb-h1", "zb-h2", "zb-v"):  # every action and transfer one unit: a tick is a unit
        for p in (2, 3, 5):
            for m in (p, 2 * p, 3 * p):
                s, c = zb.build_schedule(name, p, m), zb.Costs(comm=1.0)
                overlapped = zb.simulate(s, c, lockstep=True, overlap=True)
                assert overlapped.global_span == zb.simulate(s, c).global_span < zb.simulate(s, c, lockstep=True).global_span
    with pytest.raises(ValueError, match="^overlap=True times the transfers of a lockstep"):
        zb.simulate(s, overlap=True)


def test_overlapped_lockstep_zb_h1_waits_p_minus_1_ticks_a_round_for_its_gradients():
    # lesson 10: ZB-H1's rank 0 holds p forwards and microbatch 0's gradient is back after 4p - 3 ticks,
    # so p microbatches take 4p - 1 ticks, not 3p (the overlapped exercise's ZB-H1 foil)
    from zbpp_lite.schedules.simulate import lockstep_ticks

    for p in range(2, 8):
        for m in range(2 * p, 5 * p + 1, p):
            s = zb.build_schedule("zb-h1", p, m)
            ticks = lockstep_ticks(s, overlap=True)
            assert len(ticks) == (4 * p - 1) * m // p + 4 * p - 5
            b0 = next(t for t, row in enumerate(ticks) if row[0] is not None and s.actions[0][row[0]].label == "B0")
            assert b0 == 4 * p - 3
