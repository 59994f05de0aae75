"""Anthropic's Messages API on a gateway session: a ``/v1/messages`` request as the session's chat turn, the
turn as a ``message`` or its stream of events, and Anthropic's error shape (docs/agents.md has the table).

Pure mapping functions (the gateway's route calls them around :meth:`SessionHub.chat`, the same token-exact
turn as chat completions), and :class:`AnthropicDialect`, the ASGI wrapper that takes the ``x-api-key``
header as the bearer token and answers errors on ``/v1/messages`` in Anthropic's shape. The reply's
text (``<tool_call>`` blocks included) is its ``text`` block; its calls are ``tool_use`` blocks too, so an
agent that resends the assistant content as returned repeats the recorded conversation exactly.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from relax.rollout.session_requests import SessionError

_FREE = {"model", "metadata", "service_tier", "stream"}
_MAPPED = {"max_tokens", "system", "messages", "tools", "tool_choice", "stop_sequences", "temperature", "top_p",
           "top_k", "thinking"}
_CHOICE = {"auto": "auto", "any": "required", "none": "none"}
_ERROR = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
          405: "not_found_error", 409: "invalid_request_error", 413: "request_too_large", 503: "overloaded_error"}


def _blocks(where: str, content: Any) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise SessionError(400, f"{where}.content must be a string or a list of content blocks")
    return content


def _part(where: str, block: Any) -> dict[str, Any]:
    """A text or image block as a chat content part."""
    kind = block.get("type") if isinstance(block, dict) else None
    if kind == "text" and isinstance(block.get("text"), str):
        return {"type": "text", "text": block["text"]}
    source = block.get("source") if kind == "image" else None
    if isinstance(source, dict) and source.get("type") == "base64" and isinstance(source.get("data"), str):
        url = f"data:{source.get('media_type', 'image/png')};base64,{source['data']}"
        return {"type": "image_url", "image_url": {"url": url}}
    raise SessionError(400, f"{where} must be a text block or an image block with a base64 source (url and file "
                            f"sources are not served), got {kind!r}")


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """``system`` and ``messages`` as chat messages: ``tool_result`` blocks become ``tool`` messages (before
    the user's other blocks), an assistant's ``tool_use`` blocks are derived from its text."""
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        blocks = _blocks("system", system)
        out.append({"role": "system", "content": "".join(_part(f"system[{i}]", b)["text"]
                                                         if b.get("type") == "text" else _bad_system(i)
                                                         for i, b in enumerate(blocks))})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise SessionError(400, "messages must be a non-empty list of {role, content}")
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            raise SessionError(400, f"messages[{i}].role must be 'user' or 'assistant', got {role!r}")
        blocks = _blocks(f"messages[{i}]", m.get("content"))
        if role == "assistant":
            texts = [b.get("text", "") for b in blocks if isinstance(b, dict) and b.get("type") == "text"]
            if any(not isinstance(b, dict) or b.get("type") not in ("text", "tool_use") for b in blocks):
                raise SessionError(400, f"messages[{i}]: an assistant message holds text and tool_use blocks only")
            out.append({"role": "assistant", "content": "".join(texts)})
            continue
        parts = []
        for j, b in enumerate(blocks):
            if isinstance(b, dict) and b.get("type") == "tool_result":
                result = b.get("content", "")
                content = result if isinstance(result, str) else [
                    _part(f"messages[{i}].content[{j}].content[{k}]", r) for k, r in enumerate(result)]
                out.append({"role": "tool", "tool_call_id": str(b.get("tool_use_id", "")), "content": content})
            else:
                parts.append(_part(f"messages[{i}].content[{j}]", b))
        if parts:
            text_only = all(p["type"] == "text" for p in parts)
            out.append({"role": "user", "content": "".join(p["text"] for p in parts) if text_only else parts})
    return out


def _bad_system(i: int) -> str:
    raise SessionError(400, f"system[{i}] must be a text block")


def chat_request(body: dict[str, Any]) -> dict[str, Any]:
    """A ``/v1/messages`` body as a chat request (a SessionError names a field that cannot be honoured)."""
    for key in body:
        if key not in _MAPPED | _FREE:
            raise SessionError(400, f"{key} is not served by the session gateway's /v1/messages (docs/agents.md)")
    if body.get("thinking") not in (None, {"type": "disabled"}):
        raise SessionError(400, "thinking cannot be honoured: the policy's turn is sampled as the run samples it")
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise SessionError(400, f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    chat: dict[str, Any] = {"messages": chat_messages(body), "max_tokens": max_tokens}
    tools = body.get("tools") or []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "custom") != "custom" or not isinstance(t.get("name"), str):
            raise SessionError(400, f"tools[{i}] must be a client tool with a name and an input_schema; server "
                                    f"tools are not served")
    if tools:
        chat["tools"] = [{"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                           "parameters": t.get("input_schema", {})}} for t in tools]
    choice = body.get("tool_choice")
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind == "tool":
            chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
        elif kind in _CHOICE:
            chat["tool_choice"] = _CHOICE[kind]
        else:
            raise SessionError(400, f"tool_choice.type must be auto, any, tool or none, got {kind!r}")
        if choice.get("disable_parallel_tool_use"):
            chat["parallel_tool_calls"] = False
    for src, dst in (("stop_sequences", "stop"), ("temperature", "temperature"), ("top_p", "top_p"),
                     ("top_k", "top_k")):
        if body.get(src) is not None:
            chat[dst] = body[src]
    return chat


def message_object(turn: dict[str, Any], calls: list[dict[str, Any]], body: dict[str, Any],
                   model: str) -> dict[str, Any]:
    """A hub turn as an Anthropic ``message``: a ``text`` block and one ``tool_use`` block per call."""
    mid = "msg_" + turn["id"].removeprefix("chatcmpl-")
    content: list[dict[str, Any]] = [{"type": "text", "text": turn["text"]}] if turn["text"] else []
    content += [{"type": "tool_use", "id": f"toolu_{mid[4:]}_{k}", "name": c["name"], "input": c["arguments"]}
                for k, c in enumerate(calls)]
    matched = next((s for s in body.get("stop_sequences") or [] if turn["text"].endswith(s)), None)
    if calls:
        reason = "tool_use"
    elif turn["finish"] == "length":
        reason = "max_tokens"
    else:
        reason = "stop_sequence" if matched else "end_turn"
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": matched if reason == "stop_sequence" else None,
            "usage": {"input_tokens": turn["prompt_tokens"], "output_tokens": turn["completion_tokens"]},
            "episode_ended": turn.get("ended") or None}  # a limit ended the episode with this turn


def message_events(msg: dict[str, Any]) -> Iterator[bytes]:
    """A finished ``message`` as Anthropic's server-sent events (generated whole, then delivered)."""
    def event(kind: str, **data: Any) -> bytes:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()

    yield event("message_start", message={**msg, "content": [], "stop_reason": None, "stop_sequence": None,
                                          "usage": {**msg["usage"], "output_tokens": 0}})
    for i, block in enumerate(msg["content"]):
        if block["type"] == "text":
            yield event("content_block_start", index=i, content_block={"type": "text", "text": ""})
            yield event("content_block_delta", index=i, delta={"type": "text_delta", "text": block["text"]})
        else:
            yield event("content_block_start", index=i, content_block={**block, "input": {}})
            yield event("content_block_delta", index=i,
                        delta={"type": "input_json_delta", "partial_json": json.dumps(block["input"])})
        yield event("content_block_stop", index=i)
    yield event("message_delta", delta={"stop_reason": msg["stop_reason"], "stop_sequence": msg["stop_sequence"]},
                usage={"output_tokens": msg["usage"]["output_tokens"]}, episode_ended=msg["episode_ended"])
    yield event("message_stop")


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _ERROR.get(status, "api_error"), "message": message}}


