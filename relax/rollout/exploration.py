"""Forced answers (``rollout.explore_answers``): samples of a group that try an answer the
policy may no longer sample.

GRPO learns an answer only from groups that sampled it. Once the policy stops sampling an
answer (a colour, a pitch) it gets no reward signal for it again, and regularisers toward
the warm start only keep it alive, they do not teach when it is right (docs/benchmarks.md).
An explored sample is written by the task's own oracle format with an answer drawn
uniformly from the answers of its question's kind (``TaskSpec.answers_for``: the colours for
"What colour...", the counts for "How many..."; the whole answer space for tasks without
kinds), and the engine forces
its tokens (``SamplingParams.forced_output_ids``), reporting the policy's logprob of each as
for a drawn token. It is rewarded by the same verifier and enters the group's baseline like
the others, so a right forced answer in a group that missed gets a large advantage, a wrong
one a small negative one. The draw never looks at the sample's answer: nothing about the
truth enters except through the reward.

Which answer a sample forces is a pure function of (seed, sample id, stream position, index
in the group): a restarted rollout forces the same answers.
"""

from __future__ import annotations

import random
from typing import Any

from relax.data.schema import Sample
from relax.data.tasks import TASKS
from relax.data.tasks.base import derive_seed


class AnswerExplorer:
    """The last ``per_group`` samples of each single-turn group of a built-in task force an answer."""

    def __init__(self, per_group: int, tokenizer: Any, *, seed: int = 0, difficulty: int = 1):
        if per_group < 0:
            raise ValueError(f"per_group must be >= 0, got {per_group}")
        self.per_group, self.tokenizer = per_group, tokenizer
        self.seed, self.difficulty = seed, difficulty
        self._spaces: dict[tuple[str, str], list[str]] = {}

    def answer(self, sample: Sample, position: int, index: int) -> str:
        """The answer sample ``index`` of the group at stream ``position`` forces: uniform over
        the answers of the question's kind (``TaskSpec.answers_for``)."""
        task = TASKS[sample.task]
        key = (sample.task, task.kind(sample) if task.kind is not None else "")
        space = self._spaces.get(key)
        if space is None:
            space = self._spaces[key] = task.answers_for(sample, self.difficulty)
        rng = random.Random(derive_seed(self.seed, "explore", sample.id, position, index))
        return rng.choice(space)

    def forced_ids(self, sample: Sample, position: int, index: int, group_size: int) -> list[int]:
        """The token ids sample ``index`` (of ``group_size``) must produce; [] = draw freely, as
        every sample of a group too small to leave one drawn. Built-in tasks only (the rollout
        role checks the split before it builds an explorer)."""
        if index < group_size - min(self.per_group, group_size - 1):
            return []
        response = TASKS[sample.task].response_with(sample, self.answer(sample, position, index))
        return list(self.tokenizer(response, add_special_tokens=False)["input_ids"])
