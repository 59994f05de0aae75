"""``/generate`` with ``stream: true``: cumulative SSE chunks that end in the non-streaming reply."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from relax.engines.server import build_native_engine, create_app
from tests.relax.engines.contract import InProcessServer, auth, save_tiny_model


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory):
    folder = save_tiny_model(Path(tmp_path_factory.mktemp("stream")) / "model")
    engine, processor = build_native_engine(str(folder), max_batch_size=8)
    engine.start()
    try:
        with InProcessServer(create_app(engine, str(folder), processor=processor)) as srv:
            yield srv.url
    finally:
        engine.stop()


def post(url: str, body: dict) -> bytes:
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                 headers=auth({"Content-Type": "application/json"}))
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.read()


def events(raw: bytes) -> list:
    out = []
    for block in raw.decode().split("\n\n"):
        if block.startswith("data: "):
            payload = block[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def test_stream_is_cumulative_and_ends_like_the_plain_reply(url):
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 5, "sampling_seed": 11,
                                                            "ignore_eos": True}, "return_logprob": True}
    plain = json.loads(post(url, body))
    chunks = events(post(url, {**body, "stream": True}))
    assert chunks[-1] == "[DONE]"
    progress, final = chunks[:-2], chunks[-2]
    assert [len(c["output_ids"]) for c in progress] == [1, 2, 3, 4, 5]  # one event per token, cumulative
    assert all(c["meta_info"]["finish_reason"] is None for c in progress)
    assert all(a["output_ids"] == b["output_ids"][: len(a["output_ids"])]
               for a, b in zip(progress, progress[1:], strict=False))
    assert final["output_ids"] == plain["output_ids"] == progress[-1]["output_ids"]
    assert final["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert len(final["meta_info"]["output_token_logprobs"]) == 5


def test_stream_with_n_samples_carries_the_index(url):
    chunks = events(post(url, {"input_ids": [1, 2, 3], "stream": True,
                               "sampling_params": {"max_new_tokens": 3, "n": 2, "ignore_eos": True}}))
    assert {c["index"] for c in chunks[:-1]} == {0, 1} and chunks[-1] == "[DONE]"
    finals = [c for c in chunks[:-1] if c["meta_info"]["finish_reason"] is not None]
    assert sorted(c["index"] for c in finals) == [0, 1]


def test_stream_refuses_a_batch(url):
    with pytest.raises(urllib.error.HTTPError) as e:
        post(url, {"input_ids": [[1, 2], [3, 4]], "stream": True})
    assert e.value.code == 400 and b"stream=true takes one prompt" in e.value.read()


def test_special_tokens_are_kept_when_asked_as_slime_asks(url):
    # slime sends skip_special_tokens=false and spaces_between_special_tokens=false by default (a 400 before).
    # A random 300-token model sampled hot writes special tokens now and then: with them kept, the text is the
    # tokenizer's decoding with specials, streamed and not, and it differs from the default's where one appeared
    from transformers import AutoTokenizer

    sp = {"max_new_tokens": 24, "temperature": 1.5, "sampling_seed": 3, "ignore_eos": True, "n": 8}
    plain = json.loads(post(url, {"input_ids": [5, 6, 7, 8], "sampling_params": sp}))
    kept_sp = {**sp, "skip_special_tokens": False, "spaces_between_special_tokens": False}
    kept = json.loads(post(url, {"input_ids": [5, 6, 7, 8], "sampling_params": kept_sp}))
    streamed = [e for e in events(post(url, {"input_ids": [5, 6, 7, 8], "sampling_params": kept_sp, "stream": True}))
                if e != "[DONE]"]
    tok = AutoTokenizer.from_pretrained(url_model_dir(url))
    specials = set(tok.all_special_ids)
    assert [r["output_ids"] for r in kept] == [r["output_ids"] for r in plain]  # decoding changes no token
    for r, p in zip(kept, plain, strict=True):
        assert r["text"] == tok.decode(r["output_ids"], skip_special_tokens=False)
        assert p["text"] == tok.decode(p["output_ids"], skip_special_tokens=True)
    assert any(set(r["output_ids"]) & specials and r["text"] != p["text"] for r, p in zip(kept, plain, strict=True))
    last = {e["index"]: e["text"] for e in streamed}  # the final event of each sample: its whole text
    assert [last[i] for i in range(8)] == [r["text"] for r in kept]
    with pytest.raises(urllib.error.HTTPError) as bad:
        post(url, {"input_ids": [5], "sampling_params": {"skip_special_tokens": "no"}})
    assert bad.value.code == 400


def url_model_dir(url: str) -> str:
    with urllib.request.urlopen(urllib.request.Request(url + "/get_model_info", headers=auth()), timeout=30) as r:
        return json.loads(r.read())["model_path"]
