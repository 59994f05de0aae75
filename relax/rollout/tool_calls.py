"""Tool calls in a policy's reply, in the format its model family was trained to write them.

The session gateway returns the calls it finds as each API's tool calls (docs/agents.md); which format
it reads is ``rollout.tool_format`` ('auto': by ``model.family``):

* ``qwen`` (Qwen2/2.5/3 and their VL, audio and omni variants): ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>`` blocks anywhere in the text, any number of them (relax.data.suite.tool_lookup reads
  them, as the built-in tool task does).
* ``llama3`` (Llama 3.1+ JSON tool calling): the whole reply is the call(s), ``{"name": ..., "parameters":
  {...}}``, optionally after ``<|python_tag|>``, several separated by ``;`` or whitespace. A reply with
  anything else in it is prose and calls nothing, as Meta's reference parser treats it.

Calls come back as ``{"name": str, "arguments": dict}`` whatever the format; a malformed call is skipped
(the agent sees the reply's text and can react to it).
"""

from __future__ import annotations

import json
from typing import Any

from relax.data.suite.tool_lookup import parse_tool_calls as parse_qwen

FORMATS = ("qwen", "llama3")
PYTHON_TAG = "<|python_tag|>"
_LLAMA_ENDS = ("<|eom_id|>", "<|eot_id|>")


def tool_format(setting: str, family: str) -> str:
    """The format a run's gateway reads: ``setting`` (rollout.tool_format), or by family when 'auto'."""
    if setting != "auto":
        return setting
    return "llama3" if family == "llama" else "qwen"


def parse_llama3(text: str) -> list[dict[str, Any]]:
    """Llama 3's JSON tool calls: the reply (after an optional ``<|python_tag|>``) is one or more JSON
    objects with a string ``name`` and object ``parameters`` (or ``arguments``); else no calls."""
    body = text.strip()
    body = body.removeprefix(PYTHON_TAG).strip()
    for end in _LLAMA_ENDS:
        body = body.removesuffix(end).strip()
    decoder, calls, i = json.JSONDecoder(), [], 0
    while i < len(body):
        try:
            obj, i = decoder.raw_decode(body, i)
        except json.JSONDecodeError:
            return []  # prose, or a call cut off mid-JSON: nothing to call
        call = _llama_call(obj)
        if call is None:
            return []
        calls.append(call)
        while i < len(body) and (body[i].isspace() or body[i] == ";"):
            i += 1
    return calls


def _llama_call(obj: Any) -> dict[str, Any] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("parameters", obj.get("arguments", {}))
    if isinstance(args, str):  # arguments serialised twice, as some templates do
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return {"name": obj["name"], "arguments": args} if isinstance(args, dict) else None


def parse_tool_calls(text: str, fmt: str) -> list[dict[str, Any]]:
    """The well-formed tool calls in ``text`` written in format ``fmt`` (one of FORMATS), in order."""
    if fmt == "llama3":
        return parse_llama3(text)
    if fmt == "qwen":
        return parse_qwen(text)
    raise ValueError(f"unknown tool-call format {fmt!r}: one of {FORMATS}")
