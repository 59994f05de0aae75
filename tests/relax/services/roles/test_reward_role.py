"""``data.reward_role``: rewards scored by a role of its own instead of the rollout.

A reward is a pure function of the row, so scoring in the rollout or in the reward role must
train identically: the same rewards, the same errors (with zero weight), the same weights.
The reward function here fails on some responses, to carry the error path through the queue."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from relax.config import ConfigError, load_config
from relax.data.samples import Sample
from relax.data.verifiers import numeric_match_reward
from relax.services.driver import train
from relax.services.report.metrics import read_metrics
from relax.services.run_context import RunContext
from relax.services.run_record import ensure_run
from relax.services.trainable import check_trainable
from tests.relax.services.runtime_helpers import tiny_config

PICKY = "tests.relax.services.roles.test_reward_role:picky_reward"
BASE = (f"data.reward_fn={PICKY}", "trainer.total_steps=3", "trainer.lr=1e-2", "trainer.warmup_steps=0")


def picky_reward(response: str, sample: Sample) -> float:
    """The numeric verifier, except that it fails on responses holding a 3 (an error path)."""
    if "3" in response:
        raise ValueError("refuses to grade a 3")
    return numeric_match_reward(response, sample)


def _run(root: str, run_id: str, *extra: str):
    cfg = tiny_config(root, run_id, *BASE, *extra)
    result = train(cfg, progress=False)
    ctx = RunContext(cfg)
    store = ctx.weights()
    return result, ctx, store.load(store.latest())[0]


@pytest.mark.slow
@pytest.mark.parametrize("topology", ["colocated", "disaggregated"])
def test_a_reward_role_trains_exactly_like_the_rollout_scoring(tmp_path, topology):
    inline, _, w_inline = _run(f"file://{tmp_path}/a", "inline")
    role, ctx, w_role = _run(f"file://{tmp_path}/b", "role", "data.reward_role=true", f"topology={topology}")
    assert role.steps == 3
    # the report merges the reward role's figures into the rollout batches
    assert [m["reward"] for m in role.metrics("rollout")] == pytest.approx(
        [m["reward"] for m in inline.metrics("rollout")]
    )
    assert [m["reward_errors"] for m in role.metrics("rollout")] == [
        m["reward_errors"] for m in inline.metrics("rollout")
    ]
    assert sum(m["reward_errors"] for m in role.metrics("rollout")) > 0  # the error path ran
    for name, w in w_inline.items():
        torch.testing.assert_close(torch.as_tensor(w_role[name]), torch.as_tensor(w), atol=1e-5, rtol=0)
    assert len(read_metrics(ctx.run_url, "reward")) == 3
    queue = ctx.queue()
    queue.refresh()
    ids = [i for i, m in queue.state.samples.items() if "advantages" in m.locs]
    rows = queue.read(ids, ["error", "advantages", "loss_mask"])
    failed = [i for i, e in enumerate(rows["error"]) if e]
    assert failed and all("refuses to grade a 3" in rows["error"][i] for i in failed)
    assert all(not np.any(rows["advantages"][i]) for i in failed)  # zero weight
    assert all(np.any(rows["loss_mask"][i]) for i in failed)  # the rollout kept the mask: consumers zero it


def test_a_reward_role_refuses_what_needs_rewards_during_the_rollout(tmp_path):
    with pytest.raises(ConfigError, match="rollout.dynamic_sampling"):
        load_config("tiny-cpu", ["data.reward_role=true", "rollout.dynamic_sampling=true"])
    ctx = RunContext(tiny_config(f"file://{tmp_path}", "agents", "data.reward_role=true",
                                 "data.tasks=[tool_lookup]"))
    with pytest.raises(ConfigError, match=r"tasks \['tool_lookup'\] are agent episodes"):
        check_trainable(ctx)


def test_near_miss_credit_reaches_both_scoring_roles(tmp_path):
    from relax.services.roles.actor import ActorRole
    from relax.services.roles.reward import RewardRole
    from relax.services.roles.rollout import RolloutRole

    ctx = RunContext(tiny_config(f"file://{tmp_path}/root", "nm", "data.tasks=[tones]", "data.train_per_task=8",
                                 "model.name_or_path=tiny-omni", "model.family=qwen2_5_omni",
                                 "algorithm.near_miss_credit=0.25"))
    ensure_run(ctx)
    count = next(s for s in ctx.split("train") if s.metadata["question"] == "count")
    truth = int(count.answer)
    near = f"<answer>{truth - 1 if truth > 1 else 2}</answer>"
    ActorRole(ctx).close()  # publishes weight version 0, which the rollout's step waits for
    rollout, reward = RolloutRole(ctx), RewardRole(ctx)
    try:
        assert rollout.rewards.score(near, count).reward == 0.25
        assert reward.rewards.score(near, count).reward == 0.25
        # the batch's metrics hold each kind of question's mean beside the task's, which lies between them
        m = rollout.step(timeout=60)
        kinds = [m["reward/tones:count"], m["reward/tones:pitch"]]
        assert min(kinds) <= m["reward/tones"] <= max(kinds)
    finally:
        rollout.close()
        reward.close()
