"""Training on image and audio samples: rows rebuild their media from the snapshot, and the
trainer scores them exactly as the engine that sampled them did."""

from __future__ import annotations

import copy

import pytest
import torch

from relax.services.policy import build_model
from relax.services.roles.actor import ActorRole, to_rollout_batch
from relax.services.roles.advantage import AdvantageRole
from relax.services.roles.media import MediaInputs
from relax.services.roles.rollout import RolloutRole
from relax.services.run_context import RunContext
from relax.services.run_record import ensure_run
from relax.services.trainable import check_trainable
from relax.trainers.torch.actor import Reference
from relax.trainers.torch.forward import compute_logprobs
from relax.transfer.consumer import ConsumerGroup
from tests.relax.services.runtime_helpers import tiny_config

OMNI = ["model.name_or_path=tiny-omni", "model.family=qwen2_5_omni", "data.tasks=[shapes,tones,arithmetic]",
        "data.train_per_task=8", "rollout.prompts_per_step=6", "rollout.n_samples_per_prompt=2"]


def _ctx(tmp_path, *extra: str) -> RunContext:
    ctx = RunContext(tiny_config(f"file://{tmp_path}/root", "mm", *OMNI, *extra))
    check_trainable(ctx)
    ensure_run(ctx)
    return ctx


@pytest.fixture
def omni_ctx(tmp_path):
    return _ctx(tmp_path)


# engine_processes=1: the media go to an engine process over HTTP (ids + bytes) and must come
# back scored exactly as the trainer scores them
@pytest.mark.parametrize("engine_processes", [0, 1], ids=["in-process-engine", "engine-process"])
def test_trainer_logprobs_of_media_rows_equal_the_engines(tmp_path, engine_processes):
    omni_ctx = _ctx(tmp_path, f"rollout.engine_processes={engine_processes}")
    actor, adv, rollout = ActorRole(omni_ctx), AdvantageRole(omni_ctx), RolloutRole(omni_ctx)
    try:
        rollout.step(timeout=30)
        adv.step(timeout=30)
        group = ConsumerGroup(omni_ctx.queue(), "probe", ["tokens", "loss_mask", "logprobs", "advantages",
                                                          "prompt_len"], batch_groups=6, max_staleness=5)
        batch = to_rollout_batch(group.take(0, current_version=0, timeout=10), actor.media)
        group.close()
    finally:
        rollout.close()
        adv.close()
    tasks = [i.split("-")[0] for i in batch.ids]
    assert {"shapes", "tones", "arithmetic"} <= set(tasks)
    # image rows carry pixels and a grid, audio rows mel features; text rows nothing
    for task, media in zip(tasks, batch.media, strict=True):
        expected = {"shapes": {"pixel_values", "image_grid_thw"},
                    "tones": {"input_features", "feature_attention_mask"}}.get(task)
        assert (media is None) if expected is None else set(media) == expected
    mbs = actor.actor.trainer.micro_batches(batch)
    assert any(mb.media for mb in mbs) and any(not mb.media for mb in mbs)
    mine = compute_logprobs(actor.actor.model, mbs, len(batch))
    for sid, lp, old, mask in zip(batch.ids, mine, batch.old_logprobs, batch.loss_mask, strict=True):
        m = mask.bool()
        assert m.any()
        torch.testing.assert_close(lp[m], old[m], atol=1e-4, rtol=0, msg=sid)
    # the KL reference plans the same media-aware micro-batches (bucket layout) and agrees
    ref = Reference(copy.deepcopy(actor.actor.model)).logprobs(batch)
    for lp, r in zip(mine, ref, strict=True):
        torch.testing.assert_close(lp, r, atol=1e-5, rtol=0)
    # without its image a row scores differently: the media reached the forward pass
    i = tasks.index("shapes")
    blank = type(batch)(ids=[batch.ids[i]], input_ids=[batch.input_ids[i]], loss_mask=[batch.loss_mask[i]],
                        media=[{k: torch.zeros_like(v) if k == "pixel_values" else v
                                for k, v in batch.media[i].items()}])
    other = compute_logprobs(actor.actor.model, actor.actor.trainer.micro_batches(blank), 1)[0]
    assert not torch.allclose(other[batch.loss_mask[i].bool()], mine[i][batch.loss_mask[i].bool()], atol=1e-4)
    actor.close()


