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


def test_the_last_samples_of_a_group_force_an_answer_of_the_question_in_its_format(tok):
    sample = TASKS["shapes"].generate(0, "train", 1, 1)[0]
    kind_space = TASKS["shapes"].kind_answer_space(1)[sample.metadata["question"]]
    ex = AnswerExplorer(2, tok, seed=3)
    # group of 8: indices 0-5 draw, 6 and 7 force "<answer>X</answer>" with X an answer of the question's kind
    assert [bool(ex.forced_ids(sample, 5, i, 8)) for i in range(8)] == [False] * 6 + [True] * 2
    for i in (6, 7):
        text = tok.decode(ex.forced_ids(sample, 5, i, 8))
        assert text == f"<answer>{ex.answer(sample, 5, i)}</answer>" and ex.answer(sample, 5, i) in kind_space
    # a group of 2 keeps one drawn sample; a group of 1 forces nothing
    assert [bool(ex.forced_ids(sample, 5, i, 2)) for i in range(2)] == [False, True]
    assert ex.forced_ids(sample, 5, 0, 1) == []


def test_forced_answers_are_seeded_and_uniform_over_the_kind_whatever_the_truth(tok):
    samples = TASKS["shapes"].generate(0, "train", 40, 1)
    ex, again = AnswerExplorer(1, tok, seed=0), AnswerExplorer(1, tok, seed=0)
    pairs = [(s, pos) for pos in range(30) for s in samples]
    drawn = [ex.answer(s, pos, 7) for s, pos in pairs]
    assert drawn == [again.answer(s, pos, 7) for s, pos in pairs]  # a restart forces the same
    assert drawn != [AnswerExplorer(1, tok, seed=1).answer(s, pos, 7) for s, pos in pairs]
    spaces = TASKS["shapes"].kind_answer_space(1)  # count: 1-4, colour: six names
    for kind, space in spaces.items():
        mine = [a for a, (s, _) in zip(drawn, pairs, strict=True) if s.metadata["question"] == kind]
        counts = Counter(mine)
        expected = len(mine) / len(space)  # 20 questions of each kind x 30 positions = 600 draws
        # every answer of the kind, each within +-30% of its share (a binomial's sd is 4-5% of it)
        assert set(counts) == set(space) and all(0.7 * expected <= c <= 1.3 * expected for c in counts.values())
        # the draw does not see the truth: right answers at chance (1/4 or 1/6 of the draws), not above
        right = sum(a == s.answer for a, (s, _) in zip(drawn, pairs, strict=True) if s.metadata["question"] == kind)
        assert right < 1.3 * expected
    # a task without kinds draws from its whole answer space
    text = TASKS["largest"].generate(0, "train", 1, 1)[0]
    assert {ex.answer(text, pos, 7) for pos in range(200)} == set(TASKS["largest"].answer_space(1))


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
