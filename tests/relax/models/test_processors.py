"""prepare_inputs: placeholder expansion, media reaching the logits, clear errors on bad media."""

from __future__ import annotations

import io
import os
import wave

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from relax.config import ModelConfig  # noqa: E402
from relax.data.suite import generate_suite  # noqa: E402
from relax.models.builders import build_policy  # noqa: E402
from relax.models.processors import audio_token_count, decode_wav, prepare_inputs  # noqa: E402
from relax.models.tokenizers import build_tokenizer  # noqa: E402

MODELS = {
    "vl": ("tiny-qwen2-vl", "qwen2_5_vl"),
    "audio": ("tiny-qwen2-audio", "qwen2_audio"),
    "omni": ("tiny-omni", "qwen2_5_omni"),
}


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer("bpe-tiny")


@pytest.fixture(scope="module")
def models(tok):
    return {k: build_policy(ModelConfig(name_or_path=n, family=f), tok, seed=0) for k, (n, f) in MODELS.items()}


@pytest.fixture(scope="module")
def suite():
    return generate_suite(["arithmetic", "shapes", "tones", "tool_lookup"], seed=0, train_per_task=2,
                          eval_per_task=0)["train"]


def _media(suite, kind: str) -> list[bytes]:
    return [r.data for s in suite for r in getattr(s, kind)]


def _last_logits(model, kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model(**kwargs).logits[0, -1]


def _wav(freq: float, seconds: float = 1.0, rate: int = 16_000) -> bytes:
    t = np.arange(int(rate * seconds)) / rate
    pcm = (0.5 * np.sin(2 * np.pi * freq * t) * 32767).astype(np.int16)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


@pytest.mark.parametrize("key", ["vl", "omni"])
def test_image_changes_logits(tok, models, suite, key: str) -> None:
    model, proc = models[key]
    img_a, img_b = _media(suite, "images")[:2]
    assert img_a != img_b
    msgs = [{"role": "user", "content": "<image>\nHow many shapes are in the image?"}]
    ka = prepare_inputs(msgs, [img_a], [], tok, proc)
    kb = prepare_inputs(msgs, [img_b], [], tok, proc)
    assert torch.equal(ka["input_ids"], kb["input_ids"])
    assert int((ka["input_ids"] == proc.image_token_id).sum()) == 16  # 56x56 -> 4x4 patches, no merge -> 16
    assert not torch.allclose(_last_logits(model, ka), _last_logits(model, kb))


@pytest.mark.parametrize("key", ["audio", "omni"])
def test_audio_changes_logits(tok, models, key: str) -> None:
    model, proc = models[key]
    msgs = [{"role": "user", "content": "<audio>\nHow many beeps do you hear?"}]
    ka = prepare_inputs(msgs, [], [_wav(440.0)], tok, proc)
    kb = prepare_inputs(msgs, [], [_wav(1500.0)], tok, proc)
    assert torch.equal(ka["input_ids"], kb["input_ids"])
    assert int((ka["input_ids"] == proc.audio_token_id).sum()) == audio_token_count(100) == 25  # 1 s = 100 frames
    assert ka["input_features"].shape == (1, 32, 200)
    assert not torch.allclose(_last_logits(model, ka), _last_logits(model, kb))


def test_omni_takes_image_and_audio_together(tok, models, suite) -> None:
    model, proc = models["omni"]
    kw = prepare_inputs("<|im_start|>user\n<image> <audio> count<|im_end|>\n", _media(suite, "images")[:1],
                        _media(suite, "audios")[:1], tok, proc)
    assert {"pixel_values", "image_grid_thw", "input_features", "feature_attention_mask"} <= kw.keys()
    assert torch.isfinite(_last_logits(model, kw)).all()


@pytest.mark.parametrize("key", ["vl", "audio", "omni"])
def test_suite_samples_run(tok, models, suite, key: str) -> None:
    model, proc = models[key]
    ran = 0
    for sample in suite:
        if (sample.images and proc.image_processor is None) or (sample.audios and proc.feature_extractor is None):
            continue
        kw = prepare_inputs(sample, [r.data for r in sample.images], [r.data for r in sample.audios], tok, proc)
        logits = _last_logits(model, kw)
        assert logits.shape == (len(tok),) and torch.isfinite(logits).all()
        ran += 1
    assert ran >= 6


def test_text_model_runs_suite_and_refuses_media(tok, suite) -> None:
    model, proc = build_policy(ModelConfig(), tok, seed=0)
    for sample in suite:
        if sample.images or sample.audios:
            with pytest.raises(ValueError, match="takes no"):
                prepare_inputs(sample, _media([sample], "images"), _media([sample], "audios"), tok, proc)
        else:
            _last_logits(model, prepare_inputs(sample, [], [], tok, proc))


def test_bad_media_names_the_item(tok, models, suite) -> None:
    _, proc = models["omni"]
    good_img, good_wav = _media(suite, "images")[0], _wav(440.0)
    two_images = "<image><image>"
    with pytest.raises(ValueError, match="image 1"):
        prepare_inputs(two_images, [good_img, b"not a png"], [], tok, proc)
    with pytest.raises(ValueError, match="audio 0"):
        prepare_inputs("<audio>", [], [b"RIFF garbage"], tok, proc)
    with pytest.raises(ValueError, match="audio 1"):
        prepare_inputs("<audio><audio>", [], [good_wav, good_img], tok, proc)
    with pytest.raises(ValueError, match="placeholders"):
        prepare_inputs("<image>", [], [], tok, proc)


def test_wav_decoding_resamples_and_mixes() -> None:
    x = decode_wav(_wav(440.0, seconds=0.5, rate=8000), 0)
    assert x.dtype == np.float32 and len(x) == 8000 and np.abs(x).max() <= 1.0


def test_tiny_vision_models_map_white_to_zero_and_keep_it_in_their_checkpoint(tok, models, tmp_path) -> None:
    from PIL import Image

    from relax.models.processors import build_media_processor

    buf = io.BytesIO()
    Image.new("RGB", (56, 56), (255, 255, 255)).save(buf, format="PNG")
    sample = generate_suite(["shapes"], seed=0, train_per_task=1, eval_per_task=0)["train"][0]
    model, processor = models["omni"]
    white = prepare_inputs(sample, [buf.getvalue()], [], tok, processor)["pixel_values"]
    assert torch.count_nonzero(white) == 0  # (1 - mean 1) / std 0.5 = 0 for every channel
    model.save_pretrained(tmp_path)  # the setting travels with the checkpoint's config.json
    reloaded = build_policy(ModelConfig(name_or_path=str(tmp_path), family="qwen2_5_omni"), tok, seed=0)[1]
    assert list(reloaded.image_processor.image_mean) == [1.0, 1.0, 1.0]
    # a config without the setting (a real Qwen checkpoint) keeps the processor's CLIP constants:
    # white is (1 - 0.48145466) / 0.26862954 = 1.93 in the red channel
    del model.config.relax_image_norm
    clip = build_media_processor(model.config, tok)
    model.config.relax_image_norm = {"mean": [1.0, 1.0, 1.0], "std": [0.5, 0.5, 0.5]}  # the module fixture is shared
    red = prepare_inputs(sample, [buf.getvalue()], [], tok, clip)["pixel_values"][0, 0]
    assert float(red) == pytest.approx((1 - 0.48145466) / 0.26862954, abs=1e-4)
