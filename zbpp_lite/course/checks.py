"""What the course's exercise checks share: a check says right or wrong, with a hint.

Each lesson (notebooks 01-09) asks at least three questions, one predicted before the simulation runs
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

import math
import numbers
import os
import sys
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, Sequence

import plotly.graph_objects as go



@dataclass(frozen=True)
class Verdict:
    """What a check says about one answer.

    Attributes:
        exercise: the exercise's id, e.g. ``"1.1"`` (lesson 1, exercise 1).
        ok: True when the answer is right.
        message: why it is right, or what is wrong.
        hint: a nudge towards the answer (empty when right).
    """

    exercise: str
    ok: bool
    message: str
    hint: str = ""

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


def _as_number(answer: Any) -> float | None:
    """A real number from an int, float, Fraction or a string such as "2/8" (None if not one)."""
    if isinstance(answer, bool):
        return None
    if isinstance(answer, numbers.Real):
        value = float(answer)
    elif isinstance(answer, str):
        try:
            value = float(Fraction(answer.strip()))
        except (ValueError, ZeroDivisionError):
            return None
    else:
        return None
    return value if math.isfinite(value) else None


def _number_check(exercise: str, answer: Any, expected: float, what: str, hint: str,
                  tol: float = 1e-6, known: dict[float, tuple[str, str]] | None = None) -> Verdict:
    """``answer`` against ``expected`` within ``tol`` (relative above 1); ``known`` maps a wrong answer the
    lesson's printed pattern gives to its own (message, hint)."""
    if _unanswered(answer):
        return Verdict(exercise, False, "no answer yet: replace ... with yours.", hint)
    value = _as_number(answer)
    if value is None:
        return Verdict(exercise, False, f"expected a number for {what}, got {answer!r}.", hint)

    def near(target: float) -> bool:
        return abs(value - target) <= tol * max(1.0, abs(target))

    if near(expected):
        return Verdict(exercise, True, f"{what} is {expected:g}.")
    for wrong, (message, why) in (known or {}).items():
        if near(wrong):
            return Verdict(exercise, False, message, why)
    return Verdict(exercise, False, f"{value:g} is not {what}.", hint)


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""The zbpp_lite folder: a function answer may call nothing in it (module docstring)."""


class _UsedPackage(Exception):
    """The learner's function called ``name``, a zbpp_lite function."""


def _alone(fn: Callable, point: tuple) -> Any:
    """``fn(*point)``, raising :class:`_UsedPackage` if it called any zbpp_lite function (a profile hook)."""
    used: list[str] = []

    def watch(frame, event, arg):
        if event == "call" and not used and frame.f_code.co_filename.startswith(_PACKAGE):
            used.append(f"{frame.f_code.co_name} ({os.path.relpath(frame.f_code.co_filename, _PACKAGE)})")

    previous = sys.getprofile()
    sys.setprofile(watch)
    try:
        got = fn(*point)
    finally:
        sys.setprofile(previous)
    if used:
        raise _UsedPackage(used[0])
    return got


def _called(exercise: str, fn: Callable, point: tuple, hint: str) -> tuple[Any, Verdict | None]:
    """``(fn(*point), None)``, or ``(None, the verdict)`` when it raised or called the package."""
    try:
        return _alone(fn, point), None
    except _UsedPackage as e:
        return None, Verdict(exercise, False, f"your function called zbpp_lite's {e} at {point}: this "
                             "exercise asks you to derive the answer, so the check refuses one that asks the "
                             "package (the simulator, a builder, a planner or a closed form).", hint)
    except Exception as e:  # noqa: BLE001  (the learner's error is an answer to report, not to raise)
        return None, Verdict(exercise, False, f"your function raised {type(e).__name__} at {point}: {e}",
                             hint)


def _function_missing(exercise: str, fn: Any, hint: str, name: str = "the function",
                      shape: str = "a function") -> Verdict | None:
    """The verdict for an answer that is not yet a function (still ``...``, or not callable), else None;
    ``name``: what the learner is to write, ``shape``: what was expected instead of the answer given."""
    if _unanswered(fn):
        return Verdict(exercise, False, f"no answer yet: write {name}.", hint)
    if not callable(fn):
        return Verdict(exercise, False, f"expected {shape}, got {fn!r}.", hint)
    return None


def _function_check(exercise: str, fn: Any, points: Sequence[tuple], expected: Callable[..., float],
                    what: str, hint: str, tol: float = 1e-6) -> Verdict:
    """Call the learner's function at every point (:func:`_alone`) and compare with ``expected(*point)``."""
    missing = _function_missing(exercise, fn, hint, shape=f"a function for {what}")
    if missing is not None:
        return missing
    for point in points:
        want = expected(*point)
        got, refused = _called(exercise, fn, point, hint)
        if refused is not None:
            return refused
        value = _as_number(got) if not isinstance(got, bool) else None
        if isinstance(want, bool):
            if not isinstance(got, (bool,)) and not (hasattr(got, "__bool__")
                                                     and type(got).__name__ == "bool_"):
                return Verdict(exercise, False, f"at {point} expected True or False, got {got!r}.", hint)
            if bool(got) != want:
                return Verdict(exercise, False,
                               f"at {point} your function gives {bool(got)}, the simulator {want}.", hint)
            continue
        if value is None:
            return Verdict(exercise, False, f"at {point} expected a number, got {got!r}.", hint)
        if abs(value - want) > tol * max(1.0, abs(want)):
            return Verdict(exercise, False, f"at {point} your function gives {value:g}, not {want:g}.", hint)
    return Verdict(exercise, True, f"{what} agrees at all {len(points)} points checked.")


def _line_figure(x: list, y: list, title: str, x_title: str, y_title: str = "bubble rate"):
    """A bubble rate (or ``y_title``) against one swept quantity (a reveal's plotly figure)."""

    return go.Figure(go.Scatter(x=x, y=y, mode="lines+markers"),
                     layout=dict(title=title, xaxis_title=x_title, yaxis_title=y_title, height=340))
