"""What the course's exercise checks share: a check says right or wrong, with a hint.

Each lesson asks at least two questions, one predicted before the simulation runs
(:func:`reveal` draws it only once answered); formula answers are functions of p, m and the costs, called at
several points; in lesson 8 the learner writes the pipeline. A check never raises for a wrong answer: it
returns a :class:`Verdict` (prints "right" or "not yet" with a hint; truthy only when right, so solutions can
``assert`` it). Answers are compared with what the simulator, validator, placements, attribution or
rebalancer compute, or with flop counts from the shapes; no answer is stored. No JAX at import. A function
answer runs with the package out of bounds: one that calls any zbpp_lite function (the simulator, a builder,
a planner, a closed form) is refused, so that wrapping ``zb.simulate`` does not pass for a derivation.

Sources: arXiv 2401.10241 sections 2-3 (bubbles, memory, heuristic); arXiv 2405.15362 section 3
(V placement); Narayanan et al., SC 2021, section 2.2 (interleaved 1F1B).
"""

from __future__ import annotations

import copy
import decimal
import functools
import itertools
import math
import numbers
import os
import random
import sys
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, Sequence

import numpy as np
import plotly.graph_objects as go

from ..schedules.costs import Costs



@dataclass(frozen=True)
class Verdict:
    """What a check says about one answer.

    Three rules keep a check from doing the learner's thinking: a verdict for no answer yet (its message
    starts "no answer yet") carries no hint, so a predict-first exercise shows nothing before the prediction;
    a function check names the failing input and what is wrong there (too high, too low, how many points
    agree), never the expected value; and :func:`zbpp_lite.course.reveal` draws the simulation only after a
    real attempt (``attempt``).

    Attributes:
        exercise: the exercise's id, e.g. ``"1.1"`` (lesson 1, exercise 1).
        ok: True when the answer is right.
        message: why it is right, or what is wrong.
        hint: a nudge towards the idea (empty when right, and when no answer is given yet).
        attempt: whether the answer is a real attempt, right or a well-formed try (a number near the answer,
            or a wrong answer the check recognises), which unlocks the reveal; False for no answer and for a
            throwaway number. Checks that do not judge it leave it True.
    """

    exercise: str
    ok: bool
    message: str
    hint: str = ""
    attempt: bool = True

    def __post_init__(self) -> None:
        if not self.ok and self.message.startswith("no answer yet"):
            object.__setattr__(self, "hint", "")
            object.__setattr__(self, "attempt", False)

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        if self.ok:
            return f"Exercise {self.exercise}: right. {self.message}"
        hint = f"\n  Hint: {self.hint}" if self.hint else ""
        return f"Exercise {self.exercise}: not yet. {self.message}{hint}"

    __repr__ = __str__


def _unanswered(answer: Any) -> bool:
    return answer is None or answer is Ellipsis


def _crossings(placement: tuple[int, ...], m: int) -> int:
    """Values that cross between ranks in one step of m microbatches through the stages of ``placement``
    (stage -> rank; exercise 5.1): each link between consecutive stages on two ranks carries m
    activations down and m input gradients back."""
    return 2 * m * sum(a != b for a, b in zip(placement, placement[1:]))


def _one_slow_stage(p: int, slow: int) -> Costs:
    """Unit T_F = T_B = T_W (T_BW = 2) on p stages but stage ``slow``, where each is 2: the one slow stage
    of exercises 1.1 and 7.1."""
    costs = [2.0 if s == slow else 1.0 for s in range(p)]
    return Costs(f=costs, b=costs, w=costs)


def _as_number(answer: Any) -> float | None:
    """A real number from an int, float, Fraction or a string such as "2/8" (None if not one)."""
    if isinstance(answer, bool):
        return None
    try:
        if isinstance(answer, numbers.Real):
            value = float(answer)
        elif (getattr(answer, "shape", None) == ()   # a 0-d NumPy or JAX array of ints or floats
              and np.dtype(getattr(answer, "dtype", object)).kind in "iuf"):
            value = float(answer)
        elif isinstance(answer, str):
            value = float(Fraction(answer.strip()))
        else:
            return None
    except (ValueError, ZeroDivisionError, OverflowError):   # not a number, or too large for a float
        return None
    return value if math.isfinite(value) else None


