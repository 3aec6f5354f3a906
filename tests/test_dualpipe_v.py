"""DualPipeV (issue 20): the builder, the overlapped F&B pair in the IR, T_F&B in the costs, and
DualPipe's published bubble (PP/2 - 1)(F&B + B - 3W) (DeepSeek's DualPipe README, arXiv
2412.19437), against PyTorch 2.13's own DualPipeV order (tests/artifacts)."""

from __future__ import annotations

import pathlib

import pytest

import zbpp_lite as zb
from zbpp_lite.schedules.ir import Overlap, Schedule, parts, produces

ARTIFACTS = pathlib.Path(__file__).parent / "artifacts"
TORCH_P, TORCH_M = 4, 8  # tests/artifacts/generate_torch_csv.py: ScheduleDualPipeV, 2 stages a rank, p = 4, m = 8


# --------------------------------------------------------------------------- the pair in the IR


def test_the_pair_has_pytorchs_text_form_and_parses_back():
    pair = Overlap(zb.Action("F", 0, 7), zb.Action("BW", 7, 3))
    assert str(pair) == "(0F7;7B3)OVERLAP_F_B" and pair.kind == "F&B" and pair.label == "F7&BW3"
    assert Overlap.from_str(str(pair)) == pair
    assert parts(pair) == (zb.Action("F", 0, 7), zb.Action("BW", 7, 3))
    assert Overlap.from_str("(1F2;6I0)OVERLAP_F_B").backward == zb.Action("B", 6, 0)


@pytest.mark.parametrize("text, match", [
    ("(0F7)OVERLAP_F_B", "expected"),
    ("(7B3;0F7)OVERLAP_F_B", "is \\(F; B or BW\\)"),
    ("(0F1;0W1)OVERLAP_F_B", "is \\(F; B or BW\\)"),
    ("(3F2;3B2)OVERLAP_F_B", "its own forward"),
])
def test_malformed_pairs_are_refused_with_what_is_expected(text, match):
    with pytest.raises(ValueError, match=match):
        Overlap.from_str(text)


@pytest.mark.parametrize("p, m", [(1, 2), (2, 4), (3, 7), (4, 8)])
def test_the_builder_round_trips_through_pytorchs_csv_form(p, m):
    s = zb.build_schedule("dualpipe-v", p, m)
    text = s.to_csv()
    assert ("OVERLAP_F_B" in text) == s.has_pairs
    back = Schedule.from_csv_text(text)
    assert back.actions == s.actions and back.placement == s.placement


def test_our_builder_is_pytorchs_dualpipev_order_pair_for_pair():
    ours = zb.build_schedule("dualpipe-v", TORCH_P, TORCH_M)
    torch_pairs = Schedule.from_csv(ARTIFACTS / "torch_DualPipeV_comms.csv")
    torch_split = Schedule.from_csv(ARTIFACTS / "torch_DualPipeV.csv")
    assert ours.actions == torch_pairs.actions
    assert ours.split_pairs().actions == torch_split.actions


def test_pytorchs_csvs_simulate_no_faster_than_ours_where_a_pair_overlaps():
    ours = zb.build_schedule("dualpipe-v", TORCH_P, TORCH_M)
    torch_pairs = Schedule.from_csv(ARTIFACTS / "torch_DualPipeV_comms.csv")
    torch_split = Schedule.from_csv(ARTIFACTS / "torch_DualPipeV.csv")
    unit = zb.Costs()  # T_F = T_B = T_W = 1, T_F&B = T_F + T_BW = 3: no overlap
    assert zb.simulate(torch_pairs, unit).makespan == zb.simulate(ours, unit).makespan == 54
    # written as two actions, a pair need not wait for the later of its two inputs: without any
    # overlap, PyTorch's compute-only CSV is 3 units shorter than the pairs it was written from
    assert zb.simulate(torch_split, unit).makespan == 51
    for fb in (2.0, 2.5, 2.7):  # once a pair saves 10 % of its F + BW (0.3 units), the pairs win or tie
        c = zb.Costs(fb=fb)
        assert zb.simulate(torch_split, c).makespan >= zb.simulate(ours, c).makespan - 1e-9
        assert zb.simulate(torch_pairs, c).makespan == zb.simulate(ours, c).makespan
    assert zb.simulate(ours, zb.Costs(fb=2.0)).makespan == 44


