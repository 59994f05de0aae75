"""GenRMJudge over an in-process engine: batched verdicts, the invalid rule, and a judge beside the policy.

In the colocated topology the judge's engine shares the rollout's process (genrm.engines=0): the
policy's new weight versions must reach the policy's engine only, and judging must leave the
policy's engine as it was."""

from __future__ import annotations

import pytest
import torch

from relax.config import ModelConfig
from relax.data.suite import TASKS
from relax.models import build_policy, build_tokenizer
from relax.rollout.engine_pool import LocalEngines
from relax.rollout.genrm import GenRMJudge, JudgeSpec
from relax.rollout.verdicts import TEMPLATES
from relax.transfer.weights import WeightStore
from tests.relax.services.judges import yes_judge


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    return yes_judge(str(tmp_path_factory.mktemp("judge") / "yes"))


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer("bpe-tiny")


def _pairs(n: int = 6):
    samples = TASKS["arithmetic"].generate(1, "eval", n, 1)
    return [(f"<answer>{i}</answer>", s) for i, s in enumerate(samples)]


def _judge(name_or_path: str, tok, **spec) -> GenRMJudge:
    model, _ = build_policy(ModelConfig(name_or_path=name_or_path), tok, seed=0)
    pool = LocalEngines(model.eval(), tok, max_batch_size=8, max_seq_len=512, seed=0)
    return GenRMJudge(pool, tok, JudgeSpec(TEMPLATES[spec.pop("verdict", "yes_no")], **spec), {"model_id": "m"})


def test_a_yes_judge_scores_every_row_near_one_the_same_each_time(judge_dir, tok):
    judge = _judge(judge_dir, tok)
    pairs = _pairs()
    first = judge.score_many(pairs, [f"r{i}" for i in range(len(pairs))])
    assert [s.error for s in first] == [""] * len(pairs)
    assert min(s.reward for s in first) > 0.9  # p(yes) / (p(yes) + p(no)) of a judge trained to say yes
    again = judge.score_many(pairs, [f"r{i}" for i in range(len(pairs))])
    assert [s.reward for s in again] == [s.reward for s in first]
    assert judge.counts == {"judged": 2 * len(pairs), "unparsable": 0, "out_of_range": 0, "too_long": 0}
    assert judge.metrics()["genrm/engines"] == 1.0


@pytest.mark.parametrize(("invalid", "error"), [("skip", "genrm verdict invalid: unparsable"), ("zero", "")])
def test_unreadable_verdicts_follow_the_invalid_rule_and_are_counted(tok, invalid, error):
    # an untrained judge asked for <score>S</score> writes no tag
    judge = _judge("tiny-qwen2", tok, verdict="score", max_new_tokens=8, invalid=invalid)
    scored = judge.score_many(_pairs(3))
    assert [s.reward for s in scored] == [0.0] * 3
    assert all(s.error.startswith(error) for s in scored) and (error == "") == all(not s.error for s in scored)
    assert judge.counts["unparsable"] == 3 and judge.metrics()["genrm/invalid"] == 3.0


def test_a_judge_beside_the_policy_in_one_process_never_mixes_their_weights(judge_dir, tok, tmp_path):
    judge = _judge(judge_dir, tok)
    judge_state = {k: v.clone() for k, v in judge.pool.engine.model.state_dict().items()}
    policy_model, _ = build_policy(ModelConfig(), tok, seed=1)
    policy = LocalEngines(policy_model.eval(), tok, max_batch_size=8, max_seq_len=256, seed=0)
    before = judge.score_many(_pairs())
    # the trainer publishes a new policy version; the policy's engine loads it
    store = WeightStore(f"file://{tmp_path}/root", "run")
    new = {k: v + 0.01 for k, v in policy_model.state_dict().items()}
    store.publish(1, new)
    policy.load_weights(store, 1)
    for k, v in judge.pool.engine.model.state_dict().items():
        assert torch.equal(v, judge_state[k]), f"the judge's {k} changed when the policy loaded a version"
    policy_state = {k: v.clone() for k, v in policy.engine.model.state_dict().items()}
    assert torch.allclose(policy_state["model.embed_tokens.weight"], new["model.embed_tokens.weight"])
    after = judge.score_many(_pairs())
    assert [s.reward for s in after] == [s.reward for s in before]
    for k, v in policy.engine.model.state_dict().items():  # judging touched nothing of the policy's
        assert torch.equal(v, policy_state[k])


def test_a_row_too_long_for_the_judge_is_its_own_invalid_verdict(judge_dir, tok):
    judge = _judge(judge_dir, tok)
    judge.context = 512
    pairs = _pairs(3)
    pairs[1] = ("<answer>1</answer>" + " and so on" * 200, pairs[1][1])  # ~600 tokens: over 512
    scored = judge.score_many(pairs)
    assert scored[1].reward == 0.0 and "too long" in scored[1].error and "genrm.template" in scored[1].error
    assert scored[0].reward > 0.9 and scored[2].reward > 0.9 and not scored[0].error
    assert judge.counts["too_long"] == 1