def _whole(answer: Any) -> int:
    """``answer`` as an int when it is a whole number (an int or bool, or a float, Fraction or 0-d array equal
    to one; not a string), else ValueError: a count given as 2.9 is no count, not 2."""
    if isinstance(answer, numbers.Integral):
        return int(answer)
    value = None if isinstance(answer, (str, bytes)) else _as_number(answer)
    if value is None or not value.is_integer():
        raise ValueError(f"{answer!r} is not a whole number")
    return int(value)


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
"""The zbpp_lite folder, with its separator (a learner's ``zbpp_lite_helpers.py`` beside it is not in it): a
function answer may call nothing in it (module docstring)."""


class _UsedPackage(Exception):
    """The learner's function called a zbpp_lite function, or switched :func:`_alone`'s watch off."""


_UNWATCHED = "sys.setprofile, sys.settrace or threading's (which switch the check's watch off)"


class _OverBudget(Exception):
    """The learner's function took more steps than :func:`_alone`'s ``steps`` allow."""


_PLAIN = (bool, int, float, str, bytes, Fraction, type(None), type(Ellipsis))


_MOST_ITEMS = 1_000_000
"""The most items :func:`_settled` reads from an answer's iterator (an endless one would never end)."""


def _settled(answer: Any) -> Any:
    """``answer`` as plain Python values, read while :func:`_alone` still watches, so that nothing the
    learner's code defines runs later, unwatched, when a check reads it: a NumPy scalar or 0-d array becomes
    its Python number, another real number (a Decimal too) an int or float, a 1-D or object array a list,
    any other NumPy or JAX array a plain NumPy array, a str a plain str, a dict or other mapping a dict and a
    tuple or list (or any other iterable: a list, read to :data:`_MOST_ITEMS` items) a plain one, each item
    settled; an int, float, bool, bytes, Fraction, None or Ellipsis is kept. Anything else, and an answer
    that cannot be read, becomes a text naming it, which every check refuses."""
    kind = type(answer)
    if kind in _PLAIN:
        return answer
    try:
        if isinstance(answer, np.generic):
            return _settled(answer.item())   # the value stored, whatever the subclass's __float__ says
        jax = sys.modules.get("jax")
        if isinstance(answer, np.ndarray) or (jax is not None and isinstance(answer, jax.Array)):
            array = np.asarray(answer)   # a plain ndarray: a subclass's methods are not called again
            if array.ndim == 0:
                return _settled(array.item())
            return _settled(array.tolist()) if array.ndim == 1 or array.dtype == np.dtype(object) else array
        if isinstance(answer, str):
            return str.__str__(answer)
        if isinstance(answer, dict):
            return dict(zip(dict.keys(answer), map(_settled, dict.values(answer))))
        if isinstance(answer, (tuple, list)):   # (map: no frame of its own for the watch to see)
            return (tuple if isinstance(answer, tuple) else list)(map(_settled, answer))
        if isinstance(answer, numbers.Integral):
            return int(answer)
        if isinstance(answer, (numbers.Real, decimal.Decimal)):
            return float(answer)
        if getattr(answer, "shape", None) == ():   # a 0-d array of another library
            return _settled(answer.item() if hasattr(answer, "item") else float(answer))
        if hasattr(answer, "tolist") and (getattr(answer, "ndim", None) == 1
                                          or getattr(answer, "dtype", None) == np.dtype(object)):
            return _settled(answer.tolist())
        if isinstance(answer, Mapping):
            return {k: _settled(v) for k, v in answer.items()}
        if isinstance(answer, Iterable):
            items = list(itertools.islice(answer, _MOST_ITEMS + 1))
            if len(items) > _MOST_ITEMS:
                return f"<a {kind.__name__} of more than {_MOST_ITEMS} items>"
            return list(map(_settled, items))
    except Exception as e:  # noqa: BLE001  (an answer that cannot be read is an answer too)
        return f"<a {kind.__name__} that could not be read: {type(e).__name__}>"
    return f"<a {kind.__name__}: not a number, text, sequence, dict or array>"


_HOOK_CODES = frozenset(f.__code__ for f in (threading.setprofile, threading.settrace,
                                              getattr(threading, "setprofile_all_threads", None),
                                              getattr(threading, "settrace_all_threads", None)) if f)
"""threading's hook setters (Python code): they switch the watch off for threads to come, which raises no
audit event, so the profile hook refuses a call of them; sys's setters raise one (:data:`_AUDITED`)."""

