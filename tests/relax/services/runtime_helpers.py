"""Small configs for runtime tests: tiny model, arithmetic, a handful of steps."""

from __future__ import annotations

from relax.config import load_config

# a reward function for the "raising reward" contract test (dotted path below)
FAULTY_PATH = "tests.relax.services.runtime_helpers:faulty_reward"


def faulty_reward(response: str, sample) -> float:
    """Raises on every third sample (by id), scores 1.0 otherwise."""
    if sum(map(ord, sample.id)) % 3 == 0:
        raise RuntimeError("judge unavailable")
    return 1.0


def tiny_config(root: str, run_id: str = "t", *overrides: str):
    return load_config("tiny-cpu", [f"root={root}", f"run_id={run_id}", "data.tasks=[arithmetic]",
                                    "data.train_per_task=64", "data.eval_per_task=8", "rollout.prompts_per_step=4",
                                    "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=8",
                                    "trainer.total_steps=4", "trainer.checkpoint_every=2", *overrides])


def task_reward(response: str, sample) -> float:
    """The task's own verifier, as a custom reward (its slow twin below scores the same)."""
    from relax.data.suite import TASKS

    return TASKS[sample.task].reward(response, sample)


def slow_task_reward(response: str, sample) -> float:
    """``task_reward`` 20 ms later: a rollout that falls behind the actor."""
    import time

    time.sleep(0.02)
    return task_reward(response, sample)


def length_reward(response: str, sample) -> float:
    """A reward that varies within every prompt group: (len(response) mod 3) / 2, in {0, 0.5, 1}."""
    return (len(response) % 3) / 2


def refusing_env(sample):
    """An env factory (rollout.env_fn) that refuses every sample as a user's error would."""
    from relax.config import ConfigError

    raise ConfigError(f"this env cannot run task {sample.task!r}; set rollout.env_fn to one that can")