class AnthropicDialect:
    """ASGI wrapper: ``x-api-key`` is taken as the bearer token (the anthropic client's default header), and
    an error answered on a ``/v1/messages`` path is rewritten from OpenAI's shape to Anthropic's."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = list(scope.get("headers") or [])
        names = {k for k, _ in headers}
        if b"authorization" not in names and b"x-api-key" in names:
            key = next(v for k, v in headers if k == b"x-api-key")
            scope = {**scope, "headers": [*headers, (b"authorization", b"Bearer " + key)]}
        if not scope.get("path", "").endswith("/v1/messages"):
            await self.app(scope, receive, send)
            return
        start: dict[str, Any] = {}

        async def rewrite(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start.update(message)  # held until the body is seen
                return
            if message["type"] == "http.response.body" and start:
                try:
                    body = json.loads(message.get("body", b""))
                    text = body["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    text = message.get("body", b"").decode("utf-8", "replace")
                data = json.dumps(anthropic_error(start["status"], str(text))).encode()
                kept = [(k, v) for k, v in start.get("headers", []) if k != b"content-length"]
                await send({**start, "headers": [*kept, (b"content-length", str(len(data)).encode())]})
                await send({"type": "http.response.body", "body": data})
                return
            await send(message)

        await self.app(scope, receive, rewrite)