_AUDITED = {"sys.setprofile": _UNWATCHED, "sys.settrace": _UNWATCHED}
_AUDITED.update(dict.fromkeys(("subprocess.Popen", "os.system", "os.fork", "os.forkpty", "os.posix_spawn",
                               "os.spawn", "os.exec"), "another process (which the check cannot watch)"))
"""Interpreter audit events (PEP 578) an answer may not raise while :func:`_alone` watches, and what the
verdict calls them: a hook switched off however it is reached, or work handed to another process."""

_WATCHING: list | None = None
"""While :func:`_alone` runs an answer, the list its hooks record into (the first thing the answer used
that it may not), else None: the profile hook and the audit hook (:func:`_audit_hook`) record only then."""

_AUDIT_HOOKED = False
"""Whether :func:`_audit_hook` is added (once per process: audit hooks cannot be removed)."""


def _audit_hook(event: str, args: tuple) -> None:
    record = _WATCHING
    if record is not None and not record and event in _AUDITED:
        record.append(_AUDITED[event])


def _shown(value: Any, limit: int = 80, as_text: Callable[[Any], str] = repr) -> str:
    """``as_text(value)`` for a verdict (its ``repr``; ``str`` for an error's message), cut to ``limit``
    characters; a placeholder where that itself fails (a learner's class whose ``__repr__`` or an error
    whose ``__str__`` raises, an int too long for Python to print)."""
    try:
        text = as_text(value)
    except Exception:  # noqa: BLE001  (the answer's own failure, reported as what it is)
        text = f"(a value of type {type(value).__name__} that cannot be printed)"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _alone(fn: Callable, point: tuple, steps: int | None = None) -> Any:
    """``_settled(fn(*point))``, raising :class:`_UsedPackage` if it called any zbpp_lite function (a
    profile hook, on this thread and on threads the call starts, and on Python 3.12 on every thread; the
    course's caches answer through one too: :func:`course_cache`), switched a hook off or started another
    process (an audit hook), and :class:`_OverBudget` once it has taken more than ``steps`` steps on this
    thread: function calls (Python's and built-ins', the profile hook) and lines of Python run (a trace
    hook, set only with ``steps``). ``fn`` gets a deep copy of ``point``: an answer that changes a list it
    was given changes neither the check's point nor what the check computes from it. Every hook is as it
    was after the call."""
    global _WATCHING, _AUDIT_HOOKED
    used: list[str] = []
    taken = [0]
    owner, own_code = threading.get_ident(), _settled.__code__
    if not _AUDIT_HOOKED:
        sys.addaudithook(_audit_hook)
        _AUDIT_HOOKED = True

    def count() -> None:
        taken[0] += 1
        if taken[0] > steps:
            raise _OverBudget(steps)

    def watch(frame, event, arg):
        if used or _WATCHING is not used:   # (not watching: the hooks being set and unset, or a thread
            return                          # the answer left running)
        code = frame.f_code
        if event == "call" and code.co_filename.startswith(_PACKAGE) and code is not own_code:
            used.append(f"zbpp_lite's {code.co_name} ({os.path.relpath(code.co_filename, _PACKAGE)})")
        elif event == "call" and code in _HOOK_CODES:
            used.append(_UNWATCHED)
        if steps is not None and event in ("call", "c_call") and threading.get_ident() == owner:
            count()

    def lines(frame, event, arg):   # the trace hook: each frame's lines counted as steps
        if event == "line":
            count()
        return lines

    previous, traced = sys.getprofile(), sys.gettrace()
    threads, threads_traced = threading.getprofile(), threading.gettrace()
    every_thread = getattr(threading, "setprofile_all_threads", None)   # Python 3.12
    given = copy.deepcopy(point)
    threading.setprofile(watch)
    if every_thread is not None:
        every_thread(watch)
    if steps is not None:
        sys.settrace(lines)
    sys.setprofile(watch)
    _WATCHING = used
    try:
        got = _settled(fn(*given))
    finally:
        _WATCHING = None
        replaced, seen = sys.getprofile() is not watch, used[:]
        if every_thread is not None:
            every_thread(previous)
        sys.setprofile(previous)
        threading.setprofile(threads)
        sys.settrace(traced)
        threading.settrace(threads_traced)
    if seen or replaced:
        raise _UsedPackage(seen[0] if seen else _UNWATCHED)
    return got


