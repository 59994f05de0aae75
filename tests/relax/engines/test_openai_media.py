"""The official ``openai`` client sends an image part and an audio part to a multimodal model
(the tiny Qwen2.5-Omni thinker) served by the native server, and the media change the answer."""

from __future__ import annotations

import base64
import io
import os
from pathlib import Path

import numpy as np
import openai
import pytest
from PIL import Image

from relax.config_loader import load_config
from relax.engines.server import build_native_engine, create_app
from relax.models import build_policy, build_tokenizer
from tests.relax.engines.contract import InProcessServer, data_uri, wav_bytes


def noise_png(seed: int) -> bytes:
    pixels = (np.random.default_rng(seed).random((56, 56, 3)) * 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory):
    folder = Path(tmp_path_factory.mktemp("omni")) / "model"
    tok = build_tokenizer("bpe-tiny")
    model, _ = build_policy(load_config(None, ["model.name_or_path=tiny-omni"]).model, tok, seed=0)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    engine, processor = build_native_engine(str(folder), max_batch_size=4)
    assert processor is not None  # loaded back from the folder as a multimodal model
    engine.start()
    try:
        with InProcessServer(create_app(engine, str(folder), processor=processor)) as srv:
            yield openai.OpenAI(base_url=srv.url + "/v1", api_key=os.environ["RELAX_ENGINE_TOKEN"], max_retries=0, timeout=60)
    finally:
        engine.stop()


def ask(client: openai.OpenAI, image: bytes):
    content = [{"type": "text", "text": "what do you see and hear?"},
               {"type": "image_url", "image_url": {"url": data_uri(image)}},
               {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav_bytes()).decode(), "format": "wav"}}]
    return client.chat.completions.create(model="tiny-omni", messages=[{"role": "user", "content": content}],
                                          max_tokens=4, temperature=1.0, seed=3, logprobs=True)


def test_image_and_audio_parts_are_answered_and_matter(client):
    first = ask(client, noise_png(1))
    assert first.choices[0].finish_reason in ("stop", "length") and first.usage.prompt_tokens > 10
    again = ask(client, noise_png(1))
    other = ask(client, noise_png(2))
    lps = lambda r: [t.logprob for t in r.choices[0].logprobs.content]  # noqa: E731
    assert lps(again) == lps(first)  # same media, same seed: the same answer
    assert lps(other) != lps(first)  # another image: the model sees it
