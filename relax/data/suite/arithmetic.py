"""Text task: integer arithmetic questions such as "What is 3 + 4?".

The cheapest possible verifiable task: a policy that learns it proves the text path of the
RL loop (generation, reward, update) works before any media is involved.
"""

from __future__ import annotations

import functools
import operator
import random
from collections.abc import Callable
from dataclasses import dataclass

from relax.data.errors import DataError
from relax.data.samples import Message, Sample
from relax.data.suite.base import (
    TaskSpec,
    check_generate_args,
    generate_split,
)
from relax.data.verifiers import ANSWER_FORMAT_HINT, numeric_match_reward

NAME = "arithmetic"

OPERATORS: dict[str, Callable[[int, int], int]] = {"+": operator.add, "-": operator.sub, "*": operator.mul}


@dataclass(frozen=True)
class ArithmeticConfig:
    """Knobs of one difficulty level.

    Operands are drawn uniformly from ``[low, high]``. With ``allow_negative=False`` the
    operands of ``-`` are ordered so the result is never negative.
    """

    low: int
    high: int
    operators: tuple[str, ...]
    allow_negative: bool = True

    def __post_init__(self) -> None:
        unknown = [op for op in self.operators if op not in OPERATORS]
        if unknown or not self.operators:
            raise DataError(
                f"arithmetic: operators must be a non-empty subset of {tuple(OPERATORS)}, got {self.operators}"
            )
        if self.low > self.high:
            raise DataError(f"arithmetic: operand range [{self.low}, {self.high}] is empty; need low <= high")


CONFIGS: dict[int, ArithmeticConfig] = {
    1: ArithmeticConfig(low=1, high=9, operators=("+",)),
    2: ArithmeticConfig(low=0, high=20, operators=("+", "-"), allow_negative=False),
    3: ArithmeticConfig(low=0, high=99, operators=("+", "-", "*")),
}


@dataclass(frozen=True)
class Question:
    a: int
    op: str
    b: int

    @property
    def expression(self) -> str:
        return f"{self.a} {self.op} {self.b}"

    @property
    def value(self) -> int:
        return OPERATORS[self.op](self.a, self.b)


def draw_question(rng: random.Random, config: ArithmeticConfig) -> Question:
    a = rng.randint(config.low, config.high)
    b = rng.randint(config.low, config.high)
    op = rng.choice(config.operators)
    if op == "-" and not config.allow_negative and a < b:
        a, b = b, a
    return Question(a, op, b)


def question_to_sample(question: Question, sample_id_: str, difficulty: int) -> Sample:
    prompt = f"What is {question.expression}?\n{ANSWER_FORMAT_HINT}"
    return Sample(
        id=sample_id_,
        task=NAME,
        messages=(Message("user", prompt),),
        answer=str(question.value),
        metadata={"difficulty": difficulty, "expression": question.expression},
    )


def generate_with_config(
    seed: int, split: str, n: int, config: ArithmeticConfig, difficulty: int = 0
) -> list[Sample]:
    """``n`` samples of ``split`` under an explicit config (``difficulty`` is only recorded)."""
    return generate_split(NAME, seed, split, n, config, lambda r: draw_question(r, config),
                          lambda q: q.expression, lambda q, sid: question_to_sample(q, sid, difficulty))


def generate(seed: int, split: str, n: int, difficulty: int) -> list[Sample]:
    check_generate_args(NAME, split, n, difficulty, tuple(CONFIGS))
    return generate_with_config(seed, split, n, CONFIGS[difficulty], difficulty)


@functools.cache
def _answers(config: ArithmeticConfig) -> tuple[str, ...]:
    values = set()
    operands = range(config.low, config.high + 1)
    for op in config.operators:
        for a in operands:
            for b in operands:
                if op == "-" and not config.allow_negative and a < b:
                    continue
                values.add(OPERATORS[op](a, b))
    return tuple(str(v) for v in sorted(values))


def answer_space(difficulty: int) -> list[str]:
    """Every result the questions of ``difficulty`` can have."""
    if difficulty not in CONFIGS:
        raise DataError(f"task {NAME!r}: difficulty must be one of {tuple(CONFIGS)}, not {difficulty!r}")
    return list(_answers(CONFIGS[difficulty]))


TASK = TaskSpec(
    name=NAME,
    modality="text",
    description="Integer arithmetic: 'What is 3 + 4?'. Answer: the integer result. Reward: numeric match.",
    generate=generate,
    reward=numeric_match_reward,
    answer_space=answer_space,
    difficulties=tuple(CONFIGS),
)