# --------------------------------------------------------------------------- the builder


@pytest.mark.parametrize("p", [1, 2, 3, 5])
def test_the_builder_refuses_fewer_than_2p_microbatches_saying_what_works(p):
    for m in range(1, 2 * p):
        with pytest.raises(ValueError, match=rf"at least 2p = {2 * p} microbatches.*use m >= {2 * p}"):
            zb.build_schedule("dualpipe-v", p, m)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("extra", [0, 1, 5])
def test_v_placement_p_ranks_2p_stages_every_action_once(p, extra):
    m = 2 * p + extra
    s = zb.validate(zb.build_schedule("dualpipe-v", p, m))
    assert s.placement == zb.v_placement(p) and s.num_stages == 2 * p and s.num_ranks == p
    done = [key for _, a in s for key in produces(a)]  # a BW gives B and W
    assert len(done) == len(set(done)) == 3 * 2 * p * m  # one F, B and W per stage and microbatch
    # pairs: F with a full backward of the rank's other chunk; rank r has 2m - 3p + r + 1 (the last one fewer)
    for r in range(p):
        pairs = [e for e in s.actions[r] if isinstance(e, Overlap)]
        assert all(e.backward.kind == "BW" and e.forward.stage != e.backward.stage for e in pairs)
        assert len(pairs) == 2 * m - 3 * p + r + 1 - (r == p - 1)


def test_the_validator_names_a_pair_that_runs_too_early():
    rows = [list(r) for r in zb.build_schedule("dualpipe-v", 2, 4).actions]
    i = next(i for i, e in enumerate(rows[0]) if isinstance(e, Overlap))
    rows[0].insert(0, rows[0].pop(i))  # the pair before the F its backward needs
    with pytest.raises(zb.ScheduleError, match=r"rank 0, step 0: .*comes before .* rule:") as err:
        zb.validate(Schedule(rows, zb.v_placement(2), 4))
    assert isinstance(err.value.action, Overlap)


def test_a_pair_waits_for_both_inputs_so_it_can_deadlock_where_its_two_actions_would_not():
    # rank 0's pair holds 0F1, which rank 1 needs before it can send the B 0BW0 waits for
    rank0 = ["0F0", "3F0", "3B0", "(0F1;0B0)OVERLAP_F_B", "3F1", "3B1", "0B1"]
    rank1 = ["1F0", "2F0", "1F1", "2F1", "2B0", "1B0", "2B1", "1B1"]
    paired = Schedule.from_rows([rank0, rank1])
    with pytest.raises(zb.ScheduleError, match=r"deadlock.*\n.*rank 0 step 3: the F&B pair of F\(stage 0, microbatch 1\) and BW"):
        zb.validate(paired)
    zb.validate(paired.split_pairs())


# --------------------------------------------------------------------------- T_F&B and the simulator


def test_t_fb_defaults_to_the_two_parts_added_and_is_what_a_pair_lasts():
    pair = Overlap(zb.Action("F", 0, 1), zb.Action("BW", 3, 0))
    assert zb.Costs(f=1.0, b=2.0, w=0.5).table(4).duration(pair) == 3.5
    assert zb.Costs(f=1.0, b=2.0, w=0.5, fb=2.75).table(4).duration(pair) == 2.75
    assert zb.Costs(fb=[1, 2, 3, 4]).table(4).duration(pair) == 1.0  # the forward's stage's value
    with pytest.raises(ValueError, match="Costs.fb has 3 per-stage values but the schedule has 4"):
        zb.Costs(fb=[1, 2, 3]).table(4)
    with pytest.raises(ValueError, match="Costs.fb must be finite numbers >= 0"):
        zb.Costs(fb=-1.0)


