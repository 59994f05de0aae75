"""Video prompts through the native engine: logprobs equal to an HF forward for Qwen2.5-VL and the
Qwen2.5-Omni thinker (frames alone, and frames with their audio track interleaved in time), a shared
prefill for a prompt's n samples, and a prefill batch that mixes the two kinds of video prompt."""

from __future__ import annotations

import pytest
import torch

from relax.config import load_config
from relax.data.suite import flash_beep
from relax.engines.native.engine import NativeEngine
from relax.engines.types import GenerateRequest, SamplingParams
from relax.models import build_policy, build_tokenizer, prepare_inputs
from relax.models.video_inputs import AUDIO_IN_VIDEO, model_media_kwargs

CONFIG = flash_beep.CONFIGS[1]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer("bpe-tiny")


@pytest.fixture(scope="module")
def models(tokenizer):
    return {name: build_policy(load_config(None, [f"model.name_or_path={name}"]).model, tokenizer, 0)
            for name in ("tiny-qwen2-vl", "tiny-omni")}


@pytest.fixture(scope="module")
def clips():
    """Two flash_beep clips as MP4 with their track, and the first again without one."""
    samples = flash_beep.generate(0, "train", 2, 1)
    draws = [s.videos[0].data for s in samples]
    import random

    clip = flash_beep.draw_clip(random.Random(5), CONFIG)
    silent = flash_beep.encode_mp4(flash_beep.render_frames(clip, CONFIG), CONFIG.fps, None)
    return {"track": draws[0], "other": draws[1], "silent": silent}


def encode(tokenizer, processor, video: bytes, text: str = "<video> how many flashes?"):
    inputs = prepare_inputs(text, [], [], tokenizer, processor, videos=[video])
    ids = inputs.pop("input_ids")[0].tolist()
    inputs.pop("attention_mask")
    return ids, dict(inputs)


def generate(model, tokenizer, requests, n: int = 1, max_batch_size: int = 8):
    engine = NativeEngine(model, tokenizer, max_batch_size=max_batch_size, background=False)
    futures = [engine.submit(GenerateRequest(f"r{i}", ids, SamplingParams(max_new_tokens=6, temperature=1.0,
                                                                          sampling_seed=3, n=n), mm_inputs=mm))
               for i, (ids, mm) in enumerate(requests)]
    engine.run_until_idle()
    return [f.result() for f in futures]


def hf_logprobs(model, ids, mm, out_ids):
    full = torch.tensor([ids + out_ids])
    with torch.no_grad():
        logits = model(input_ids=full, attention_mask=torch.ones_like(full), **model_media_kwargs(mm)).logits[0]
    lp = torch.log_softmax(logits.float(), -1)[len(ids) - 1:-1]
    return lp.gather(-1, torch.tensor(out_ids)[:, None]).squeeze(-1)


@pytest.mark.parametrize("name,video", [("tiny-qwen2-vl", "track"), ("tiny-omni", "track"), ("tiny-omni", "silent")])
def test_video_prompt_logprobs_equal_an_hf_forward(tokenizer, models, clips, name, video):
    model, processor = models[name]
    ids, mm = encode(tokenizer, processor, clips[video])
    assert mm["video_grid_thw"].tolist() == [[6, 4, 4]]  # 12 frames of 56x56: 6 temporal patches of 4x4
    # Omni interleaves the clip's track (50 audio tokens for 2 s); VL and a silent clip do not
    with_track = name == "tiny-omni" and video == "track"
    assert (AUDIO_IN_VIDEO in mm) == with_track == ("input_features" in mm)
    assert ids.count(processor.audio_token_id or -1) == (50 if with_track else 0)
    (first,) = generate(model, tokenizer, [(ids, mm)])[0]
    ref = hf_logprobs(model, ids, mm, first.output_ids)
    assert torch.allclose(torch.tensor(first.logprobs), ref, atol=1e-4)
    # the frames matter: another clip under the same text and seed changes what the model does
    other_ids, other_mm = encode(tokenizer, processor, clips["other"])
    (second,) = generate(model, tokenizer, [(other_ids, other_mm)])[0]
    assert (second.output_ids, second.logprobs) != (first.output_ids, first.logprobs)


def test_a_video_prompts_samples_share_one_prefill_and_mixed_kinds_batch_apart(tokenizer, models, clips):
    # Omni takes one use_audio_in_video flag per forward: a prompt with a track and one without are
    # admitted together but prefill in separate batches, and each samples what it samples alone
    model, processor = models["tiny-omni"]
    requests = [encode(tokenizer, processor, clips["track"]), encode(tokenizer, processor, clips["silent"]),
                encode(tokenizer, processor, clips["other"], "<video> and the colour at the beep?")]
    towers = []
    hook = model.model.visual.register_forward_hook(lambda *_: towers.append(1))
    try:
        together = generate(model, tokenizer, requests, n=3, max_batch_size=16)
        assert len(towers) == 2  # one prefill with the two track prompts (n=3 each), one for the silent one
        for request, outs in zip(requests, together, strict=True):
            alone = generate(model, tokenizer, [request], n=3)[0]
            for a, b in zip(outs, alone, strict=True):
                assert a.output_ids == b.output_ids
                assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    finally:
        hook.remove()


def test_bad_videos_name_the_item(tokenizer, models, clips):
    model, processor = models["tiny-omni"]
    with pytest.raises(ValueError, match="video 0: cannot decode"):
        prepare_inputs("<video> what?", [], [], tokenizer, processor, videos=[b"not a video at all"])
    with pytest.raises(ValueError, match="all have an audio track or none"):
        prepare_inputs("<video> <video>", [], [], tokenizer, processor, videos=[clips["track"], clips["silent"]])
    with pytest.raises(ValueError, match="1 <video> placeholders but 0 image"):
        prepare_inputs("<video> what?", [], [], tokenizer, processor)
    text_model = load_config(None, ["model.name_or_path=tiny-qwen2"]).model
    _, no_media = build_policy(text_model, tokenizer, 0)
    with pytest.raises(ValueError, match="takes no video"):
        prepare_inputs("<video> what?", [], [], tokenizer, no_media, videos=[clips["track"]])
