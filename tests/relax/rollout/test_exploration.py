"""Forced answers (rollout.explore_answers): which samples force, what they force, and that the
rollout ships them with the policy's own logprobs and the verifier's reward."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from relax.config_loader import ConfigError
from relax.data.tasks import TASKS
from relax.models.tokenizers import build_tokenizer
from relax.rollout.exploration import AnswerExplorer
from relax.services.context import RunContext
from relax.services.controller import train
from tests.relax.services.runtime_helpers import tiny_config


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer("bpe-tiny")


def test_the_last_samples_of_a_group_force_an_answer_of_the_task_in_its_format(tok):
    sample = TASKS["shapes"].generate(0, "train", 1, 1)[0]
    space = TASKS["shapes"].answer_space(1)
    ex = AnswerExplorer(2, tok, seed=3)
    # group of 8: indices 0-5 draw, 6 and 7 force "<answer>X</answer>" with X from the answer space
    assert [bool(ex.forced_ids(sample, 5, i, 8)) for i in range(8)] == [False] * 6 + [True] * 2
    for i in (6, 7):
        text = tok.decode(ex.forced_ids(sample, 5, i, 8))
        assert text == f"<answer>{ex.answer(sample, 5, i)}</answer>" and ex.answer(sample, 5, i) in space
    # a group of 2 keeps one drawn sample; a group of 1 forces nothing
    assert [bool(ex.forced_ids(sample, 5, i, 2)) for i in range(2)] == [False, True]
    assert ex.forced_ids(sample, 5, 0, 1) == []


def test_forced_answers_are_seeded_and_uniform_over_the_space_whatever_the_truth(tok):
    samples = TASKS["shapes"].generate(0, "train", 40, 1)
    ex, again = AnswerExplorer(1, tok, seed=0), AnswerExplorer(1, tok, seed=0)
    drawn = [ex.answer(s, pos, 7) for pos in range(30) for s in samples]
    assert drawn == [again.answer(s, pos, 7) for pos in range(30) for s in samples]  # a restart forces the same
    assert drawn != [AnswerExplorer(1, tok, seed=1).answer(s, pos, 7) for pos in range(30) for s in samples]
    counts = Counter(drawn)
    space = TASKS["shapes"].answer_space(1)
    # 1200 draws over the 10 answers of difficulty 1 (counts 1-4, six colours): 120 each expected;
    # every answer within +-30% of that (a binomial's sd is 10.4)
    assert len(space) == 10 and set(counts) == set(space) and all(84 <= c <= 156 for c in counts.values()), counts
    # the draw does not see the truth: right answers are at chance (1/10, 120 of 1200), not above
    right = sum(a == s.answer for a, s in zip(drawn, [s for _ in range(30) for s in samples], strict=True))
    assert right < 160


@pytest.mark.parametrize(("override", "message"), [
    ("rollout.explore_answers=4", "leaves no drawn sample"),
    ("rollout.env_fn=tests.relax.rollout.picture_env:make_env", "multi-turn"),
    ("algorithm.advantage=gae model.value_head=true", "group estimator"),
])
def test_a_config_that_cannot_explore_fails_naming_why(tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(f"file://{tmp_path}", "bad", "rollout.explore_answers=1", *override.split())
    with pytest.raises(ConfigError, match="SGLang"):
        tiny_config(f"file://{tmp_path}", "bad", "rollout.explore_answers=1", "rollout.engine=sglang",
                    "resources.num_gpus=1", "resources.rollout_gpus=1")


@pytest.mark.slow
def test_the_rollout_ships_forced_answers_with_logprobs_and_rewards(tmp_path):
    cfg = tiny_config(f"file://{tmp_path}", "explore", "rollout.explore_answers=2", "trainer.total_steps=2")
    result = train(cfg, progress=False)
    assert result.steps == 2
    assert [m["explored"] for m in result.rollout] == [2 * cfg.rollout.prompts_per_step] * len(result.rollout)
    ctx = RunContext(cfg)
    queue = ctx.queue()
    queue.refresh()
    ids = sorted(queue.state.samples)
    rows = queue.read(ids, ["tokens", "loss_mask", "logprobs", "prompt_len", "response", "reward", "explored",
                            "advantages"])
    by_id = {s.id: s for s in ctx.split("train")}
    ex = AnswerExplorer(2, ctx.tokenizer, seed=cfg.seed, difficulty=cfg.data.difficulty)
    task = TASKS["arithmetic"]
    forced = 0
    for i, rid in enumerate(ids):
        sample_id, where = rid.rsplit("@", 1)
        pos, index = (int(x) for x in where.split("."))
        mask, lps = rows["loss_mask"][i], rows["logprobs"][i]
        assert np.all(lps[mask == 1] < 0)  # every trained token, forced or drawn, has a behaviour logprob
        assert rows["explored"][i] == (index >= cfg.rollout.n_samples_per_prompt - 2)
        if index < cfg.rollout.n_samples_per_prompt - 2:
            continue
        forced += 1
        sample = by_id[sample_id]
        answer = ex.answer(sample, pos, index)
        assert rows["response"][i] == task.response_with(sample, answer)
        assert rows["reward"][i] == task.reward(rows["response"][i], sample)  # the verifier scored it
        p = int(rows["prompt_len"][i])
        assert rows["tokens"][i][p:p + len(ex.forced_ids(sample, pos, index, 4))].tolist() == \
            ex.forced_ids(sample, pos, index, 4)
    assert forced == 2 * cfg.rollout.prompts_per_step * len(result.rollout)
    # the advantage role kept them out of the baseline: a forced row's advantage is its margin over
    # its group's drawn mean, or 0 (relax.algorithms.explored_advantages)
    groups: dict[str, list[int]] = {}
    for i, rid in enumerate(ids):
        groups.setdefault(rid.rsplit(".", 1)[0], []).append(i)
    for members in groups.values():
        drawn = np.mean([rows["reward"][i] for i in members if not rows["explored"][i]])
        for i in members:
            if rows["explored"][i]:
                trained = rows["loss_mask"][i] == 1
                np.testing.assert_allclose(rows["advantages"][i][trained], max(0.0, rows["reward"][i] - drawn),
                                           rtol=1e-5)
