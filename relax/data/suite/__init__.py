"""The built-in synthetic task suite and its registry.

Every task is verifiable and generated from a seed, so a run needs no downloads and its
data is reproducible byte for byte. See ``docs/tasks.md`` for the tasks, their knobs and
random-policy baselines.
"""

from __future__ import annotations

import difflib

from relax.data.errors import DataError
from relax.data.samples import Sample
from relax.data.suite import arithmetic, flash_beep, largest, shapes, tones, tool_lookup
from relax.data.suite.base import Env, RewardFn, TaskSpec, load_env_fn, load_reward_fn, random_policy_score

TASKS: dict[str, TaskSpec] = {
    task.name: task for task in (arithmetic.TASK, largest.TASK, shapes.TASK, tones.TASK, tool_lookup.TASK,
                                  flash_beep.TASK)
}

__all__ = [
    "TASKS",
    "Env",
    "RewardFn",
    "TaskSpec",
    "generate_suite",
    "get_task",
    "kind_of",
    "load_env_fn",
    "load_reward_fn",
    "random_policy_score",
]


def get_task(name: str) -> TaskSpec:
    """The registered task called ``name``; a typo gets the closest valid name suggested."""
    if name in TASKS:
        return TASKS[name]
    close = difflib.get_close_matches(str(name), TASKS, n=1, cutoff=0.0)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise DataError(f"unknown task {name!r}; {hint}valid tasks are {sorted(TASKS)}")


def kind_of(sample: Sample) -> str:
    """The kind of question ``sample`` asks ("count", "colour"), "" for a task without kinds."""
    spec = TASKS.get(sample.task)
    return spec.kind(sample) if spec is not None and spec.kind is not None else ""


def generate_suite(
    names: list[str], seed: int, train_per_task: int, eval_per_task: int, difficulty: int = 1
) -> dict[str, list[Sample]]:
    """``{"train": [...], "eval": [...]}`` with ``*_per_task`` samples of each task, in ``names`` order.

    Deterministic for the same arguments (media bytes included). Ids are unique across the
    suite (``"<task>-<split>-<index>"``) and a task's samples do not depend on which other
    tasks are in ``names``.
    """
    if not names:
        raise DataError(f"generate_suite needs at least one task name; valid tasks are {sorted(TASKS)}")
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise DataError(f"generate_suite: task(s) {duplicates} listed more than once; list each task once")
    tasks = [get_task(name) for name in names]
    suite: dict[str, list[Sample]] = {"train": [], "eval": []}
    for task in tasks:
        suite["train"].extend(task.generate(seed, "train", train_per_task, difficulty))
        suite["eval"].extend(task.generate(seed, "eval", eval_per_task, difficulty))
    return suite
