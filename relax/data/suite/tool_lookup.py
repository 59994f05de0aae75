"""Multi-turn tool-use task: the answer is a secret code only a ``lookup`` tool call reveals.

"What is the secret code of the item 'golden plum'?" cannot be answered from the prompt:
the table lives in ``sample.metadata["table"]``, never in the messages. The policy has to
emit ``<tool_call>{"name": "lookup", "arguments": {"key": "golden plum"}}</tool_call>``, read
the result the environment returns, and answer. Codes are two-digit numbers, so guessing
scores about 1/90 and any real progress shows the tool loop works.

The agent loop drives :class:`ToolLookupEnv`. The task's plain :func:`reward` grades a
single transcript and can only pay out when the transcript itself contains the right
lookup followed by the right answer.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from typing import Any

from relax.data.errors import DataError
from relax.data.samples import Message, Sample
from relax.data.suite.base import TaskSpec, check_generate_args, generate_split
from relax.data.verifiers import extract_final_answer, normalize_answer

NAME = "tool_lookup"
TOOL_NAME = "lookup"
ADJECTIVES = (
    "golden", "silver", "red", "green", "blue", "tiny", "giant", "sour",
    "sweet", "frozen", "wild", "ripe", "purple", "spotted", "striped", "dusty",
)  # fmt: skip
NOUNS = (
    "plum", "apple", "pear", "lemon", "cherry", "mango", "peach", "grape",
    "melon", "kiwi", "fig", "lime", "olive", "berry", "apricot", "papaya",
    "banana", "coconut", "guava", "quince", "date", "orange", "nutmeg", "walnut",
)  # fmt: skip
CODES = tuple(str(c) for c in range(10, 100))

LOOKUP_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Return the secret code stored for an item.",
        "parameters": {
            "type": "object",
            "properties": {"key": {"type": "string", "description": "The item's name, e.g. 'golden plum'."}},
            "required": ["key"],
        },
    },
}
SYSTEM_PROMPT = (
    "You can use one tool, `lookup`, which returns the secret code stored for an item.\n"
    "To call it, write exactly:\n"
    '<tool_call>{"name": "lookup", "arguments": {"key": "<item name>"}}</tool_call>\n'
    "The result comes back in the next message. When you know the code, reply with only "
    "the code inside <answer></answer>, for example <answer>42</answer>."
)
_TOOL_CALL_RE = re.compile(r"<\s*tool_call\s*>(.*?)<\s*/\s*tool_call\s*>", re.DOTALL | re.IGNORECASE)


@dataclass(frozen=True)
class LookupConfig:
    """``table_size`` items (the asked one plus distractors) sit in the hidden table."""

    table_size: int = 4

    def __post_init__(self) -> None:
        if not 1 <= self.table_size <= len(ADJECTIVES) * len(NOUNS):
            raise DataError(f"tool_lookup: table_size must be in [1, {len(ADJECTIVES) * len(NOUNS)}]")


CONFIGS: dict[int, LookupConfig] = {1: LookupConfig(4), 2: LookupConfig(8), 3: LookupConfig(16)}


@dataclass(frozen=True)
class Puzzle:
    key: str
    table: tuple[tuple[str, str], ...]

    @property
    def code(self) -> str:
        return dict(self.table)[self.key]


def draw_puzzle(rng: random.Random, config: LookupConfig) -> Puzzle:
    items = set()
    while len(items) < config.table_size:
        items.add(f"{rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}")
    names = sorted(items)
    rng.shuffle(names)
    table = tuple((name, rng.choice(CODES)) for name in names)
    return Puzzle(key=rng.choice(names), table=table)


def puzzle_to_sample(puzzle: Puzzle, sample_id_: str, difficulty: int) -> Sample:
    question = f"What is the secret code of the item '{puzzle.key}'? Use the lookup tool."
    return Sample(
        id=sample_id_,
        task=NAME,
        messages=(Message("system", SYSTEM_PROMPT), Message("user", question)),
        answer=puzzle.code,
        metadata={
            "difficulty": difficulty,
            "key": puzzle.key,
            "table": dict(puzzle.table),
            "tools": [LOOKUP_SCHEMA],
        },
    )


def generate_with_config(
    seed: int, split: str, n: int, config: LookupConfig, difficulty: int = 0
) -> list[Sample]:
    """``n`` samples of ``split``; the asked item name decides the split, so question texts never leak."""
    return generate_split(NAME, seed, split, n, config, lambda r: draw_puzzle(r, config),
                          lambda p: p.key, lambda p, sid: puzzle_to_sample(p, sid, difficulty))


def generate(seed: int, split: str, n: int, difficulty: int) -> list[Sample]:
    check_generate_args(NAME, split, n, difficulty, tuple(CONFIGS))
    return generate_with_config(seed, split, n, CONFIGS[difficulty], difficulty)


def answer_space(difficulty: int) -> list[str]:
    """All codes ``"10".."99"``."""
    if difficulty not in CONFIGS:
        raise DataError(f"task {NAME!r}: difficulty must be one of {tuple(CONFIGS)}, not {difficulty!r}")
    return list(CODES)


def parse_tool_calls_with_errors(text: str) -> tuple[list[dict[str, Any]], list[str]]:
    """Every well-formed ``<tool_call>`` in ``text`` as ``{"name", "arguments"}``, plus one
    message per malformed call (bad JSON, missing name, non-object arguments)."""
    calls: list[dict[str, Any]] = []
    errors: list[str] = []
    for raw in _TOOL_CALL_RE.findall(text):
        try:
            call = json.loads(raw.strip())
        except json.JSONDecodeError as e:
            errors.append(f"tool call is not valid JSON ({e.msg} at char {e.pos}): {raw.strip()[:80]!r}")
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            errors.append(f'tool call must be an object with a string "name": {raw.strip()[:80]!r}')
            continue
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some chat templates serialise arguments twice
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            errors.append(f'tool call "arguments" must be an object: {raw.strip()[:80]!r}')
            continue
        calls.append({"name": call["name"], "arguments": arguments})
    return calls, errors


def parse_tool_calls(text: str) -> list[dict[str, Any]]:
    """Well-formed tool calls in ``text``, in order; malformed ones are skipped."""
    return parse_tool_calls_with_errors(text)[0]


def _canonical_key(key: Any) -> str:
    return " ".join(str(key).lower().split())


def run_lookup(call: dict[str, Any], table: dict[str, str]) -> tuple[str, str | None]:
    """The tool's text result for ``call`` and the key it found (``None`` when it failed)."""
    if call["name"] != TOOL_NAME:
        return f"error: unknown tool '{call['name']}'; the only tool is '{TOOL_NAME}'", None
    if "key" not in call["arguments"]:
        return "error: lookup needs an argument 'key'", None
    wanted = _canonical_key(call["arguments"]["key"])
    for name, code in table.items():
        if _canonical_key(name) == wanted:
            return f"{name}: {code}", name
    return f"error: unknown key '{call['arguments']['key']}'", None


