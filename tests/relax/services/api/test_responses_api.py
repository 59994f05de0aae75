"""The Responses API's mapping onto a session's chat turn: pure functions, no model."""

from __future__ import annotations

import json

import pytest

from relax.rollout.session_requests import SessionError
from relax.rollout.tool_choice import ToolChoice
from relax.services.api.responses_api import (
    ResponseHistory,
    chat_request,
    input_messages,
    response_events,
    response_object,
)

TEXT = '<tool_call>{"name": "lookup", "arguments": {"key": "fig"}}</tool_call>'
TURN = {"id": "chatcmpl-abc-1", "text": TEXT, "finish": "stop", "prompt_tokens": 20, "completion_tokens": 9,
        "tool_choice": ToolChoice()}


def test_items_map_to_chat_messages_with_the_assistant_run_as_one_message():
    items = [{"role": "developer", "content": "be brief"},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "code of fig?"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": TEXT}]},
             {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "fig: 42"}]
    assert input_messages(items) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "code of fig?"}]},
        {"role": "assistant", "content": TEXT},
        {"role": "tool", "tool_call_id": "c1", "content": "fig: 42"}]
    assert input_messages("hi") == [{"role": "user", "content": "hi"}]
    with pytest.raises(SessionError, match=r"input\[0\] is a 'reasoning' item"):
        input_messages([{"type": "reasoning", "summary": []}])


def test_a_request_maps_fields_and_refuses_what_it_cannot_honour():
    body = {"model": "m", "instructions": "sys", "input": "q", "max_output_tokens": 7, "parallel_tool_calls": False,
            "tools": [{"type": "function", "name": "lookup", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "lookup"}}
    chat = chat_request(body, None)
    assert chat["messages"] == [{"role": "system", "content": "sys"}, {"role": "user", "content": "q"}]
    assert chat["tools"] == [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "lookup"}}
    assert chat["max_tokens"] == 7 and chat["parallel_tool_calls"] is False
    history = [{"role": "system", "content": "sys"}, {"role": "user", "content": "q"},
               {"role": "assistant", "content": TEXT}]
    follow = chat_request({"previous_response_id": "r", "input": [{"type": "function_call_output", "call_id": "c",
                                                                   "output": "x"}]}, history)
    assert follow["messages"] == [*history, {"role": "tool", "tool_call_id": "c", "content": "x"}]
    for bad, named in (({"input": "q", "reasoning": {"effort": "high"}}, "reasoning="),
                       ({"input": "q", "prompt": {"id": "p"}}, "prompt is not served"),
                       ({"input": "q", "tools": [{"type": "web_search"}]}, r"tools\[0\] must be a function tool"),
                       ({"input": "q", "instructions": "other"}, "instructions differ")):
        with pytest.raises(SessionError, match=named):
            chat_request(bad, history if "instructions" in bad else None)


def test_history_is_per_session():
    h = ResponseHistory(size=2)
    h.put("s1", "r1", [{"role": "user", "content": "a"}])
    assert h.get("s1", "r1") == [{"role": "user", "content": "a"}]
    with pytest.raises(SessionError, match="not a response of this session"):
        h.get("s2", "r1")


def test_a_turn_is_a_response_and_its_events():
    resp = response_object(TURN, [{"name": "lookup", "arguments": {"key": "fig"}}], {"model": "m"}, "m")
    assert [o["type"] for o in resp["output"]] == ["message", "function_call"]
    assert resp["output"][0]["content"][0]["text"] == TEXT and resp["status"] == "completed"
    assert json.loads(resp["output"][1]["arguments"]) == {"key": "fig"}
    events = [json.loads(e.split(b"data: ", 1)[1]) for e in response_events(resp)]
    kinds = [e["type"] for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and "response.function_call_arguments.done" in kinds
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    cut = response_object({**TURN, "finish": "length"}, [], {}, "m")
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}
