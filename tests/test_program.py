"""The lowered program (zbpp_lite/schedules/program.py): a schedule's transfers written out as sends and
receives (PyTorch's SEND_F/RECV_F/SEND_B/RECV_B), checked by the validator, timed by the simulator to the
same figures as before, read from and written to PyTorch's compute+comms CSV."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

import zbpp_lite as zb
from zbpp_lite.schedules.ir import Action, Key, Schedule, deps, produces
from zbpp_lite.schedules.program import Program, Recv, Send, consumer_stage, lower

ROOT = pathlib.Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "tests" / "artifacts"
sys.path.insert(0, str(ARTIFACTS))
sys.path.insert(0, str(ROOT / "tools"))
import generate_simulate_golden as golden  # noqa: E402
from torch_program_cases import receive_moved_early, write_cases  # noqa: E402


def test_1f1b_on_two_ranks_lowers_to_pytorchs_sends_and_receives():
    rows = lower(zb.build_schedule("1f1b", 2, 2)).to_rows()
    assert rows == [["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0RECV_B1", "0B1"],
                    ["1RECV_F0", "1F0", "1B0", "1SEND_B0", "1RECV_F1", "1F1", "1B1", "1SEND_B1"]]
    send, recv = lower(zb.build_schedule("1f1b", 2, 2)).instructions[0][1], lower(
        zb.build_schedule("1f1b", 2, 2)).instructions[1][0]
    assert send == Send(Key("F", 0, 0), 1) and recv == Recv(Key("F", 0, 0), 0)  # one key, both ends


def test_f_goes_to_the_next_stage_and_b_to_the_previous():
    assert consumer_stage("F", 3) == 4 and consumer_stage("B", 3) == 2
    from zbpp_lite.runtime.transport import Transfer

    assert Transfer("F", 3, 0).consumer == 4 and Transfer("B", 3, 0).consumer == 2


@pytest.mark.parametrize("name", sorted(zb.SCHEDULES))
def test_every_value_crossing_ranks_is_sent_right_after_it_is_made_and_received_right_before_use(name):
    s = zb.build_schedule(name, 4, 8)
    program = zb.validate(lower(s))
    assert program.schedule().actions == s.actions
    crossings = {(k, a.stage) for r, a in s for k in deps(a, s.num_stages) if s.placement[k.stage] != r}
    sends = [x for row in program.instructions for x in row if isinstance(x, Send)]
    assert sorted(x.key for x in sends) == sorted(k for k, _ in crossings)  # one send per crossing
    boundaries = sum(s.placement[t] != s.placement[t + 1] for t in range(s.num_stages - 1))
    assert len(sends) == 2 * boundaries * s.num_microbatches  # every F onward and every B back
    for row in program.instructions:
        for i, x in enumerate(row):
            if isinstance(x, Send):  # after the compute making it, only other sends between
                j = max(j for j in range(i) if not isinstance(row[j], Send))
                assert x.key in produces(row[j])
            if isinstance(x, Recv):  # before the compute needing it, only other receives between
                j = min(j for j in range(i + 1, len(row)) if not isinstance(row[j], Recv))
                assert x.key in deps(row[j], s.num_stages)


def test_the_simulated_program_gives_the_figures_of_the_compute_only_simulator():
    # tests/artifacts/simulate_golden.json: written by the simulator before it timed the program
    stored = json.loads((ARTIFACTS / "simulate_golden.json").read_text())
    seen = 0
    for key, schedule, costs in golden.cases():
        assert golden.record(zb.simulate(schedule, costs)) == stored[key], key
        seen += 1
    assert seen == len(stored) > 400


def test_a_program_simulates_as_its_schedule_also_with_pytorchs_early_receives():
    s = zb.build_schedule("zb-v", 4, 8)
    costs = zb.Costs(f=1.3, b=1.1, w=0.7, comm=0.3)
    assert zb.simulate(lower(s), costs) == zb.simulate(s, costs)
    # PyTorch's lowering posts each receive as soon as its sender sends: the consumer still waits
    torch = Program.from_csv(ARTIFACTS / "torch_DualPipeV_comms.csv")
    assert zb.validate(torch) is torch
    assert zb.simulate(torch, costs) == zb.simulate(torch.schedule(), costs)
    assert zb.simulate(torch, costs, lockstep=True) == zb.simulate(torch.schedule(), costs, lockstep=True)


def test_pytorchs_compute_and_comms_csv_reads_with_its_transfers_and_writes_back():
    path = ARTIFACTS / "torch_DualPipeV_comms.csv"
    program = Program.from_csv(path)
    cells = [[c for c in line.split(",") if not c.endswith(("SHARD", "REDUCE_GRAD"))]
             for line in path.read_text().splitlines() if line.strip()]
    assert program.to_rows() == cells  # every send and receive kept, in its place
    assert program.schedule().actions == Schedule.from_csv(path).actions
    first = program.instructions[0]
    assert first[1] == Send(Key("F", 0, 0), 1) and Recv(Key("F", 6, 0), 1) in first  # "7RECV_F0": from stage 6
    for name in sorted(zb.SCHEDULES):
        p = lower(zb.build_schedule(name, 3, 6))
        assert Program.from_csv_text(p.to_csv()).instructions == p.instructions, name


def test_a_receive_out_of_order_is_a_deadlock_named_in_one_line():
    bad = receive_moved_early(lower(zb.build_schedule("1f1b", 2, 4)))
    with pytest.raises(zb.ScheduleError) as err:
        zb.validate(bad)
    assert str(err.value) == (
        "rank 0, step 2: RECV of the input gradient of stage 1, microbatch 1 from rank 1 [0RECV_B1] waits for "
        "rank 1's 1SEND_B1 (step 7), but rank 1 waits at step 4 for 1RECV_F1: deadlock; rule: a receive "
        "blocks until its send has run")
    assert (err.value.rank, err.value.step, err.value.action) == (0, 2, Recv(Key("B", 1, 1), 1))
    with pytest.raises(zb.ScheduleError, match="deadlock"):
        zb.simulate(bad, check=False)


def test_pytorchs_own_deadlock_check_accepts_our_programs_and_refuses_a_receive_out_of_order(tmp_path):
    # PyTorch 2.13's _simulate_comms_compute, run by ../shared/peers/torch_check_schedules.py with a Python
    # that has torch (ZBPP_TORCH_PYTHON, else /work/torchvenv/bin/python); skipped without one
    import os
    import subprocess

    python = os.environ.get("ZBPP_TORCH_PYTHON") or "/work/torchvenv/bin/python"
    script = ROOT.parent / "shared" / "peers" / "torch_check_schedules.py"
    probe = subprocess.run([python, "-c", "import torch"], capture_output=True) if os.path.exists(python) else None
    if not script.exists() or probe is None or probe.returncode != 0:
        pytest.skip(f"no PyTorch check: {script} or a Python with torch ({python}) is missing")
    cases = write_cases(tmp_path, [2, 4], bad=True)
    out = subprocess.run([python, str(script), str(cases)], capture_output=True, text=True, timeout=300)
    failed = sorted(line.split()[1] for line in out.stdout.splitlines() if line.startswith("FAIL"))
    assert failed == ["bad-1f1b_p2", "bad-1f1b_p4"], out.stdout[-2000:]
    assert "Schedule is not progressing" in out.stdout and f"torch accepted {2 * 2 * len(zb.SCHEDULES)} of" in out.stdout


def _edited(edit) -> Program:
    """The 1F1B program of 2 ranks, 2 microbatches with rank 1's list edited by ``edit``."""
    p = lower(zb.build_schedule("1f1b", 2, 2))
    return Program((p.instructions[0], tuple(edit(list(p.instructions[1])))), p.placement, 2)


