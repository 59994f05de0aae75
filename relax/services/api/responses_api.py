"""OpenAI's Responses API on a gateway session: a ``/v1/responses`` request as the session's chat turn,
and the turn as a ``response`` object or its stream of events (docs/agents.md has the field table).

Pure mapping functions; the gateway's route calls them around :meth:`SessionHub.chat`, so a turn asked
through this API is the same token-exact session turn as one asked through chat completions. The
assistant's text (with any ``<tool_call>`` blocks, as chat completions return it) is the ``message``
item's ``output_text``; its calls are ``function_call`` items too. An agent that resends those items
as ``input`` (or names ``previous_response_id``, whose conversation the gateway holds) repeats the
recorded conversation exactly.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from relax.rollout.session_requests import SessionError

# accepted at these values only (anything else would change the answer and is a 400 naming the field)
_NEUTRAL: dict[str, tuple] = {"truncation": (None, "disabled"), "reasoning": (None, {}), "include": (None, []),
                              "text": (None, {"format": {"type": "text"}}), "background": (None, False),
                              "top_logprobs": (None, 0)}
_FREE = {"model", "store", "metadata", "user", "service_tier", "prompt_cache_key", "safety_identifier"}
_MAPPED = {"input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "max_output_tokens",
           "previous_response_id", "stream", "temperature", "top_p"}


class ResponseHistory:
    """The conversation (chat messages, the reply included) after each response, for ``previous_response_id``;
    the newest ``size`` responses are kept."""

    def __init__(self, size: int = 65536):
        self.size, self._items = size, OrderedDict[str, tuple[str, list[dict[str, Any]]]]()

    def put(self, sid: str, rid: str, messages: list[dict[str, Any]]) -> None:
        self._items[rid] = (sid, messages)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def get(self, sid: str, rid: str) -> list[dict[str, Any]]:
        held = self._items.get(rid)
        if held is None or held[0] != sid:
            raise SessionError(400, f"previous_response_id {rid!r} is not a response of this session (or is too "
                                    f"old): send the whole conversation as input instead")
        return list(held[1])


def _content(where: str, content: Any) -> str | list[dict[str, Any]]:
    """A Responses message content as chat content (text, or text and image parts)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise SessionError(400, f"{where}.content must be a string or a list of content parts")
    parts: list[dict[str, Any]] = []
    for j, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind in ("input_text", "output_text") and isinstance(p.get("text"), str):
            parts.append({"type": "text", "text": p["text"]})
        elif kind == "input_image" and isinstance(p.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": p["image_url"]}})
        else:
            raise SessionError(400, f"{where}.content[{j}] must be input_text, output_text or input_image with a "
                                    f"data: image_url (file ids are not served), got {kind!r}")
    return parts


def _text(content: str | list[dict[str, Any]]) -> str:
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content)


