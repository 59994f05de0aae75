"""The advantage role: per-group and whole-batch estimators, derived by hand on three-element groups,
and what the role commits on a real rollout."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from relax.services.roles.advantage import group_advantages
from relax.services.run_record import ensure_run


def test_grpo_group_by_hand():
    # rewards (1, 0, 0): mean 1/3, population std sqrt(((2/3)^2 + 2 (1/3)^2) / 3) = sqrt(2)/3
    # A = (r - 1/3) / (sqrt(2)/3) = (2/3, -1/3, -1/3) * 3/sqrt(2) = (sqrt 2, -1/sqrt 2, -1/sqrt 2)
    masks = [np.array([0, 1, 1], np.int8), np.array([0, 0, 1, 1], np.int8), np.array([0, 1], np.int8)]
    adv = group_advantages("grpo", [1.0, 0.0, 0.0], masks)
    assert [a.shape for a in adv] == [(3,), (4,), (2,)]
    np.testing.assert_allclose(adv[0], [0, math.sqrt(2), math.sqrt(2)], rtol=1e-5)
    np.testing.assert_allclose(adv[1], [0, 0, -1 / math.sqrt(2), -1 / math.sqrt(2)], rtol=1e-5)
    np.testing.assert_allclose(adv[2], [0, -1 / math.sqrt(2)], rtol=1e-5)


def test_rloo_and_masked_out_error_sample():
    # RLOO: A_i = r_i - mean of the others: (1 - 0.5, 0 - 1, 1 - 0.5) = (0.5, -1, 0.5);
    # the middle sample's reward failed: its mask is all zero, so its advantage is zero everywhere
    masks = [np.array([1, 1], np.int8), np.array([0, 0], np.int8), np.array([1], np.int8)]
    adv = group_advantages("rloo", [1.0, 0.0, 1.0], masks)
    np.testing.assert_allclose(adv[0], [0.5, 0.5])
    np.testing.assert_allclose(adv[1], [0.0, 0.0])
    np.testing.assert_allclose(adv[2], [0.5])


def test_gae_waits_for_the_critics_values(tmp_path):
    # GRPO needs only rewards and masks; GAE must not start a batch before the critic's values exist.
    from relax.services.roles.advantage import AdvantageRole
    from relax.services.run_context import RunContext
    from tests.relax.services.runtime_helpers import tiny_config

    gae = AdvantageRole(RunContext(tiny_config(f"file://{tmp_path}/a", "t", "algorithm.advantage=gae",
                                               "model.value_head=true")))
    grpo = AdvantageRole(RunContext(tiny_config(f"file://{tmp_path}/b", "t")))
    assert "values" in gae.consumer.fields and "values" not in grpo.consumer.fields
    assert "returns" in gae.producer.fields and "returns" not in grpo.producer.fields


def test_group_advantages_with_kl_in_reward_on_ragged_rows():
    # RLOO with rewards (1, 0, 1), beta = 0.5, per-token KL (already masked): sums (0.4, 0, 0.2)
    # r' = r - beta sum KL = (0.8, 0, 0.9); A_i = r'_i - mean of the others:
    # (0.8 - 0.45, 0 - 0.85, 0.9 - 0.4) = (0.35, -0.85, 0.5) on each row's masked tokens
    masks = [np.array([0, 1, 1], np.int8), np.array([0, 1], np.int8), np.array([1], np.int8)]
    kl = [np.array([0, 0.1, 0.3], np.float32), np.array([0, 0], np.float32), np.array([0.2], np.float32)]
    adv = group_advantages("rloo", [1.0, 0.0, 1.0], masks, kl=kl, kl_coef=0.5)
    np.testing.assert_allclose(adv[0], [0, 0.35, 0.35], atol=1e-6)
    np.testing.assert_allclose(adv[1], [0, -0.85], atol=1e-6)
    np.testing.assert_allclose(adv[2], [0.5], atol=1e-6)


def test_kl_in_reward_reads_logprobs_and_waits_for_the_reference(tmp_path):
    # the reference is policy version 0, which the actor publishes: without it the role waits, then says so
    from relax.services.roles.advantage import AdvantageRole
    from relax.services.run_context import RunContext
    from relax.transfer.errors import QueueTimeout
    from tests.relax.services.runtime_helpers import tiny_config

    cfg = tiny_config(f"file://{tmp_path}", "t", "algorithm.kl_in_reward=true", "algorithm.kl_coef=0.1")
    with pytest.raises(QueueTimeout, match="weight version 0 not published"):
        AdvantageRole(RunContext(cfg), wait_s=0.2)


def test_batch_gae_returns_carry_the_kl_penalty():
    # one row, V = 0, gamma = lam = 1, r = 1, KL (0, 0.2, 0.1), beta = 0.5:
    # R = (0, -0.1, 1 - 0.05) = (0, -0.1, 0.95); returns-to-go = (0.85, 0.85, 0.95) (the critic's target)
    from relax.services.roles.advantage import batch_gae

    mask, zeros = np.ones(3, np.int8), np.zeros(3, np.float32)
    _, returns = batch_gae([1.0], [mask], [zeros], gamma=1.0, lam=1.0, kl=[np.array([0, 0.2, 0.1], np.float32)],
                           kl_coef=0.5)
    np.testing.assert_allclose(returns[0], [0.85, 0.85, 0.95], atol=1e-6)


@pytest.mark.parametrize("role", ["advantage", "reward"])
def test_a_step_recorded_but_never_committed_is_recomputed_at_start(tmp_path, role):
    # a role that dies between recording step 0 (its consumer's cursor) and committing the
    # column: the next incarnation finds the step by the missing field and commits it
    from relax.services.roles.actor import ActorRole
    from relax.services.roles.advantage import AdvantageRole
    from relax.services.roles.reward import RewardRole
    from relax.services.roles.rollout import RolloutRole
    from relax.services.run_context import RunContext
    from tests.relax.services.runtime_helpers import tiny_config

    ctx = RunContext(tiny_config(f"file://{tmp_path}", "repair", *(["data.reward_role=true"] if role == "reward"
                                                                    else [])))
    ensure_run(ctx)
    ActorRole(ctx).close()
    rollout = RolloutRole(ctx)
    rollout.step(timeout=60)
    rollout.close()
    make, field = (RewardRole, "reward") if role == "reward" else (AdvantageRole, "advantages")
    dead = make(ctx)
    assert dead.repaired == 0
    batch = dead.consumer.take(0, current_version=0)  # recorded ...
    dead.close()  # ... and never committed
    assert dead.consumer.steps_missing(field) == [0]
    again = make(ctx)
    try:
        assert again.repaired == 1 and again.consumer.steps_missing(field) == []
        queue = ctx.queue()
        queue.refresh()
        assert all(field in queue.state.samples[sid].locs for sid in batch.ids)
    finally:
        again.close()


def test_stuck_group_push_on_a_real_batch(tmp_path):
    # a real rollout of the untrained tiny policy (mostly wrong answers), advantages committed by the
    # role with stuck_group_push 0.3: a group of all-equal rewards r < 1 carries -0.3 * (1 - r) on every
    # response token, any other group its GRPO advantage; the metric counts the first kind
    m, batch = one_advantage_step(tmp_path, "stuck", "algorithm.stuck_group_push=0.3")
    f = batch.fields
    by_group: dict[str, list[int]] = {}
    for i, g in enumerate(batch.groups):
        by_group.setdefault(g, []).append(i)
    stuck = 0
    for idx in by_group.values():
        rewards = [float(f["reward"][i]) for i in idx]
        expected = group_advantages("grpo", rewards, [f["loss_mask"][i] for i in idx])
        if len(set(rewards)) == 1 and rewards[0] < 1.0:
            stuck += 1
            expected = [-0.3 * (1.0 - rewards[0]) * np.asarray(f["loss_mask"][i], np.float32) for i in idx]
        for i, e in zip(idx, expected, strict=True):
            np.testing.assert_allclose(f["advantages"][i], e, atol=1e-6)
    assert stuck > 0, "the untrained policy should miss every sample of some prompt"
    assert m["stuck_groups"] == pytest.approx(stuck / len(by_group))


def test_batch_whitened_uses_the_whole_batch_not_each_group():
    # two groups of three one-token rows, rewards (1, 0, 0) and (1, 1, 0): REINFORCE++ whitens over all six
    # tokens: mu = 1/2, population var = 1/4 -> A = (r - 1/2) / (1/2) = +-1 for every row. Per group, the first
    # group alone would give (sqrt 2, -1/sqrt 2, -1/sqrt 2): a different answer
    from relax.services.roles.advantage import batch_whitened

    masks = [np.ones(1, np.int8)] * 6
    rows = batch_whitened("reinforce_pp", [1.0, 0.0, 0.0, 1.0, 1.0, 0.0], masks, ["a", "a", "a", "b", "b", "b"])
    np.testing.assert_allclose(np.concatenate(rows), [1, -1, -1, 1, 1, -1], atol=1e-6)
    np.testing.assert_allclose(np.concatenate(group_advantages("reinforce_pp", [1.0, 0.0, 0.0], masks[:3])),
                               [math.sqrt(2), -1 / math.sqrt(2), -1 / math.sqrt(2)], atol=1e-6)
    # baseline: group means (1/3, 2/3) first -> r' = (2/3, -1/3, -1/3, 1/3, 1/3, -2/3), mean 0, population
    # var = (4 + 1 + 1 + 1 + 1 + 4) / 54 = 2/9 -> A = r' * 3/sqrt(2); rows interleaved by group come back in place
    base = batch_whitened("reinforce_pp_baseline", [1.0, 1.0, 0.0, 1.0, 0.0, 0.0], masks,
                          ["a", "b", "a", "b", "a", "b"])
    k = 3 / math.sqrt(2)
    np.testing.assert_allclose(np.concatenate(base), [k * 2 / 3, k / 3, -k / 3, k / 3, -k / 3, -k * 2 / 3], atol=1e-6)
    with pytest.raises(ValueError, match="one size"):
        batch_whitened("reinforce_pp_baseline", [1.0, 0.0, 1.0], masks[:3], ["a", "a", "b"])


def test_overlong_shaped_by_hand():
    # max 5 tokens, buffer 2 (soft start 3): lengths 2, 4, 5 -> penalties 0, (3 - 4)/2 = -0.5, (3 - 5)/2 = -1
    from relax.services.roles.advantage import overlong_shaped

    masks = [np.array([1, 1], np.int8), np.array([0, 1, 1, 1, 1], np.int8), np.ones(5, np.int8)]
    rewards, mean = overlong_shaped([1.0, 1.0, 0.0], masks, 5, 2, 1.0)
    assert rewards == pytest.approx([1.0, 0.5, -1.0]) and mean == pytest.approx(-0.5)


def test_batch_whitened_discounts_by_gamma_by_hand():
    # gamma 0.9; row a: mask [1, 1, 1], reward 1 -> returns [0.81, 0.9, 1]; row b: mask [1, 1], reward 0 -> [0, 0].
    # Whitened over the 5 tokens: mean 2.71 / 5 = 0.542; variance 2.4661 / 5 - 0.542^2 = 0.199456, std 0.446605;
    # a: (0.268, 0.358, 0.458) / 0.446605 = (0.60009, 0.80160, 1.02552); b: -0.542 / 0.446605 = -1.21360.
    # Undiscounted it would be a: (1 - 0.6) / 0.489898 = 0.81650 on every token.
    from relax.services.roles.advantage import batch_whitened

    masks = [np.ones(3, np.int8), np.ones(2, np.int8)]
    a, b = batch_whitened("reinforce_pp", [1.0, 0.0], masks, ["a", "b"], gamma=0.9)
    np.testing.assert_allclose(a, [0.60009, 0.80160, 1.02552], atol=1e-4)
    np.testing.assert_allclose(b, [-1.21360, -1.21360], atol=1e-4)
    undiscounted, _ = batch_whitened("reinforce_pp", [1.0, 0.0], masks, ["a", "b"])
    np.testing.assert_allclose(undiscounted, [0.81650] * 3, atol=1e-4)


def test_gamma_is_refused_with_reinforce_pp_baseline_as_verl_ignores_it():
    from relax.config import ConfigError
    from tests.relax.services.runtime_helpers import tiny_config

    with pytest.raises(ConfigError, match=r"algorithm.gamma=0.9 is read only with advantage gae or reinforce_pp"):
        tiny_config("file:///tmp/unused", "g", "algorithm.advantage=reinforce_pp_baseline", "algorithm.gamma=0.9")


@pytest.mark.parametrize("advantage,gamma", [("reinforce_pp", 1.0), ("reinforce_pp", 0.9),
                                             ("reinforce_pp_baseline", 1.0), ("grpo", 1.0)])
def test_the_role_whitens_reinforce_pp_over_the_step(tmp_path, advantage, gamma):
    # a real rollout scored with a reward that varies inside every group; the role's committed advantages equal
    # the library function on the whole batch (REINFORCE++: mean 0, std 1 over the step's trained tokens), and
    # differ from the per-group answer the role gave before; GRPO stays per group
    from relax.algorithms import compute_advantages

    m, batch = one_advantage_step(tmp_path, "rpp", f"algorithm.advantage={advantage}", f"algorithm.gamma={gamma}",
                                  "data.reward_fn=tests.relax.services.runtime_helpers:length_reward")
    f = batch.fields
    order = sorted(range(len(batch)), key=lambda i: (batch.groups[i], i))  # contiguous groups of 4
    rewards = torch.tensor([float(f["reward"][i]) for i in order])
    masks = [np.asarray(f["loss_mask"][order[k]], np.float32) for k in range(len(order))]
    width = max(len(x) for x in masks)
    mask = torch.tensor(np.stack([np.pad(x, (0, width - len(x))) for x in masks]))
    whole, _ = compute_advantages(advantage, rewards, mask, group_size=4, gamma=gamma)  # the role read gamma
    got = [np.asarray(f["advantages"][i]) for i in order]
    per_group = [compute_advantages(advantage, rewards[g:g + 4], mask[g:g + 4], group_size=4, gamma=gamma)[0]
                 for g in range(0, len(order), 4)]
    per_group_rows = torch.cat(per_group)
    for k, a in enumerate(got):
        np.testing.assert_allclose(a, whole[k, : len(a)].numpy(), atol=1e-5)
    trained = np.concatenate([a[np.asarray(x) > 0] for a, x in zip(got, masks, strict=True)])
    assert m["adv_mean"] == pytest.approx(float(trained.mean()), abs=1e-6)
    assert m["adv_std"] == pytest.approx(float(trained.std()), abs=1e-6)
    if advantage == "grpo":  # per group by definition: the whole-batch call groups the same way
        torch.testing.assert_close(per_group_rows, whole)
    else:
        assert m["adv_mean"] == pytest.approx(0.0, abs=1e-5) and m["adv_std"] == pytest.approx(1.0, abs=1e-4)
        assert (per_group_rows - whole).abs().max() > 1e-3, "per-group whitening would have given the same answer"


def one_advantage_step(tmp_path, run_id: str, *overrides: str):
    """A real rollout step of the untrained tiny policy, then one advantage-role step on it: (the role's
    metrics, the committed batch with reward, loss_mask and advantages)."""
    from relax.services.roles.actor import ActorRole
    from relax.services.roles.advantage import AdvantageRole
    from relax.services.roles.rollout import RolloutRole
    from relax.services.run_context import RunContext
    from relax.transfer.consumer import ConsumerGroup
    from tests.relax.services.runtime_helpers import tiny_config

    ctx = RunContext(tiny_config(f"file://{tmp_path}", run_id, *overrides))
    ensure_run(ctx)
    ActorRole(ctx).close()
    rollout = RolloutRole(ctx)
    rollout.step(timeout=60)
    rollout.close()
    role = AdvantageRole(ctx)
    try:
        metrics = role.step(timeout=60)
    finally:
        role.close()
    check = ConsumerGroup(ctx.queue(), "check", ["reward", "loss_mask", "advantages"],
                          batch_groups=ctx.cfg.rollout.prompts_per_step, max_staleness=10)
    try:
        return metrics, check.take(0, current_version=0, timeout=30)
    finally:
        check.close()


def test_turn_rewards_join_the_advantage_on_their_turns_tokens(tmp_path):
    # three episodes of one prompt as the rollout commits them (trajectory_row), two posted turn rewards
    # each; the role's advantage is GRPO's plus turn_reward_coef * r_k on the tokens of turn k
    from relax.data.samples import Message, Sample
    from relax.rollout.episodes import Trajectory
    from relax.services.queue_contract import rollout_fields
    from relax.services.roles.advantage import AdvantageRole
    from relax.services.roles.rollout import trajectory_row
    from relax.services.run_context import RunContext
    from relax.transfer.consumer import ConsumerGroup
    from tests.relax.services.runtime_helpers import tiny_config

    ctx = RunContext(tiny_config(f"file://{tmp_path}", "turns", "rollout.agents=external", "rollout.prompts_per_step=1",
                                 "rollout.n_samples_per_prompt=3", "algorithm.turn_reward_coef=0.5"))
    ensure_run(ctx)
    sample = Sample("s0", (Message("user", "q"),), "a", task="tool_lookup")
    mask = [0, 0, 1, 1, 0, 1]  # prompt, turn 0 (tokens 2-3), a tool result, turn 1 (token 5)
    rows = []
    for i, (reward, turns) in enumerate([(1.0, [0.2, 1.0]), (0.0, [0.4, -1.0]), (0.0, [0.0, 0.0])]):
        t = Trajectory(sample, 0, i, list(range(6)), list(mask), [-0.5] * 6, 2, reward=reward,
                       turn_spans=[(2, 4), (5, 6)], turn_rewards=turns)
        rows.append(trajectory_row(t, 3, turn_rewards=True))
    producer = ctx.queue().producer("rollout", rollout_fields(False, True), tokens_field="tokens")
    producer.put(rows, meta={"batch": 0, "next_prompt": 1})
    producer.close()
    role = AdvantageRole(ctx)
    try:
        role.step(timeout=60)
    finally:
        role.close()
    check = ConsumerGroup(ctx.queue(), "check", ["advantages"], batch_groups=1, max_staleness=10)
    try:
        batch = check.take(0, current_version=0, timeout=30)
    finally:
        check.close()
    # GRPO on (1, 0, 0): (sqrt 2, -1/sqrt 2, -1/sqrt 2) on the trained tokens (test_grpo_group_by_hand)
    s = math.sqrt(2)
    want = {"s0@0.0": [0, 0, s + 0.1, s + 0.1, 0, s + 0.5], "s0@0.1": [0, 0, -1 / s + 0.2, -1 / s + 0.2, 0,
                                                                        -1 / s - 0.5],
            "s0@0.2": [0, 0, -1 / s, -1 / s, 0, -1 / s]}
    for sid, adv in zip(batch.ids, batch.fields["advantages"], strict=True):
        np.testing.assert_allclose(adv, want[sid], atol=1e-5)