def _first_batch(ctx: RunContext) -> dict[str, tuple]:
    ActorRole(ctx).close()  # publishes weight version 0, which the rollout waits for
    rollout = RolloutRole(ctx)
    try:
        rollout.step(timeout=60)
    finally:
        rollout.close()
    group = ConsumerGroup(ctx.queue(), "probe", ["tokens", "logprobs"], batch_groups=6, max_staleness=5)
    batch = group.take(0, current_version=0, timeout=10)
    group.close()
    f = batch.fields
    return {i: (list(t), list(lp)) for i, t, lp in zip(batch.ids, f["tokens"], f["logprobs"], strict=True)}


def test_an_engine_process_samples_what_the_in_process_engine_samples(tmp_path):
    # the run's seed reaches the engine processes: the same seed draws the same tokens there
    here = _first_batch(_ctx(tmp_path / "a", "seed=3"))
    there = _first_batch(_ctx(tmp_path / "b", "seed=3", "rollout.engine_processes=1"))
    assert here.keys() == there.keys()
    for sid, (tokens, lps) in here.items():
        assert there[sid][0] == tokens, sid
        assert there[sid][1] == pytest.approx(lps, abs=1e-4), sid


def test_a_colocated_step_trains_on_media(omni_ctx):
    from relax.services.topologies.colocated import run_colocated

    run_colocated(omni_ctx, progress=False, max_steps=2)
    assert ActorRole(omni_ctx).step_index == 2  # resumes after the 2 trained steps (checkpoint_every=2)


def test_media_rows_whose_prompt_changed_are_refused(omni_ctx):
    media = MediaInputs(omni_ctx.split("train"), omni_ctx.tokenizer, build_model(omni_ctx)[1],
                        omni_ctx.snapshot.load_media)
    sample = next(s for s in omni_ctx.split("train") if s.images)
    with pytest.raises(ValueError, match="prompt tokens differ"):
        media(f"{sample.id}@0.0", [1, 2, 3], 3)
    text = next(s for s in omni_ctx.split("train") if s.task == "arithmetic")
    assert media(f"{text.id}@0.0", [1, 2, 3], 3) is None


def test_engine_first_token_of_a_text_prompt_on_the_omni_model():
    # the omni thinker ignores logits_to_keep and returns logits for every prompt position; the
    # engine once took position 0's logits for the first sampled token
    from relax.config import ModelConfig
    from relax.engines.native.engine import NativeEngine
    from relax.engines.types import GenerateRequest, SamplingParams
    from relax.models import build_policy, build_tokenizer

    tok = build_tokenizer("bpe-tiny")
    model, _ = build_policy(ModelConfig(name_or_path="tiny-omni", family="qwen2_5_omni"), tok, seed=0)
    engine = NativeEngine(model, tok, max_batch_size=2, max_seq_len=64, seed=0, background=False)
    ids = tok("What is 3 + 4?", add_special_tokens=False)["input_ids"]
    future = engine.submit(GenerateRequest("r", ids, SamplingParams(max_new_tokens=2)))
    while engine.step():
        pass
    c = future.result()[0]
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([ids + c.output_ids])).logits[0].float(), -1)
    expected = [float(logp[len(ids) - 1 + i, t]) for i, t in enumerate(c.output_ids)]
    assert c.logprobs == pytest.approx(expected, abs=1e-4)


