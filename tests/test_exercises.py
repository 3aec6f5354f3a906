"""Every exercise's check, twice: a right answer passes and a wrong one fails (with a hint, and
without raising). The right answers are worked out by hand here, from the closed forms and the
definitions, so each check's simulator-computed reference is tested against them."""

from __future__ import annotations

import pytest

from zbpp_lite.viz import exercises as ex

TWO_RANK_1F1B = [["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1"]]

# id -> (a right answer, a wrong answer)
CASES = {
    "1.1": ("2/8", 2.0),                            # (p-1)/(m+p-1) = 2/8; 2 is the bubble time, not the rate
    "1.2": (28, 27),                                # 3/(m+3) < 0.1 -> m > 27; at m = 27 the rate is exactly 10%
    "1.3": (TWO_RANK_1F1B, [["0F0", "0B0", "0F1", "0B1"], ["1B0", "1F0", "1F1", "1B1"]]),  # BW before its F
    "2.1": (2 * 32 * 16 * 64 + 2 * 64 * 16 * 32, 2 * 16 * 32 * 64),   # both dW products; only one is wrong
    "2.2": (3 * 2 * 16 * 32 * 64, 2 * 2 * 16 * 32 * 64),               # + dy @ W2.T recomputed
    "3.1": (8 * 2.5 + 3 * 1.5, 8 * 2.5 + 3 * 2.5),  # m(f+b+w) + (p-1)(f+b-w); the wrong one is 1F1B's
    "3.2": (2 * 5 - 1, 5),                          # 2p - 1 against 1F1B's p
    "3.3": (8 * 3 + 3 * (3 + 2 * 0.25), 8 * 3 + 3 * 3),   # (p-1)(T_F+T_B+T_W+2T_comm); without T_comm
    "4.1": (6, 7),                                  # 5 M_B: 7.1%, 6 M_B: 4.2% (7 also works but is not the smallest)
    "4.2": (5, 4),                                  # the limit: one M_B per warm-up F
    "5.1": ([0, 1, 2, 2, 1, 0], [0, 1, 2, 0, 1, 2]),   # V against looped
    "5.2": ([8, 8, 8, 8], [8, 6, 4, 2]),            # balanced 2p stage-units, not 1F1B's p - r
    "6.1": ([0, 1, 0, 1], [0, 0, 1, 1]),            # s % p, not contiguous
    "6.2": (8 * 3 + 3 * 3 / 2, 8 * 3 + 3 * 3),      # work + 1F1B's bubble / v; plain 1F1B's makespan
    "7.1": (1, 3),
    "7.2": (5, 4),                                  # 1+1+1+1+2 = 6 = 2+2+2; 4 layers leave 8 on stage 1
}


def test_every_lesson_has_at_least_two_exercises_and_every_check_is_tested():
    lessons = {}
    for key in ex.EXERCISES:
        lessons.setdefault(key.split(".")[0], []).append(key)
    assert sorted(lessons) == [str(n) for n in range(1, 9)]
    assert all(len(v) >= 2 for v in lessons.values())
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
