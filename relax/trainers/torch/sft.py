"""Format warm-start: supervised steps that teach the answer *format*, never the answers.

Each demonstration is a training prompt followed by the task's oracle response written for
a *random* answer drawn from the task's answer space (``TaskSpec.answer_space``), e.g.
``<answer>13</answer>`` for "What is 3 + 4?". The targets are independent of the correct
answer, so the warm-started policy emits well-formed answers at chance accuracy, and any
accuracy above chance after RL was learned by RL.

Rows of your own data (a task that is not built in, e.g. ``custom`` or ``gsm8k``) are
demonstrated the same way: their answer space is the set of distinct answers of the task's
training rows (:func:`answer_spaces`), and the response is written in the format the prompt
asks for (:func:`stated_format`: ``<answer>``, ``\\boxed{}`` or ``####``; ``<answer>`` when it
names none, the default verifier's first choice). A row's own answer is never read: the plan
is the same whichever row holds which answer.

Random labels also teach the model to ignore its input, which RL must then undo. Two choices
keep that damage small (measured with linear probes on the shapes task, docs/history/learning-recipe.md):

* balanced answers: a prompt is demonstrated with several *distinct* answers in the same step
  (its whole answer space when that is small), so each prompt's target is close to the uniform
  distribution over answers and the step carries no per-prompt label noise to fit;
* frozen media encoders: random labels carry nothing about a picture or a sound, so the vision
  and audio towers are left as initialised (trained, they lost colour: a linear probe read it
  off the vision tower at 0.70 before the warm-start and 0.52 after).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from relax.data.errors import DataError
from relax.data.samples import Sample
from relax.data.suite import TASKS
from relax.data.suite.base import derive_seed
from relax.models.processors import prepare_inputs
from relax.trainers.torch.batch import RolloutBatch
from relax.trainers.torch.encoders import ENCODER_MODULES, encoder_parameters
from relax.trainers.torch.trainer import StepResult, TorchTrainer, sft_loss

IM_END = "<|im_end|>"
# Recipe version of the warm-start: cached warm-starts (relax.pipeline.warm_start_key) are keyed
# on it. 2: balanced answers per prompt and frozen media encoders.
FORMAT_RECIPE = 2


# The answer formats a prompt can ask for, as (what the prompt says, the response for answer X).
# The order is the verifier's (relax.data.verifiers.extract_final_answer): <answer> first.
STATED_FORMATS: tuple[tuple[str, str], ...] = (
    ("<answer>", "<answer>{}</answer>"),
    ("\\boxed", "\\boxed{{{}}}"),
    ("####", "#### {}"),
)


def answer_spaces(samples: Sequence[Sample], difficulty: int) -> dict[str, list[str]]:
    """Every answer each task of ``samples`` can have: a built-in task's ``answer_space``, and for a
    task of your own the sorted distinct answers of its rows. A set of answers, cut from the rows
    it came from, so a demonstration drawn from it says nothing about which prompt has which answer."""
    spaces: dict[str, set[str]] = {}
    for s in samples:
        if s.task not in TASKS:
            spaces.setdefault(s.task, set()).add(s.answer.strip())
    out = {task: sorted(answers) for task, answers in spaces.items()}
    out.update({s.task: TASKS[s.task].answer_space(difficulty) for s in samples if s.task in TASKS})
    return out


def stated_format(sample: Sample) -> str:
    """The response template (``"<answer>{}</answer>"``) of the first answer format the prompt's
    text names; ``<answer>`` when it names none."""
    text = "\n".join(m.content for m in sample.messages if m.role in ("system", "user"))
    return next((template for marker, template in STATED_FORMATS if marker in text), STATED_FORMATS[0][1])


def demonstration_answers(sample: Sample, rng: random.Random, difficulty: int, per_prompt: int,
                          spaces: Mapping[str, list[str]] | None = None) -> list[str]:
    """``min(per_prompt, |space|)`` distinct answers drawn at random from the task's answer space
    (``spaces[sample.task]`` for a task of your own, see :func:`answer_spaces`)."""
    if sample.task in TASKS:
        space = TASKS[sample.task].answer_space(difficulty)
    elif spaces is not None and spaces.get(sample.task):
        space = list(spaces[sample.task])
    else:
        raise ValueError(f"format warm-start: task {sample.task!r} is not built in and no answer space was given "
                         f"for it (relax.trainers.torch.sft.answer_spaces of the training rows)")
    return rng.sample(space, min(per_prompt, len(space)))


def demonstration_plan(samples: Sequence[Sample], rng: random.Random, difficulty: int, batch_size: int,
                       answers_per_prompt: int, spaces: Mapping[str, list[str]] | None = None,
                       ) -> list[tuple[Sample, str]]:
    """One step's (prompt, answer) pairs: random prompts, each with its distinct random answers
    (:func:`demonstration_answers`), until there are at least ``batch_size``."""
    plan: list[tuple[Sample, str]] = []
    while len(plan) < batch_size:
        s = samples[rng.randrange(len(samples))]
        plan += [(s, a) for a in demonstration_answers(s, rng, difficulty, answers_per_prompt, spaces)]
    return plan


def format_demonstration(sample: Sample, answer: str) -> str:
    """The oracle response of ``sample`` with its answer replaced by ``answer``: the task's own for a
    built-in task, else ``answer`` in the format the prompt states (:func:`stated_format`)."""
    if sample.task in TASKS:
        return TASKS[sample.task].response_with(sample, answer)
    return stated_format(sample).format(answer)


def prompt_inputs(sample: Sample, tokenizer: Any, processor: Any = None, load: Callable[[Any], bytes] | None = None,
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None]:
    """(prompt ids (P,), media inputs or None): the chat prompt with its media placeholders expanded."""
    load = load or (lambda ref: ref.data)
    inputs = prepare_inputs(sample, [load(r) for r in sample.images], [load(r) for r in sample.audios],
                            tokenizer, processor)
    prompt = inputs.pop("input_ids")[0]
    inputs.pop("attention_mask", None)
    return prompt, inputs or None


def demonstration_tokens(sample: Sample, response: str, tokenizer: Any, processor: Any = None,
                         load: Callable[[Any], bytes] | None = None,
                         encoded: tuple[torch.Tensor, dict[str, torch.Tensor] | None] | None = None,
                         ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor] | None]:
    """(input_ids (L,), loss_mask (L,), media inputs or None): the chat prompt with its media
    placeholders expanded, then ``response`` + end-of-turn, trained. ``encoded`` is the
    prompt's :func:`prompt_inputs` when the caller already has them."""
    prompt, media = encoded or prompt_inputs(sample, tokenizer, processor, load)
    reply = torch.tensor(tokenizer(response + IM_END, add_special_tokens=False)["input_ids"], dtype=torch.long)
    ids = torch.cat([prompt, reply])
    mask = torch.cat([torch.zeros(len(prompt)), torch.ones(len(reply))])
    return ids, mask, media


