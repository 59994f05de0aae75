"""The `largest` text task: questions, answers, answer space and held-out split."""

from __future__ import annotations

from collections import Counter

import pytest

from relax.data.errors import DataError
from relax.data.suite import TASKS, random_policy_score
from relax.data.suite.largest import CONFIGS, LargestConfig, answer_space, generate, phrase


def test_questions_answer_their_maximum():
    for s in generate(0, "train", 50, 1):
        numbers = s.metadata["numbers"]
        assert len(set(numbers)) == 3 and all(0 <= v <= 9 for v in numbers)
        assert s.answer == str(max(numbers))
        assert f"largest of {phrase(tuple(numbers))}?" in s.messages[0].content
    assert phrase((3, 8, 5)) == "3, 8 and 5"


def test_answer_space_holds_exactly_the_reachable_maxima():
    # three distinct digits: the maximum is at least 2 (0, 1, 2), at most 9 -> 8 values
    assert answer_space(1) == ["2", "3", "4", "5", "6", "7", "8", "9"]
    # four distinct digits: at least 3 -> 7 values; five numbers in 10..99: at least 14 -> 86 values
    assert answer_space(2)[0] == "3" and len(answer_space(2)) == 7
    assert answer_space(3)[0] == "14" and len(answer_space(3)) == 86
    with pytest.raises(DataError, match="difficulty"):
        answer_space(4)


def test_reward_and_random_baseline():
    task = TASKS["largest"]
    s = generate(0, "eval", 1, 1)[0]
    assert task.reward(f"<answer>{s.answer}</answer>", s) == 1.0
    assert task.reward("<answer>-1</answer>", s) == 0.0
    # a uniform guess over 8 values scores about 1/8 (the maxima are not uniform: 9 is likeliest)
    assert random_policy_score(task, 0, 1000, 1) <= 0.3


def test_held_out_questions_are_new_combinations():
    train = {tuple(s.metadata["numbers"]) for s in generate(0, "train", 500, 1)}
    held = {tuple(s.metadata["numbers"]) for s in generate(0, "eval", 100, 1)}
    assert held and not train & held


def test_train_split_is_balanced_over_maxima_and_held_out_is_not():
    # 256 train questions over the 8 maxima 2..9: 32 each, though only one set of digits, {0, 1, 2},
    # has maximum 2 (6 orders, some of them held out), so the train split repeats those
    train = [s.answer for s in generate(0, "train", 256, 1)]
    assert Counter(train) == {str(v): 32 for v in range(2, 10)}
    # held out as questions fall: P(max = k) = C(k, 2) / C(10, 3), 36/120 for 9 and 1/120 for 2
    held = Counter(s.answer for s in generate(0, "eval", 128, 1))
    assert held["9"] > 3 * held["5"] > 0 and held["2"] <= 4
    # difficulty 3 (86 maxima, the rarest one draw in 4e7 by uniform draws) still balances
    hard = Counter(s.answer for s in generate(0, "train", 172, 3))
    assert len(hard) == 86 and set(hard.values()) == {2}


def test_bad_config_is_refused():
    with pytest.raises(DataError, match="fewer than 5"):
        LargestConfig(count=5, low=0, high=3)
    assert CONFIGS[1].count == 3
