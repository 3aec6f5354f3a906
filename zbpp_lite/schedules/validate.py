"""The validator: is a schedule complete, ordered, and free of deadlock? (pure Python)

:func:`validate` checks in order, raising :class:`ScheduleError` with rank, step, action, rule and the
marked rank x step grid: 1. every action's stage and microbatch exist, on the rank its stage is placed on;
2. every (stage, microbatch) has one F and either one BW or one B and one W; 3. what an action needs from
its own rank comes earlier in the list; 4. running every list in order with blocking receives finishes.
An :class:`~zbpp_lite.schedules.ir.Overlap` is one step whose parts are checked as actions of that step,
waiting for both inputs. Dependencies: :func:`zbpp_lite.schedules.ir.deps` (paper section 2, figure 1).
"""

from __future__ import annotations


from typing import Sequence, Union

from .ir import KINDS, Action, Entry, Key, Overlap, Schedule, deps, produces
from .program import (COMMS, Instruction, Optimize, OptimizerMessage, Program, Recv, Send, consumer_stage,
    destination, lower)


class ScheduleError(ValueError):
    """A schedule that cannot run as written; ``rank``, ``step``, ``action`` (the step's entry, maybe an
    :class:`Overlap`) locate it, ``None`` where no single place (e.g. a missing action)."""

    def __init__(self, message: str, rank: int | None = None, step: int | None = None,
            action: Entry | None = None):
        super().__init__(message)
        self.rank, self.step, self.action = rank, step, action


def describe(action: Instruction) -> str:
    """``B(stage 1, microbatch 3) [1B3]``: readable and in our text form (a pair: both parts; a transfer:
    what, between which ranks)."""
    if type(action) is Optimize:
        return f"the optimizer's {action.op} [{action.text}]"
    if isinstance(action, COMMS) and type(action.key) is OptimizerMessage:
        way = f"to rank {action.peer}" if isinstance(action, Send) else f"from rank {action.peer}"
        when = " of the previous step" if getattr(action, "earlier", 0) else ""
        return (f"{type(action).__name__.upper()} of the optimizer's {action.key.tag} message{when} {way} "
                f"[{action.text}]")
    if isinstance(action, COMMS):
        kind, stage, j = action.key
        what = f"{'activation' if kind == 'F' else 'input gradient'} of stage {stage}, microbatch {j}"
        way = "to" if isinstance(action, Send) else "from"
        return f"{type(action).__name__.upper()} of the {what} {way} rank {action.peer} [{action.text}]"
    if isinstance(action, Overlap):
        f, b = action.parts
        return (f"the F&B pair of F(stage {f.stage}, microbatch {f.microbatch}) and "
                f"{b.kind}(stage {b.stage}, microbatch {b.microbatch}) [{action.text}]")
    return f"{action.kind}(stage {action.stage}, microbatch {action.microbatch}) [{action.text}]"


Lists = Union[Schedule, Program]
"""What the validator walks: a schedule's action lists or a program's instruction lists."""


def rows_of(lists: Lists) -> tuple[tuple, ...]:
    """A schedule's ``actions`` or a program's ``instructions``: per rank, its steps."""
    return lists.instructions if isinstance(lists, Program) else lists.actions


def format_grid(schedule: Lists, mark: tuple[int, int] | None = None, window: int = 8) -> str:
    """The rank x step grid in our text form (``1B3`` for B, ``0BW1`` for BW: :attr:`Action.text`);
    ``mark=(rank, step)`` brackets one cell and shows only ``window`` steps either side."""
    rows = rows_of(schedule)
    lo, hi = 0, max((len(r) for r in rows), default=0)
    if mark is not None:
        lo, hi = max(0, mark[1] - window), min(hi, mark[1] + window + 1)
    width = max([len(e.text) for row in rows for e in row] + [3]) + 2
    lines = ["step    " + "".join(f"{i:>{width}}" for i in range(lo, hi))]
    for rank, row in enumerate(rows):
        cells = []
        for i in range(lo, hi):
            text = row[i].text if i < len(row) else ""
            if mark == (rank, i):
                text = f"[{text}]"
            cells.append(f"{text:>{width}}")
        lines.append(f"rank {rank:<3}" + "".join(cells))
    return "\n".join(lines)


