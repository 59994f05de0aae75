"""Tool calls read from a policy's reply per model family (relax.rollout.tool_calls), and tool_choice's
forced prefixes in each family's format."""

from __future__ import annotations

import pytest

from relax.config import ConfigError, load_config
from relax.rollout.tool_calls import parse_llama3, parse_tool_calls, tool_format
from relax.rollout.tool_choice import tool_choice_of


def test_qwen_tool_call_blocks_anywhere_in_the_text():
    text = ('Let me look. <tool_call>{"name": "lookup", "arguments": {"key": "fig"}}</tool_call>\n'
            '<tool_call>{"name": "lookup", "arguments": "{\\"key\\": \\"plum\\"}"}</tool_call>'
            '<tool_call>{"name": 3}</tool_call>')  # the last is malformed: skipped
    assert parse_tool_calls(text, "qwen") == [{"name": "lookup", "arguments": {"key": "fig"}},
                                              {"name": "lookup", "arguments": {"key": "plum"}}]
    # a Llama-style bare JSON call is prose to a Qwen policy
    assert parse_tool_calls('{"name": "lookup", "parameters": {"key": "fig"}}', "qwen") == []


def test_llama3_json_calls_are_the_whole_reply():
    one = '{"name": "lookup", "parameters": {"key": "fig"}}'
    assert parse_tool_calls(one, "llama3") == [{"name": "lookup", "arguments": {"key": "fig"}}]
    # after <|python_tag|>, ending with <|eom_id|>, several separated by ';', arguments as a JSON string
    many = ('<|python_tag|>{"type": "function", "name": "lookup", "parameters": {"key": "fig"}}; '
            '{"name": "search", "arguments": "{\\"q\\": \\"plum\\"}"}<|eom_id|>')
    assert parse_llama3(many) == [{"name": "lookup", "arguments": {"key": "fig"}},
                                  {"name": "search", "arguments": {"q": "plum"}}]
    # prose around a call, a call cut off mid-JSON, a JSON object that is no call: no calls
    for text in (f"Sure: {one}", one[:-5], '{"answer": 42}', '{"name": "lookup", "parameters": [1]}', ""):
        assert parse_llama3(text) == [], text
    # a Qwen block is not a Llama call
    assert parse_llama3('<tool_call>{"name": "lookup", "arguments": {}}</tool_call>') == []


def test_the_format_follows_the_family_unless_set_and_tool_choice_forces_its_prefix():
    assert tool_format("auto", "llama") == "llama3" and tool_format("auto", "qwen2_5_vl") == "qwen"
    assert tool_format("qwen", "llama") == "qwen"
    with pytest.raises(ValueError, match="unknown tool-call format 'mistral'"):
        parse_tool_calls("", "mistral")
    with pytest.raises(ConfigError, match="rollout.tool_format"):
        load_config("tiny-cpu", ["rollout.tool_format=mistral"])
    forced = {"tool_choice": {"type": "function", "function": {"name": "lookup"}}, "parallel_tool_calls": False}
    llama, qwen = tool_choice_of(forced, ["lookup"], "llama3"), tool_choice_of(forced, ["lookup"], "qwen")
    assert llama.prefill() == '{"name": "lookup", "parameters": '
    assert qwen.prefill() == '<tool_call>{"name": "lookup", "arguments": '
    # no end marker in Llama's JSON to stop at: the first call alone is returned
    assert llama.stop() == [] and qwen.stop() == ["</tool_call>"]
    calls = parse_llama3('{"name": "lookup", "parameters": {"key": "a"}}; {"name": "lookup", "parameters": {}}')
    assert llama.calls(calls) == calls[:1]
    assert tool_choice_of({"tool_choice": "required"}, ["lookup"], "llama3").prefill() == '{"name": "'


def test_each_configured_format_is_the_one_the_gateway_reads():
    # what the rollout role hands its SessionHub: tool_format(rollout.tool_format, model.family)
    picked = {o: tool_format(c.rollout.tool_format, c.model.family)
              for o in ("rollout.tool_format=auto", "rollout.tool_format=qwen", "rollout.tool_format=llama3")
              for c in [load_config("tiny-cpu", [o])]}
    assert picked == {"rollout.tool_format=auto": "qwen",  # tiny-cpu is a qwen2 model
                      "rollout.tool_format=qwen": "qwen", "rollout.tool_format=llama3": "llama3"}
    call = '{"name": "lookup", "parameters": {"key": "fig"}}'
    assert parse_tool_calls(call, picked["rollout.tool_format=llama3"]) == [
        {"name": "lookup", "arguments": {"key": "fig"}}]
    assert parse_tool_calls(call, picked["rollout.tool_format=qwen"]) == []  # a qwen run reads only <tool_call>
