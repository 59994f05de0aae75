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

from relax.config import load_config
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
            yield openai.OpenAI(
                base_url=srv.url + "/v1", api_key=os.environ["RELAX_ENGINE_TOKEN"], max_retries=0, timeout=60
            )
    finally:
        engine.stop()


def ask(client: openai.OpenAI, image: bytes):
    content = [
        {"type": "text", "text": "what do you see and hear?"},
        {"type": "image_url", "image_url": {"url": data_uri(image)}},
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav_bytes()).decode(), "format": "wav"}},
    ]
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


def mp3_of(seconds: float, rate: int = 16000) -> bytes:
    """A 440 Hz tone at half scale, mp3-encoded with PyAV (FFmpeg's encoder)."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp3") as out:
        stream = out.add_stream("mp3", rate=rate)
        stream.layout = "mono"
        t = np.arange(int(seconds * rate)) / rate
        frame = av.AudioFrame.from_ndarray((0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)[None, :],
                                           format="flt", layout="mono")
        frame.sample_rate = rate
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            out.mux(packet)
    return buf.getvalue()


def test_an_mp3_part_decodes_to_the_wav_the_processor_reads():
    import wave

    from relax.engines.audio import mp3_to_wav

    with wave.open(io.BytesIO(mp3_to_wav(mp3_of(1.0, rate=22050), 0))) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 16000)
        pcm = np.frombuffer(w.readframes(w.getnframes()), "<i2") / 32767
    assert abs(len(pcm) - 16000) <= 1600  # one second, give or take the codec's padding
    assert 0.4 < np.abs(pcm).max() < 0.6  # the tone's half scale survived
    spectrum = np.abs(np.fft.rfft(pcm[:16000 if len(pcm) >= 16000 else len(pcm)]))
    assert abs(np.argmax(spectrum) * 16000 / min(len(pcm), 16000) - 440) < 5  # and its pitch


def test_mp3_parts_are_answered_and_bad_ones_named(client, monkeypatch):
    # OpenAI's two input_audio formats are wav and mp3: an mp3 part is answered (a 400 before)
    def ask_audio(data: bytes, fmt: str):
        content = [{"type": "text", "text": "what do you hear?"},
                   {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}]
        return client.chat.completions.create(model="tiny-omni", messages=[{"role": "user", "content": content}],
                                              max_tokens=2, temperature=0.0)

    short, longer = ask_audio(mp3_of(1.0), "mp3"), ask_audio(mp3_of(3.0), "mp3")
    assert longer.usage.prompt_tokens > short.usage.prompt_tokens  # the audio reached the model as tokens
    with pytest.raises(openai.BadRequestError, match=r"input_audio\[0\] is not a decodable mp3 file"):
        ask_audio(b"\x00" * 400, "mp3")
    with pytest.raises(openai.BadRequestError, match=r"input_audio\[0\]\.format must be 'wav' or 'mp3'"):
        ask_audio(wav_bytes(), "flac")
    monkeypatch.setattr("relax.engines.audio.MAX_SECONDS", 2.0)
    with pytest.raises(openai.BadRequestError, match=r"input_audio\[0\] lasts more than 2 s"):
        ask_audio(mp3_of(3.0), "mp3")