def _answer_correct(text: str, sample: Sample) -> bool:
    predicted = extract_final_answer(text)
    return predicted is not None and normalize_answer(predicted) == normalize_answer(sample.answer)


def reward(response: str, sample: Sample) -> float:
    """Single-shot grading: 1.0 only if ``response`` looks up the asked key and then, after
    its last tool call, gives the right code; a bare answer (even a correct guess) gets 0.

    Training uses :class:`ToolLookupEnv`, which feeds real tool results back to the policy.
    """
    table = dict(sample.metadata.get("table", {}))
    calls = parse_tool_calls(response)
    found = {run_lookup(call, table)[1] for call in calls}
    if sample.metadata.get("key") not in found:
        return 0.0
    after = _TOOL_CALL_RE.split(response)[-1]
    return 1.0 if _answer_correct(after, sample) else 0.0


def oracle_response(sample: Sample) -> str:
    """The ideal single-shot transcript: the right lookup, then the right code."""
    call = json.dumps({"name": TOOL_NAME, "arguments": {"key": sample.metadata["key"]}})
    return f"<tool_call>{call}</tool_call>\n<answer>{sample.answer}</answer>"


class ToolLookupEnv:
    """The :class:`~relax.data.suite.base.Env` for this task.

    Each step either contains tool calls (observation: their results, one per line; reward
    0; not done) or is the final answer (reward 1.0 if it is right *and* the asked key was
    successfully looked up earlier in the episode; done). The episode also ends, with
    reward 0, when ``max_turns`` steps pass without a final answer.
    """

    def __init__(self, max_turns: int = 4) -> None:
        if max_turns < 1:
            raise DataError(f"ToolLookupEnv: max_turns must be >= 1, got {max_turns}")
        self.max_turns = max_turns
        self._sample: Sample | None = None
        self._turn = 0
        self._looked_up = False
        self._done = True

    def reset(self, sample: Sample) -> str:
        if "table" not in sample.metadata or "key" not in sample.metadata:
            raise DataError(
                f"ToolLookupEnv: sample {sample.id!r} has no 'table'/'key' metadata; use a tool_lookup sample"
            )
        self._sample, self._turn, self._looked_up, self._done = sample, 0, False, False
        return sample.prompt_text

    def step(self, action_text: str) -> tuple[str, float, bool, dict[str, Any]]:
        if self._done or self._sample is None:
            raise DataError("ToolLookupEnv: the episode is over; call reset(sample) before step()")
        self._turn += 1
        calls, errors = parse_tool_calls_with_errors(action_text)
        info: dict[str, Any] = {"turn": self._turn, "tool_calls": calls, "malformed": errors}
        if not calls and not errors:
            self._done = True
            correct = _answer_correct(action_text, self._sample)
            info.update(reason="answer", correct=correct, looked_up=self._looked_up)
            return "", 1.0 if correct and self._looked_up else 0.0, True, info
        lines = [f"error: {e}" for e in errors]
        for call in calls:
            result, found = run_lookup(call, dict(self._sample.metadata["table"]))
            self._looked_up |= found == self._sample.metadata["key"]
            lines.append(result)
        if self._turn >= self.max_turns:
            self._done = True
            info["reason"] = "max_turns"
            return "\n".join(lines), 0.0, True, info
        return "\n".join(lines), 0.0, False, info


TASK = TaskSpec(
    name=NAME,
    modality="text",
    description=(
        "Multi-turn tool use: find an item's secret code with the 'lookup' tool, then answer "
        "the two-digit code. Reward: 1 only for the right code after the right lookup."
    ),
    generate=generate,
    reward=reward,
    answer_space=answer_space,
    make_env=ToolLookupEnv,
    difficulties=tuple(CONFIGS),
    oracle=oracle_response,
)
