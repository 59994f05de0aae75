"""Format warm-start: supervised steps that teach the answer *format*, never the answers.

Each demonstration is a training prompt followed by the task's oracle response written for
a *random* answer drawn from the task's answer space (``TaskSpec.answer_space``), e.g.
``<answer>13</answer>`` for "What is 3 + 4?". The targets are independent of the correct
answer, so the warm-started policy emits well-formed answers at chance accuracy, and any
accuracy above chance after RL was learned by RL.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence
from typing import Any

import torch

from relax.data.schema import Sample
from relax.data.tasks import TASKS
from relax.data.tasks.base import derive_seed
from relax.models.processors import prepare_inputs
from relax.trainers.torch.batch import RolloutBatch
from relax.trainers.torch.trainer import StepResult, TorchTrainer, sft_loss

IM_END = "<|im_end|>"


def format_demonstration(sample: Sample, rng: random.Random, difficulty: int) -> str:
    """The oracle response of ``sample`` with its answer replaced by a random one."""
    task = TASKS[sample.task]
    fake = dataclasses.replace(sample, answer=rng.choice(task.answer_space(difficulty)))
    return task.oracle_response(fake)


def demonstration_tokens(sample: Sample, response: str, tokenizer: Any, processor: Any = None,
                         load: Callable[[Any], bytes] | None = None,
                         ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor] | None]:
    """(input_ids (L,), loss_mask (L,), media inputs or None): the chat prompt with its media
    placeholders expanded, then ``response`` + end-of-turn, trained."""
    load = load or (lambda ref: ref.data)
    inputs = prepare_inputs(sample, [load(r) for r in sample.images], [load(r) for r in sample.audios],
                            tokenizer, processor)
    prompt = inputs.pop("input_ids")[0]
    inputs.pop("attention_mask", None)
    reply = torch.tensor(tokenizer(response + IM_END, add_special_tokens=False)["input_ids"], dtype=torch.long)
    ids = torch.cat([prompt, reply])
    mask = torch.cat([torch.zeros(len(prompt)), torch.ones(len(reply))])
    return ids, mask, inputs or None


def format_warmup(model: torch.nn.Module, tokenizer: Any, samples: Sequence[Sample], steps: int, *, lr: float,
                  batch_size: int = 64, seed: int = 0, difficulty: int = 1, micro_batch_tokens: int = 4096,
                  processor: Any = None, media_loader: Callable[[Any], bytes] | None = None) -> list[StepResult]:
    """``steps`` SFT steps on format-only demonstrations of ``samples`` (built-in tasks; image and
    audio prompts too when the model's ``processor`` and a ``media_loader`` are given)."""
    usable = [s for s in samples if s.task in TASKS and (processor is not None or not (s.images or s.audios))]
    if not usable:
        raise ValueError("format warm-start needs samples of built-in tasks (text ones, or media ones with a "
                         "multimodal model); set trainer.sft_steps=0 for custom data")
    trainer = TorchTrainer(model, lr=lr, warmup_steps=0, total_steps=max(steps, 1),
                           micro_batch_tokens=micro_batch_tokens, layout="pack",
                           pad_id=tokenizer.pad_token_id or 0)
    rng = random.Random(derive_seed(seed, "format-warmup"))
    results = []
    for step in range(steps):
        picked = [usable[rng.randrange(len(usable))] for _ in range(batch_size)]
        demos = [demonstration_tokens(s, format_demonstration(s, rng, difficulty), tokenizer, processor, media_loader)
                 for s in picked]
        media = [d[2] for d in demos]
        batch = RolloutBatch(ids=[f"sft-{step}-{i}" for i in range(len(demos))], input_ids=[d[0] for d in demos],
                             loss_mask=[d[1] for d in demos], media=media if any(media) else None)
        results.append(trainer.step(batch, sft_loss))
    model.eval()
    return results
