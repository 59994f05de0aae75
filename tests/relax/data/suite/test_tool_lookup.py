"""The tool-use task: parsing tool calls, scripted episodes in the env, single-shot reward."""

from __future__ import annotations

import pytest

from relax.data.errors import DataError
from relax.data.samples import Message, Sample
from relax.data.suite.tool_lookup import (
    SYSTEM_PROMPT,
    ToolLookupEnv,
    generate,
    parse_tool_calls,
    parse_tool_calls_with_errors,
    reward,
)

# A hand-written sample: the table is hidden in metadata, the question only names the key.
SAMPLE = Sample(
    id="tool_lookup-train-000000",
    task="tool_lookup",
    messages=(
        Message("system", SYSTEM_PROMPT),
        Message("user", "What is the secret code of the item 'golden plum'? Use the lookup tool."),
    ),
    answer="47",
    metadata={"key": "golden plum", "table": {"golden plum": "47", "red fig": "12"}},
)


def call(key: str, name: str = "lookup") -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {{"key": "{key}"}}}}</tool_call>'


# --- parse_tool_calls -----------------------------------------------------------------


def test_parse_tolerates_whitespace_and_multiple_calls() -> None:
    text = '< tool_call >\n  {"name": "lookup",\n "arguments": {"key": "a"}}  \n</tool_call> and ' + call("b")
    assert parse_tool_calls(text) == [
        {"name": "lookup", "arguments": {"key": "a"}},
        {"name": "lookup", "arguments": {"key": "b"}},
    ]


def test_parse_accepts_arguments_serialised_as_a_string() -> None:
    text = '<tool_call>{"name": "lookup", "arguments": "{\\"key\\": \\"a\\"}"}</tool_call>'
    assert parse_tool_calls(text) == [{"name": "lookup", "arguments": {"key": "a"}}]


def test_parse_skips_and_reports_malformed_calls() -> None:
    text = '<tool_call>{"name": "lookup", "arguments": {"key": "a"</tool_call>' + call("b")
    calls, errors = parse_tool_calls_with_errors(text)
    assert calls == [{"name": "lookup", "arguments": {"key": "b"}}]
    assert len(errors) == 1 and "not valid JSON" in errors[0]
    _, errors = parse_tool_calls_with_errors(
        '<tool_call>["lookup"]</tool_call><tool_call>{"name": "x", "arguments": 3}</tool_call>'
    )
    assert len(errors) == 2


def test_parse_without_calls() -> None:
    assert parse_tool_calls("The code is 47.") == []


# --- scripted episodes ----------------------------------------------------------------


def test_lookup_then_correct_answer_scores_one() -> None:
    env = ToolLookupEnv()
    assert env.reset(SAMPLE) == SAMPLE.prompt_text
    obs, r, done, info = env.step("I will look it up. " + call("golden plum"))
    assert (obs, r, done) == ("golden plum: 47", 0.0, False)
    assert info["tool_calls"] == [{"name": "lookup", "arguments": {"key": "golden plum"}}]
    obs, r, done, info = env.step("<answer>47</answer>")
    assert (r, done) == (1.0, True)
    assert info["reason"] == "answer" and info["correct"] and info["looked_up"]


def test_key_matching_ignores_case_and_spacing() -> None:
    env = ToolLookupEnv()
    env.reset(SAMPLE)
    assert env.step(call("  Golden   PLUM "))[0] == "golden plum: 47"


def test_correct_answer_without_lookup_scores_zero() -> None:
    env = ToolLookupEnv()
    env.reset(SAMPLE)
    obs, r, done, info = env.step("<answer>47</answer>")
    assert (r, done) == (0.0, True)
    assert info["correct"] and not info["looked_up"]


def test_lookup_of_another_key_does_not_count() -> None:
    env = ToolLookupEnv()
    env.reset(SAMPLE)
    assert env.step(call("red fig"))[0] == "red fig: 12"
    assert env.step("<answer>47</answer>")[1] == 0.0


