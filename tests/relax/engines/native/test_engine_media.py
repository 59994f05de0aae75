"""Media prompts through the native engine: exact logprobs and outputs that depend on the media."""

from __future__ import annotations

import io
import wave

import numpy as np
import pytest
import torch
from PIL import Image

from relax.config import load_config
from relax.engines.native.engine import NativeEngine
from relax.engines.types import GenerateRequest, SamplingParams
from relax.models import build_policy, build_tokenizer, prepare_inputs


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer("bpe-tiny")


def wav(freq: float) -> bytes:
    t = np.arange(16000) / 16000
    pcm = (0.5 * np.sin(2 * np.pi * freq * t) * 32767).astype(np.int16)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


def png(seed: int) -> bytes:
    pixels = (np.random.default_rng(seed).random((112, 112, 3)) * 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def run(model, tokenizer, processor, media: str, item: bytes):
    kw = {"images": [item], "audios": []} if media == "image" else {"images": [], "audios": [item]}
    inputs = prepare_inputs(f"<{media}> what is it?", tokenizer=tokenizer, processor=processor, **kw)
    ids = inputs.pop("input_ids")
    inputs.pop("attention_mask")
    engine = NativeEngine(model, tokenizer, max_batch_size=4, background=False)
    future = engine.submit(GenerateRequest("m", ids[0].tolist(), SamplingParams(max_new_tokens=6, sampling_seed=1),
                                           mm_inputs=dict(inputs)))
    engine.run_until_idle()
    return ids, inputs, future.result()[0]


@pytest.mark.parametrize("name,media,items", [
    ("tiny-qwen2-audio", "audio", (wav(440), wav(1760))),
    ("tiny-qwen2-vl", "image", (png(1), png(2))),
    ("tiny-omni", "image", (png(1), png(2))),  # Qwen2.5-Omni thinker: 3-D rope with a non-zero offset
])
def test_media_prompts_are_exact_and_matter(tokenizer, name, media, items):
    model, processor = build_policy(load_config(None, [f"model.name_or_path={name}"]).model, tokenizer, 0)
    model.eval()
    ids, inputs, first = run(model, tokenizer, processor, media, items[0])
    full = torch.cat([ids, torch.tensor([first.output_ids])], dim=1)
    with torch.no_grad():
        logits = model(input_ids=full, attention_mask=torch.ones_like(full), **inputs).logits[0].float()
    ref = torch.log_softmax(logits, -1)[ids.shape[1] - 1:-1].gather(-1, torch.tensor(first.output_ids)[:, None])
    assert torch.allclose(torch.tensor(first.logprobs), ref.squeeze(-1), atol=1e-4)
    _, _, second = run(model, tokenizer, processor, media, items[1])
    # same text, same seed, other media: the model's distribution (hence logprobs or tokens) changes
    assert (second.output_ids, second.logprobs) != (first.output_ids, first.logprobs)


def test_requests_of_one_media_prompt_share_one_prefill(tokenizer):
    # the rollout sends a prompt's n samples as n requests holding the same encoding: the engine
    # runs the vision tower and the prompt once for all of them, and each still samples exactly
    # what it samples alone
    model, processor = build_policy(load_config(None, ["model.name_or_path=tiny-omni"]).model, tokenizer, 0)
    model.eval()
    inputs = prepare_inputs("<image> what is it?", [png(3)], [], tokenizer, processor)
    ids = inputs.pop("input_ids")[0].tolist()
    inputs.pop("attention_mask")
    mm = dict(inputs)
    towers = []
    model.model.visual.register_forward_hook(lambda *_: towers.append(1))

    def reqs():
        return [GenerateRequest(f"r{i}", ids, SamplingParams(max_new_tokens=5, temperature=1.0, sampling_seed=10 + i),
                                mm_inputs=mm) for i in range(4)]

    engine = NativeEngine(model, tokenizer, max_batch_size=8, background=False)
    together = [engine.submit(r) for r in reqs()]
    engine.run_until_idle()
    assert len(towers) == 1  # one prefill for the four requests
    alone = []
    for r in reqs():
        f = engine.submit(r)
        engine.run_until_idle()
        alone.append(f)
    assert len(towers) == 5
    for a, b in zip(together, alone, strict=True):
        a, b = a.result()[0], b.result()[0]
        assert a.output_ids == b.output_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert len({tuple(f.result()[0].output_ids) for f in together}) > 1  # their own sampling streams


def test_distinct_media_prompts_prefill_as_one_batch_and_sample_what_they_sample_alone(tokenizer):
    # prompts of different lengths, an image and an audio clip, in one right-padded prefill:
    # each row keeps its own 3-D rope offset and its tokens and logprobs equal a lone prefill's
    model, processor = build_policy(load_config(None, ["model.name_or_path=tiny-omni"]).model, tokenizer, 0)
    model.eval()
    prompts = [("<image> what is it?", [png(4)], []), ("<audio> which note is this, low or high?", [], [wav(880)]),
               ("<image> and this one?", [png(5)], [])]
    requests = []
    for i, (text, images, audios) in enumerate(prompts):
        inputs = prepare_inputs(text, images, audios, tokenizer, processor)
        ids = inputs.pop("input_ids")[0].tolist()
        inputs.pop("attention_mask")
        requests.append((f"p{i}", ids, dict(inputs)))
    assert len({len(ids) for _, ids, _ in requests}) == 3
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))

    def submit(engine, rid, ids, mm):
        return engine.submit(GenerateRequest(rid, ids, SamplingParams(max_new_tokens=5, temperature=1.0,
                                                                      sampling_seed=7, n=2), mm_inputs=mm))

    engine = NativeEngine(model, tokenizer, max_batch_size=8, background=False)
    together = [submit(engine, *r) for r in requests]
    engine.step()  # admits all three: one prefill forward, then the first decode forward
    assert len(calls) == 2
    engine.run_until_idle()
    for r, f in zip(requests, together, strict=True):
        alone = submit(engine, *r)
        engine.run_until_idle()
        for a, b in zip(f.result(), alone.result(), strict=True):
            assert a.output_ids == b.output_ids
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
