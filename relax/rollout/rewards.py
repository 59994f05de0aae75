"""Reward dispatch: which function scores a response, and what happens when it raises.

By default each sample is scored by its task's verifier (``TASKS[sample.task].reward``);
``data.reward_fn`` (a dotted path, see :data:`relax.data.tasks.base.RewardFn`) replaces it
for every sample. A reward function that raises or returns something that is not a finite
number in [0, 1] does not stop the run: the sample gets reward 0, zero loss weight and the
error text, which is stored with the sample and counted in the metrics.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from relax.data.schema import Sample
from relax.data.tasks import TASKS, load_reward_fn
from relax.data.verifiers import numeric_match_reward


@dataclass(frozen=True)
class Scored:
    reward: float
    error: str = ""  # empty when the reward function succeeded


class RewardDispatcher:
    """Scores ``(response, sample)`` pairs; never raises for a faulty reward function."""

    def __init__(self, reward_fn: str = ""):
        self.custom: Callable[[str, Sample], float] | None = load_reward_fn(reward_fn) if reward_fn else None
        self.errors = 0

    def function_for(self, sample: Sample) -> Callable[[str, Sample], float]:
        if self.custom is not None:
            return self.custom
        task = TASKS.get(sample.task)
        return task.reward if task is not None else numeric_match_reward

    def score(self, response: str, sample: Sample) -> Scored:
        fn = self.function_for(sample)
        try:
            value = fn(response, sample)
            reward = float(value)
            if not math.isfinite(reward) or not 0.0 <= reward <= 1.0:
                raise ValueError(f"returned {value!r}; a reward must be a finite float in [0, 1]")
        except Exception as e:  # a user function: anything may come out of it
            self.errors += 1
            name = getattr(fn, "__qualname__", repr(fn))
            return Scored(0.0, f"reward function {name} failed on sample {sample.id}: {type(e).__name__}: {e}")
        return Scored(reward)
