"""What an agent sends a gateway session, checked: the conversation it repeats, the rewards it posts.

Pure functions over the request bodies (no hub state), so each refusal is a :class:`SessionError`
whose status is the HTTP code and whose message names the problem and the fix.
"""

from __future__ import annotations

import json
import math
from typing import Any


class SessionError(Exception):
    """A request the hub refuses: ``status`` is its HTTP code, the message names the problem and the fix."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def comparable(m: Any) -> tuple[str, str]:
    """A message as the history check compares it: role and content (other fields, e.g. tool_calls, are
    derived from the content the gateway returned)."""
    if not isinstance(m, dict):
        return ("?", repr(m))
    content = m.get("content")
    return (str(m.get("role", "user")), content if isinstance(content, str) else json.dumps(content or "",
                                                                                            sort_keys=True))


def new_messages_start(sid: str, recorded: list[tuple[str, str]], messages: list[dict[str, Any]]) -> int:
    """Where the new messages of a session's next turn start: ``messages`` must repeat the ``recorded``
    conversation exactly, then add at least one message that is not the assistant's."""
    for i, seen in enumerate(recorded):
        if i >= len(messages) or comparable(messages[i]) != seen:
            raise SessionError(400, f"messages[{i}] does not match what session {sid} recorded: resend the "
                                    f"conversation so far (with the assistant replies as returned), then the "
                                    f"new messages")
    start = len(recorded)
    if len(messages) == start:
        raise SessionError(400, f"no new message after the {start} recorded ones: add a tool result or a user "
                                f"message")
    for j in range(start, len(messages)):
        if messages[j].get("role") == "assistant":
            raise SessionError(400, f"messages[{j}] is an assistant message the gateway did not generate; "
                                    f"only tool, user or system messages may follow the recorded conversation")
    return start


# the run's sampling is the policy's (the behaviour log-probs must be its own): these may only repeat it
_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k"}
_NEUTRAL_ZERO = ("presence_penalty", "frequency_penalty")


def extra_stops(body: dict[str, Any], params: Any) -> list[str]:
    """The request's ``stop`` strings (added to the run's: a stop truncates, it never changes a sampled
    token's log-prob), after refusing sampling fields that would change the policy's distribution."""
    for key, attr in _SAMPLING.items():
        given = body.get(key)
        if given is not None and given != getattr(params, attr):
            raise SessionError(400, f"{key}={given!r} differs from the run's rollout.{attr}="
                                    f"{getattr(params, attr)!r}: a session samples as the policy does (its "
                                    f"log-probs train it); leave {key} out")
    for key in _NEUTRAL_ZERO:
        if body.get(key) not in (None, 0, 0.0):
            raise SessionError(400, f"{key} must be 0 or absent: a session samples as the policy does")
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(x, str) and x for x in stops) or len(stops) > 16:
        raise SessionError(400, f"stop must be a non-empty string or a list of at most 16 of them, got {stop!r}")
    return stops


def check_media(messages: list[dict[str, Any]], start: int, processor: Any) -> None:
    """Refuse, naming the part, an image or audio part the policy has no tower for: one agent's screenshot
    on a text-only policy is that session's 400, not a failed batch."""
    kinds = {"image_url": ("image_processor", "images"), "input_audio": ("feature_extractor", "audio")}
    for i in range(start, len(messages)):
        content = messages[i].get("content")
        for j, part in enumerate(content if isinstance(content, list) else []):
            need = kinds.get(part.get("type")) if isinstance(part, dict) else None
            if need and getattr(processor, need[0], None) is None:
                raise SessionError(400, f"messages[{i}].content[{j}] is an {part['type']} part, but this run's policy "
                                        f"takes no {need[1]}; send it as text (or train a model that takes "
                                        f"{need[1]}); the session is unchanged")


def unusable_request(e: Exception) -> SessionError:
    """A request the hub could not turn into the policy's context (the chat template or a media decoder
    refused it): that session's 400, naming the cause."""
    return SessionError(400, f"this request cannot be turned into the policy's context "
                             f"({type(e).__name__}: {e}); the session is unchanged: fix the messages and resend")


def checked_rewards(body: dict[str, Any], reward_range: tuple[float, float]) -> tuple[float, list[float] | None]:
    """``(reward, turn_rewards)`` of a reward post, each inside ``reward_range`` (rollout.agent_reward_min/max):
    a value such as 1e39 is finite in Python but inf in the float32 reward column, and NaN in every
    advantage of its batch."""
    reward, turns = body.get("reward"), body.get("turn_rewards")
    lo, hi = reward_range
    if not _within(reward, lo, hi):
        raise SessionError(400, f"reward must be a number in [{lo:g}, {hi:g}] (rollout.agent_reward_min/max), got "
                                f"{reward!r}")
    if turns is not None and not (isinstance(turns, list) and all(_within(x, lo, hi) for x in turns)):
        raise SessionError(400, f"turn_rewards must be a list of numbers in [{lo:g}, {hi:g}] "
                                f"(rollout.agent_reward_min/max), got {turns!r}")
    return float(reward), None if turns is None else [float(x) for x in turns]


def _within(x: Any, lo: float, hi: float) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and lo <= x <= hi