def input_messages(items: Any) -> list[dict[str, Any]]:
    """``input`` (a string or items) as chat messages: a run of assistant ``message`` and ``function_call``
    items is one assistant message (its text; the calls are derived from it), a ``function_call_output`` a
    ``tool`` message."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise SessionError(400, "input must be a string or a non-empty list of items")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        last = out[-1] if out and out[-1]["role"] == "assistant" and out[-1].get("_open") else None
        if kind == "message" and item.get("role") in ("user", "system", "developer", "assistant"):
            content = _content(f"input[{i}]", item.get("content"))
            if item["role"] == "assistant":
                if last is not None:
                    last["content"] += _text(content)
                else:
                    out.append({"role": "assistant", "content": _text(content), "_open": True})
            else:
                out.append({"role": "system" if item["role"] == "developer" else item["role"], "content": content})
        elif kind == "function_call":
            if last is None:
                out.append({"role": "assistant", "content": "", "_open": True})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or output is None:
                raise SessionError(400, f"input[{i}] (function_call_output) needs a call_id and an output")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": _content(f"input[{i}]", output)
                        if not isinstance(output, str) else output})
        else:
            raise SessionError(400, f"input[{i}] is a {kind!r} item; served: message (user, system, developer, "
                                    f"assistant), function_call, function_call_output")
    for m in out:
        m.pop("_open", None)
    return out


def chat_request(body: dict[str, Any], history: list[dict[str, Any]] | None) -> dict[str, Any]:
    """A ``/v1/responses`` body (after ``history``, the messages of ``previous_response_id``) as a chat request."""
    for key in body:
        if key not in _MAPPED | _FREE | set(_NEUTRAL):
            raise SessionError(400, f"{key} is not served by the session gateway's /v1/responses (docs/agents.md)")
    for key, neutral in _NEUTRAL.items():
        if body.get(key) not in neutral:
            raise SessionError(400, f"{key}={body[key]!r} cannot be honoured: only {neutral[-1]!r} is served")
    messages = list(history or [])
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise SessionError(400, "instructions must be a string")
        if not history:
            messages.append({"role": "system", "content": instructions})
        elif history[0] != {"role": "system", "content": instructions}:
            raise SessionError(400, "instructions differ from the session's first ones: a session's prompt cannot "
                                    "change; resend the same instructions or leave them out")
    messages += input_messages(body.get("input"))
    chat: dict[str, Any] = {"messages": messages}
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list):
            raise SessionError(400, "tools must be a list of function tools")
        chat["tools"] = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str):
                raise SessionError(400, f"tools[{i}] must be a function tool ({{\"type\": \"function\", \"name\": "
                                        f"...}}); other tool types are not served")
            chat["tools"].append({"type": "function", "function": {k: t[k] for k in ("name", "description",
                                                                                      "parameters") if k in t}})
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    for key, value in (("tool_choice", choice), ("parallel_tool_calls", body.get("parallel_tool_calls")),
                       ("max_tokens", body.get("max_output_tokens")), ("temperature", body.get("temperature")),
                       ("top_p", body.get("top_p"))):
        if value is not None:
            chat[key] = value
    return chat


def response_object(turn: dict[str, Any], calls: list[dict[str, Any]], body: dict[str, Any],
                    model: str) -> dict[str, Any]:
    """A hub turn as a ``response``: a ``message`` item (its text) and one ``function_call`` item per call."""
    rid = "resp_" + turn["id"].removeprefix("chatcmpl-")
    output: list[dict[str, Any]] = [{"type": "message", "id": "msg_" + rid[5:], "status": "completed",
                                     "role": "assistant",
                                     "content": [{"type": "output_text", "text": turn["text"], "annotations": []}]}]
    for k, c in enumerate(calls):
        output.append({"type": "function_call", "id": f"fc_{rid[5:]}_{k}", "call_id": f"call_{rid[5:]}_{k}",
                       "name": c["name"], "arguments": json.dumps(c["arguments"]), "status": "completed"})
    cut = turn["finish"] == "length"
    done, prompt = turn["completion_tokens"], turn["prompt_tokens"]
    return {"id": rid, "object": "response", "created_at": int(time.time()), "model": model,
            "status": "incomplete" if cut else "completed", "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "previous_response_id": body.get("previous_response_id"), "output": output,
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [], "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "text": {"format": {"type": "text"}}, "truncation": "disabled", "metadata": body.get("metadata") or {},
            "usage": {"input_tokens": prompt, "output_tokens": done, "total_tokens": prompt + done,
                      "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}},
            "episode_ended": turn.get("ended") or None}  # a limit ended the episode with this turn


def response_events(resp: dict[str, Any]) -> Iterator[bytes]:
    """A finished ``response`` as the Responses API's server-sent events (generated whole, then delivered)."""
    seq = iter(range(1 << 30))

    def event(kind: str, **data: Any) -> bytes:
        body = {"type": kind, "sequence_number": next(seq), **data}
        return f"event: {kind}\ndata: {json.dumps(body)}\n\n".encode()

    start = {**resp, "status": "in_progress", "output": [], "usage": None}
    yield event("response.created", response=start)
    yield event("response.in_progress", response=start)
    for i, item in enumerate(resp["output"]):
        where = {"item_id": item["id"], "output_index": i}
        if item["type"] == "message":
            text = item["content"][0]["text"]
            yield event("response.output_item.added", output_index=i, item={**item, "status": "in_progress",
                                                                           "content": []})
            empty = {"type": "output_text", "text": "", "annotations": []}
            yield event("response.content_part.added", **where, content_index=0, part=empty)
            yield event("response.output_text.delta", **where, content_index=0, delta=text, logprobs=[])
            yield event("response.output_text.done", **where, content_index=0, text=text, logprobs=[])
            yield event("response.content_part.done", **where, content_index=0, part=item["content"][0])
        else:
            yield event("response.output_item.added", output_index=i, item={**item, "status": "in_progress",
                                                                           "arguments": ""})
            yield event("response.function_call_arguments.delta", **where, delta=item["arguments"])
            yield event("response.function_call_arguments.done", **where, arguments=item["arguments"])
        yield event("response.output_item.done", output_index=i, item=item)
    yield event("response.incomplete" if resp["status"] == "incomplete" else "response.completed", response=resp)