def _fail(schedule: Lists, message: str, rank: int | None = None, step: int | None = None) -> None:
    action = rows_of(schedule)[rank][step] if rank is not None and step is not None else None
    where = f"rank {rank}, step {step}: " if rank is not None and step is not None else ""
    grid = format_grid(schedule, (rank, step) if action is not None else None)
    raise ScheduleError(f"{where}{message}\n{grid}", rank, step, action)


def _rule(action: Action, key: Key, num_stages: int) -> str:
    kind, stage, _ = key
    if action.kind == "F":
        return f"forward order: F of stage {stage} must come before F of stage {action.stage}"
    if action.kind == "W":
        return "B before W: the weight gradient needs the output gradient B kept"
    if kind == "F" and action.stage == num_stages - 1:
        return "the last stage's backward comes after its own F (which computed the loss)"
    if kind == "F":
        return "F before B: the backward needs the activations its own F kept"
    return f"backward order: B of stage {stage} must come before B of stage {action.stage}"


def step_keys(schedule: Schedule) -> tuple[list[list[tuple[Key, ...]]], list[list[tuple[Key, ...]]]]:
    """(needs, made): per rank and list entry, the keys it needs (:func:`deps`) and those it completes
    (:func:`produces`), computed once for the checks, the execution order and the simulator."""
    S = schedule.num_stages
    needs = [[deps(a, S) for a in row] for row in schedule.actions]
    made = [[produces(a) for a in row] for row in schedule.actions]
    return needs, made


def _check_structure(schedule: Schedule) -> None:
    S, m = schedule.num_stages, schedule.num_microbatches
    if schedule.num_ranks < 1:
        raise ScheduleError("a schedule needs at least one rank")
    if m < 1:
        raise ScheduleError(f"num_microbatches must be >= 1, got {m}")
    placement = schedule.placement
    for rank, row in enumerate(schedule.actions):
        for step, entry in enumerate(row):
            for a in (entry.parts if type(entry) is Overlap else (entry,)):  # parts(entry), without a call
                if a.stage < S and placement[a.stage] == rank and a.microbatch < m:
                    continue  # right: the checks below find what is wrong
                if a.stage >= S:
                    _fail(schedule, f"{describe(a)} names stage {a.stage}, but stages are 0 .. {S - 1}",
                        rank, step)
                if a.microbatch >= m:
                    _fail(schedule, f"{describe(a)} names microbatch {a.microbatch}, but microbatches are 0 "
                        f".. {m - 1}", rank, step)
                if placement[a.stage] != rank:
                    _fail(
                        schedule,
                        f"{describe(a)} runs on rank {rank} but stage {a.stage} is placed on rank "
                        f"{placement[a.stage]}",
                        rank,
                        step,
                    )