@contextmanager
def frozen_media_encoders(model: torch.nn.Module) -> Iterator[int]:
    """Stop gradients into the model's vision and audio encoders for the block; yields how many
    parameters were frozen (0 for a text model) and restores ``requires_grad`` afterwards."""
    params = [p for kind in ENCODER_MODULES for p in encoder_parameters(model, kind) if p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    try:
        yield sum(p.numel() for p in params)
    finally:
        for p in params:
            p.requires_grad_(True)


def format_warmup(model: torch.nn.Module, tokenizer: Any, samples: Sequence[Sample], steps: int, *, lr: float,
                  batch_size: int = 64, answers_per_prompt: int = 16, seed: int = 0, difficulty: int = 1,
                  micro_batch_tokens: int = 4096, processor: Any = None,
                  media_loader: Callable[[Any], bytes] | None = None) -> list[StepResult]:
    """``steps`` SFT steps on format-only demonstrations of ``samples`` (built-in tasks and your own;
    image and audio prompts too when the model's ``processor`` and a ``media_loader`` are given).

    A step holds at least ``batch_size`` demonstrations: random prompts, each with
    ``answers_per_prompt`` distinct random answers (all of a smaller answer space)."""
    usable = [s for s in samples if processor is not None or not (s.images or s.audios or s.videos)]
    if not usable:
        # the data and the model disagree, a user's mistake: a DataError, which the CLI prints as one line
        raise DataError(f"format warm-start: all {len(samples)} training rows hold images, audio or video and the "
                         f"model takes text only; use a multimodal model (the omni-cpu preset) or skip the warm "
                         f"start with trainer.sft_steps=0 and start from model.init_checkpoint")
    spaces = answer_spaces(usable, difficulty)
    rng = random.Random(derive_seed(seed, "format-warmup"))
    results = []
    with frozen_media_encoders(model):
        trainer = TorchTrainer(model, lr=lr, warmup_steps=0, total_steps=max(steps, 1),
                               micro_batch_tokens=micro_batch_tokens, layout="pack",
                               pad_id=tokenizer.pad_token_id or 0)
        for step in range(steps):
            plan = demonstration_plan(usable, rng, difficulty, batch_size, answers_per_prompt, spaces)
            # a prompt comes with several answers: decode and process its media once
            prompts = {s.id: s for s, _ in plan}
            encoded = {sid: prompt_inputs(s, tokenizer, processor, media_loader) for sid, s in prompts.items()}
            demos = [demonstration_tokens(s, format_demonstration(s, a), tokenizer, encoded=encoded[s.id])
                     for s, a in plan]
            media = [d[2] for d in demos]
            batch = RolloutBatch(ids=[f"sft-{step}-{i}" for i in range(len(demos))], input_ids=[d[0] for d in demos],
                                 loss_mask=[d[1] for d in demos], media=media if any(media) else None)
            results.append(trainer.step(batch, sft_loss))
    model.eval()
    return results
