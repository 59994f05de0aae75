"""The format warm-start: answers independent of the truth, balanced per prompt, media encoders untouched."""

import random
from collections import Counter

import pytest
import torch

from relax.config import ModelConfig
from relax.data.suite import TASKS, generate_suite
from relax.models import build_policy, build_tokenizer
from relax.trainers.torch.sft import (
    demonstration_answers,
    demonstration_plan,
    format_demonstration,
    format_warmup,
    frozen_media_encoders,
)


@pytest.fixture(scope="module")
def suite():
    return generate_suite(["largest", "shapes", "tones"], seed=0, train_per_task=6, eval_per_task=1)["train"]


@pytest.fixture(scope="module")
def omni():
    tokenizer = build_tokenizer("bpe-tiny")
    model, processor = build_policy(ModelConfig(name_or_path="tiny-omni", family="qwen2_5_omni"), tokenizer, seed=0)
    return model, processor, tokenizer


def test_demonstration_answers_are_distinct_draws_from_the_answer_space(suite):
    shapes = next(s for s in suite if s.task == "shapes")
    rng = random.Random(0)
    # shapes' space at difficulty 1 is the counts 1..4 and six colours: 10 answers, so a cap of
    # 16 takes all of them (in random order), and a cap of 3 takes 3 different ones
    everything = demonstration_answers(shapes, rng, 1, 16)
    assert sorted(everything) == sorted(["1", "2", "3", "4", "red", "green", "blue", "yellow", "purple", "orange"])
    three = demonstration_answers(shapes, rng, 1, 3)
    assert len(set(three)) == 3 and set(three) <= set(everything)


def test_a_plan_gives_every_prompt_its_whole_small_answer_space(suite):
    plan = demonstration_plan(suite, random.Random(1), 1, batch_size=20, answers_per_prompt=16)
    # largest and tones have 8 answers, shapes 10: three prompts reach 20 demonstrations (24-30)
    assert 20 <= len(plan) <= 30
    by_prompt: dict[str, list[str]] = {}
    for sample, answer in plan:
        by_prompt.setdefault(sample.id, []).append(answer)
    for sid, answers in by_prompt.items():
        task = next(s.task for s in suite if s.id == sid)
        # each answer once: the prompt's targets are uniform, whatever its true answer is
        assert Counter(answers) == Counter(TASKS[task].answer_space(1))


def test_a_demonstration_is_the_oracle_response_for_the_given_answer(suite):
    shapes = next(s for s in suite if s.task == "shapes")
    assert format_demonstration(shapes, "purple") == "<answer>purple</answer>"


def test_media_encoders_are_frozen_only_inside_the_block(omni):
    model, _, _ = omni
    encoder = [p for n, p in model.named_parameters() if {"visual", "audio_tower"} & set(n.split("."))]
    with frozen_media_encoders(model) as frozen:
        assert frozen == sum(p.numel() for p in encoder) > 0
        assert not any(p.requires_grad for p in encoder)
    assert all(p.requires_grad for p in model.parameters())


def test_format_warmup_trains_the_decoder_and_leaves_the_encoders(omni, suite):
    model, processor, tokenizer = omni
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    results = format_warmup(model, tokenizer, suite, 2, lr=1e-2, batch_size=8, processor=processor,
                            media_loader=lambda ref: ref.data)
    assert len(results) == 2 and all(not r.skipped for r in results)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    encoder = {n for n in before if {"visual", "audio_tower"} & set(n.split("."))}
    assert encoder and not changed & encoder  # random answers say nothing about pictures or sounds
    assert any(n.endswith("embed_tokens.weight") for n in changed)  # the decoder learned
    assert all(p.requires_grad for p in model.parameters())


def _custom(sid: str, answer: str, prompt: str = "Which digit? Put your final answer inside <answer></answer>.",
            task: str = "custom"):
    from relax.data.samples import Message, Sample

    return Sample(id=sid, messages=(Message("user", prompt),), answer=answer, task=task)


def test_a_custom_task_is_demonstrated_from_its_rows_answer_set():
    from relax.trainers.torch.sft import answer_spaces

    rows = [_custom(f"r{i}", str(i % 4)) for i in range(12)]
    assert answer_spaces(rows, 1) == {"custom": ["0", "1", "2", "3"]}
    plan = demonstration_plan(rows, random.Random(0), 1, batch_size=8, answers_per_prompt=16,
                              spaces=answer_spaces(rows, 1))
    for sample in {s.id: s for s, _ in plan}.values():
        # every answer of the space as often per prompt: uniform targets, whatever the row's answer
        counts = Counter(a for s, a in plan if s.id == sample.id)
        assert set(counts) == {"0", "1", "2", "3"} and len(set(counts.values())) == 1


def test_the_plan_does_not_depend_on_which_row_holds_which_answer():
    from relax.trainers.torch.sft import answer_spaces

    rows = [_custom(f"r{i}", str(i % 10)) for i in range(20)]
    shuffled = [_custom(r.id, str((i * 7 + 3) % 10)) for i, r in enumerate(rows)]  # same answer set, moved around

    def plan(samples):
        spaces = answer_spaces(samples, 1)
        return [(s.id, a) for s, a in demonstration_plan(samples, random.Random(5), 1, 40, 4, spaces)]

    assert plan(rows) == plan(shuffled)


@pytest.mark.parametrize(("prompt", "response"), [
    ("Which digit? Put your final answer inside <answer></answer>.", "<answer>7</answer>"),
    ("Solve it and write the result as \\boxed{}.", "\\boxed{7}"),
    ("End with '#### N'.", "#### 7"),
    ("Which digit?", "<answer>7</answer>"),  # no format stated: the default verifier's first choice
])
def test_a_custom_demonstration_uses_the_format_the_prompt_states(prompt, response):
    from relax.data.verifiers import numeric_match_reward

    sample = _custom("r", "3", prompt)
    assert format_demonstration(sample, "7") == response
    assert numeric_match_reward(response, _custom("r", "7", prompt)) == 1.0  # and the verifier reads it


def test_format_warmup_runs_on_rows_of_your_own(omni):
    """omni-cpu on custom rows crashed here; now the rows' own prompts are demonstrated."""
    model, processor, tokenizer = omni
    rows = [_custom(f"r{i}", str(i % 5)) for i in range(10)] + [_custom("g", "12", "Add. ####", task="gsm8k")]
    results = format_warmup(model, tokenizer, rows, 2, lr=1e-2, batch_size=8, processor=processor)
    assert len(results) == 2 and all(not r.skipped for r in results)


def test_picture_rows_for_a_text_only_model_are_a_data_error_naming_the_ways_out(omni):
    """A user's mistake, so a DataError (the CLI prints it as one line), not a raw ValueError."""
    from dataclasses import replace

    from relax.data.errors import DataError

    model, _, tokenizer = omni
    rows = [replace(_custom(f"r{i}", str(i)), images=(f"img/{i}.png",)) for i in range(3)]
    with pytest.raises(DataError, match=r"all 3 training rows hold images.*trainer\.sft_steps=0"):
        format_warmup(model, tokenizer, rows, 1, lr=1e-2, processor=None)