@pytest.mark.parametrize("edit, message", [
    (lambda row: row[1:2] + row[:1] + row[2:],
     r"^rank 1, step 0: F\(stage 1, microbatch 0\) \[1F0\] uses the F of stage 0, microbatch 0 from rank 0 "
     r"with no RECV before it; rule: receive before use$"),
    (lambda row: row[:2] + row[3:4] + row[2:3] + row[4:],
     r"^rank 1, step 2: SEND of the input gradient .* \[1SEND_B0\] comes before the B that makes it; rule: "
     r"send after the compute$"),
    (lambda row: row[:3] + row[4:],
     r"^rank 0, step 4: RECV of the input gradient of stage 1, microbatch 0 from rank 1 \[0RECV_B0\] has no "
     r"matching SEND on rank 1; rule: every send has its receive$"),
    (lambda row: row[:3] + [Send(Key("B", 1, 0), 1)] + row[4:],
     r"^rank 1, step 3: SEND .* runs on rank 1, but stage 1 is on rank 1 and stage 0 on rank 0; rule: F goes "
     r"to the next stage's rank, B to the previous stage's$"),
    (lambda row: row + [Recv(Key("F", 0, 1), 0)],
     r"^rank 1, step 8: RECV .* repeats rank 1's step 4; rule: each value is sent and received once$"),
])
def test_a_broken_transfer_is_named_in_one_line(edit, message):
    with pytest.raises(zb.ScheduleError, match=message):
        zb.validate(_edited(edit))


