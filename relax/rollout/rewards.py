"""Reward dispatch: which function scores a response, and what happens when it raises.

By default each sample is scored by its task's verifier (``TASKS[sample.task].reward``), and a
row of a task that is not built in (``custom``, ``gsm8k``) by
:func:`~relax.data.verifiers.answer_match_reward` (numbers compared as numbers, words exactly);
``data.reward_fn`` (a dotted path, see :data:`relax.data.suite.base.RewardFn`) replaces it
for every sample. A reward function that raises or returns something that is not a finite
number in [0, 1] does not stop the run: the sample gets reward 0, zero loss weight and the
error text, which is stored with the sample and counted in the metrics.

``near_miss_credit`` (``algorithm.near_miss_credit``, training only) shapes the task
verifiers: on the kinds of question a task marks ordinal, an answer one away from the truth
earns the credit instead of 0. Evaluation builds its dispatcher without it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from relax.data.samples import Sample
from relax.data.suite import TASKS, kind_of, load_reward_fn
from relax.data.verifiers import answer_match_reward, integer_distance
from relax.rollout.judge import judge_from_config


def reward_metrics(scored: Sequence[tuple[Sample, float]]) -> dict[str, float]:
    """Mean reward per task (``reward/shapes``) and per kind of question where the task asks
    several (``reward/shapes:colour``), over ``(sample, reward)`` pairs.

    Why per kind: a policy can learn a picture's count and answer one colour to every colour
    question (docs/history/learning-recipe.md, "Why images stall"); the task's mean then sits at a plateau that
    looks like slow learning, and only the kind's curve shows the collapse while the run goes on."""
    groups: dict[str, list[float]] = {}
    for sample, reward in scored:
        groups.setdefault(f"reward/{sample.task}", []).append(reward)
        kind = kind_of(sample)
        if kind:
            groups.setdefault(f"reward/{sample.task}:{kind}", []).append(reward)
    return {key: math.fsum(values) / len(values) for key, values in sorted(groups.items())}


@dataclass(frozen=True)
class Scored:
    reward: float
    error: str = ""  # empty when the reward function succeeded


class RewardDispatcher:
    """Scores ``(response, sample)`` pairs; never raises for a faulty reward function.

    ``judge`` (a :class:`~relax.rollout.judge.JudgeReward`, from ``data.judge_url``) replaces
    the verifiers, and :meth:`score_many` sends its requests concurrently."""

    def __init__(self, reward_fn: str = "", judge: Any = None, near_miss_credit: float = 0.0):
        self.custom: Callable[[str, Sample], float] | None = load_reward_fn(reward_fn) if reward_fn else None
        if judge is not None and self.custom is not None:
            raise ValueError("set data.judge_url or data.reward_fn, not both")
        if near_miss_credit and (judge is not None or self.custom is not None):
            raise ValueError("near_miss_credit shapes the task verifiers; it cannot apply to a custom reward or judge")
        self.judge = judge
        self.near_miss_credit = near_miss_credit
        self.errors = 0

    @classmethod
    def for_training(cls, cfg: Any) -> RewardDispatcher:
        """The dispatcher a run's scoring role uses (a ``RelaxConfig``): ``data.reward_fn`` or the
        judge of ``data.judge_*``, else the task verifiers with ``algorithm.near_miss_credit``."""
        return cls(cfg.data.reward_fn, judge_from_config(cfg.data), cfg.algorithm.near_miss_credit)

    def function_for(self, sample: Sample) -> Callable[[str, Sample], float]:
        if self.judge is not None:
            return self.judge
        if self.custom is not None:
            return self.custom
        task = TASKS.get(sample.task)
        return task.reward if task is not None else answer_match_reward

    def score(self, response: str, sample: Sample) -> Scored:
        fn = self.function_for(sample)
        try:
            value = fn(response, sample)
        except Exception as e:  # a user function: anything may come out of it
            value = e
        if self.near_miss_credit and value == 0.0 and self._near_miss(response, sample):
            value = self.near_miss_credit
        return self._checked(value, fn, sample)

    @staticmethod
    def _near_miss(response: str, sample: Sample) -> bool:
        task = TASKS.get(sample.task)
        return task is not None and task.is_ordinal(sample) and integer_distance(response, sample) == 1

    def score_many(self, pairs: Sequence[tuple[str, Sample]], ids: Sequence[str] | None = None) -> list[Scored]:
        """:meth:`score` for each pair; a judge grades them all concurrently. ``ids`` (the rows') go unused:
        the signature is the generative judge's (relax.rollout.genrm)."""
        if self.judge is None:
            return [self.score(r, s) for r, s in pairs]
        return [self._checked(v, self.judge, s) for v, (_, s) in zip(self.judge.many(pairs), pairs, strict=True)]

    def _checked(self, value: Any, fn: Any, sample: Sample) -> Scored:
        try:
            if isinstance(value, BaseException):
                raise value
            reward = float(value)
            if not math.isfinite(reward) or not 0.0 <= reward <= 1.0:
                raise ValueError(f"returned {value!r}; a reward must be a finite float in [0, 1]")
        except Exception as e:
            self.errors += 1
            name = getattr(fn, "__qualname__", None) or repr(fn)
            return Scored(0.0, f"reward function {name} failed on sample {sample.id}: {type(e).__name__}: {e}")
        return Scored(reward)
