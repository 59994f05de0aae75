"""A tiny generative judge trained here: supervised verdicts on the answers of a built-in text task.

The reward role's generative judge (``genrm``, docs/genrm.md) needs a model that grades answers;
this module makes one on a CPU in minutes, so the whole GenRM loop runs without a download.

A *demonstration* is one training question of the task, a response in the task's own answer
format (``TaskSpec.response_with``: the oracle response written for some answer) and the
verdict: correct when that answer is the right one, wrong when it is another answer of the
task's answer space. Every question is shown once of each kind, so the labels are exactly
balanced and a judge that ignores the response is right half the time. The prompt is the one a
run's judge sees, the verdict's built-in template (relax.rollout.verdicts) with the reference
shown, chat-formatted as :class:`~relax.rollout.genrm.GenRMJudge` encodes it; only the reply is
trained (:func:`judge_reply`).

Why the judge writes ``7 vs 9 \\boxed{0}`` (``genrm.verdict=boxed``) rather than a bare ``no``
(``yes_no``): whether two answers are equal is not a sum of what each says alone, so a first
token that must compare the response's answer with the reference ~40 tokens back gets no
gradient until attention already finds both; a tiny judge stayed at chance (training loss at
ln 2 on the verdict token, 400 steps of 32 and 90 of 64, measured). Copying each answer has a
gradient from the first step, and once both are written the verdict compares two nearby tokens.

:func:`train_judge` trains a built-in tiny Qwen2 (:data:`JUDGE_SIZE`) on the policy's tokenizer
and saves a Hugging Face folder that ``genrm.name_or_path=<folder>`` loads (with
:func:`judge_overrides`); :func:`judge_accuracy` measures it the way a run sees it, through
:class:`GenRMJudge` over a :class:`LocalEngines`, against the task's verifier on held-out questions.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from relax.config import ModelConfig
from relax.config.preflight import JUDGE_RECORD
from relax.data.samples import Sample
from relax.data.suite import TASKS
from relax.data.suite.base import derive_seed
from relax.rollout.engine_pool import LocalEngines
from relax.rollout.genrm import GenRMJudge, JudgeSpec, judge_prompt
from relax.rollout.verdicts import TEMPLATES
from relax.trainers.torch.batch import RolloutBatch
from relax.trainers.torch.sft import IM_END
from relax.trainers.torch.trainer import TorchTrainer, sft_loss

# The verdict the judge is trained to write (genrm.verdict; the module docstring says why not yes_no) and the
# longest answer it writes (genrm.max_new_tokens): "7 vs 9 \\boxed{0}" is 16 bpe-tiny tokens.
VERDICT = "boxed"
MAX_NEW_TOKENS = 20
# Width, depth and steps of the trained judge: 500 steps take ~12 min on 2 shared cores and agree with the
# verifier on 0.68 of held-out pairs (docs/benchmarks.md); larger or longer was not tried for lack of CPU.
JUDGE_SIZE = {"hidden_size": 64, "num_layers": 2, "num_heads": 4}
TRAIN_STEPS = 500
# Bump when the demonstrations or the training recipe change: cached judges (benchmarks/genrm.py) are keyed on it.
JUDGE_RECIPE = 1
RECORD = JUDGE_RECORD  # beside the weights: the task and how the judge answers (checked by preflight)


@dataclasses.dataclass(frozen=True)
class Demo:
    """One judge demonstration: ``response`` to ``sample`` and the verdict ``target`` (yes / no)."""

    sample: Sample
    response: str
    answer: str  # the answer written in ``response``
    target: str  # "yes" (answer correct) or "no"


def text_task(task: str) -> Any:
    if task not in TASKS or TASKS[task].modality != "text" or TASKS[task].make_env is not None:
        text = sorted(n for n, t in TASKS.items() if t.modality == "text" and t.make_env is None)
        raise ValueError(f"judge SFT: task {task!r} is not a built-in single-turn text task; use one of {text}")
    return TASKS[task]


def judge_demos(samples: Sequence[Sample], rng: random.Random, difficulty: int = 1) -> list[Demo]:
    """Two demonstrations per sample, in order: its correct answer (``yes``) and a wrong answer of the task's
    answer space drawn by ``rng`` (``no``), each written in the task's response format."""
    demos = []
    for s in samples:
        spec = text_task(s.task)
        wrong = [a for a in spec.answer_space(difficulty) if a != s.answer]
        bad = rng.choice(wrong)
        demos += [Demo(s, spec.response_with(s, s.answer), s.answer, "yes"),
                  Demo(s, spec.response_with(s, bad), bad, "no")]
    return demos