def test_compute_errors_of_a_program_are_the_schedules():
    p = lower(zb.build_schedule("1f1b", 2, 2))
    missing = Program((p.instructions[0][:-2], p.instructions[1]), p.placement, 2)
    with pytest.raises(zb.ScheduleError, match="missing B \\(or BW\\) of stage 0, microbatch 1"):
        zb.validate(missing)
    with pytest.raises(ValueError, match=r"^rank 1: 5RECV_F0 moves a value between stages 4 and 5, but the "
                       r"stages are 0 \.\. 1$"):
        Program.from_rows([["0F0", "0SEND_F0", "0B0"], ["5RECV_F0", "1F0", "1B0", "1SEND_B0"]])
    assert Program.from_rows([[Action("F", 0, 0)]]).to_rows() == [["0F0"]]


@pytest.mark.parametrize("name", sorted(zb.SCHEDULES))
def test_the_optimizers_instructions_validate_and_show_the_synchronisation_bubble_post_validation_removes(name):
    """Paper section 4: a synchronous step waits for every rank's norm, so every rank's step ends at the
    last rank's end (the global span); post-validated, each rank steps at its own end (the makespan)."""
    from zbpp_lite.schedules.program import Optimize, OptimizerMessage

    s = zb.build_schedule(name, 4, 8)
    costs = zb.Costs(f=1.3, b=1.1, w=0.7, comm=0.3)
    plain = zb.simulate(s, costs)
    for policy, speculative in (("plain", True), ("synchronous", True), ("post-validation", True),
                                ("post-validation", False)):
        program = zb.validate(lower(s, policy, speculative))
        assert program.schedule().actions == s.actions, policy
        t = zb.simulate(program, costs)
        steps = [e for e in t.events if e.action == Optimize("STEP")]
        assert sorted(e.rank for e in steps) == list(range(4)), policy  # one step per rank, shown
        ends = [max(e.end for e in plain.rank_events(r)) for r in range(4)]
        if policy == "synchronous":
            assert [e.start for e in sorted(steps, key=lambda e: e.rank)] == pytest.approx([max(ends)] * 4)
            assert t.makespan == pytest.approx(plain.global_span)
        else:  # plain and post-validated: ranks step when their share (and the partial norm) is in
            assert t.makespan == pytest.approx(plain.makespan), policy
        assert t.peak_memory == plain.peak_memory and t.busy == plain.busy, policy
    rows = lower(s, "post-validation").instructions
    full = OptimizerMessage("FULL", 3)
    assert [row.count(Optimize("VALIDATE")) for row in rows] == [1] * 4
    assert [Recv(full, 3, earlier=1) in row for row in rows] == [True, True, True, False]
    assert [Send(full, q) in rows[3] for q in range(3)] == [True] * 3
    # speculative: the previous step is validated before a rank's first backward, F's before it run on
    # speculative parameters; the last rank, which holds the full norm, validates first
    for r, row in enumerate(rows):
        at = row.index(Optimize("VALIDATE"))
        first = min(i for i, x in enumerate(row) if isinstance(x, (Action, zb.Overlap))
                    and any(a.kind != "F" for a in getattr(x, "parts", (x,))))
        assert (at == 0) if r == 3 else (at < first and all(
            getattr(x, "kind", "F") == "F" for x in row[:at] if not isinstance(x, (Send, Recv)))), (name, r)


