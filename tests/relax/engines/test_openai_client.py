"""The official ``openai`` client against ``/v1/chat/completions`` of the native server (in-process uvicorn)."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import openai
import pytest

from relax.engines.server import build_native_engine, create_app
from tests.relax.engines.contract import InProcessServer, data_uri, png_bytes, save_tiny_model, wav_bytes


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory):
    model_dir = save_tiny_model(Path(tmp_path_factory.mktemp("oai")) / "model")
    engine, processor = build_native_engine(str(model_dir), max_batch_size=8)
    engine.start()
    try:
        with InProcessServer(create_app(engine, str(model_dir), processor=processor)) as srv:
            yield openai.OpenAI(
                base_url=srv.url + "/v1", api_key=os.environ["RELAX_ENGINE_TOKEN"], max_retries=0, timeout=30
            )
    finally:
        engine.stop()


def test_text_chat(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello world"}],
                                       max_completion_tokens=5, temperature=0.0, logprobs=True, n=2)
    assert r.object == "chat.completion" and len(r.choices) == 2
    c = r.choices[0]
    assert c.message.role == "assistant" and isinstance(c.message.content, str)
    assert c.finish_reason in ("stop", "length") and r.choices[1].message.content == c.message.content
    assert r.usage.prompt_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert c.logprobs is not None and 1 <= len(c.logprobs.content) <= 5
    assert all(t.logprob <= 0 for t in c.logprobs.content)


def test_max_tokens_and_stop(client: openai.OpenAI) -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "1 + 2"}]}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=1, temperature=0.0)
    assert r.usage.completion_tokens == 1
    full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0.0)
    text = full.choices[0].message.content
    stop = next((text[i:i + 2] for i in range(len(text) - 1) if text[i:i + 2].strip()), None)
    if stop and full.choices[0].finish_reason == "length":
        r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0.0, stop=[stop])
        assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].message.content


def test_image_and_audio_parts(client: openai.OpenAI) -> None:
    """Both parts are decoded and validated; this text-only model then refuses them by name (400)."""
    content = [
        {"type": "text", "text": "what is shown and heard?"},
        {"type": "image_url", "image_url": {"url": data_uri(png_bytes())}},
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav_bytes()).decode(), "format": "wav"}},
    ]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}], max_tokens=2)
    assert e.value.status_code == 400 and "takes no images and audio" in str(e.value)


def test_malformed_media_and_long_prompt(client: openai.OpenAI) -> None:
    bad = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,!!!!"}}]
    with pytest.raises(openai.BadRequestError, match=r"image_url\[0\]"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": bad}])
    notpng = [{"type": "image_url", "image_url": {"url": data_uri(b"not an image")}}]
    with pytest.raises(openai.BadRequestError, match=r"image_data\[0\] is not a decodable image"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": notpng}])
    badwav = [{"type": "input_audio", "input_audio": {"data": base64.b64encode(b"RIFFxx").decode(), "format": "wav"}}]
    with pytest.raises(openai.BadRequestError, match=r"audio_data\[0\]"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": badwav}])
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello world " * 60}])


def test_chat_streaming_pieces_add_up_to_the_reply(client: openai.OpenAI) -> None:
    # greedy: the streamed deltas of each of n=2 samples concatenate to the non-streaming text, the first delta
    # names the role, only the last carries a finish_reason; with a stop string, nothing of it is streamed
    msgs = [{"role": "user", "content": "the quick brown fox"}]
    full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0.0, n=2)
    text = full.choices[0].message.content
    stops = [None] + ([text[2:4]] if len(text) >= 4 and text[2:4].strip() else [])
    for stop in stops:
        expected = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0.0, n=2,
                                                  stop=stop)
        pieces: dict[int, list[str]] = {0: [], 1: []}
        finishes: dict[int, list] = {0: [], 1: []}
        roles = []
        for chunk in client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0.0, n=2,
                                                    stop=stop, stream=True):
            assert chunk.object == "chat.completion.chunk"
            for ch in chunk.choices:
                pieces[ch.index].append(ch.delta.content or "")
                finishes[ch.index].append(ch.finish_reason)
                roles.append(ch.delta.role)
        for c in expected.choices:
            assert "".join(pieces[c.index]) == c.message.content
            assert finishes[c.index][-1] == c.finish_reason and all(f is None for f in finishes[c.index][:-1])
        assert roles.count("assistant") == 2


def test_text_completions_and_their_stream(client: openai.OpenAI) -> None:
    r = client.completions.create(model="tiny", prompt="1 + 2 =", max_tokens=5, temperature=0.0, logprobs=0)
    c = r.choices[0]
    assert r.object == "text_completion" and isinstance(c.text, str) and r.usage.completion_tokens >= 1
    assert len(c.logprobs.token_logprobs) == r.usage.completion_tokens and all(
        x <= 0 for x in c.logprobs.token_logprobs
    )
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model="tiny", prompt="1 + 2 =", max_tokens=5, temperature=0.0, stream=True))
    assert streamed == c.text
    ids = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=3, temperature=0.0)
    assert ids.usage.prompt_tokens == 3
    top = client.completions.create(model="tiny", prompt="1 + 2 =", max_tokens=3, temperature=0.0, logprobs=3)
    for row, chosen, lp in zip(top.choices[0].logprobs.top_logprobs, top.choices[0].logprobs.tokens,
                               top.choices[0].logprobs.token_logprobs, strict=True):
        assert len(row) <= 3 and max(row.values()) == pytest.approx(lp, abs=1e-6) and chosen in row  # greedy
    with pytest.raises(openai.BadRequestError, match=r"prompt\[1\] = 99999"):
        client.completions.create(model="tiny", prompt=[5, 99999], max_tokens=2)


def test_chat_top_logprobs(client: openai.OpenAI) -> None:
    # greedy: each sampled token is its position's likeliest, so it heads its top-3 list, which is sorted
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=4,
                                       temperature=0.0, logprobs=True, top_logprobs=3)
    for entry in r.choices[0].logprobs.content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert entry.top_logprobs[0].token == entry.token and tops[0] == pytest.approx(entry.logprob, abs=1e-6)


def test_stream_options_include_usage_ends_the_stream_with_the_usage(client: openai.OpenAI) -> None:
    # as OpenAI streams it: usage null on every content chunk, then one chunk without choices whose usage is the
    # non-streamed reply's; for chat (n=2) and for text completions
    msgs = [{"role": "user", "content": "the quick brown fox"}]
    plain = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0.0, n=2)
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0.0, n=2,
                                                 stream=True, stream_options={"include_usage": True}))
    assert all(c.usage is None and c.choices for c in chunks[:-1])
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        plain.usage.prompt_tokens, plain.usage.completion_tokens, plain.usage.total_tokens)
    text = list(client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=3, temperature=0.0, stream=True,
                                          stream_options={"include_usage": True}))
    plain_text = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=3, temperature=0.0)
    assert text[-1].choices == [] and text[-1].usage.prompt_tokens == 3
    assert text[-1].usage.completion_tokens == plain_text.usage.completion_tokens
    unasked = list(client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=3, temperature=0.0,
                                             stream=True))
    assert all(c.choices for c in unasked)  # no usage chunk unless asked for
    with pytest.raises(openai.BadRequestError, match="include_usage is only allowed when stream is true"):
        client.chat.completions.create(
            model="tiny", messages=msgs, max_tokens=2, stream_options={"include_usage": True}
        )
    with pytest.raises(openai.BadRequestError, match="stream_options must be an object"):
        client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, stream=True,
                                       stream_options={"include_usage": True, "other": 1})


def test_any_model_name_is_served_and_echoed_as_sglang_does(client: openai.OpenAI) -> None:
    # SGLang 0.5.23's chat and text routes neither check `model` nor replace it: replies name the request's
    msgs = [{"role": "user", "content": "hello"}]
    r = client.chat.completions.create(model="not-served", messages=msgs, max_tokens=2)
    assert r.model == "not-served"
    chunks = list(client.chat.completions.create(model="other", messages=msgs, max_tokens=2, stream=True))
    assert {c.model for c in chunks} == {"other"}
    assert client.completions.create(model="x/y", prompt=[5, 6], max_tokens=2).model == "x/y"
    served = client.models.list().data[0].id  # what /v1/models lists is the model path
    assert served.endswith("model") and served != "not-served"
    with pytest.raises(openai.BadRequestError, match="model must be a string"):
        client.chat.completions.create(model=3, messages=msgs, max_tokens=2)  # type: ignore[arg-type]
