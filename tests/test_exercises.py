"""Every exercise's check, twice: a right answer passes and a wrong one fails (with a hint, and
without raising). The right answers are worked out by hand here, from the closed forms and the
definitions, so each check's simulator-computed reference is tested against them."""

from __future__ import annotations

import pytest

from zbpp_lite.viz import exercises as ex

TWO_RANK_1F1B = [["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1"]]

# id -> (a right answer, a wrong answer); formula answers are functions, checked at several points
CASES = {
    "1.1": (24, 8 * 2),                             # (m+p-1)(T_F+T_BW) = 8 * 3; 16 forgets T_F
    "1.2": (28, 27),                                # 3/(m+3) < 0.1 -> m > 27; at m = 27 the rate is exactly 10%
    "1.3": (TWO_RANK_1F1B, [["0F0", "0B0", "0F1", "0B1"], ["1B0", "1F0", "1F1", "1B1"]]),  # BW before its F
    "1.4": (lambda p, m, r: min(p - r, m), lambda p, m, r: p - r),   # the wrong one forgets m < p
    "2.1": (lambda n, a, b, c: 2 * a * n * b + 2 * b * n * c, lambda n, a, b, c: 2 * a * n * b),  # only dW1
    "2.2": (lambda n, a, b, c: 2 * a * n * b + 2 * b * n * c + 2 * n * c * b,
            lambda n, a, b, c: 2 * a * n * b + 2 * b * n * c + 2 * n * b * a),   # recomputes dx's product instead
    "2.3": (0.5, 1.0),                              # dy @ W2.T only; 1.0 is a B that also makes dx
    "3.1": (8 * 2.5 + 3 * 1.5, 8 * 2.5 + 3 * 2.5),  # m(f+b+w) + (p-1)(f+b-w); the wrong one is 1F1B's
    "3.2": (lambda p, r: 2 * (p - r) - 1, lambda p, r: p - r),   # against 1F1B's p - r
    "3.3": (lambda p, m, f, b, w, c: (m + p - 1) * (f + b + w) + 2 * (p - 1) * c,
            lambda p, m, f, b, w, c: (m + p - 1) * (f + b + w + 2 * c)),   # T_comm in every microbatch
    "4.1": (lambda p, m, f, b, w: (m * (f + b + w) + (p - 1) * (f + b - w)) / (m + p - 1) - f,
            lambda p, m, f, b, w: b + w),           # the paper's T_BW = T_B + T_W is not the break-even
    "4.2": (5, 4),                                  # the limit: one M_B per warm-up F
    "4.3": (1, 5),                                  # the last stage's B needs only its own F
    "5.1": (lambda p: 2 * p - 2, lambda p: 2 * p - 1),   # the turn of the V stays on rank p-1
    "5.2": ([8] * 6, [12] * 6),                     # 2(p/2 + 1) stage units, not ZB-V's 2p
    "5.3": (lambda p, m, t: 6 * m * t, lambda p, m, t: 3 * m * t + 3 * (p - 1) * t),
    "6.1": (lambda p, v, r: [r + k * p for k in range(v)], lambda p, v, r: list(range(r * v, r * v + v))),  # looped, not contiguous
    "6.2": (8 * 3 + 3 * 3 / 2, 8 * 3 + 3 * 3),      # work + 1F1B's bubble / v; plain 1F1B's makespan
    "6.3": (lambda p, m, v: 2 * m * (v * p - 1), lambda p, m, v: m * (v * p - 1)),   # forward only
    "7.1": (0, 1),                                  # rank 0 idles 23; the slow rank 1 never idles
    "7.2": (5, 4),                                  # 1+1+1+1+2 = 6 = 2+2+2; 4 layers leave 8 on stage 1
    "7.3": (lambda c: min(range(1, len(c)), key=lambda k: max(sum(c[:k]), sum(c[k:]))), lambda c: len(c) // 2),
}


def test_every_lesson_has_at_least_three_exercises_and_every_check_is_tested():
    lessons = {}
    for key in ex.EXERCISES:
        lessons.setdefault(key.split(".")[0], []).append(key)
    assert sorted(lessons) == [str(n) for n in range(1, 9)]
    assert all(len(v) >= 3 for v in lessons.values())
    assert set(CASES) == {k for k in ex.EXERCISES if not k.startswith("8.")}  # lesson 8's: test_build_lesson.py


@pytest.mark.parametrize("key", sorted(CASES))
def test_a_right_answer_passes(key):
    verdict = ex.EXERCISES[key](CASES[key][0])
    assert verdict.ok and bool(verdict), str(verdict)
    assert str(verdict).startswith(f"Exercise {key}: right.")


@pytest.mark.parametrize("key", sorted(CASES))
def test_a_wrong_answer_fails_with_a_hint(key):
    verdict = ex.EXERCISES[key](CASES[key][1])
    assert not verdict.ok and not bool(verdict), str(verdict)
    assert str(verdict).startswith(f"Exercise {key}: not yet.") and verdict.hint and "Hint:" in str(verdict)


@pytest.mark.parametrize("key", sorted(CASES))
@pytest.mark.parametrize("junk", [..., None, "many", [1, "x"]], ids=["ellipsis", "none", "word", "list"])
def test_no_answer_or_nonsense_is_not_yet_and_raises_nothing(key, junk):
    verdict = ex.EXERCISES[key](junk)
    assert not verdict.ok and verdict.hint


def test_the_schedule_check_passes_on_the_validators_message():
    verdict = ex.two_rank_schedule([["0F0", "0F1", "0B0"], ["1F0", "1B0", "1F1", "1B1"]])
    assert not verdict.ok and "incomplete" in verdict.hint and "microbatch 1" in verdict.hint


def test_a_function_answer_that_raises_is_not_yet_with_the_error():
    verdict = ex.peak_memory_1f1b(lambda p, m, r: 1 / 0)
    assert not verdict.ok and "ZeroDivisionError" in verdict.message


@pytest.mark.parametrize("key", ["1.1", "3.1", "4.2", "5.2", "6.2", "7.1"])
def test_reveal_shows_the_simulation_only_after_a_prediction(key, capsys):
    assert ex.reveal(key, ...) is None and "commit" in capsys.readouterr().out
    fig = ex.reveal(key, 1)
    assert fig.data and fig.layout.title.text
    assert ex.reveal("2.3", 0.5, show=lambda: "shown") == "shown"
