"""The tiny judge's demonstrations: balanced, graded as the verifier grades them, encoded as the judge reads."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from relax.data.suite import TASKS
from relax.models import build_tokenizer
from relax.rollout.genrm import GenRMJudge, JudgeSpec, judge_prompt
from relax.rollout.verdicts import TEMPLATES
from relax.trainers.torch.judge_sft import demo_tokens, judge_demos, judge_reply, text_task


@pytest.mark.parametrize("task", ["largest", "arithmetic"])
def test_demos_are_balanced_and_their_verdicts_are_the_verifiers(task):
    samples = TASKS[task].generate(0, "train", 40, 1)
    demos = judge_demos(samples, random.Random(0))
    assert [d.target for d in demos].count("yes") == [d.target for d in demos].count("no") == len(samples)
    for d in demos:
        verified = TASKS[task].reward(d.response, d.sample)
        assert verified == (1.0 if d.target == "yes" else 0.0), (d.response, d.sample.answer, d.target)
        assert d.answer in d.response
    wrong = {d.answer for d in demos if d.target == "no"}
    assert len(wrong) > 3  # wrong answers drawn across the answer space, not one fixed decoy


@pytest.mark.parametrize("verdict", ["yes_no", "boxed", "score"])
def test_demo_prompt_is_what_the_judge_engine_is_sent_and_only_the_reply_is_trained(verdict):
    tok = build_tokenizer("bpe-tiny")
    sample = TASKS["largest"].generate(0, "train", 1, 1)[0]
    right, wrong = judge_demos([sample], random.Random(1))
    ids, mask = demo_tokens(wrong, tok, verdict)
    judge = GenRMJudge(None, tok, JudgeSpec(TEMPLATES[verdict], verdict), {})
    sent = judge.prompt(wrong.response, sample).input_ids
    assert ids[: len(sent)].tolist() == sent == judge_prompt(TEMPLATES[verdict], wrong.response, sample, tok).input_ids
    assert mask[: len(sent)].sum() == 0 and bool(mask[len(sent):].all())
    reply = tok.decode(ids[len(sent):].tolist())
    assert reply == judge_reply(wrong, verdict) + "<|im_end|>"
    # the reply, read back by the run's verdict parser, is the verifier's grade
    for demo, grade in ((wrong, 0.0), (right, 1.0)):
        reply_ids = tok(judge_reply(demo, verdict), add_special_tokens=False)["input_ids"]
        completion = SimpleNamespace(output_ids=reply_ids, top_logprobs=[[(0.0, reply_ids[0])]])
        assert judge.verdict(completion).score == grade


def test_a_task_without_a_text_verifier_is_refused_by_name():
    with pytest.raises(ValueError, match="shapes.*largest"):
        text_task("shapes")
