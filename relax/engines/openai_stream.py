"""Server-sent events for OpenAI's ``stream: true`` (chat and completions), as the official client reads them.

Each event is ``data: <json>\\n\\n`` with the text *added* since the previous event (``delta.content``
for chat, ``text`` for completions), ``finish_reason`` null until a sample's last event, and the
stream ends with ``data: [DONE]``. The pieces concatenate to exactly the non-streaming reply's text:
a piece that would end inside a multi-byte character (decoded as U+FFFD) is held back until the
character is complete, the last characters that could still begin a stop string are held back until
the sample ends, and its last event carries what is left once a matched stop string is cut. Tokens
reach the event loop from the engine thread through ``call_soon_threadsafe``.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

from relax.engines.streaming import TokenStream
from relax.engines.types import EngineError, GenerateRequest

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def openai_stream(fe: Any, req: GenerateRequest, kind: str, body: dict[str, Any]) -> StreamingResponse:
    """``kind``: ``chat.completion.chunk`` or ``text_completion``. ``stream_options.include_usage``: every
    chunk carries ``"usage": null`` and one more chunk, with no choices, carries the request's usage
    before ``[DONE]``, as OpenAI streams it (LangChain, LiteLLM and the Agents SDK ask for it)."""
    usage = bool((body.get("stream_options") or {}).get("include_usage"))
    return StreamingResponse(_events(fe, req, kind, usage, reply_model(fe, body)), media_type="text/event-stream")


def reply_model(fe: Any, body: dict[str, Any]) -> str:
    """The ``model`` a reply names: the request's, echoed as SGLang's OpenAI routes do (they serve any
    name; SGLang 0.5.23 checks it only on /v1/responses), else the served model path."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise EngineError(f"model must be a string, got {type(model).__name__}")
    return model or fe.model_path


def _event(req: GenerateRequest, kind: str, model: str, choices: list[dict[str, Any]], usage: Any = ...) -> bytes:
    body = {"id": req.rid, "object": kind, "created": int(time.time()), "model": model, "choices": choices}
    if usage is not ...:
        body["usage"] = usage
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def _chunk(req: GenerateRequest, kind: str, model: str, index: int, piece: str, finish: str | None,
           first: bool, usage: bool = False) -> bytes:
    if kind == "text_completion":
        choice: dict[str, Any] = {"index": index, "text": piece, "logprobs": None, "finish_reason": finish}
    else:
        delta = {"role": "assistant", "content": piece} if first else {"content": piece}
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
    return _event(req, kind, model, [choice], None if usage else ...)


def _streamable(text: str, stops: list[str], hold: int) -> str:
    """What of ``text`` may be sent now: up to a stop string it holds (the sample ends there and the reply
    cuts it), else all but the last ``hold`` characters, which could be the start of one."""
    found = [text.find(x) for x in stops if x and x in text]
    if found:
        return text[:min(found)]
    return text[:len(text) - hold] if hold else text


async def _events(fe: Any, req: GenerateRequest, kind: str, usage: bool, model: str) -> AsyncIterator[bytes]:
    n = req.params.n
    ids: list[list[int]] = [[] for _ in range(n)]
    sent = [""] * n
    hold = max((len(x) for x in req.params.stop), default=1) - 1  # a stop string may still be forming
    stream = TokenStream(fe, req)
    async for i, token in stream:
        ids[i].append(token)
        text = _streamable(fe.tokenizer.decode(ids[i], skip_special_tokens=True), req.params.stop, hold)
        if text.endswith("\ufffd") or not text.startswith(sent[i]) or len(text) <= len(sent[i]):
            continue  # an incomplete character, or nothing new yet
        piece, sent[i] = text[len(sent[i]):], text
        yield _chunk(req, kind, model, i, piece, None, first=len(piece) == len(text), usage=usage)
    for c in stream.completions:
        final = fe.decode(c.output_ids, c.finish_reason, True)
        rest = final[len(sent[c.index]):] if final.startswith(sent[c.index]) else ""
        yield _chunk(req, kind, model, c.index, rest, _FINISH.get(c.finish_reason.get("type"), "stop"),
                     first=not sent[c.index], usage=usage)
    if usage:  # the tokens the engine generated, as the non-streamed reply counts them
        done, prompt = sum(len(c.output_ids) for c in stream.completions), len(req.input_ids)
        yield _event(req, kind, model, [], {"prompt_tokens": prompt, "completion_tokens": done,
                                             "total_tokens": prompt + done})
    yield b"data: [DONE]\n\n"
