"""OpenAI ``/v1/chat/completions`` and ``/v1/models`` on top of an engine's :class:`Frontend`.

Chat messages (string content, or ``text``/``image_url``/``input_audio`` parts with data: URIs)
become the tokenizer's chat template with ``<image>``/``<audio>`` placeholders and the decoded
media; sampling options map onto SGLang's ``sampling_params`` names; completions come back as a
``chat.completion`` (or, with ``stream: true``, as ``chat.completion.chunk`` events). ``/v1/completions``
takes a plain prompt (text or token ids) the same way.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from fastapi import Body, FastAPI

from relax.engines.audio import mp3_to_wav
from relax.engines.frontend import Frontend, decode_media
from relax.engines.openai_stream import openai_stream, reply_model
from relax.engines.types import (
    EngineError,
    GenerateRequest,
    SamplingParams,
    check_types,
    refuse_unless_neutral,
)

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


# OpenAI request fields the native engine does not apply: accepted at their neutral value, a 400 naming
# the field otherwise (silently ignoring logit_bias, a JSON response_format or tools would answer wrongly)
NEUTRAL = {"logit_bias": (None, {}), "response_format": (None, {"type": "text"}), "tools": (None, []),
           "tool_choice": (None, "none", "auto")}


def check_stream_options(body: dict[str, Any]) -> None:
    """``stream_options``: only ``include_usage`` (a bool), and only with ``stream: true``, as OpenAI
    answers; the usage chunk itself is relax.engines.openai_stream's."""
    opts = body.get("stream_options")
    if opts is None:
        return
    if not isinstance(opts, dict) or set(opts) - {"include_usage"}:
        raise EngineError(f"stream_options must be an object with at most 'include_usage', got {opts!r}")
    if not isinstance(opts.get("include_usage", False), bool):
        raise EngineError(f"stream_options.include_usage must be true or false, got {opts['include_usage']!r}")
    if opts.get("include_usage") and not body.get("stream"):  # OpenAI's 400 too; a false one harms nothing
        raise EngineError("stream_options.include_usage is only allowed when stream is true (a reply that is "
                          "not streamed always carries its usage)")


def _check_message(i: int, m: Any) -> None:
    if not isinstance(m, dict):
        raise EngineError(f"messages[{i}] must be an object with 'role' and 'content'")
    if not isinstance(m.get("role", "user"), str):
        raise EngineError(f"messages[{i}].role must be a string")
    content = m.get("content")
    if content is not None and not isinstance(content, (str, list)):
        raise EngineError(f"messages[{i}].content must be a string or a list of content parts, got "
                          f"{type(content).__name__}")
    for j, p in enumerate(content if isinstance(content, list) else []):
        if not isinstance(p, dict):
            raise EngineError(f"messages[{i}].content[{j}] must be an object with a 'type'")
        for key, kind in (("text", str), ("image_url", dict), ("input_audio", dict)):
            if p.get("type") == key and not isinstance(p.get(key), kind):
                raise EngineError(f"messages[{i}].content[{j}].{key} must be a {kind.__name__}")