def test_wrong_answer_after_lookup_scores_zero() -> None:
    env = ToolLookupEnv()
    env.reset(SAMPLE)
    env.step(call("golden plum"))
    assert env.step("<answer>46</answer>")[1:3] == (0.0, True)


def test_unknown_key_and_unknown_tool_give_error_observations() -> None:
    env = ToolLookupEnv()
    env.reset(SAMPLE)
    obs, r, done, _ = env.step(call("plum"))
    assert (obs, r, done) == ("error: unknown key 'plum'", 0.0, False)
    obs, _, _, _ = env.step(call("golden plum", name="search"))
    assert obs.startswith("error: unknown tool 'search'")
    obs, _, _, _ = env.step('<tool_call>{"name": "lookup", "arguments": {}}</tool_call>')
    assert obs == "error: lookup needs an argument 'key'"


def test_malformed_json_is_reported_and_the_episode_goes_on() -> None:
    env = ToolLookupEnv()
    env.reset(SAMPLE)
    obs, r, done, info = env.step(
        '<tool_call>{"name": "lookup", "arguments": {key: golden plum}}</tool_call>'
    )
    assert obs.startswith("error: tool call is not valid JSON")
    assert (r, done) == (0.0, False)
    assert info["tool_calls"] == [] and len(info["malformed"]) == 1
    env.step(call("golden plum"))
    assert env.step("<answer>47</answer>")[1] == 1.0


def test_max_turns_ends_the_episode_with_zero() -> None:
    env = ToolLookupEnv(max_turns=2)
    env.reset(SAMPLE)
    assert env.step(call("golden plum"))[2] is False  # turn 1
    obs, r, done, info = env.step(call("golden plum"))  # turn 2 = max_turns, still no answer
    assert (obs, r, done, info["reason"]) == ("golden plum: 47", 0.0, True, "max_turns")
    with pytest.raises(DataError, match="call reset"):
        env.step("<answer>47</answer>")


def test_answer_on_the_last_turn_is_still_graded() -> None:
    env = ToolLookupEnv(max_turns=2)
    env.reset(SAMPLE)
    env.step(call("golden plum"))
    assert env.step("<answer>47</answer>")[1:3] == (1.0, True)


def test_reset_starts_a_fresh_episode() -> None:
    env = ToolLookupEnv()
    env.reset(SAMPLE)
    env.step(call("golden plum"))
    env.reset(SAMPLE)  # the earlier lookup must not carry over
    assert env.step("<answer>47</answer>")[1] == 0.0


def test_env_rejects_bad_arguments() -> None:
    with pytest.raises(DataError, match="max_turns"):
        ToolLookupEnv(max_turns=0)
    with pytest.raises(DataError, match="no 'table'/'key' metadata"):
        ToolLookupEnv().reset(Sample(id="x", messages=(Message("user", "hi"),), answer="1"))


# --- single-shot reward ---------------------------------------------------------------


def test_single_shot_reward() -> None:
    assert reward(call("golden plum") + "\n<answer>47</answer>", SAMPLE) == 1.0
    assert reward("<answer>47</answer>", SAMPLE) == 0.0  # right code, no lookup
    assert reward(call("red fig") + "\n<answer>47</answer>", SAMPLE) == 0.0  # wrong key
    assert reward(call("golden plum") + "\n<answer>12</answer>", SAMPLE) == 0.0  # wrong code
    assert reward("<answer>47</answer>\n" + call("golden plum"), SAMPLE) == 0.0  # answer before the call


def test_generated_samples_hide_the_table() -> None:
    for sample in generate(0, "eval", 20, 3):
        assert len(sample.metadata["table"]) == 16
        assert sample.answer == sample.metadata["table"][sample.metadata["key"]]
        assert 10 <= int(sample.answer) <= 99
        assert [m.role for m in sample.messages] == ["system", "user"]
        assert "<tool_call>" in sample.messages[0].content
        assert sample.metadata["tools"][0]["function"]["name"] == "lookup"
