"""``rollout.env_fn``: a user's env factory, loaded by dotted path, drives every episode; an
image it returns mid-episode enters the context, and the trainer sees that image too.

The check that matters: for rows sampled by policy version 0, the trainer's logprobs (its
media rebuilt from the snapshot for the prompt and from the row's ``turn_media`` for the
env's picture) equal the engine's behaviour logprobs, and differ once the picture is blanked."""

from __future__ import annotations

import pytest
import torch

from relax.data.errors import DataError
from relax.services.driver import train
from relax.services.roles.media import MediaInputs, unpack_media
from relax.services.run_context import RunContext
from relax.services.trainable import check_trainable
from relax.trainers.torch.batch import RolloutBatch
from relax.trainers.torch.forward import compute_logprobs
from tests.relax.rollout.picture_env import square_png
from tests.relax.services.runtime_helpers import tiny_config

ENV = "tests.relax.rollout.picture_env:make_env"
OMNI = ("model.name_or_path=tiny-omni", "model.family=qwen2_5_omni", "data.tasks=[largest]",
        "data.train_per_task=16", f"rollout.env_fn={ENV}", "rollout.max_turns=2")


@pytest.mark.slow
def test_an_env_picture_mid_episode_is_trained_with_its_pixels(tmp_path):
    cfg = tiny_config(f"file://{tmp_path}", "env", *OMNI, "trainer.total_steps=2")
    assert train(cfg, progress=False).steps == 2
    ctx = RunContext(cfg)
    queue = ctx.queue()
    queue.refresh()
    ids = [i for i, m in queue.state.samples.items() if m.policy_version == 0]
    rows = queue.read(ids, ["tokens", "loss_mask", "logprobs", "prompt_len", "turn_media"])
    assert ids and all(rows["turn_media"])  # every episode reached the picture
    for m, sid in zip(rows["turn_media"], ids, strict=True):
        images, audios = unpack_media(m)
        assert audios == [] and images in ([square_png("red")], [square_png("blue")]), sid

    from relax.models import build_policy

    model, processor = build_policy(cfg.model, ctx.tokenizer, seed=cfg.seed)
    state, _ = ctx.weights().load(0)
    model.load_state_dict(state)
    media = MediaInputs(ctx.split("train"), ctx.tokenizer, processor, ctx.snapshot.load_media)
    per_row = [media(i, t, int(n), m) for i, t, n, m in
               zip(ids, rows["tokens"], rows["prompt_len"], rows["turn_media"], strict=True)]
    assert all(set(r) == {"pixel_values", "image_grid_thw"} for r in per_row)  # the text prompt has no media

    def logprobs(rows_media):
        batch = RolloutBatch(ids=ids, input_ids=[torch.tensor(t) for t in rows["tokens"]],
                             loss_mask=[torch.tensor(x, dtype=torch.float32) for x in rows["loss_mask"]],
                             media=rows_media)
        from relax.trainers.torch.actor import Actor

        return compute_logprobs(model, Actor(model, cfg, pad_id=0).trainer.micro_batches(batch), len(ids))

    mine = logprobs(per_row)
    blank = logprobs([{**r, "pixel_values": torch.zeros_like(r["pixel_values"])} for r in per_row])
    differs = 0
    for lp, b, old, mask in zip(mine, blank, rows["logprobs"], rows["loss_mask"], strict=True):
        m = torch.tensor(mask).bool()
        torch.testing.assert_close(lp[m], torch.tensor(old)[m], atol=1e-4, rtol=0)
        differs += not torch.allclose(lp[m], b[m], atol=1e-4)
    assert differs > 0  # the answer after the picture depends on its pixels


@pytest.mark.parametrize(("dotted", "fragment"), [
    ("tests.relax.rollout.picture_env:no_such_env", "has no attribute 'no_such_env'"),
    ("tests.relax.rollout.picture_env:not_a_factory", r"cannot be called as fn\(sample: Sample\)"),
    ("no_such_module_xyz:make_env", "cannot import module 'no_such_module_xyz'"),
])
def test_a_bad_env_fn_fails_before_any_role_starts(tmp_path, dotted, fragment):
    ctx = RunContext(tiny_config(f"file://{tmp_path}", "badenv", f"rollout.env_fn={dotted}"))
    with pytest.raises(DataError, match=fragment):
        check_trainable(ctx)
