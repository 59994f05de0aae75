"""``algorithm.kl_in_reward`` end to end (colocated): the advantage role folds the KL to the
version-0 reference into the reward, the actor adds no KL term.

The check recomputes every committed row's GRPO advantage by hand from the queue: the row's
behaviour logprobs, the reference's logprobs of its tokens (policy version 0 from the
WeightStore) and its reward, A_i = (r'_i - mean_g r') / (std_g r' + 1e-6) with
r'_i = r_i - beta * sum_t m_it KL_it and KL = k1 = logp - logp_ref.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import relax.trainers.torch.actor as torch_actor
from relax.services.driver import train
from relax.services.report.metrics import read_metrics
from relax.services.roles.actor import initial_reference
from relax.services.roles.media import MediaInputs
from relax.services.run_context import RunContext
from relax.trainers.torch.batch import RolloutBatch
from tests.relax.services.runtime_helpers import tiny_config

BETA = 0.5


def _no_kl_loss(*_args, **_kwargs):
    raise AssertionError("the actor computed a KL term although kl_in_reward is on")


def _grpo(r: np.ndarray) -> np.ndarray:
    if np.all(r == r[0]):
        return np.zeros_like(r)
    return (r - r.mean()) / (r.std() + 1e-6)  # numpy's std is the population std, as GRPO's


# media: image and audio rows, whose reference logprobs need their pixels and mel features
MEDIA = ("model.name_or_path=tiny-omni", "model.family=qwen2_5_omni", "data.tasks=[shapes,tones]",
         "data.train_per_task=16")


@pytest.mark.slow
@pytest.mark.parametrize("extra", [(), MEDIA], ids=["text", "image-and-audio"])
def test_kl_in_reward_run_matches_the_hand_formula(tmp_path, monkeypatch, extra):
    # the actor's loss must not call its KL estimator in this mode (the advantage role uses its own import)
    monkeypatch.setattr(torch_actor, "kl_estimate", _no_kl_loss)
    cfg = tiny_config(f"file://{tmp_path}", "klr", "algorithm.kl_in_reward=true", f"algorithm.kl_coef={BETA}",
                      "algorithm.kl_estimator=k1", "trainer.total_steps=3", "trainer.lr=1e-2",
                      "trainer.warmup_steps=0", *extra)
    result = train(cfg, progress=False)
    assert result.steps == 3
    ctx = RunContext(cfg)
    adv_metrics = read_metrics(ctx.run_url, "advantage")
    assert len(adv_metrics) == 3 and all(np.isfinite(m["kl_mean"]) for m in adv_metrics)

    queue = ctx.queue()
    queue.refresh()
    metas = [m for m in queue.state.samples.values() if "advantages" in m.locs]
    ids = [m.id for m in metas]
    rows = queue.read(ids, ["tokens", "loss_mask", "logprobs", "reward", "advantages", "prompt_len"])
    reference, processor = initial_reference(ctx, wait_s=0)
    media = MediaInputs(ctx.split("train"), ctx.tokenizer, processor, ctx.snapshot.load_media)
    per_row = [media(i, t, int(n)) for i, t, n in zip(ids, rows["tokens"], rows["prompt_len"], strict=True)]
    assert (sum(m is not None for m in per_row) == len(ids)) == bool(extra)  # every media row has its media
    ref = reference.logprobs(RolloutBatch(ids=ids, input_ids=[torch.tensor(t) for t in rows["tokens"]],
                                          loss_mask=[torch.tensor(m, dtype=torch.float32) for m in rows["loss_mask"]],
                                          media=per_row if extra else None))
    kl_sum = np.array([float(np.sum(m * (lp - r.numpy()))) for m, lp, r in
                       zip(rows["loss_mask"], rows["logprobs"], ref, strict=True)])
    reward = np.asarray(rows["reward"], np.float64)
    by_group: dict[str, list[int]] = {}
    for i, m in enumerate(metas):
        by_group.setdefault(m.group, []).append(i)
    moved = 0
    for idx in by_group.values():
        shaped = reward[idx] - BETA * kl_sum[idx]
        if shaped.std() < 1e-3:  # a group sampled from the reference itself: GRPO would amplify float noise
            continue
        expected, plain = _grpo(shaped), _grpo(reward[idx])
        for k, i in enumerate(idx):
            m = rows["loss_mask"][i].astype(bool)
            np.testing.assert_allclose(rows["advantages"][i][m], expected[k], atol=2e-3)
        moved += int(np.abs(expected - plain).max() > 1e-2)
    # once the policy has moved from version 0, the KL changes some group's advantages
    assert moved > 0


def test_actor_holds_the_reference_only_for_the_kl_loss_term(tmp_path):
    from relax.services.roles.actor import ActorRole

    for name, in_reward in (("loss", "false"), ("reward", "true")):
        ctx = RunContext(tiny_config(f"file://{tmp_path}/{name}", name, "algorithm.kl_coef=0.1",
                                     f"algorithm.kl_in_reward={in_reward}"))
        role = ActorRole(ctx)
        try:
            assert (role.reference is None) == (in_reward == "true")
        finally:
            role.close()