def test_a_pair_starts_once_both_inputs_are_there_and_its_parts_run_back_to_back():
    s = zb.build_schedule("dualpipe-v", 3, 6)
    c = zb.Costs(f=1.0, b=1.5, w=0.5, fb=2.25)
    t = zb.simulate(s, c)
    ends = {key: e.end for e in t.events for key in produces(e.action)}
    for r in range(3):
        events = t.rank_events(r)
        assert [e.action for e in events] == list(s.rank_actions(r))
        i = 0
        for entry in s.actions[r]:
            if isinstance(entry, Overlap):
                f, b = events[i], events[i + 1]
                assert f.end == b.start and b.end - f.start == pytest.approx(2.25)
                assert f.duration == pytest.approx(2.25 * 1.0 / 3.0)  # T_F&B split as T_F : T_BW
                assert all(ends[k] <= f.start + 1e-9 for k in zb.deps(entry, s.num_stages))  # both inputs first
            i += len(parts(entry))
    assert t.busy[0] == pytest.approx(sum(c.table(6).duration(e) for e in s.actions[0]))


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("extra", [0, 3])
@pytest.mark.parametrize("f, w", [(1.0, 0.25), (1.0, 0.5), (1.0, 1.0), (2.0, 0.5), (2.0, 2.0)])
@pytest.mark.parametrize("overlap", [0.0, 0.5, 1.0])
def test_dualpipes_published_bubble_where_it_applies(p, extra, f, w, overlap):
    """(PP/2 - 1)(F&B + B - 3W), PP = 2p stages, B the full backward T_B + T_W: the makespan less
    the last rank's busy time, for T_F = T_B, T_W <= T_F, T_comm = 0, m >= 2p and T_F&B from
    max(T_F, T_BW) (full overlap) to T_F + T_BW (none)."""
    b = f
    full, none = max(f, b + w), f + b + w
    fb = none - overlap * (none - full)
    s = zb.build_schedule("dualpipe-v", p, 2 * p + extra)
    t = zb.simulate(s, zb.Costs(f=f, b=b, w=w, fb=fb))
    published = (2 * p / 2 - 1) * (fb + (b + w) - 3 * w)
    assert t.makespan - t.busy[-1] == pytest.approx(published)
    if overlap == 0.0:  # no overlap: every rank's bubble is the published one
        assert [t.makespan - x for x in t.busy] == pytest.approx([published] * p)


@pytest.mark.parametrize("f, b, w, published, simulated", [
    (2.0, 1.0, 1.0, 9.0, 12.0),  # T_F != T_B: a pair waits for the later of its inputs
    (1.0, 2.0, 1.0, 12.0, 11.0),
    (1.0, 1.0, 2.0, 3.0, 6.0),  # T_W > T_F: a W outgrows the gap it fills
])
def test_where_the_published_bubble_does_not_apply(f, b, w, published, simulated):
    p = 4
    t = zb.simulate(zb.build_schedule("dualpipe-v", p, 8), zb.Costs(f=f, b=b, w=w))
    assert (p - 1) * ((f + b + w) + (b + w) - 3 * w) == published
    assert t.makespan - t.busy[-1] == simulated != published


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 12), (8, 16)])
def test_activation_memory_is_pp_plus_one_stages_a_rank_against_zb_vs_pp(p, m):
    """DualPipe's table: activation per device PP + 1 (in one stage's M_B); ZB-V: PP = 2p."""
    assert zb.simulate(zb.build_schedule("dualpipe-v", p, m)).peak_memory == (2 * p + 1,) * p
    assert zb.simulate(zb.build_schedule("zb-v", p, m)).peak_memory == (2 * p,) * p


def test_lockstep_runs_a_pair_in_one_tick():
    s = zb.build_schedule("dualpipe-v", 2, 4)
    t = zb.simulate(s, zb.Costs(fb=2.0), lockstep=True)
    assert len(t.events) == len(s) and t.makespan >= zb.simulate(s, zb.Costs(fb=2.0)).makespan
