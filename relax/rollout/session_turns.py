"""One chat turn of a gateway session: the request turned into the context the policy generates from, and
the sampled turn recorded (relax.rollout.sessions serves the turns of every session in rounds).

The first request's messages are chat-templated into the prompt; each later request repeats the recorded
conversation and adds only non-assistant messages, tokenized as an observation (masked out of the loss)
as the built-in agent loop does. A forced reply prefix (``tool_choice``, relax.rollout.tool_choice) is
context too: masked, and part of the reply's text. The assistant's tokens and log-probs are the engine's
own, never re-tokenised. Planning changes nothing, so a refused request (a SessionError, 400) leaves
the session as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from relax.data.samples import Sample
from relax.engines.openai_routes import chat_prompt, check_chat_request
from relax.engines.types import EngineError, SamplingParams
from relax.models.processors import merge_media
from relax.rollout.episodes import Trajectory, observation_tokens
from relax.rollout.prompts import EncodedPrompt, encode_prompt
from relax.rollout.session_requests import (
    SessionError,
    check_media,
    comparable,
    extra_stops,
    new_messages_start,
)
from relax.rollout.tool_calls import parse_tool_calls
from relax.rollout.tool_choice import ToolChoice, ToolChoiceError, tool_choice_of, tool_names

_TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")  # read here; the engine routes' check refuses them


@dataclass
class Slot:
    position: int
    sample: Sample
    index: int
    drops: int = 0
    releases: int = 0  # sessions on it closed before any chat turn (not failures: see SessionHub._release)
    done: Trajectory | None = None


@dataclass
class Session:
    id: str
    slot: Slot
    last_active: float
    state: str = "open"  # open -> closed | dropped | aborted
    traj: Trajectory | None = None  # from the first chat call
    messages: list[tuple[str, str]] = field(default_factory=list)  # the recorded conversation, comparable
    tools: list[str] = field(default_factory=list)  # the function names the first request declared
    busy: bool = False  # a chat or close is queued or running
    reward: float | None = None
    turn_rewards: list[float] | None = None
    why: str = ""  # why it was dropped or aborted


@dataclass
class TurnPlan:
    context: EncodedPrompt  # the whole context to generate from (a forced prefix included)
    traj: Trajectory  # the trajectory it extends (a new one on the first turn)
    max_new: int
    stop: list[str]  # stop strings added to the run's (the request's, parallel_tool_calls=false)
    new: list[tuple[str, str]]  # the new messages, as the history check compares them
    transcript: str  # the new messages as the verifier reads them
    choice: ToolChoice
    tools: list[str]


class TurnMaker:
    """Plans and records turns for one hub (its tokenizer, processor and limits)."""

    def __init__(self, tokenizer: Any, processor: Any, params: SamplingParams, max_seq_len: int, max_turns: int,
                 max_episode_tokens: int = 0, tool_format: str = "qwen",
                 done_fn: Callable[[Sample, str], bool] | None = None):
        self.tokenizer, self.processor, self.params = tokenizer, processor, params
        self.max_new_tokens, self.max_seq_len, self.max_turns = params.max_new_tokens, max_seq_len, max_turns
        self.max_episode_tokens = max_episode_tokens  # 0: no limit
        self.tool_format = tool_format  # how the policy writes tool calls (relax.rollout.tool_calls)
        self.done_fn = done_fn  # rollout.session_done_fn: the task's word that the episode is over

    def plan(self, s: Session, body: dict[str, Any]) -> TurnPlan:
        try:
            check_chat_request({k: v for k, v in body.items() if k not in _TOOL_FIELDS})
            if body.get("n", 1) != 1:
                raise SessionError(400, "n must be 1: a session is one episode")
            stop = extra_stops(body, self.params)
            tools = tool_names(body.get("tools")) if body.get("tools") else s.tools
            choice = tool_choice_of(body, tools, self.tool_format)
            messages = body["messages"]
            start = 0 if s.traj is None else new_messages_start(s.id, s.messages, messages)
            check_media(messages, start, self.processor)
            msgs, images, audios = chat_prompt(messages[start:])
        except (EngineError, ToolChoiceError) as e:
            raise SessionError(400, str(e)) from None
        if s.traj is not None and s.traj.turns >= self.max_turns:
            raise SessionError(400, f"session {s.id} has taken rollout.max_turns={self.max_turns} policy turns; "
                                    f"close it (POST /v1/sessions/{s.id}/close)")
        if s.traj is not None and s.traj.ended == "max_episode_tokens":
            raise SessionError(400, f"session {s.id} has generated rollout.max_episode_tokens={self.max_episode_tokens}"
                                    f" policy tokens; close it (POST /v1/sessions/{s.id}/close)")
        if s.traj is not None and s.traj.ended in ("env_done", "env_error"):
            said = "said so" if s.traj.ended == "env_done" else "raised: " + s.traj.error
            raise SessionError(400, f"session {s.id}'s episode is done (rollout.session_done_fn {said}); close it "
                                    f"(POST /v1/sessions/{s.id}/close)")
        prefill = self.tokenizer(choice.prefill(), add_special_tokens=False)["input_ids"] if choice.prefill() else []
        if s.traj is None:
            text = self.tokenizer.apply_chat_template(msgs, tools=body.get("tools") or None, tokenize=False,
                                                      add_generation_prompt=True)
            enc = encode_prompt(text, images, audios, self.tokenizer, self.processor)
            slot, k = s.slot, len(enc.input_ids)
            traj = Trajectory(slot.sample, slot.position, slot.index, list(enc.input_ids), [0] * k, [0.0] * k, k,
                              enc.mm_inputs, images=list(enc.images), audios=list(enc.audios))
            context = EncodedPrompt(traj.tokens + prefill, traj.mm_inputs, traj.images, traj.audios)
        else:
            traj = s.traj
            enc = observation_tokens(traj.tokens, msgs, images, audios, self.tokenizer, self.processor)
            context = EncodedPrompt(traj.tokens + enc.input_ids + prefill, merge_media(traj.mm_inputs, enc.mm_inputs),
                                    traj.images + enc.images, traj.audios + enc.audios)
        room = self.max_seq_len - len(context.input_ids)
        asked = body.get("max_completion_tokens", body.get("max_tokens"))
        if asked is not None and (isinstance(asked, bool) or not isinstance(asked, int) or asked < 1):
            raise SessionError(400, f"max_tokens must be an integer >= 1, got {asked!r}")
        if room <= 0 or (asked is not None and asked > room):
            raise SessionError(400, f"this turn's context is {len(context.input_ids)} tokens and "
                                    f"model.max_seq_len is {self.max_seq_len}, leaving {max(room, 0)} for the reply"
                                    f"{f' (asked max_tokens={asked})' if asked is not None else ''}; the session is "
                                    f"unchanged: send shorter messages, ask fewer tokens, or close it")
        max_new = min(self.max_new_tokens, room, asked or room)
        if self.max_episode_tokens:  # the turn that reaches the episode's budget is cut there
            max_new = min(max_new, self.max_episode_tokens - traj.policy_tokens)
        transcript = "".join(f"\n[{m['role']}] {m['content']}\n" for m in msgs) if s.traj is not None else ""
        return TurnPlan(context, traj, max_new, stop + choice.stop(), [comparable(m) for m in messages[start:]],
                        transcript, choice, tools)

    def record(self, s: Session, plan: TurnPlan, c: Any) -> dict[str, Any]:
        """Record the observation (and forced prefix) and the sampled turn; the turn for the reply."""
        traj = plan.traj
        if s.traj is None:
            s.traj, s.tools = traj, plan.tools
        traj.observe(plan.context.input_ids[len(traj.tokens):])  # the agent's messages and any forced prefix
        traj.mm_inputs, traj.images, traj.audios = plan.context.mm_inputs, plan.context.images, plan.context.audios
        traj.response += plan.transcript
        traj.turn_spans.append((len(traj.tokens), len(traj.tokens) + len(c.output_ids)))
        traj.extend(c)
        text = plan.choice.prefill() + self.tokenizer.decode(c.output_ids, skip_special_tokens=True)
        traj.response += text
        traj.turns += 1
        traj.finish = str(c.finish_reason.get("type", ""))
        if self.max_episode_tokens and traj.policy_tokens >= self.max_episode_tokens:
            traj.ended = "max_episode_tokens"  # checked first: a cut turn says why it was cut
        elif self.done_fn is not None and self._done(traj):
            traj.ended = "env_done"
        elif traj.turns >= self.max_turns:
            traj.ended = "max_turns"
        s.messages += [*plan.new, ("assistant", text)]
        return {"id": f"chatcmpl-{s.id}-{traj.turns}", "text": text, "finish": traj.finish, "ended": traj.ended,
                "prompt_tokens": len(plan.context.input_ids), "completion_tokens": len(c.output_ids),
                "tool_choice": plan.choice, "calls": parse_tool_calls(text, self.tool_format)}

    def _done(self, traj: Trajectory) -> bool:
        """The done hook's answer; one that raises ends this episode alone, scored 0 with the error kept
        (as a faulty Env does in the built-in loop), never the batch."""
        try:
            return bool(self.done_fn(traj.sample, traj.response))
        except Exception as e:
            traj.error = f"rollout.session_done_fn failed on sample {traj.sample.id}: {type(e).__name__}: {e}"
            traj.ended = "env_error"
            return False