def test_tied_weights_gradient_sums_are_instructions_the_validator_checks_and_the_simulator_times():
    """A tie across ranks (GPT-2's embedding and head under 1F1B) and one on a single rank (both ends on
    rank 0 under the V): each holding rank sums its copies (TIE), sends that share to the tie's other
    ranks, receives theirs and adds them (TIE_TOTAL), before the optimizer's instructions."""
    from zbpp_lite.schedules.program import Optimize, OptimizerMessage, tie_instructions

    s = zb.build_schedule("1f1b", 2, 4)
    program = zb.validate(lower(s, "synchronous", ties=((0, 1), (1,))))
    tie0 = [Optimize("TIE"), Send(OptimizerMessage("TIE0", 0), 1), Recv(OptimizerMessage("TIE0", 1), 1),
            Optimize("TIE_TOTAL")]
    rank0 = list(program.instructions[0])
    at = rank0.index(Optimize("TIE"))
    assert rank0[at:at + 4] == tie0 and rank0[at + 4] == Optimize("NORM")  # the ties, then the optimizer
    assert [str(x) for x in rank0[at:at + 6]] == ["TIE", "SEND_TIE0.0>1", "RECV_TIE0.1", "TIE_TOTAL", "NORM",
                                                 "SEND_NORM0>1"]  # a dot where the tag ends in a digit
    assert str(Send(OptimizerMessage("TIE1", 10), 0)) != str(Send(OptimizerMessage("TIE11", 0), 0))
    assert all(isinstance(x, (Action, Send, Recv)) for x in rank0[:at])  # after the rank's last compute
    assert [x.text for x in program.instructions[1] if type(x) is Optimize][:2] == ["TIE", "TIE_TOTAL"]
    costs = zb.Costs(f=1.3, b=1.1, w=0.7, comm=0.3)
    t, plain = zb.simulate(program, costs), zb.simulate(lower(s, "synchronous"), costs)
    assert t.makespan == plain.makespan and t.busy == plain.busy  # instants in the cost model
    ties = sorted((e.rank, e.action.kind) for e in t.events if e.action.kind.startswith("TIE"))
    assert ties == [(0, "TIE"), (0, "TIE_TOTAL"), (1, "TIE"), (1, "TIE_TOTAL")]
    on_one = lower(zb.build_schedule("zb-v", 2, 4), ties=((0,),)).instructions  # the V: both ends on rank 0
    assert on_one[0][-2:] == (Optimize("TIE"), Optimize("TIE_TOTAL")) and Optimize("TIE") not in on_one[1]

    def edited(edit, rank=0):
        rows = list(program.instructions)
        rows[rank] = tuple(edit(list(rows[rank])))
        return Program(tuple(rows), program.placement, 4)

    with pytest.raises(zb.ScheduleError, match=r"comes before the rank's TIE; rule: send a message after"):
        zb.validate(edited(lambda row: row[:at] + [row[at + 1], row[at]] + row[at + 2:]))
    with pytest.raises(zb.ScheduleError, match=r"SEND_TIE0.0>1\] has no matching RECV on rank 1"):
        zb.validate(edited(lambda row: [x for x in row if x != Recv(OptimizerMessage("TIE0", 0), 0)], rank=1))
    total = rank0.index(Optimize("TIE_TOTAL"))
    with pytest.raises(zb.ScheduleError, match=r"TIE \[TIE\] comes before the rank's last compute"):
        zb.validate(edited(lambda row: row[at:at + 4] + row[:at] + row[at + 4:]))  # summed before the last W
    with pytest.raises(zb.ScheduleError, match=r"TIE_TOTAL \[TIE_TOTAL\] comes before RECV .*TIE0.* rule: add the "
                       r"shares once received"):
        zb.validate(edited(lambda row: row[:total - 1] + [row[total], row[total - 1]] + row[total + 1:]))
    with pytest.raises(zb.ScheduleError, match=r"TIE \[TIE\] has no TIE_TOTAL after it"):
        zb.validate(edited(lambda row: row[:total] + row[total + 1:]))
    norm = rank0.index(Optimize("NORM"))
    with pytest.raises(zb.ScheduleError, match=r"STEP \[STEP\] comes before RECV .*NORM"):
        zb.validate(edited(lambda row: row[:norm + 2] + [Optimize("STEP")] + row[norm + 2:-1]))
    with pytest.raises(ValueError, match=r"ties name ranks \[\(0, 2\)\]; the program has ranks 0 \.\. 1"):
        tie_instructions(lower(s), [(2, 0)])


