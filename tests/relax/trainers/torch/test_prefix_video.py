"""Shared-prefix training on video prompts (Qwen2.5-Omni thinker): frames with their audio track,
frames alone and an image prompt in one batch score and differentiate exactly like full rows, and
prompts whose videos carry a track never share a forward with ones that do not."""

import random

import torch

from relax.config import ModelConfig
from relax.data.suite import flash_beep, shapes
from relax.models import build_policy, build_tokenizer, prepare_inputs
from relax.models.video_inputs import audio_in_video
from relax.trainers.packing import micro_batches
from relax.trainers.torch.batch import RolloutBatch
from relax.trainers.torch.forward import compute_logprobs, token_logprobs
from relax.trainers.torch.prefix import plan_prefix


def _batch():
    tokenizer = build_tokenizer("bpe-tiny")
    model, processor = build_policy(ModelConfig(name_or_path="tiny-omni", family="qwen2_5_omni"), tokenizer, seed=0)
    config = flash_beep.CONFIGS[1]
    clip = flash_beep.draw_clip(random.Random(4), config)
    silent = flash_beep.encode_mp4(flash_beep.render_frames(clip, config), config.fps, None)
    prompts = [(s, [], [s.videos[0].data]) for s in flash_beep.generate(0, "train", 1, 1)]
    prompts.append(("<video> how many flashes?", [], [silent]))
    prompts += [(s, [s.images[0].data], []) for s in shapes.generate(0, "train", 1, 1)]
    g = torch.Generator().manual_seed(0)
    ids, masks, media = [], [], []
    for prompt, images, videos in prompts:
        kw = prepare_inputs(prompt, images, [], tokenizer, processor, videos=videos)
        extra = {k: v for k, v in kw.items() if k not in ("input_ids", "attention_mask")}
        for j in range(2):
            response = torch.randint(5, 200, (2 + j,), generator=g)
            ids.append(torch.cat([kw["input_ids"][0], response]))
            masks.append(torch.cat([torch.zeros(kw["input_ids"].shape[1]), torch.ones(2 + j)]))
            media.append(extra)
    return model, RolloutBatch(ids=[str(i) for i in range(len(ids))], input_ids=ids, loss_mask=masks, media=media)


def _grads_and_scores(model, mbs, batch):
    model.zero_grad()
    out = [None] * len(batch)
    for mb in mbs:
        for s, lp in zip(mb.spans, token_logprobs(model, mb).logprobs, strict=True):
            out[s.index] = lp
    sum((lp * m).sum() for lp, m in zip(out, batch.loss_mask, strict=True)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_prefix_layout_on_video_prompts_equals_full_rows():
    model, batch = _batch()
    flags = [audio_in_video(m) for m in batch.media]
    assert flags.count(True) == 2 and flags.count(False) == 4  # a clip with its track; a silent clip, an image
    rows = micro_batches(batch.input_ids, 8192, "bucket", media=batch.media)
    shared = plan_prefix(batch.input_ids, batch.loss_mask, batch.media, 8192)
    for mb in [*rows, *shared]:  # one kind of prompt per forward
        assert len({flags[s.index] for s in mb.spans}) == 1
    assert sum(len(mb.prompts) for mb in shared) == 3 and len(shared) == 2
    full = _grads_and_scores(model, rows, batch)
    mine = _grads_and_scores(model, shared, batch)
    assert any("visual" in n and g.abs().sum() > 0 for n, g in mine.items())
    assert any("audio_tower" in n and g.abs().sum() > 0 for n, g in mine.items())  # the clips' tracks train it
    assert full.keys() == mine.keys()
    for name in full:
        scale = max(1.0, full[name].abs().max().item())
        torch.testing.assert_close(mine[name], full[name], atol=1e-6 * scale, rtol=1e-4, msg=name)
    for x, y, m in zip(compute_logprobs(model, rows, len(batch)), compute_logprobs(model, shared, len(batch)),
                       batch.loss_mask, strict=True):
        torch.testing.assert_close(y * m, x * m, atol=1e-5, rtol=0)
