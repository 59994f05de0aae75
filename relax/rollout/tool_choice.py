"""``tool_choice`` and ``parallel_tool_calls`` of an agent's request, checked, and how a session honours them.

The policy writes a tool call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in its own
text (relax.data.suite.tool_lookup.parse_tool_calls reads it back). A choice is honoured by constraining
what the policy may emit, never by editing what it sampled:

* ``auto`` (the default): the reply is the policy's; its calls come back as tool calls.
* ``none``: the reply's text comes back as text only; no call is returned to the agent.
* ``required`` / a named function: the reply starts with a forced prefix (``<tool_call>{"name": "``, or the
  name and ``"arguments": `` too) that the session records as context the agent added (masked out of the
  loss, as a tool result is); the policy samples the rest.
* ``parallel_tool_calls: false``: generation stops after the first ``</tool_call>`` (a stop string, which
  truncates but never changes a sampled token's log-prob).

A Llama 3 policy (``rollout.tool_format``, relax.rollout.tool_calls) writes a call as the bare JSON
``{"name": ..., "parameters": {...}}``: its forced prefixes are ``{"name": "`` and the name plus
``"parameters": ``; JSON has no end marker to stop at, so ``parallel_tool_calls: false`` returns the
first call only.

A value the session cannot honour (a function it was not given, a shape of neither API) is a 400 naming it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

CALL_END = "</tool_call>"
MODES = ("auto", "none", "required")


class ToolChoiceError(ValueError):
    """A tool_choice or parallel_tool_calls value the session cannot honour; the message names it."""


@dataclass(frozen=True)
class ToolChoice:
    mode: str = "auto"  # auto | none | required | function
    name: str | None = None  # the function forced (mode "function")
    parallel: bool = True
    fmt: str = "qwen"  # the policy's tool-call format (relax.rollout.tool_calls.FORMATS)

    def prefill(self) -> str:
        """The text the reply is forced to start with ('' when the policy starts it freely)."""
        open_call, args = ('{"name": ', '"parameters": ') if self.fmt == "llama3" else ('<tool_call>{"name": ',
                                                                                        '"arguments": ')
        if self.mode == "required":
            return open_call + '"'
        if self.mode == "function":
            return open_call + json.dumps(self.name) + ", " + args
        return ""

    def stop(self) -> list[str]:
        """Stop strings the choice adds to the run's."""
        return [CALL_END] if not self.parallel and self.mode != "none" and self.fmt == "qwen" else []

    def calls(self, parsed: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The calls returned to the agent out of those parsed from the reply."""
        if self.mode == "none":
            return []
        return parsed if self.parallel else parsed[:1]


def tool_names(tools: Any, field: str = "tools") -> list[str]:
    """Names of OpenAI function tools (``[{"type": "function", "function": {"name", ...}}]``)."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ToolChoiceError(f"{field} must be a list of function tools, got {type(tools).__name__}")
    names = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str):
            raise ToolChoiceError(f"{field}[{i}] must be a function tool: {{\"type\": \"function\", \"function\": "
                                  f"{{\"name\": ..., \"parameters\": {{...}}}}}}; other tool types are not served")
        names.append(fn["name"])
    return names


def tool_choice_of(body: dict[str, Any], names: list[str], fmt: str = "qwen") -> ToolChoice:
    """The chat request's ``tool_choice`` and ``parallel_tool_calls`` against the tools the session has
    (``names``), for a policy writing calls in format ``fmt``; a ToolChoiceError names a value that cannot
    be honoured."""
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise ToolChoiceError(f"parallel_tool_calls must be true or false, got {parallel!r}")
    choice = body.get("tool_choice")
    if choice is None:
        return ToolChoice("auto", parallel=parallel, fmt=fmt)
    if isinstance(choice, str):
        if choice not in MODES:
            raise ToolChoiceError(f"tool_choice must be one of {MODES} or {{\"type\": \"function\", \"function\": "
                                  f"{{\"name\": ...}}}}, got {choice!r}")
        if choice == "required" and not names:
            raise ToolChoiceError("tool_choice 'required' needs tools: this session was given none")
        return ToolChoice(choice, parallel=parallel, fmt=fmt)
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise ToolChoiceError(f"tool_choice must be one of {MODES} or {{\"type\": \"function\", \"function\": "
                              f"{{\"name\": ...}}}}, got {choice!r}")
    if name not in names:
        raise ToolChoiceError(f"tool_choice names function {name!r}, but this session's tools are {names}: "
                              f"name one of them")
    return ToolChoice("function", name, parallel, fmt)
