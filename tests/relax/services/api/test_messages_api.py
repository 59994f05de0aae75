"""The Messages API's mapping onto a session's chat turn, and Anthropic's shapes: pure functions, no model."""

from __future__ import annotations

import json

import pytest

from relax.rollout.session_requests import SessionError
from relax.services.api.messages_api import anthropic_error, chat_request, message_events, message_object

TEXT = '<tool_call>{"name": "lookup", "arguments": {"key": "fig"}}</tool_call>'


def test_blocks_map_to_chat_messages():
    body = {"max_tokens": 16, "system": [{"type": "text", "text": "sys"}],
            "messages": [{"role": "user", "content": "code of fig?"},
                         {"role": "assistant", "content": [{"type": "text", "text": TEXT},
                                                           {"type": "tool_use", "id": "t1", "name": "lookup",
                                                            "input": {"key": "fig"}}]},
                         {"role": "user", "content": [
                             {"type": "tool_result", "tool_use_id": "t1", "content": [
                                 {"type": "text", "text": "see:"},
                                 {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                              "data": "AAAA"}}]},
                             {"type": "text", "text": "and?"}]}],
            "tools": [{"name": "lookup", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "tool", "name": "lookup", "disable_parallel_tool_use": True},
            "stop_sequences": ["END"]}
    chat = chat_request(body)
    assert chat["messages"] == [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "code of fig?"},
        {"role": "assistant", "content": TEXT},
        {"role": "tool", "tool_call_id": "t1", "content": [
            {"type": "text", "text": "see:"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
        {"role": "user", "content": "and?"}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "lookup"}}
    assert chat["parallel_tool_calls"] is False and chat["stop"] == ["END"] and chat["max_tokens"] == 16
    assert chat["tools"][0]["function"]["parameters"] == {"type": "object"}


@pytest.mark.parametrize("extra, named", [
    ({"max_tokens": None}, "max_tokens must be an integer"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking cannot be honoured"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, r"tools\[0\] must be a client tool"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type must be"),
    ({"container": "c"}, "container is not served"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}]},
     "base64 source"),
])
def test_what_cannot_be_honoured_is_named(extra, named):
    with pytest.raises(SessionError, match=named):
        chat_request({"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **extra})


def test_a_turn_is_a_message_and_its_events():
    turn = {"id": "chatcmpl-abc-1", "text": TEXT, "finish": "stop", "prompt_tokens": 5, "completion_tokens": 3}
    msg = message_object(turn, [{"name": "lookup", "arguments": {"key": "fig"}}], {}, "m")
    assert [b["type"] for b in msg["content"]] == ["text", "tool_use"] and msg["stop_reason"] == "tool_use"
    plain = message_object({**turn, "text": "done END"}, [], {"stop_sequences": ["END"]}, "m")
    assert plain["stop_reason"] == "stop_sequence" and plain["stop_sequence"] == "END"
    assert message_object({**turn, "finish": "length"}, [], {}, "m")["stop_reason"] == "max_tokens"
    events = [e.decode().split("\n")[0].removeprefix("event: ") for e in message_events(msg)]
    assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]
    assert events.count("content_block_start") == 2
    delta = [json.loads(e.split(b"data: ", 1)[1]) for e in message_events(msg)][5]
    assert delta["delta"] == {"type": "input_json_delta", "partial_json": json.dumps({"key": "fig"})}
    assert anthropic_error(401, "no")["error"]["type"] == "authentication_error"
