"""Bad requests get a 400 naming the field, as JSON, and fail alone: the valid requests sent with them in the
same moment (so batched in the same engine step) answer 200 with the tokens they produce alone.

Against the native server as a real subprocess (``python -m relax.engines.server``, a tiny Qwen2 with a
64-token context)."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from tests.relax.engines.contract import auth, free_port, save_tiny_model, start_subprocess

GREEDY = {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(Path(tmp_path_factory.mktemp("validate")) / "model")


@pytest.fixture(scope="module")
def url(model_dir: Path):
    tmp = model_dir.parent
    port = free_port()
    proc, base = start_subprocess(["-m", "relax.engines.server", "--model-path", str(model_dir), "--port", str(port),
                                   "--max-batch-size", "16"], port, tmp / "server.log")
    yield base
    proc.terminate()
    proc.wait(timeout=30)


# each (route, body, words the 400's message must hold)
BAD = [
    ("/generate", {"input_ids": [1, 2, 100000], "sampling_params": GREEDY}, ["input_ids[2] = 100000"]),
    ("/generate", {"input_ids": [1, -3, 2], "sampling_params": GREEDY}, ["input_ids[1] = -3"]),
    (
        "/generate",
        {"input_ids": [1, 2], "sampling_params": {**GREEDY, "max_new_tokens": 2.5}},
        ["max_new_tokens must be an integer"],
    ),
    (
        "/generate",
        {"input_ids": [1, 2], "sampling_params": {**GREEDY, "max_new_tokens": 100000}},
        ["context length (64 tokens)", "at most 62"],
    ),
    (
        "/generate",
        {"input_ids": [1, 2], "sampling_params": {**GREEDY, "temperature": "hot"}},
        ["temperature must be a finite number"],
    ),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {**GREEDY, "n": 0}}, ["n must be >= 1"]),
    (
        "/generate",
        {"input_ids": [1, 2], "sampling_params": {**GREEDY, "regex": "a+"}},
        ["sampling_params.regex='a+' is not supported"],
    ),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {**GREEDY, "min_p": 1.5}}, ["min_p must be in [0, 1]"]),
    (
        "/generate",
        {"input_ids": [1, 2], "sampling_params": GREEDY, "logprob_start_len": 0},
        ["logprob_start_len asks for prompt log-probs", "return_logprob=true"],
    ),
    (
        "/generate",
        {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 0}, "logprob_start_len": 2, "return_logprob": True},
        ["logprob_start_len=2 is not below prompt 0's length (2)"],
    ),
    (
        "/generate",
        {"input_ids": [1, 2], "sampling_params": {**GREEDY, "stop_token_ids": [99999]}},
        ["stop_token_ids[0] = 99999"],
    ),
    ("/v1/chat/completions", {"messages": "hello"}, ["messages must be a non-empty list"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, ["messages[0].content must be"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": ["hi"]}]}, ["messages[0].content[0] must be"]),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
        ["content[0].image_url must be a dict"],
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "5"},
        ["request.max_tokens must be an integer"],
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2.5},
        ["request.max_tokens must be an integer"],
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"},
        ["request.temperature must be a finite number"],
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 0}, ["n must be an integer >= 1"]),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000},
        ["exceeds the model's context length"],
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": 100}},
        ["logit_bias", "not supported"],
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}},
        ["response_format", "not supported"],
    ),
]


def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers=auth({"Content-Type": "application/json"})
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize(("route", "body", "needles"), BAD, ids=[f"{r}-{i}" for i, (r, _, _) in enumerate(BAD)])
def test_a_bad_request_is_a_json_400_naming_the_field(url, route, body, needles):
    status, reply = post(url + route, body)
    assert status == 400, reply
    message = reply["error"]["message"]
    assert all(n in message for n in needles), message


def test_neutral_values_of_unsupported_fields_pass(url):
    # SGLang's frontend always sends the penalties at their neutral values; OpenAI clients send empty extras
    sp = {**GREEDY, "repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "min_p": 0.0,
          "regex": None, "json_schema": None}
    assert post(url + "/generate", {"input_ids": [1, 2, 3], "sampling_params": sp})[0] == 200
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logit_bias": {}, "tools": [],
            "response_format": {"type": "text"}}
    assert post(url + "/v1/chat/completions", chat)[0] == 200


def test_one_bad_request_fails_alone_in_a_batch_of_eight(url):
    # 8 concurrent requests, one of them invalid in one of the ways above: the 7 others answer 200 with the
    # tokens each produces alone (greedy), whatever the bad one was
    good = [{"input_ids": [1 + i, 2 + i, 3], "sampling_params": GREEDY} for i in range(7)]
    alone = [post(url + "/generate", b)[1]["output_ids"] for b in good]

    async def burst(bad: dict) -> list[tuple[int, dict]]:
        async with aiohttp.ClientSession(headers=auth()) as s:
            async def one(body: dict) -> tuple[int, dict]:
                async with s.post(url + "/generate", json=body) as r:
                    return r.status, await r.json()
            return await asyncio.gather(*(one(b) for b in [*good[:3], bad, *good[3:]]))

    for _, bad, _ in (b for b in BAD if b[0] == "/generate"):
        replies = asyncio.run(burst(bad))
        assert replies[3][0] == 400
        others = replies[:3] + replies[4:]
        assert [s for s, _ in others] == [200] * 7
        assert [r["output_ids"] for _, r in others] == alone


def get(url: str, headers: dict | None = None) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_the_server_is_guarded_and_answers_the_probe_routes(url):
    # create_app puts the guard in front: no token, no weight update (the served weights stay), no generation
    status, _ = get(url + "/get_model_info")
    assert status == 401
    req = urllib.request.Request(url + "/update_weights_from_disk", data=b'{"model_path": "/tmp"}',
                                 headers={"Content-Type": "application/json", "Authorization": "Bearer wrong"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    assert err.value.code == 401
    assert get(url + "/health")[0] == 200
    info = json.loads(get(url + "/get_server_info", auth())[1])
    assert info["context_length"] == 64 and info["engine"] == "relax-native" and info["weight_version"] != "/tmp"
    (load,) = json.loads(get(url + "/get_load", auth())[1])
    assert (load["num_reqs"], load["num_tokens"], load["dp_rank"]) == (0, 0, 0)
    assert "version" in json.loads(get(url + "/version", auth())[1])
    status, tokens = post(url + "/tokenize", {"prompt": "hello world"})
    assert status == 200 and tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] == 64
    status, text = get(url + "/metrics", auth())
    assert status == 200 and "relax_engine_load 0" in text and 'relax_engine_info{model_path=' in text


def test_generate_returns_top_logprobs_in_sglangs_shape(url):
    body = {"input_ids": [5, 6, 7], "sampling_params": GREEDY, "return_logprob": True, "top_logprobs_num": 2}
    status, reply = post(url + "/generate", body)
    assert status == 200
    meta = reply["meta_info"]
    assert len(meta["output_top_logprobs"]) == len(reply["output_ids"]) == 4
    for (lp, tok, _), row in zip(meta["output_token_logprobs"], meta["output_top_logprobs"], strict=True):
        assert len(row) == 2 and row[0][1] == tok and row[0][0] >= row[1][0]
        assert row[0][0] == pytest.approx(lp, abs=1e-6)


def test_a_prompt_is_scored_from_logprob_start_len_as_sglang_answers(url, model_dir):
    import torch
    from transformers import Qwen2ForCausalLM

    ids = [5, 6, 7, 8, 9]
    body = {"input_ids": [ids, ids], "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
            "logprob_start_len": 2, "top_logprobs_num": 3}
    status, reply = post(url + "/generate", body)
    assert status == 200 and len(reply) == 2 and reply[0]["meta_info"]["input_token_logprobs"] == \
        reply[1]["meta_info"]["input_token_logprobs"]
    meta = reply[0]["meta_info"]
    assert reply[0]["output_ids"] == [] and meta["output_token_logprobs"] == [] and meta["completion_tokens"] == 0
    # position j's entry is log p(ids[j] | ids[:j]) from the raw logits (temperature 1), as SGLang's
    with torch.no_grad():
        logp = torch.log_softmax(Qwen2ForCausalLM.from_pretrained(model_dir).eval()(
            torch.tensor([ids])).logits[0].float(), -1)
    assert [e[1] for e in meta["input_token_logprobs"]] == [7, 8, 9]
    for (lp, tok, _), row, j in zip(meta["input_token_logprobs"], meta["input_top_logprobs"], (2, 3, 4), strict=True):
        assert lp == pytest.approx(float(logp[j - 1, tok]), abs=1e-5)
        top = torch.topk(logp[j - 1], 3)
        assert [t for _, t, _ in row] == top.indices.tolist()
        assert [v for v, _, _ in row] == pytest.approx(top.values.tolist(), abs=1e-5)
    # from position 0: nothing predicts the first token, so its logprob is null (SGLang's form)
    status, whole = post(url + "/generate", {**body, "input_ids": ids, "logprob_start_len": 0})
    entries = whole["meta_info"]["input_token_logprobs"]
    assert status == 200 and entries[0][0] is None and whole["meta_info"]["input_top_logprobs"][0] is None
    assert [e[1] for e in entries] == ids and entries[2][0] == pytest.approx(
        meta["input_token_logprobs"][0][0], abs=1e-6
    )


def test_prompt_and_output_logprobs_come_in_one_generate(url):
    # as SGLang serves it: logprob_start_len with generation answers the prompt's log-probs from that position
    # beside the sampled tokens' (a 400 before); they equal scoring alone (max_new_tokens 0) and the output
    # equals generating alone, for n = 2 samples of two prompts
    ids = [5, 6, 7, 8, 9]
    sp = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True, "n": 2}
    base = {"input_ids": [ids, ids[:4]], "return_logprob": True, "logprob_start_len": 1, "top_logprobs_num": 2}
    status, both = post(url + "/generate", {**base, "sampling_params": sp})
    assert status == 200 and len(both) == 4  # two prompts x n=2, in order
    _, scored = post(url + "/generate", {**base, "sampling_params": {"max_new_tokens": 0}})
    _, generated = post(url + "/generate", {k: v for k, v in {**base, "sampling_params": sp}.items()
                                            if k != "logprob_start_len"})
    for k, row in enumerate(both):
        meta, alone = row["meta_info"], scored[k // 2]["meta_info"]
        assert meta["input_token_logprobs"] == alone["input_token_logprobs"]
        assert meta["input_top_logprobs"] == alone["input_top_logprobs"]
        assert row["output_ids"] == generated[k]["output_ids"] and len(meta["output_token_logprobs"]) == 4
    assert [e[1] for e in both[0]["meta_info"]["input_token_logprobs"]] == ids[1:]