def test_a_frozen_vision_encoder_keeps_its_weights_while_the_rest_trains(tmp_path):
    from relax.services.topologies.colocated import run_colocated

    ctx = RunContext(tiny_config(f"file://{tmp_path}/root", "frozen", *OMNI, "trainer.freeze_encoders=[vision]",
                                # an entropy bonus: a gradient even when every reward of a tiny run is 0
                                "algorithm.entropy_coef=0.1"))
    ensure_run(ctx)
    run_colocated(ctx, progress=False, max_steps=2)
    store = ctx.weights()
    first, _ = store.load(0)
    last, _ = store.load(store.latest())
    moved = {n for n in first if not torch.equal(torch.as_tensor(first[n]), torch.as_tensor(last[n]))}
    visual = {n for n in first if "visual" in n.split(".")}
    assert visual and not (moved & visual)  # the vision tower is exactly as built
    assert any("audio_tower" in n.split(".") for n in moved)  # the audio tower still trains
    assert any("language_model" in n.split(".") for n in moved)


@pytest.mark.parametrize("warmup", [0, 2])  # 2: the tower's ramped parameter groups are resumed too
def test_a_vision_encoder_thaws_at_its_step_and_stays_thawed_across_resumes(tmp_path, warmup):
    from relax.services.topologies.colocated import run_colocated

    ctx = RunContext(tiny_config(f"file://{tmp_path}/root", "thaw", *OMNI, "trainer.freeze_encoders=[vision]",
                                 "trainer.thaw_encoders_at=2", "trainer.total_steps=6", "algorithm.entropy_coef=0.1",
                                 f"trainer.thaw_warmup_steps={warmup}"))
    ensure_run(ctx)
    store = ctx.weights()

    def visual(version: int) -> dict[str, torch.Tensor]:
        return {n: torch.as_tensor(v) for n, v in store.load(version)[0].items() if "visual" in n.split(".")}

    def moved(a: dict, b: dict) -> set[str]:
        return {n for n in a if not torch.equal(a[n], b[n])}

    # each call is a fresh actor resuming from the checkpoint of the previous one (every 2 steps)
    run_colocated(ctx, progress=False, max_steps=2)  # steps 0-1: frozen
    v0, v2 = visual(0), visual(2)
    run_colocated(ctx, progress=False, max_steps=4)  # resumed exactly at the thaw step
    v4 = visual(4)
    run_colocated(ctx, progress=False)  # resumed after the thaw, the tower's Adam moments in the checkpoint
    v6 = visual(6)
    assert v0 and not moved(v0, v2)
    assert moved(v2, v4) and moved(v4, v6)


def test_shared_prefix_training_scores_media_rows_as_the_engine_did(tmp_path):
    from relax.services.topologies.colocated import run_colocated
    from relax.trainers.torch.prefix import PrefixMicroBatch

    ctx = _ctx(tmp_path, "trainer.micro_batch_layout=prefix", "algorithm.kl_coef=0.1", "algorithm.entropy_coef=0.01")
    actor, adv, rollout = ActorRole(ctx), AdvantageRole(ctx), RolloutRole(ctx)
    try:
        rollout.step(timeout=30)
        adv.step(timeout=30)
        group = ConsumerGroup(ctx.queue(), "probe", ["tokens", "loss_mask", "logprobs", "advantages", "prompt_len"],
                              batch_groups=6, max_staleness=5)
        batch = to_rollout_batch(group.take(0, current_version=0, timeout=10), actor.media)
        group.close()
    finally:
        rollout.close()
        adv.close()
    mbs = actor.actor.trainer.micro_batches(batch)
    assert all(isinstance(mb, PrefixMicroBatch) for mb in mbs)
    assert sum(len(mb.prompts) for mb in mbs) == 6 and len(batch) == 12  # 6 prompts x 2 answers, each prompt once
    mine = compute_logprobs(actor.actor.model, mbs, len(batch))
    for sid, lp, old, mask in zip(batch.ids, mine, batch.old_logprobs, batch.loss_mask, strict=True):
        m = mask.bool()
        torch.testing.assert_close(lp[m], old[m], atol=1e-4, rtol=0, msg=sid)
    actor.close()
    # the whole loop (reference KL and entropy included) trains on the shared-prefix layout
    run_colocated(ctx, progress=False, max_steps=2)
    assert ActorRole(ctx).step_index == 2
