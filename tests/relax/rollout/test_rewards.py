"""Reward dispatch: task verifiers by default; a raising or out-of-range function becomes a recorded error."""

from __future__ import annotations

from relax.data.samples import Message, Sample
from relax.rollout.rewards import RewardDispatcher, reward_metrics
from tests.relax.services.runtime_helpers import FAULTY_PATH


def _sample(sid: str, task: str = "arithmetic", answer: str = "7") -> Sample:
    return Sample(id=sid, messages=(Message("user", "What is 3 + 4?"),), answer=answer, task=task)


def test_task_verifier_is_the_default():
    d = RewardDispatcher()
    assert d.score("<answer>7</answer>", _sample("a")).reward == 1.0
    assert d.score("<answer>8</answer>", _sample("a")).reward == 0.0


def test_raising_reward_is_recorded_not_raised():
    d = RewardDispatcher(FAULTY_PATH)
    ids = ["x0", "x1", "x2", "x3", "x4", "x5"]
    scored = [d.score("anything", _sample(i)) for i in ids]
    bad = [s for s, i in zip(scored, ids, strict=True) if sum(map(ord, i)) % 3 == 0]
    assert bad and all(s.reward == 0.0 and "judge unavailable" in s.error and "faulty_reward" in s.error for s in bad)
    assert all(s.reward == 1.0 and not s.error for s in scored if s not in bad)
    assert d.errors == len(bad)


def test_out_of_range_reward_is_an_error(tmp_path, monkeypatch):
    mod = tmp_path / "my_rewards.py"
    mod.write_text("def big(response, sample):\n    return 3.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    s = RewardDispatcher("my_rewards:big").score("r", _sample("a"))
    assert s.reward == 0.0 and "finite float in [0, 1]" in s.error


def test_near_miss_credit_goes_to_count_answers_one_away_only():
    from relax.data.suite import get_task

    shapes = get_task("shapes").generate(0, "train", 16, 1)
    count = next(s for s in shapes if s.metadata["question"] == "count" and s.answer in ("2", "3"))
    colour = next(s for s in shapes if s.metadata["question"] == "colour")
    truth = int(count.answer)
    d = RewardDispatcher(near_miss_credit=0.4)
    # count truth t: t -> 1 (exact), t+1 -> 0.4 (one away), t+2 -> 0 (two away), no answer -> 0
    got = [d.score(f"<answer>{a}</answer>", count).reward for a in (truth, truth + 1, truth - 1, truth + 2)]
    assert got == [1.0, 0.4, 0.4, 0.0]
    assert d.score("no answer", count).reward == 0.0
    # a colour question is not ordinal: any wrong colour is 0, and a number is never "near" a colour
    wrong = "blue" if colour.answer != "blue" else "red"
    assert d.score(f"<answer>{wrong}</answer>", colour).reward == 0.0
    # the arithmetic task marks no kind ordinal: 8 for 7 earns nothing
    assert d.score("<answer>8</answer>", _sample("a")).reward == 0.0
    # without the credit (as evaluation builds it) the near miss is a miss
    assert RewardDispatcher().score(f"<answer>{truth + 1}</answer>", count).reward == 0.0


def test_near_miss_credit_refuses_a_custom_reward():
    import pytest

    with pytest.raises(ValueError, match="near_miss_credit"):
        RewardDispatcher(FAULTY_PATH, near_miss_credit=0.5)


def test_reward_metrics_are_means_per_task_and_per_kind_of_question():
    def picture(sid: str, question: str) -> Sample:
        return Sample(
            id=sid, messages=(Message("user", "?"),), answer="1", task="shapes", metadata={"question": question}
        )

    scored = [(picture("p0", "colour"), 0.0), (picture("p1", "count"), 1.0), (picture("p2", "count"), 0.5),
              (_sample("t0"), 1.0)]
    # shapes: (0 + 1 + 0.5) / 3 = 0.5; its colour question alone 0, its two counts (1 + 0.5) / 2 = 0.75;
    # arithmetic asks one kind of question, so it gets its task's key only
    assert reward_metrics(scored) == {"reward/arithmetic": 1.0, "reward/shapes": 0.5,
                                      "reward/shapes:colour": 0.0, "reward/shapes:count": 0.75}
    assert reward_metrics([]) == {}


def test_rows_of_your_own_are_scored_as_numbers_or_as_words():
    d = RewardDispatcher()
    # a label dataset: numeric matching alone scored every right word 0
    assert d.score("<answer>Red</answer>", _sample("c", task="custom", answer="red")).reward == 1.0
    assert d.score("<answer>blue</answer>", _sample("c", task="custom", answer="red")).reward == 0.0
    assert d.score("<answer>1,200 pens</answer>", _sample("g", task="gsm8k", answer="1200")).reward == 1.0
    assert d.score("<answer>1201</answer>", _sample("g", task="gsm8k", answer="1200")).reward == 0.0