def judge_reply(demo: Demo, verdict: str = VERDICT) -> str:
    """What the judge is taught to answer: ``yes`` / ``no`` (yes_no), or the two answers it compares and then
    the verdict, ``7 vs 9 \\boxed{0}`` (boxed) or ``7 vs 9 <score>0</score>`` (score)."""
    if verdict == "yes_no":
        return demo.target
    score = 1 if demo.target == "yes" else 0
    tag = f"\\boxed{{{score}}}" if verdict == "boxed" else f"<score>{score}</score>"
    return f"{demo.answer} vs {demo.sample.answer} {tag}"


def demo_tokens(demo: Demo, tokenizer: Any, verdict: str = VERDICT) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids (L,), loss_mask (L,)): the judge prompt of ``verdict``'s built-in template, then
    :func:`judge_reply` + end-of-turn, trained."""
    prompt = judge_prompt(TEMPLATES[verdict], demo.response, demo.sample, tokenizer).input_ids
    reply = tokenizer(judge_reply(demo, verdict) + IM_END, add_special_tokens=False)["input_ids"]
    ids = torch.tensor(prompt + reply, dtype=torch.long)
    mask = torch.cat([torch.zeros(len(prompt)), torch.ones(len(reply))])
    return ids, mask


def judge_model_config(tokenizer: str = "bpe-tiny", **size: int) -> ModelConfig:
    """The built-in tiny Qwen2 the judge starts from (:data:`JUDGE_SIZE` unless ``size`` says otherwise)."""
    return ModelConfig(name_or_path="tiny-qwen2", family="qwen2", tokenizer=tokenizer, **{**JUDGE_SIZE, **size})


def train_judge(out: str, task: str = "largest", steps: int = TRAIN_STEPS, *, batch_size: int = 64,
                lr: float = 3e-3, seed: int = 0, difficulty: int = 1, train_questions: int = 512,
                tokenizer: str = "bpe-tiny", size: dict[str, int] | None = None, verdict: str = VERDICT,
                progress: Callable[[int, float], None] | None = None) -> dict[str, Any]:
    """Train a judge for ``task`` for ``steps`` SFT steps of ``batch_size`` demonstrations and save it to the
    local folder ``out`` (``model.save_pretrained`` + the tokenizer). Returns the loss curve and timings."""
    from relax.models import build_policy, build_tokenizer

    spec = text_task(task)
    tok = build_tokenizer(tokenizer)
    model, _ = build_policy(judge_model_config(tokenizer, **(size or {})), tok, seed=seed)
    samples = spec.generate(seed, "train", train_questions, difficulty)
    rng = random.Random(derive_seed(seed, f"judge-sft-{task}"))
    trainer = TorchTrainer(model, lr=lr, warmup_steps=min(10, steps // 10), total_steps=max(steps, 1),
                           micro_batch_tokens=16384, layout="pack", pad_id=tok.pad_token_id or 0)
    losses, t0 = [], time.perf_counter()
    for step in range(steps):
        demos = judge_demos(rng.sample(samples, min(batch_size // 2, len(samples))), rng, difficulty)
        tokens = [demo_tokens(d, tok, verdict) for d in demos]
        batch = RolloutBatch(ids=[f"judge-{step}-{i}" for i in range(len(demos))],
                             input_ids=[t[0] for t in tokens], loss_mask=[t[1] for t in tokens])
        losses.append(trainer.step(batch, sft_loss).loss)
        if progress is not None:
            progress(step, losses[-1])
    train_s = time.perf_counter() - t0
    model.eval()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    with open(f"{out}/{RECORD}", "w") as f:  # how to ask it: local_judge and `relax genrm train-judge` read it
        json.dump({"task": task, "verdict": verdict, "max_new_tokens": MAX_NEW_TOKENS}, f)
    return {"task": task, "steps": steps, "batch_size": batch_size, "lr": lr, "seed": seed, "verdict": verdict,
            "size": {**JUDGE_SIZE, **(size or {})}, "train_s": train_s, "loss_first": losses[0] if losses else None,
            "loss_last": losses[-1] if losses else None, "loss_curve": losses[:: max(1, steps // 20)]}


def read_record(folder: str) -> dict[str, Any]:
    """How the judge saved in ``folder`` answers (:data:`RECORD`: task, verdict, max_new_tokens)."""
    with open(f"{folder}/{RECORD}") as f:
        return json.load(f)


def judge_overrides(folder: str) -> list[str]:
    """The ``genrm.*`` overrides that grade a run with the judge saved in ``folder``."""
    record = read_record(folder)
    return [f"genrm.name_or_path={folder}", f"genrm.verdict={record['verdict']}",
            f"genrm.max_new_tokens={record['max_new_tokens']}"]


def local_spec(folder: str) -> JudgeSpec:
    """How the judge saved in ``folder`` is asked and read: its verdict's built-in template, greedy."""
    record = read_record(folder)
    return JudgeSpec(TEMPLATES[record["verdict"]], record["verdict"], max_new_tokens=record["max_new_tokens"])