def _called(exercise: str, fn: Callable, point: tuple, hint: str, steps: int | None = None,
            where: str | None = None) -> tuple[Any, Verdict | None]:
    """``(fn(*point), None)``, or ``(None, the verdict)`` when it raised, called the package or took more
    than ``steps`` steps (:func:`_alone`); ``where`` names the point in the verdict (else the point)."""
    where = str(point) if where is None else where
    try:
        return _alone(fn, point, steps), None
    except _UsedPackage as e:
        return None, Verdict(exercise, False, f"your function called {e} at {where}: this "
                             "exercise asks you to derive the answer, so the check refuses one that asks the "
                             "package (the simulator, a builder, a planner or a closed form).", hint)
    except _OverBudget as e:
        return None, Verdict(exercise, False, f"your function took over {e} steps (lines run and calls) "
                             f"at {where} and was stopped: it would take too long there.", hint)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001  (the learner's error, SystemExit too, is an answer to report)
        return None, Verdict(exercise, False, f"your function raised {type(e).__name__} at {where}: "
                             f"{_shown(e, 200, str)}", hint)


def _hand_schedule(exercise: str, actions: Any, p: int, m: int, hint: str,
                   example: str) -> tuple[Any, Verdict | None]:
    """``(schedule, None)`` for a schedule the learner wrote by hand (``p`` lists of actions in our text
    form, ``Action.from_text``, or ``Action``'s; stage r on rank r, ``m`` microbatches), or ``(None, the
    refusal)``: no answer yet, actions it cannot read, another number of ranks, or one
    :func:`zbpp_lite.validate` refuses (its first line as the hint). ``example``: actions to show."""
    from ..schedules.ir import Action, Schedule
    from ..schedules.validate import ScheduleError, validate

    if _unanswered(actions):
        return None, Verdict(exercise, False, f"no answer yet: replace ... with {p} lists of actions.", hint)
    try:
        rows = [[a if isinstance(a, Action) else Action.from_text(str(a)) for a in row] for row in actions]
    except (TypeError, ValueError) as e:
        return None, Verdict(exercise, False, f"could not read the actions: {e}",
                             f"write each action in our text form, e.g. {example}.")
    if len(rows) != p:
        return None, Verdict(exercise, False, f"{p} ranks need {p} lists, you gave {len(rows)}.", hint)
    schedule = Schedule(tuple(map(tuple, rows)), tuple(range(p)), m, "mine")
    try:
        validate(schedule)
    except ScheduleError as e:
        return None, Verdict(exercise, False, "zb.validate refuses it.", str(e).splitlines()[0])
    return schedule, None


def _function_missing(exercise: str, fn: Any, hint: str, name: str = "the function",
                      shape: str = "a function") -> Verdict | None:
    """The verdict for an answer that is not yet a function (still ``...``, or not callable), else None;
    ``name``: what the learner is to write, ``shape``: what was expected instead of the answer given."""
    if _unanswered(fn):
        return Verdict(exercise, False, f"no answer yet: write {name}.")
    if not callable(fn):
        return Verdict(exercise, False, f"expected {shape}, got {_shown(fn)}.", hint, attempt=False)
    return None


def course_cache(maxsize: int) -> Callable[[Callable], Callable]:
    """``functools.lru_cache(maxsize)`` behind a plain Python function of this package: every call, a cache
    hit too, runs a package frame, so :func:`_alone` refuses a learner's function that reads a check's cached
    answers, and the checks keep their caches from one try to the next."""

    def decorate(fn: Callable) -> Callable:
        cached = functools.lru_cache(maxsize=maxsize)(fn)

        def call(*args, **kwargs):
            return cached(*args, **kwargs)

        # the frame carries fn's name, file and first line, so a refusal names the function the learner
        # called and a traceback through it points at fn's definition
        call.__code__ = call.__code__.replace(co_name=fn.__name__, co_qualname=fn.__qualname__,
                                              co_filename=fn.__code__.co_filename,
                                              co_firstlineno=fn.__code__.co_firstlineno)
        return functools.wraps(fn)(call)

    return decorate


def _with_fresh(fixed: Sequence, draw: Callable[[random.Random], Any], count: int) -> list:
    """``fixed``, then ``count`` cases ``draw`` makes from an unseeded generator: new at every call and none
    of them a fixed one, so that a table of answers written for the fixed cases does not pass."""
    rng, fresh = random.Random(), []
    while len(fresh) < count:
        case = draw(rng)
        if case not in fixed:
            fresh.append(case)
    return [*fixed, *fresh]


def _function_check(exercise: str, fn: Any, points: Sequence[tuple], expected: Callable[..., float],
                    what: str, hint: str, tol: float = 1e-6,
                    known: Sequence[tuple[Callable[..., float], str]] = ()) -> Verdict:
    """Call the learner's function at every point (:func:`_alone`) and compare with ``expected(*point)``; a
    wrong answer is told the first point where it fails, whether it is too high or too low there and at how
    many points it agrees, never the expected value (two tries would fit a linear answer). ``known``: pairs
    (a wrong function a copied pattern gives, what that pattern misses); a numeric answer that equals one
    of them at every point is told its own message instead of the first failing point (:func:`_with_fresh`
    adds points new at every call)."""
    missing = _function_missing(exercise, fn, hint, shape=f"a function for {what}")
    if missing is not None:
        return missing
    wrong, agree, values = None, 0, []
    for point in points:
        got, refused = _called(exercise, fn, point, hint)
        if refused is not None:
            return refused
        if _unanswered(got):   # the template's body, still `return ...`: not an attempt yet
            return Verdict(exercise, False, f"at {point} your function returned {_shown(got)}: replace the "
                           "... in its body.", hint, attempt=False)
        want = expected(*point)
        if isinstance(want, tuple):   # a pair or more of numbers, compared one by one
            numbers_got = _as_numbers(got, len(want))
            if numbers_got is None:
                return Verdict(exercise, False,
                               f"at {point} expected {len(want)} numbers, got {_shown(got)}.", hint)
            values.append(numbers_got)
            if _close(numbers_got, want, tol):
                agree += 1
            elif wrong is None:
                wrong = f"at {point} your function gives {numbers_got}, which is wrong there"
            continue
        if isinstance(want, bool):
            if not isinstance(got, bool) and type(got).__name__ != "bool_":
                return Verdict(exercise, False, f"at {point} expected True or False, got {_shown(got)}.",
                               hint)
            if bool(got) == want:
                agree += 1
            elif wrong is None:
                wrong = f"at {point} your function gives {bool(got)}, which is wrong there"
            continue
        value = _as_number(got) if not isinstance(got, bool) else None
        if value is None:
            return Verdict(exercise, False, f"at {point} expected a number, got {_shown(got)}.", hint)
        values.append(value)
        if _close(value, want, tol):
            agree += 1
        elif wrong is None:
            wrong = f"at {point} your function gives {value:g}, too {'high' if value > want else 'low'}"
    if wrong is not None:
        agreed = f"(it agrees at {agree} of the {len(points)} points checked)"
        for pattern, message in known if len(values) == len(points) else ():
            if all(_close(v, pattern(*x), tol) for v, x in zip(values, points)):
                return Verdict(exercise, False, f"{message} {agreed}.", hint)
        return Verdict(exercise, False, f"{wrong} {agreed}.", hint)
    return Verdict(exercise, True, f"{what} agrees at all {len(points)} points checked.")


def _as_numbers(answer: Any, count: int) -> tuple[float, ...] | None:
    """``count`` real numbers from a tuple or list of them (:func:`_as_number` each), else None."""
    if isinstance(answer, (str, bytes)) or not isinstance(answer, Sequence) or len(answer) != count:
        return None
    got = tuple(_as_number(v) for v in answer)
    return None if None in got else tuple(int(v) if v.is_integer() else v for v in got)


def _close(got: Any, want: Any, tol: float) -> bool:
    """``got`` equals ``want`` within ``tol`` (relative above 1): two numbers, or two tuples one by one."""
    if isinstance(want, tuple):
        return (isinstance(got, tuple) and len(got) == len(want)
                and all(_close(g, v, tol) for g, v in zip(got, want)))
    return not isinstance(got, tuple) and abs(got - want) <= tol * max(1.0, abs(want))


def _line_figure(x: list, y: list, title: str, x_title: str, y_title: str = "bubble rate"):
    """A bubble rate (or ``y_title``) against one swept quantity (a reveal's plotly figure)."""

    return go.Figure(go.Scatter(x=x, y=y, mode="lines+markers"),
                     layout=dict(title=title, xaxis_title=x_title, yaxis_title=y_title, height=340))
