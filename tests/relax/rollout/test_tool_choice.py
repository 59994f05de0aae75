"""tool_choice and parallel_tool_calls: the values a session honours, and a 400 naming any other."""

from __future__ import annotations

import json

import pytest

from relax.data.suite.tool_lookup import parse_tool_calls
from relax.rollout.tool_choice import CALL_END, ToolChoice, ToolChoiceError, tool_choice_of, tool_names

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
NAMES = ["lookup", "search"]
TWO_CALLS = ('<tool_call>{"name": "lookup", "arguments": {"key": "a"}}</tool_call>'
             '<tool_call>{"name": "search", "arguments": {"q": "b"}}</tool_call>')


def test_the_modes_map_onto_prefixes_stops_and_returned_calls():
    parsed = parse_tool_calls(TWO_CALLS)
    auto = tool_choice_of({}, NAMES)
    assert auto == ToolChoice("auto") and auto.prefill() == "" and auto.stop() == [] and auto.calls(parsed) == parsed
    none = tool_choice_of({"tool_choice": "none"}, NAMES)
    assert none.calls(parsed) == [] and none.prefill() == ""
    required = tool_choice_of({"tool_choice": "required"}, NAMES)
    assert required.prefill() == '<tool_call>{"name": "'
    named = tool_choice_of({"tool_choice": {"type": "function", "function": {"name": "search"}}}, NAMES)
    # the forced prefix, completed by any arguments, parses as a call of the named function
    assert parse_tool_calls(named.prefill() + '{"q": "x"}}' + CALL_END) == [{"name": "search",
                                                                           "arguments": {"q": "x"}}]
    single = tool_choice_of({"parallel_tool_calls": False}, NAMES)
    assert single.stop() == [CALL_END] and single.calls(parsed) == parsed[:1]
    assert tool_choice_of({"tool_choice": "none", "parallel_tool_calls": False}, NAMES).stop() == []


@pytest.mark.parametrize("body, named", [
    ({"tool_choice": "always"}, "tool_choice must be one of"),
    ({"tool_choice": {"type": "function", "function": {"name": "fetch"}}}, "names function 'fetch'"),
    ({"tool_choice": {"type": "web_search"}}, "tool_choice must be one of"),
    ({"parallel_tool_calls": "no"}, "parallel_tool_calls must be true or false"),
])
def test_values_that_cannot_be_honoured_are_named(body, named):
    with pytest.raises(ToolChoiceError, match=named):
        tool_choice_of(body, NAMES)


def test_required_needs_tools_and_tools_must_be_functions():
    with pytest.raises(ToolChoiceError, match="'required' needs tools"):
        tool_choice_of({"tool_choice": "required"}, [])
    assert tool_names(TOOLS) == NAMES
    with pytest.raises(ToolChoiceError, match=r"tools\[1\] must be a function tool"):
        tool_names([TOOLS[0], {"type": "web_search"}])
    assert json.loads(tool_choice_of({"tool_choice": {"type": "function", "function": {"name": "lookup"}}},
                                     NAMES).prefill().removeprefix("<tool_call>") + '{}}')["name"] == "lookup"
