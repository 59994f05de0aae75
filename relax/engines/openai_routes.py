"""OpenAI ``/v1/chat/completions`` and ``/v1/models`` on top of an engine's :class:`Frontend`.

Chat messages (string content, or ``text``/``image_url``/``input_audio`` parts with data: URIs)
become the tokenizer's chat template with ``<image>``/``<audio>`` placeholders and the decoded
media; sampling options map onto SGLang's ``sampling_params`` names; completions come back as a
``chat.completion``. Non-streaming only (``stream: true`` is a 400).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import Body, FastAPI

from relax.engines.frontend import Frontend, decode_media
from relax.engines.types import EngineError, GenerateRequest, SamplingParams

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


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
                    if audio.get("format", "wav") != "wav":
                        raise EngineError(f"input_audio[{len(audios)}]: only format 'wav' is supported")
                    audios.append(decode_media(audio.get("data", ""), "input_audio", len(audios)))
                    parts.append("<audio>")
                else:
                    raise EngineError(f"unsupported content part type {kind!r}")
            content = "".join(parts)
        msgs.append({"role": m.get("role", "user"), "content": content or ""})
    return msgs, images, audios


async def chat_completion(fe: Frontend, body: dict[str, Any]) -> dict[str, Any]:
    """OpenAI ``/v1/chat/completions`` (non-streaming) on top of the engine."""
    if body.get("stream"):
        raise EngineError("stream=true is not supported by this server")
    if not body.get("messages"):
        raise EngineError("messages must be a non-empty list")
    msgs, images, audios = chat_prompt(body["messages"])
    text = fe.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    ids, mm = fe.tokenize(text, images, audios)
    fe.check_length(len(ids))
    sp: dict[str, Any] = {"n": body.get("n") or 1, "stop": body.get("stop")}
    for src, dst in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"), ("seed", "sampling_seed"),
                     ("max_tokens", "max_new_tokens"), ("max_completion_tokens", "max_new_tokens")):
        if body.get(src) is not None:
            sp[dst] = body[src]
    req = GenerateRequest(rid=f"chatcmpl-{uuid.uuid4().hex}", input_ids=ids, params=SamplingParams.from_json(sp),
                          mm_inputs=mm)
    completions = await fe.run(req)
    choices = []
    for c in completions:
        logprobs = None
        if body.get("logprobs"):
            toks = [fe.tokenizer.decode([t]) for t in c.output_ids]
            logprobs = {"content": [{"token": s, "logprob": float(lp), "bytes": list(s.encode()), "top_logprobs": []}
                                    for s, lp in zip(toks, c.logprobs, strict=False)]}
        choices.append({"index": c.index, "message": {"role": "assistant",
                                                      "content": fe.decode(c.output_ids, c.finish_reason, True)},
                        "logprobs": logprobs, "finish_reason": _FINISH.get(c.finish_reason.get("type"), "stop"),
                        "matched_stop": c.finish_reason.get("matched")})
    done = sum(len(c.output_ids) for c in completions)
    return {"id": req.rid, "object": "chat.completion", "created": int(time.time()), "model": fe.model_path,
            "choices": choices, "usage": {"prompt_tokens": len(ids), "completion_tokens": done,
                                          "total_tokens": len(ids) + done}}


def add_openai_routes(app: FastAPI, fe: Frontend) -> None:
    """Register ``POST /v1/chat/completions`` and ``GET /v1/models`` on ``app``."""

    @app.post("/v1/chat/completions")
    async def chat(body: dict[str, Any] = Body(...)) -> dict[str, Any]:
        return await chat_completion(fe, body)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": fe.model_path, "object": "model", "created": 0, "owned_by": "relax",
                                            "root": fe.model_path, "max_model_len": fe.engine.max_context_length}]}
