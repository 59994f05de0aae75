"""Held-out evaluation: greedy answers to the eval split, accuracy per task, per kind of
question (for tasks that declare ``TaskSpec.kind``) and per modality.

The same engine, prompt encoding, agent loop and reward functions as training, with
temperature 0 and one response per prompt, so "accuracy" here is exactly the training
reward of the policy's most likely answer on prompts it never trained on (the snapshot's
eval split shares no question with the train split, docs/tasks.md).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from relax.data.samples import Sample
from relax.data.suite import kind_of
from relax.data.verifiers import given_answer, normalize_answer
from relax.engines.types import SamplingParams
from relax.rollout.engine_pool import LocalEngines
from relax.rollout.episodes import EpisodeRunner, default_env_factory, needs_env
from relax.rollout.rewards import RewardDispatcher

MODALITIES = ("text", "image", "audio", "video")


def modality_of(sample: Sample) -> str:
    """"video", "image" or "audio" for a prompt that carries one, else "text" (in that order of precedence)."""
    return "video" if sample.videos else "image" if sample.images else "audio" if sample.audios else "text"


@dataclass
class EvalExample:
    """One held-out prompt as the greedy policy answered it, and its reward (``relax eval --show``)."""

    id: str = ""
    task: str = ""
    prompt: str = ""
    answer: str = ""
    response: str = ""
    reward: float = 0.0
    error: str = ""  # what the reward function raised, if it did


@dataclass
class EvalReport:
    """Greedy held-out accuracy of one policy."""

    checkpoint: str = ""  # what was evaluated; "" = the initial (or warm-started) policy
    accuracy: dict[str, float] = field(default_factory=dict)  # task -> mean reward
    by_modality: dict[str, float] = field(default_factory=dict)  # text/image/audio -> mean over its tasks
    n: dict[str, int] = field(default_factory=dict)  # task -> eval prompts
    errors: int = 0  # responses whose reward function raised (scored 0)
    # "task:kind" -> mean reward, e.g. "shapes:colour"; only tasks that declare TaskSpec.kind
    by_kind: dict[str, float] = field(default_factory=dict)
    n_by_kind: dict[str, int] = field(default_factory=dict)  # "task:kind" -> eval prompts
    # "task:kind" -> correct answer -> the policy's answer -> prompts (answers normalised as the
    # verifiers compare them; "" = no answer found in the response)
    confusion: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)
    # every prompt with the policy's response, as evaluated: what a score of 0 looks like from inside
    examples: list[EvalExample] = field(default_factory=list)

    def sample_examples(self, n: int) -> list[EvalExample]:
        """``n`` examples taken in turn from each task (tasks sorted), each task's in the order evaluated."""
        by_task: dict[str, list[EvalExample]] = defaultdict(list)
        for e in self.examples:
            by_task[e.task].append(e)
        queues = [by_task[t] for t in sorted(by_task)]
        out: list[EvalExample] = []
        for i in range(max(map(len, queues), default=0)):
            out += [q[i] for q in queues if i < len(q)]
        return out[:n]

    def never_answered(self) -> dict[str, list[str]]:
        """Per "task:kind", the correct answers of its prompts that the policy gave to none of them.

        A class the greedy policy never names is the usual end of a GRPO collapse: once every
        sample of a group gives the same wrong answer, the group's advantages are all 0 and
        nothing pushes the missing answer back up (docs/tasks.md, "Reading the evaluation")."""
        out = {}
        for key, rows in sorted(self.confusion.items()):
            given = {answer for row in rows.values() for answer in row}
            missing = sorted(truth for truth in rows if truth not in given)
            if missing:
                out[key] = missing
        return out

    def table(self, other: EvalReport | None = None) -> str:
        """A printable table; with ``other`` (an earlier report) a before -> after table."""
        def row(label: str, n: str, after: float, before: float | None) -> tuple[str, ...]:
            nan = float("nan")
            return (label, n, f"{nan if before is None else before:.3f}", f"{after:.3f}") if other else \
                (label, n, f"{after:.3f}")

        rows = [("task", "n", "before", "after") if other else ("task", "n", "accuracy")]
        for task in sorted(self.accuracy):
            rows.append(row(task, str(self.n[task]), self.accuracy[task], other and other.accuracy.get(task)))
            for key in sorted(k for k in self.by_kind if k.split(":", 1)[0] == task):
                label = "  " + key.split(":", 1)[1]  # indented under its task
                rows.append(row(label, str(self.n_by_kind[key]), self.by_kind[key], other and other.by_kind.get(key)))
        for mod in sorted(self.by_modality):
            rows.append(row(f"[{mod}]", "", self.by_modality[mod], other and other.by_modality.get(mod)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
        lines += [f"never answered ({key}): {', '.join(missing)}" for key, missing in self.never_answered().items()]
        return "\n".join(lines)


def evaluate_policy(model: torch.nn.Module, tokenizer: Any, processor: Any, samples: Sequence[Sample], *,
                    media_loader: Any = None, reward_fn: str = "", max_new_tokens: int = 16, max_turns: int = 4,
                    stop: Sequence[str] = (),
                    max_seq_len: int = 256, batch_size: int = 64, seed: int = 0) -> EvalReport:
    """Answer every sample greedily with ``model``; scores with each task's verifier (or ``reward_fn``)."""
    pool = LocalEngines(model, tokenizer, max_batch_size=batch_size, max_seq_len=max_seq_len, seed=seed)
    rewards = RewardDispatcher(reward_fn)
    runner = EpisodeRunner(pool, tokenizer, processor, rewards,
                           SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop=list(stop)),
                           max_turns=max_turns, max_seq_len=max_seq_len, media=media_loader)
    make_env = default_env_factory(max_turns)
    scores: dict[str, list[float]] = defaultdict(list)
    kind_scores: dict[str, list[float]] = defaultdict(list)
    confusion: dict[str, dict[str, dict[str, int]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(int)))
    kinds: dict[str, str] = {}
    examples: list[EvalExample] = []
    errors = 0
    try:
        indexed = list(enumerate(samples))
        for start in range(0, len(indexed), batch_size):
            chunk = indexed[start:start + batch_size]
            single = [p for p in chunk if not needs_env(p[1])]
            multi = [p for p in chunk if needs_env(p[1])]
            trajs = runner.single_turn(single, 1) if single else []
            if multi:
                trajs += runner.agent(multi, 1, make_env)
            for t in trajs:
                scores[t.sample.task].append(t.reward)
                examples.append(EvalExample(t.sample.id, t.sample.task, t.sample.prompt_text, t.sample.answer,
                                            t.response, t.reward, t.error))
                kind = kind_of(t.sample)
                if kind:
                    kind_scores[f"{t.sample.task}:{kind}"].append(t.reward)
                    confusion[f"{t.sample.task}:{kind}"][normalize_answer(t.sample.answer)][
                        given_answer(t.response) or ""
                    ] += 1
                kinds[t.sample.task] = modality_of(t.sample)
                errors += bool(t.error)
    finally:
        pool.close()
    accuracy = {task: sum(v) / len(v) for task, v in scores.items()}
    by_modality = {}
    for mod in MODALITIES:
        tasks = [t for t in accuracy if kinds[t] == mod]
        if tasks:
            by_modality[mod] = sum(accuracy[t] for t in tasks) / len(tasks)
    return EvalReport("", accuracy, by_modality, {t: len(v) for t, v in scores.items()}, errors,
                      by_kind={k: sum(v) / len(v) for k, v in kind_scores.items()},
                      n_by_kind={k: len(v) for k, v in kind_scores.items()},
                      confusion={k: {truth: dict(row) for truth, row in rows.items()} for k, rows in confusion.items()},
                      examples=examples)


def per_task_limit(samples: Sequence[Sample], limit: int | None) -> list[Sample]:
    """The first ``limit`` samples of each task (all of them for None), in split order."""
    if limit is None:
        return list(samples)
    seen: dict[str, int] = defaultdict(int)
    out = []
    for s in samples:
        if seen[s.task] < limit:
            seen[s.task] += 1
            out.append(s)
    return out
