"""The course's code: each lesson's exercise checks (``lesson1`` ... ``lesson10``), what the checks share
(:mod:`.checks`), and zb-auto read step by step (:mod:`.walkthrough`), and lessons 8 to 10's
test bench (:mod:`.bench`, JAX, not imported here). The top layer: it imports the
others, nothing imports it. A lesson imports it as ``from zbpp_lite import course as ex``.

Each check says right or not yet with a hint (a :class:`Verdict`, truthy only when right). A function
answer runs with the package out of bounds, so wrapping ``zb.simulate`` does not pass for a derivation.
No JAX at import.

Sources: arXiv 2401.10241 sections 2-3 (bubbles, memory, heuristic); arXiv 2405.15362 section 3
(V placement); Narayanan et al., SC 2021, section 2.2 (interleaved 1F1B).
"""

from __future__ import annotations

from typing import Any, Callable

from . import lesson1, lesson2, lesson3, lesson4, lesson5, lesson6, lesson7, lesson8, lesson9, lesson10
from . import checks  # noqa: F401  (the tests patch its guard)
from .checks import Verdict, _unanswered
from .lesson1 import *  # noqa: F401,F403
from .lesson2 import *  # noqa: F401,F403
from .lesson3 import *  # noqa: F401,F403
from .lesson4 import *  # noqa: F401,F403
from .lesson5 import *  # noqa: F401,F403
from .lesson6 import *  # noqa: F401,F403
from .lesson7 import *  # noqa: F401,F403
from .lesson8 import *  # noqa: F401,F403
from .lesson9 import *  # noqa: F401,F403
from .lesson10 import *  # noqa: F401,F403

_LESSONS = (lesson1, lesson2, lesson3, lesson4, lesson5, lesson6, lesson7, lesson8, lesson9, lesson10)

EXERCISES: dict[str, Callable[[Any], Verdict]] = {k: f for mod in _LESSONS for k, f in mod.EXERCISES.items()}
"""Every exercise's id ("3.2": lesson 3, exercise 2) -> its check; the tests and the notebook hygiene
test read it."""

REVEALS: dict[str, Callable[[Any], Any]] = {k: f for mod in _LESSONS for k, f in mod.REVEALS.items()}
"""Every predict-first exercise's id -> the simulation its reveal cell draws, given the learner's answer
(exercise 4.1 draws the plan it names; the others draw one fixed case)."""


def reveal(key: str, answer: Any, show: Callable[[], Any] | None = None) -> Any:
    """A predict-first exercise's simulation (a figure, or what ``show()`` returns) once ``answer`` is a real
    attempt: right, or a well-formed try by the exercise's own check (:attr:`checks.Verdict.attempt`: a
    number near the answer or a wrong answer the check recognises, not a throwaway number); before that, a
    line asking for one (and None).

    Raises:
        KeyError: ``key`` has no simulation of its own and ``show`` is not given.
    """
    if _unanswered(answer):
        print(f"Exercise {key}: commit to your prediction above first; then this cell shows the simulation.")
        return None
    verdict = EXERCISES[key](answer) if key in EXERCISES else None
    if verdict is not None and not (verdict.ok or verdict.attempt):
        print(f"Exercise {key}: {answer!r} is not yet a real attempt; work the prediction out above first, "
              "then this cell shows the simulation.")
        return None
    if show is not None:
        return show()
    if key not in REVEALS:
        raise KeyError(f"no reveal for exercise {key}; give show=")
    return REVEALS[key](answer)