def _check_keys(schedule: Schedule) -> None:
    """Rules 2 and 3 on a schedule whose stages, microbatches and ranks are right (:func:`_check_structure`).

    Where each key is made is kept as its step in ``made_at[kind, stage][microbatch]`` (its rank is its
    stage's), and what a (kind, stage) makes and needs is read once from :func:`produces` and :func:`deps`:
    no key tuple per action (planning at p = 256, m = 512 checks 786,432 actions)."""
    S, m, placement = schedule.num_stages, schedule.num_microbatches, schedule.placement
    makes, needs = _key_templates(S)
    made_at = {(k, s): [-1] * m for k in "FBW" for s in range(S)}
    count = 0
    # completeness: count what every action produces; F once, B once, W once (BW gives B and W)
    for rank, row in enumerate(schedule.actions):
        for step, entry in enumerate(row):
            for a in (entry.parts if type(entry) is Overlap else (entry,)):
                j = a.microbatch
                for key in makes[a.kind, a.stage]:
                    at = made_at[key]
                    if at[j] >= 0:
                        r0, s0 = placement[key[1]], at[j]
                        _fail(schedule, f"{describe(entry)} duplicates {describe(schedule.actions[r0][s0])} "
                            f"(rank {r0}, step {s0}): each (stage, microbatch) needs exactly one F and "
                            "either one BW or one B and one W", rank, step)
                    at[j] = step
                    count += 1
    # every key made is in range and made once: none missing if 3 S m
    if count != 3 * S * m:
        missing = [(k, s, j) for s in range(S) for j in range(m) for k in "FBW" if made_at[k, s][j] < 0]
        names = {"F": "F", "B": "B (or BW)", "W": "W (or BW)"}
        shown = ", ".join(f"{names[k]} of stage {s}, microbatch {j} (rank {placement[s]})"
            for k, s, j in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ScheduleError(f"incomplete schedule: missing {shown}{more}\n{format_grid(schedule)}")
    # order within a rank: what an action needs from its own rank comes earlier
    for rank, row in enumerate(schedule.actions):
        for step, entry in enumerate(row):
            for a in (entry.parts if type(entry) is Overlap else (entry,)):
                j = a.microbatch
                for key in needs[a.kind, a.stage]:
                    at = made_at[key][j]
                    if at > step and placement[key[1]] == rank:
                        _fail(schedule, f"{describe(a)} comes before {describe(row[at])} (step {at}) on the "
                            f"same rank; rule: {_rule(a, (*key, j), S)}", rank, step)


def _key_templates(num_stages: int) -> tuple[dict, dict]:
    """(makes, needs): per (kind, stage), the (kind, stage) of each key an action of it produces and
    needs, in :func:`produces`' and :func:`deps`' order (the same for every microbatch)."""
    makes, needs = {}, {}
    for kind in KINDS:
        for s in range(num_stages):
            a = Action(kind, s, 0)
            makes[kind, s] = tuple(k[:2] for k in produces(a))
            needs[kind, s] = tuple(k[:2] for k in deps(a, num_stages))
    return makes, needs


def execution_order(schedule: Lists, keys=None) -> list[tuple[int, int]]:
    """A global (rank, step) order running every list in order, each step after what it needs (shared by
    validator and simulator): a schedule's actions, each after the actions it needs (``keys``:
    :func:`step_keys` if known), or a program's instructions, a receive blocking until its send has run
    (a send never waits; a compute waits for nothing more, its inputs being received before it:
    :func:`validate` checks that). Raises ScheduleError: deadlock, naming every stuck rank's head action
    and what it waits for (a program: one line naming the first stuck rank, its step and the rank it
    waits for)."""
    if isinstance(schedule, Program):
        return _program_order(schedule)
    needs, made = step_keys(schedule) if keys is None else keys
    done: set[Key] = set()

    def advance(rank: int, row: tuple, i: int, order: list) -> int:
        while i < len(row) and done.issuperset(needs[rank][i]):
            done.update(made[rank][i])
            order.append((rank, i))
            i += 1
        return i

    def stuck(cursor: list[int]) -> None:
        rows, lines = schedule.actions, []
        for rank, row in enumerate(rows):
            if cursor[rank] < len(row):
                a = row[cursor[rank]]
                waits = [k for k in needs[rank][cursor[rank]] if k not in done]
                what = ", ".join(f"{k[0]} of stage {k[1]}, microbatch {k[2]} (rank "
                    f"{schedule.placement[k[1]]})" for k in waits)
                lines.append(f"rank {rank} step {cursor[rank]}: {describe(a)} waits for {what}")
        first = next(r for r in range(len(rows)) if cursor[r] < len(rows[r]))
        stuck_text = "\n  ".join(lines)
        message = f"deadlock: no rank can make progress with blocking receives\n  {stuck_text}"
        _fail(schedule, message, first, cursor[first])

    return _round_robin(schedule.actions, advance, stuck)


def _round_robin(rows: tuple, advance, stuck) -> list[tuple[int, int]]:
    """Visit the ranks in turn, each running ``advance(rank, row, step, order)`` (its steps from ``step``
    that may run now, appended to ``order``; returns the next step), until every list is done; when a
    turn moves no rank, ``stuck(cursor)`` raises."""
    cursor = [0] * len(rows)
    order: list[tuple[int, int]] = []
    remaining = sum(len(r) for r in rows)
    while remaining:
        moved = False
        for rank, row in enumerate(rows):
            start = cursor[rank]
            i = advance(rank, row, start, order)
            if i != start:
                remaining -= i - start
                cursor[rank] = i
                moved = True
        if not moved:
            stuck(cursor)
    return order


def _program_order(program: Program, steps: int = 1) -> list[tuple[int, int]]:
    """:func:`execution_order` of a program's instructions, over ``steps`` steps run back to back (a
    receive with ``earlier`` waits for its send that many steps before; none before the first step):
    entries (rank, index into the rank's instructions repeated ``steps`` times)."""
    rows = tuple(row * steps for row in program.instructions)
    sent: set[tuple] = set()

    def advance(rank: int, row: tuple, i: int, order: list) -> int:
        width, end = len(program.instructions[rank]), len(row)
        while i < end:
            x = row[i]
            what = type(x)
            if what is Recv:
                step = i // width - x.earlier
                if step >= 0 and (step, x.key, rank) not in sent:
                    break
            elif what is Send:
                sent.add((i // width, x.key, x.peer))
            order.append((rank, i))
            i += 1
        return i

    return _round_robin(rows, advance, lambda cursor: _program_stuck(rows, cursor))


def _program_stuck(rows: tuple, cursor: list[int]) -> None:
    """Raise the one-line deadlock error of a program whose ranks all wait (the first stuck rank's)."""
    rank = next(r for r in range(len(rows)) if cursor[r] < len(rows[r]))
    x = rows[rank][cursor[rank]]
    peer = x.peer
    sends = [i for i, y in enumerate(rows[peer]) if type(y) is Send and y.key == x.key and y.peer == rank]
    if not sends:
        message = f"{describe(x)} waits for a send rank {peer} never makes"
        rule = "every receive has its send"
    else:
        at = cursor[peer]
        message = (f"{describe(x)} waits for rank {peer}'s {rows[peer][sends[0]]} (step {sends[0]}), but "
            f"rank {peer} waits at step {at} for {rows[peer][at]}: deadlock")
        rule = "a receive blocks until its send has run"
    raise ScheduleError(f"rank {rank}, step {cursor[rank]}: {message}; rule: {rule}", rank, cursor[rank], x)


def _check_transfers(program: Program) -> None:
    """Every send and receive carries an F or B value between the ranks the placement names (F's to the
    next stage's rank, B's to the previous', :func:`~zbpp_lite.schedules.program.consumer_stage`), or an
    optimizer's message from its sender after its ``NORM`` (:func:`_check_optimizer`); a send comes after
    the compute making its value, a compute after the receive of each value from another rank, and every
    send has one receive and every receive one send (per receiving rank)."""
    S, placement = program.num_stages, program.placement
    seen: dict[tuple[type, Key | OptimizerMessage, int], tuple[int, int]] = {}
    for rank, row in enumerate(program.instructions):
        made: set = set()
        got: set[Key] = set()
        for step, x in enumerate(row):
            if type(x) is Optimize or (isinstance(x, COMMS) and type(x.key) is OptimizerMessage):
                _check_optimizer(program, x, rank, step, made)
            elif isinstance(x, COMMS):
                _check_route(program, x, rank, step, made)
            if isinstance(x, COMMS):
                mark = (type(x), x.key, x.peer if type(x) is Send else rank)
                if mark in seen:
                    r0, s0 = seen[mark]
                    _fail_line(f"{describe(x)} repeats rank {r0}'s step {s0}; rule: each value is sent and "
                        "received once", rank, step, x)
                seen[mark] = (rank, step)
                got.update([x.key] if isinstance(x, Recv) else [])
            if not isinstance(x, (Action, Overlap)):
                continue
            for key in deps(x, S):
                if placement[key[1]] != rank and key not in got:
                    _fail_line(f"{describe(x)} uses the {key[0]} of stage {key[1]}, microbatch {key[2]} "
                        f"from rank {placement[key[1]]} with no RECV before it; rule: receive before use",
                        rank, step, x)
            made.update(produces(x))
    for (kind, key, receiver), (rank, step) in seen.items():
        other = Recv if kind is Send else Send
        if (other, key, receiver) not in seen:
            x = program.instructions[rank][step]
            _fail_line(f"{describe(x)} has no matching {other.__name__.upper()} on rank {x.peer}; rule: "
                "every send has its receive", rank, step, x)


def _check_optimizer(program: Program, x: Instruction, rank: int, step: int, done: set) -> None:
    """An optimizer instruction (:func:`~zbpp_lite.schedules.program.optimizer_instructions`,
    :func:`~zbpp_lite.schedules.program.tie_instructions`): each op once per rank, ``ROLLBACK`` right
    after ``VALIDATE``; a message sent by its sender after the op making it (``TIE<t>``: ``TIE``, the
    others: ``NORM``), to another rank, and received from its sender. ``done``: the rank's earlier
    instructions' results (ops done added here)."""
    row = program.instructions[rank]
    if type(x) is Optimize:
        if x.op in done:
            _fail_line(f"{describe(x)} comes twice; rule: one of each optimizer instruction a step", rank,
                step, x)
        if (x.op == "ROLLBACK") != (step > 0 and row[step - 1] == Optimize("VALIDATE")):
            _fail_line(f"{describe(x)}: ROLLBACK comes right after VALIDATE, and only there; rule: a failed "
                "check is undone at once", rank, step, x)
        _check_combining(x, row, rank, step)
        done.add(x.op)
        return
    sender = rank if type(x) is Send else x.peer
    if x.key.sender != sender or x.peer == rank or not 0 <= x.peer < program.num_ranks:
        _fail_line(f"{describe(x)} on rank {rank}: the message is rank {x.key.sender}'s; rule: a message "
            "goes from its sender to another rank", rank, step, x)
    maker = "TIE" if x.key.tag.startswith("TIE") else "NORM"  # the op that makes the message
    if type(x) is Send and maker not in done:
        _fail_line(f"{describe(x)} comes before the rank's {maker}; rule: send a message after computing it",
            rank, step, x)


_COMBINES = {"TIE_TOTAL": ("TIE",), "STEP": ("NORM", "PARTIAL")}
"""The ops that combine received messages, and the tags of what they combine."""


def _check_combining(x: Optimize, row: Sequence[Instruction], rank: int, step: int) -> None:
    """``TIE``, ``TIE_TOTAL``, ``NORM`` and ``STEP`` come after the rank's last compute (every microbatch's
    gradient in); ``TIE_TOTAL`` and ``STEP`` after the receives of the shares they add; a ``TIE`` has its
    ``TIE_TOTAL`` after it."""
    later = row[step + 1:]
    if x.op in ("TIE", "TIE_TOTAL", "NORM", "STEP") and any(isinstance(y, (Action, Overlap)) for y in later):
        _fail_line(f"{describe(x)} comes before the rank's last compute; rule: sum or step the gradients of "
            "every microbatch", rank, step, x)
    tags = _COMBINES.get(x.op, ())
    late = next((y for y in later if tags and type(y) is Recv and type(y.key) is OptimizerMessage
                 and not y.earlier and y.key.tag.startswith(tags)), None)
    if late is not None:
        _fail_line(f"{describe(x)} comes before {describe(late)}; rule: add the shares once received", rank,
            step, x)
    if x.op == "TIE" and Optimize("TIE_TOTAL") not in later:
        _fail_line(f"{describe(x)} has no TIE_TOTAL after it; rule: every tie's shares are added into its "
            "copies", rank, step, x)


def _check_speculation(program: Program) -> None:
    """Post-validation: what a rank receives before its ``VALIDATE`` is sent before its sender's (a
    rollback redoes every rank's work since its check, so a send after it is made only by the redo, and
    a rank waiting for it before its own check would wait for ever)."""
    rows = program.instructions
    check = [row.index(Optimize("VALIDATE")) if Optimize("VALIDATE") in row else len(row) for row in rows]
    sent = {(x.key, x.peer): (r, i) for r, row in enumerate(rows) for i, x in enumerate(row)
            if type(x) is Send}
    for rank, row in enumerate(rows):
        for step, x in enumerate(row[:check[rank]]):
            if type(x) is Recv and not x.earlier and (x.key, rank) in sent:
                peer, at = sent[x.key, rank]
                if at > check[peer]:
                    _fail_line(f"{describe(x)} comes before the rank's VALIDATE, but rank {peer} sends it "
                        f"after its own (step {check[peer]}); rule: speculate only on what is sent while "
                        "speculating", rank, step, x)


def _check_route(program: Program, x: Send | Recv, rank: int, step: int, made: set[Key]) -> None:
    kind, stage, _ = x.key
    placement = program.placement
    if not 0 <= stage < len(placement) or kind not in ("F", "B"):
        _fail_line(f"{x} moves {kind} of stage {stage}, but only F and B of stages 0 .. "
            f"{len(placement) - 1} move", rank, step, x)
    sender, receiver = placement[stage], destination(x.key, placement)
    want = (sender, receiver) if isinstance(x, Send) else (receiver, sender)
    if (rank, x.peer) != want:
        _fail_line(f"{describe(x)} runs on rank {rank}, but stage {stage} is on rank {sender} and stage "
            f"{consumer_stage(kind, stage)} on rank {receiver}; rule: F goes to the next stage's rank, B to "
            "the previous stage's", rank, step, x)
    if isinstance(x, Send) and x.key not in made:
        _fail_line(f"{describe(x)} comes before the {kind} that makes it; rule: send after the compute",
            rank, step, x)


def _fail_line(message: str, rank: int, step: int, x: Instruction) -> None:
    raise ScheduleError(f"rank {rank}, step {step}: {message}", rank, step, x)


def validate(schedule: Lists) -> Lists:
    """Check a schedule or a lowered :class:`~zbpp_lite.schedules.program.Program`; return it unchanged
    if valid. Raises ScheduleError: the first problem found, naming rank, step, action and rule, for a
    schedule with the rank x step grid (our text form; the bad cell in brackets); for a program in one
    line (its compute entries first checked as a schedule, steps counted without transfers)."""
    if isinstance(schedule, Program):
        checked_program(schedule)
    else:
        checked_order(schedule)
    return schedule


def checked_order(schedule: Schedule) -> tuple[list[tuple[int, int]], tuple]:
    """:func:`validate`'s checks, returning the :func:`execution_order` they found and the
    :func:`step_keys` they used (the simulator times that order with those keys, so a checked simulation
    walks the schedule once). Raises ScheduleError as validate."""
    _check_structure(schedule)
    _check_keys(schedule)
    keys = step_keys(schedule)
    return execution_order(schedule, keys), keys


def checked_program(lists: Lists) -> tuple[Program, list[tuple[int, int]]]:
    """:func:`validate`'s checks of a program, or of a schedule and then its lowered program
    (:func:`~zbpp_lite.schedules.program.lower`: its transfers are right by construction), returning the
    program and the :func:`execution_order` of its instructions they found (the simulator times that
    order, so a checked simulation walks once). Raises ScheduleError as validate."""
    schedule = lists.schedule() if isinstance(lists, Program) else lists
    _check_structure(schedule)
    _check_keys(schedule)
    program = lists if isinstance(lists, Program) else lower(schedule)
    if program is lists:
        _check_transfers(program)
        if any(type(x) is Recv and x.earlier for row in program.instructions for x in row):
            _program_order(program, steps=2)  # a step waits for the previous one's messages: two in turn
            _check_speculation(program)
    return program, execution_order(program)