def check_chat_request(body: dict[str, Any]) -> None:
    """Shapes and types of a chat request, each error naming the field (a 400, never a 500)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise EngineError("messages must be a non-empty list of message objects")
    for i, m in enumerate(messages):
        _check_message(i, m)
    refuse_unless_neutral(body, NEUTRAL)
    check_stream_options(body)
    n = body.get("n", 1)
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise EngineError(f"n must be an integer >= 1, got {n!r}")


def chat_prompt(messages: list[dict[str, Any]]) -> tuple[list[dict[str, str]], list[bytes], list[bytes]]:
    """OpenAI messages -> (plain-text messages with <image>/<audio> placeholders, images, audios)."""
    msgs, images, audios = [], [], []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for p in content:
                kind = p.get("type")
                if kind == "text":
                    parts.append(p.get("text", ""))
                elif kind == "image_url":
                    url = (p.get("image_url") or {}).get("url", "")
                    images.append(decode_media(url, "image_url", len(images)))
                    parts.append("<image>")
                elif kind == "input_audio":
                    audio = p.get("input_audio") or {}
                    fmt = audio.get("format", "wav")
                    if fmt not in ("wav", "mp3"):
                        raise EngineError(f"input_audio[{len(audios)}].format must be 'wav' or 'mp3' (OpenAI's two), "
                                          f"got {fmt!r}")
                    raw = decode_media(audio.get("data", ""), "input_audio", len(audios))
                    audios.append(mp3_to_wav(raw, len(audios)) if fmt == "mp3" else raw)
                    parts.append("<audio>")
                else:
                    raise EngineError(f"unsupported content part type {kind!r}")
            content = "".join(parts)
        msgs.append({"role": m.get("role", "user"), "content": content or ""})
    return msgs, images, audios


async def chat_completion(fe: Frontend, body: dict[str, Any]) -> Any:
    """OpenAI ``/v1/chat/completions`` on top of the engine (``stream: true``: server-sent chunks)."""
    check_chat_request(body)
    reply_model(fe, body)  # a model that is not a string: 400 before any work
    params, explicit = sampling_of(body)
    msgs, images, audios = await asyncio.to_thread(chat_prompt, body["messages"])  # mp3 decodes off the loop

    def tokenize() -> tuple[list[int], dict | None]:  # off the event loop: a long prompt must not stall /health
        text = fe.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        return fe.tokenize(text, images, audios)

    ids, mm = await asyncio.to_thread(tokenize)
    fe.check_length(len(ids), params, explicit=explicit)
    req = GenerateRequest(rid=f"chatcmpl-{uuid.uuid4().hex}", input_ids=ids, params=params, mm_inputs=mm)
    if body.get("stream"):
        return openai_stream(fe, req, "chat.completion.chunk", body)
    completions = await fe.run(req)
    choices = []
    for c in completions:
        logprobs = None
        if body.get("logprobs"):
            toks = [fe.tokenizer.decode([t]) for t in c.output_ids]
            tops = c.top_logprobs or [[] for _ in toks]
            logprobs = {"content": [{"token": s, "logprob": float(lp), "bytes": list(s.encode()),
                                     "top_logprobs": [_entry(fe, t, x) for x, t in top]}
                                    for s, lp, top in zip(toks, c.logprobs, tops, strict=False)]}
        choices.append({"index": c.index, "message": {"role": "assistant",
                                                      "content": fe.decode(c.output_ids, c.finish_reason, True)},
                        "logprobs": logprobs, "finish_reason": _FINISH.get(c.finish_reason.get("type"), "stop"),
                        "matched_stop": c.finish_reason.get("matched")})
    return _reply(fe, req, "chat.completion", choices, completions, body)


def _reply(fe: Frontend, req: GenerateRequest, kind: str, choices: list[dict[str, Any]],
           completions: list[Any], body: dict[str, Any]) -> dict[str, Any]:
    """A non-streaming OpenAI reply of ``kind`` (``chat.completion`` or ``text_completion``) with its usage."""
    done, prompt = sum(len(c.output_ids) for c in completions), len(req.input_ids)
    return {
        "id": req.rid,
        "object": kind,
        "created": int(time.time()),
        "model": reply_model(fe, body),
        "choices": choices,
        "usage": {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done},
    }


def _entry(fe: Frontend, token: int, logprob: float) -> dict[str, Any]:
    text = fe.tokenizer.decode([token])
    return {"token": text, "logprob": float(logprob), "bytes": list(text.encode())}


def _by_text(fe: Frontend, row: list[tuple[float, int]]) -> dict[str, float]:
    """The legacy API keys top logprobs by token text; tokens that decode alike keep the likelier one."""
    out: dict[str, float] = {}
    for logprob, token in row:
        out.setdefault(fe.tokenizer.decode([token]), float(logprob))
    return out


def sampling_of(body: dict[str, Any]) -> tuple[SamplingParams, bool]:
    """OpenAI sampling fields -> (SamplingParams, whether max tokens was asked for explicitly)."""
    sp: dict[str, Any] = {"n": body.get("n") or 1, "stop": body.get("stop")}
    for src, dst in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"), ("seed", "sampling_seed"),
                     ("max_tokens", "max_new_tokens"), ("max_completion_tokens", "max_new_tokens"),
                     ("frequency_penalty", "frequency_penalty"), ("presence_penalty", "presence_penalty"),
                     ("top_logprobs", "top_logprobs_num")):
        if body.get(src) is not None:
            sp[dst] = body[src]
    # types under the caller's names (max_tokens, not the max_new_tokens it maps to)
    check_types(body, "request", ints=("max_tokens", "max_completion_tokens", "top_k", "seed", "n", "top_logprobs"),
                floats=("temperature", "top_p", "frequency_penalty", "presence_penalty"))
    return SamplingParams.from_json(sp), "max_new_tokens" in sp


async def text_completion(fe: Frontend, body: dict[str, Any]) -> Any:
    """OpenAI ``/v1/completions``: one prompt (a string or token ids), no chat template."""
    refuse_unless_neutral(body, NEUTRAL)
    check_stream_options(body)
    reply_model(fe, body)
    prompt = body.get("prompt")
    logprobs = body.get("logprobs")
    if logprobs not in (None, 0) and not (isinstance(logprobs, int) and not isinstance(logprobs, bool)):
        raise EngineError(f"logprobs must be an integer, got {logprobs!r}")
    if logprobs is not None and not 0 <= logprobs <= 20:
        raise EngineError(f"logprobs must be in [0, 20], got {logprobs}")
    params, explicit = sampling_of(body)
    params.top_logprobs_num = logprobs or 0
    if isinstance(prompt, str) and prompt:
        ids = await asyncio.to_thread(lambda: list(fe.tokenizer.encode(prompt, add_special_tokens=False)))
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        fe.check_ids(prompt, "prompt")
        ids = list(prompt)
    else:
        raise EngineError("prompt must be a non-empty string or a list of token ids (one prompt per request)")
    fe.check_length(len(ids), params, explicit=explicit)
    req = GenerateRequest(rid=f"cmpl-{uuid.uuid4().hex}", input_ids=ids, params=params)
    if body.get("stream"):
        return openai_stream(fe, req, "text_completion", body)
    completions = await fe.run(req)
    choices = []
    for c in completions:
        lp = None
        if logprobs is not None:
            tops = None if c.top_logprobs is None else [_by_text(fe, row) for row in c.top_logprobs]
            lp = {"tokens": [fe.tokenizer.decode([t]) for t in c.output_ids],
                  "token_logprobs": [float(x) for x in c.logprobs], "top_logprobs": tops, "text_offset": None}
        choices.append({"index": c.index, "text": fe.decode(c.output_ids, c.finish_reason, True), "logprobs": lp,
                        "finish_reason": _FINISH.get(c.finish_reason.get("type"), "stop")})
    return _reply(fe, req, "text_completion", choices, completions, body)


def add_openai_routes(app: FastAPI, fe: Frontend) -> None:
    """Register ``POST /v1/chat/completions``, ``POST /v1/completions`` and ``GET /v1/models`` on ``app``."""

    @app.post("/v1/chat/completions")
    async def chat(body: dict[str, Any] = Body(...)) -> Any:
        return await chat_completion(fe, body)

    @app.post("/v1/completions")
    async def completions(body: dict[str, Any] = Body(...)) -> Any:
        return await text_completion(fe, body)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": fe.model_path, "object": "model", "created": 0, "owned_by": "relax",
                                            "root": fe.model_path, "max_model_len": fe.engine.max_context_length}]}