def test_a_misplaced_optimizer_instruction_is_named_in_one_line():
    from zbpp_lite.schedules.program import Optimize, OptimizerMessage

    p = lower(zb.build_schedule("1f1b", 2, 2), "synchronous")

    def edited(edit, rank=0):
        rows = list(p.instructions)
        rows[rank] = tuple(edit(list(rows[rank])))
        return Program(tuple(rows), p.placement, 2)

    norm = Recv(OptimizerMessage("NORM", 1), 1)
    with pytest.raises(zb.ScheduleError, match=r"^rank 0, step 0: RECV of the optimizer's NORM message from rank "
                       r"1 \[RECV_NORM1\] waits for rank 1's SEND_NORM1>0 .*: deadlock"):
        zb.validate(edited(lambda row: [norm] + [x for x in row if x != norm]))
    with pytest.raises(zb.ScheduleError, match=r"SEND_NORM0>1\] has no matching RECV on rank 1"):
        zb.validate(edited(lambda row: [x for x in row if x != Recv(OptimizerMessage("NORM", 0), 0)], rank=1))
    with pytest.raises(zb.ScheduleError, match=r"comes before the rank's NORM; rule: send a message after"):
        zb.validate(edited(lambda row: row[:-4] + row[-3:-2] + row[-4:-3] + row[-2:]))
    with pytest.raises(zb.ScheduleError, match=r"STEP \[STEP\] comes twice"):
        zb.validate(edited(lambda row: row + [Optimize("STEP")]))
    with pytest.raises(ValueError, match="optimizer must be one of plain, synchronous, post-validation; got 'sgd'"):
        lower(zb.build_schedule("1f1b", 2, 2), "sgd")


def test_post_validation_speculates_only_on_what_is_sent_while_speculating():
    """ZB-V on 2 ranks: rank 0's F of stage 3 needs stage 2's F from rank 1, which validates first (it
    holds the full norm); after a rollback rank 1 sends it only in its redo, so rank 0 validates before
    receiving it, and a program checking later is refused."""
    from zbpp_lite.schedules.program import Optimize

    program = lower(zb.build_schedule("zb-v", 2, 4), "post-validation")
    row = list(program.instructions[0])
    at = row.index(Optimize("VALIDATE"))
    assert [str(x) for x in row[:at + 3]] == ["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0F2", "0SEND_F2",
                                              "RECV_FULL1<", "VALIDATE", "ROLLBACK", "3RECV_F0"]
    late = row[:at - 1] + row[at + 2:at + 3] + row[at - 1:at + 2] + row[at + 3:]  # checked after 3RECV_F0
    bad = Program((tuple(late), program.instructions[1]), program.placement, 4)
    with pytest.raises(zb.ScheduleError, match=r"^rank 0, step 6: RECV .* \[3RECV_F0\] comes before the rank's "
                       r"VALIDATE, but rank 1 sends it after its own \(step 0\); rule: speculate only on what"):
        zb.validate(bad)