def local_judge(folder: str, max_batch_size: int = 64, seed: int = 0) -> GenRMJudge:
    """The judge saved in ``folder`` as a run's reward role would use it with ``genrm.engines=0``."""
    from relax.models import build_policy, build_tokenizer

    tok = build_tokenizer(folder)
    model, _ = build_policy(ModelConfig(name_or_path=folder, family="qwen2", tokenizer=folder), tok, seed=seed)
    model.eval().requires_grad_(False)
    context = int(model.config.max_position_embeddings)  # a row that cannot fit is an invalid verdict, not a crash
    pool = LocalEngines(model, tok, max_batch_size=max_batch_size, max_seq_len=context, seed=seed)
    return GenRMJudge(pool, tok, local_spec(folder), {"name_or_path": folder}, context)


def judge_accuracy(judge: GenRMJudge, task: str = "largest", questions: int = 128, seed: int = 0,
                   difficulty: int = 1) -> dict[str, float]:
    """How often ``judge``'s verdict (score > 0.5) agrees with the task's verifier on held-out questions,
    each answered once correctly and once wrongly (:func:`judge_demos`), so chance is 0.5."""
    spec = text_task(task)
    samples = spec.generate(seed, "eval", questions, difficulty)
    demos = judge_demos(samples, random.Random(derive_seed(seed, f"judge-eval-{task}")), difficulty)
    scored = judge.score_many([(d.response, d.sample) for d in demos], [f"eval-{i}" for i in range(len(demos))])
    truth = [spec.reward(d.response, d.sample) for d in demos]
    agree = [(s.reward > 0.5) == (t > 0.5) for s, t in zip(scored, truth, strict=True)]
    return {"accuracy": sum(agree) / len(agree), "pairs": float(len(agree)),
            "mean_abs_error": math.fsum(abs(s.reward - t) for s, t in zip(scored, truth, strict=True)) / len(agree),
            "invalid": float(sum(bool(s.error) for s in scored))}
