"""PPO with GAE: the critic role's values, the advantage role's GAE, a learning run that resumes.

The end-to-end run trains on a dense reward (the share of digits in the response) so that
16 short steps on the tiny random model show learning: measured on this 2-core machine the
sampled reward goes from 0.037 in the first four batches to 0.39 in the last four.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from relax.config import ModelConfig
from relax.models.builders import build_policy
from relax.models.tokenizers import build_tokenizer
from relax.models.value_head import ValueHeadModel
from relax.services.driver import train
from relax.services.policy import build_model
from relax.services.queue_contract import CRITIC_TRAIN_GROUP, CRITIC_VALUES_GROUP
from relax.services.report.metrics import read_metrics
from relax.services.roles.advantage import batch_gae
from relax.services.roles.critic import CriticRole, critic_checkpoints
from relax.services.run_context import RunContext
from relax.trainers.checkpoint.trainer_state import load_checkpoint
from relax.trainers.torch.batch import RolloutBatch
from relax.trainers.torch.critic import Critic
from relax.transfer.consumer import load_group_state
from tests.relax.services.runtime_helpers import tiny_config

REWARD_PATH = "tests.relax.services.roles.test_critic:digit_share"


def digit_share(response: str, sample) -> float:
    """A dense reward a random tiny policy scores ~0.04 on and can raise token by token."""
    return sum(c.isdigit() for c in response) / max(len(response), 1)


def test_batch_gae_by_hand():
    # gamma = lam = 1: A_t = R - V_t on response tokens (t = 1, 2), returns = A + V = R.
    # sample 0: reward 1, V = (7, 0, 1): A = (0, 1 - 0, 1 - 1) = (0, 1, 0), returns (0, 1, 1)
    #   (V_0 = 7 sits on a prompt token: GAE never reads it)
    # sample 1: reward 0, V = (0, 0, 1): A = (0, 0, -1), returns (0, 0, 0)
    # sample 2: its reward failed, all-zero mask: A = returns = 0 and it is left out of the stats
    # whitening over the 4 response tokens (1, 0, 0, -1): mean 0, population var 2/4 = 1/2,
    # so A / sqrt(1/2) = (sqrt 2, 0, 0, -sqrt 2)
    masks = [np.array([0, 1, 1], np.int8), np.array([0, 1, 1], np.int8), np.array([0, 0, 0], np.int8)]
    values = [np.array([7, 0, 1], np.float32), np.array([0, 0, 1], np.float32), np.array([5, 5, 5], np.float32)]
    adv, ret = batch_gae([1.0, 0.0, 1.0], masks, values, gamma=1.0, lam=1.0)
    r2 = math.sqrt(2)
    np.testing.assert_allclose(adv[0], [0, r2, 0], atol=1e-6)
    np.testing.assert_allclose(adv[1], [0, 0, -r2], atol=1e-6)
    np.testing.assert_allclose(adv[2], [0, 0, 0])
    np.testing.assert_allclose(ret[0], [0, 1, 1])
    np.testing.assert_allclose(ret[1], [0, 0, 0])
    np.testing.assert_allclose(ret[2], [0, 0, 0])


def test_values_are_read_before_their_token():
    # values[t] is the head on hidden state t-1 (the state before token t was chosen), 0 at t = 0,
    # whatever the micro-batch layout
    tok = build_tokenizer("bpe-tiny")
    model = ValueHeadModel(build_policy(ModelConfig(), tok, seed=0)[0])
    with torch.no_grad():
        model.value_head.weight.normal_(generator=torch.Generator().manual_seed(0))
    ids = [torch.tensor(tok("What is 1 + 5?")["input_ids"]), torch.tensor(tok("Largest of 3 7 2")["input_ids"])]
    batch = RolloutBatch(ids=["a", "b"], input_ids=ids, loss_mask=[torch.ones_like(t, dtype=torch.float32)
                                                                   for t in ids])
    with torch.no_grad():
        direct = [model(input_ids=t[None])[0] for t in ids]
    for layout in ("pack", "pad"):
        values = Critic(model, lr=0.0, layout=layout).values(batch)
        for v, d in zip(values, direct, strict=True):
            assert v[0] == 0
            torch.testing.assert_close(v[1:], d[:-1], atol=1e-5, rtol=0)


@pytest.mark.slow
def test_ppo_gae_learns_and_the_critic_resumes_from_its_checkpoint(tmp_path):
    cfg = tiny_config(f"file://{tmp_path}", "ppo", "algorithm.advantage=gae", "model.value_head=true",
                      f"data.reward_fn={REWARD_PATH}", "trainer.total_steps=16", "trainer.lr=1e-2",
                      "trainer.checkpoint_every=4")
    # a run stopped after step 5: the critic's newest checkpoint is step 3, so a restart
    # re-takes steps 4-5 from its consumer groups' records
    first = train(cfg, progress=False, max_steps=6)
    assert first.steps == 6 and critic_checkpoints(first.run_url) == [3]
    resumed = CriticRole(RunContext(cfg))
    assert (resumed.resumed_from, resumed.trained, resumed.valued) == (3, 4, 4)
    resumed.close()

    result = train(cfg, progress=False)
    assert result.steps == 16
    rewards = [m["reward"] for m in sorted(result.metrics("rollout"), key=lambda m: m["batch"])]
    early, late = float(np.mean(rewards[:4])), float(np.mean(rewards[-4:]))
    print(f"PPO+GAE sampled reward: first 4 batches {early:.3f}, last 4 {late:.3f}; per batch "
          f"{[round(r, 2) for r in rewards]}")
    assert late > max(2 * early, early + 0.1), (early, late)

    # the second incarnation of the critic replayed steps 4 and 5 (values kept, training redone)
    log = read_metrics(result.run_url, "critic")  # both incarnations, in time order
    starts = [i for i, m in enumerate(log) if (m["kind"], m["step"]) == ("values", 4)]
    assert len(starts) == 2
    second = log[starts[1]:]
    assert [(m["kind"], m["step"], m["replayed"]) for m in second[:4]] == [
        ("values", 4, True), ("train", 4, True), ("values", 5, True), ("train", 5, True)]
    assert second[0]["reused"] and second[2]["reused"]
    ctx = RunContext(cfg)
    queue = ctx.queue()
    queue.refresh()
    for group in (CRITIC_VALUES_GROUP, CRITIC_TRAIN_GROUP):
        assert sorted(load_group_state(queue, group).steps) == list(range(16)), group
    assert all({"values", "returns", "advantages"} <= set(m.locs) for m in queue.state.samples.values())
    assert critic_checkpoints(result.run_url) == [3, 7, 11, 15]
    train_log = [m for m in log if m["kind"] == "train"]
    assert all(math.isfinite(m["loss"]) for m in train_log)
    assert np.mean([m["value_mean"] for m in train_log[-4:]]) > 0.5 * late  # the critic follows the reward

    # values of step 8 were read by the critic after 8 updates: its step-7 checkpoint gives them again
    model = ValueHeadModel(build_model(ctx)[0])
    load_checkpoint(f"{result.run_url}/critic/checkpoints/step-000007", model, restore_rng=False)
    ids = load_group_state(queue, CRITIC_VALUES_GROUP).steps[8]["ids"]
    fields = queue.read(ids, ["tokens", "loss_mask", "values"])
    batch = RolloutBatch(ids=ids, input_ids=[torch.tensor(t) for t in fields["tokens"]],
                         loss_mask=[torch.tensor(m, dtype=torch.float32) for m in fields["loss_mask"]])
    for got, want in zip(Critic(model, lr=0.0).values(batch), fields["values"], strict=True):
        torch.testing.assert_close(got, torch.from_numpy(np.array(want)), atol=1e-5, rtol=0)


@pytest.mark.slow
def test_disaggregated_runs_the_critic_as_its_own_process(tmp_path):
    from relax.services.roles.factory import role_names

    cfg = tiny_config(f"file://{tmp_path}", "ppo-dis", "algorithm.advantage=gae", "model.value_head=true",
                      f"data.reward_fn={REWARD_PATH}", "trainer.total_steps=4", "topology=disaggregated")
    assert role_names(cfg) == ("actor", "advantage", "rollout", "critic")
    assert train(cfg, progress=False).steps == 4
    log = read_metrics(RunContext(cfg).run_url, "critic")
    assert [(m["kind"], m["step"]) for m in log] == [(k, s) for s in range(4) for k in ("values", "train")]
    queue = RunContext(cfg).queue()
    queue.refresh()
    assert all({"values", "returns", "advantages"} <= set(m.locs) for m in queue.state.samples.values())
