"""Why an episode ended, recorded on every trajectory, and ``rollout.max_episode_tokens`` ending it: in the
built-in agent loop and in gateway sessions (whose replies say why, in each API's shape)."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from relax.algorithms.turn_rewards import turn_reward_tokens
from relax.config import ConfigError, load_config
from relax.engines.types import SamplingParams
from relax.rollout.episodes import ENDINGS, EpisodeRunner
from relax.rollout.rewards import RewardDispatcher
from relax.rollout.sessions import SessionError
from relax.rollout.tool_choice import ToolChoice
from relax.services.api import messages_api, responses_api
from relax.services.api.gateway import chat_reply, stream_events
from tests.relax.rollout.test_sessions import _claim, _hub, _msgs, _run, setup  # noqa: F401 (a fixture)


class CountingEnv:
    """Done after ``done_after`` steps (never if None); its observation is a fixed tool result."""

    def __init__(self, done_after: int | None):
        self.done_after, self.steps = done_after, 0

    def reset(self, sample) -> str:
        return ""

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        self.steps += 1
        return "golden plum: 7", 0.0, self.done_after is not None and self.steps >= self.done_after, {}


def _runner(setup, max_turns: int, max_episode_tokens: int = 0) -> EpisodeRunner:  # noqa: F811
    tok, pool, _ = setup
    return EpisodeRunner(pool, tok, None, RewardDispatcher(), SamplingParams(max_new_tokens=12), max_turns=max_turns,
                         max_seq_len=256, max_episode_tokens=max_episode_tokens)


def test_the_agent_loop_records_env_done_max_turns_and_max_episode_tokens(setup):  # noqa: F811
    _, _, samples = setup
    prompts = [(0, samples[0])]
    (done,) = _runner(setup, 3).agent(prompts, 1, lambda s: CountingEnv(2))
    assert done.ended == "env_done" and done.turns == 2
    (capped,) = _runner(setup, 2).agent(prompts, 1, lambda s: CountingEnv(None))
    assert capped.ended == "max_turns" and capped.turns == 2
    (budget,) = _runner(setup, 4, max_episode_tokens=3).agent(prompts, 1, lambda s: CountingEnv(None))
    # 3 policy tokens in all, however the turns split them, and nothing generated past the budget
    assert budget.ended == "max_episode_tokens" and budget.policy_tokens == 3
    (single,) = _runner(setup, 4).single_turn(prompts, 1)
    assert single.ended == "one_turn"
    assert {done.ended, capped.ended, budget.ended, single.ended} <= set(ENDINGS)


def test_a_session_cut_by_max_episode_tokens_says_so_and_refuses_another_turn(setup):  # noqa: F811
    _, _, samples = setup
    hub, _ = _hub(setup, max_turns=4, max_episode_tokens=3)
    seen: dict[str, Any] = {}

    def agent(stop: threading.Event) -> None:
        sid, sample = _claim(hub, stop)
        messages = _msgs(sample)
        seen["turn"] = turn = hub.chat(sid, {"messages": messages}).result(timeout=60)
        messages += [{"role": "assistant", "content": turn["text"]}, {"role": "tool", "content": "golden plum: 7"}]
        with pytest.raises(SessionError) as e:
            hub.chat(sid, {"messages": messages}).result(timeout=60)
        seen["refused"] = e.value
        seen["closed"] = hub.close(sid).result(timeout=60)

    (traj,) = _run(hub, [(0, samples[0])], 1, [agent])
    turn = seen["turn"]
    assert turn["completion_tokens"] == 3 and turn["finish"] == "length" and turn["ended"] == "max_episode_tokens"
    assert seen["refused"].status == 400 and "rollout.max_episode_tokens=3" in seen["refused"].message
    assert traj.ended == seen["closed"]["ended"] == "max_episode_tokens" and traj.policy_tokens == 3
    # each API's reply: its own truncation signal, and why the episode ended
    turn = {**turn, "tool_choice": ToolChoice()}
    chat = chat_reply(turn, "m")
    assert chat["choices"][0]["finish_reason"] == "length" and chat["episode_ended"] == "max_episode_tokens"
    assert b'"episode_ended": "max_episode_tokens"}' in list(stream_events(chat))[-2]
    msg = messages_api.message_object(turn, [], {}, "m")
    assert msg["stop_reason"] == "max_tokens" and msg["episode_ended"] == "max_episode_tokens"
    resp = responses_api.response_object(turn, [], {}, "m")
    assert resp["status"] == "incomplete" and resp["episode_ended"] == "max_episode_tokens"


def test_sessions_record_agent_closed_or_max_turns(setup):  # noqa: F811
    _, _, samples = setup
    hub, _ = _hub(setup, max_turns=2)
    replies: list[dict[str, Any]] = []

    def agent(stop: threading.Event) -> None:
        while (claimed := _claim(hub, stop)) is not None:
            sid, sample = claimed
            messages = _msgs(sample)
            turns = 2 if len(replies) == 0 else 1  # the first episode plays to max_turns, the other closes early
            for k in range(turns):
                if k:
                    messages.append({"role": "tool", "content": "golden plum: 7"})
                turn = hub.chat(sid, {"messages": messages}).result(timeout=60)
                replies.append(turn)
                messages.append({"role": "assistant", "content": turn["text"]})
            hub.close(sid).result(timeout=60)

    trajs = _run(hub, [(0, samples[0])], 2, [agent])
    assert sorted((t.turns, t.ended) for t in trajs) == [(1, "agent_closed"), (2, "max_turns")]
    assert [r["ended"] for r in replies] == ["", "max_turns", ""]


def test_a_max_episode_tokens_never_reached_is_a_config_error():
    with pytest.raises(ConfigError, match=r"rollout.max_episode_tokens=64 is never reached.*= 64"):
        load_config("tiny-cpu", ["rollout.max_turns=4", "rollout.max_new_tokens=16", "rollout.max_episode_tokens=64"])
    assert load_config("tiny-cpu", ["rollout.max_turns=4", "rollout.max_new_tokens=16",
                                    "rollout.max_episode_tokens=40"]).rollout.max_episode_tokens == 40


def test_posted_turn_rewards_land_on_their_turns_tokens(setup):  # noqa: F811
    _, _, samples = setup
    hub, _ = _hub(setup, max_turns=2)

    def agent(stop: threading.Event) -> None:
        sid, sample = _claim(hub, stop)
        messages = _msgs(sample)
        for k in range(2):
            if k:
                messages.append({"role": "tool", "content": "golden plum: 7"})
            messages.append({"role": "assistant", "content": hub.chat(sid, {"messages": messages}).result(60)["text"]})
        hub.post_reward(sid, {"reward": 1.0, "turn_rewards": [0.25, 0.75]})
        hub.close(sid).result(timeout=60)

    (traj,) = _run(hub, [(0, samples[0])], 1, [agent])
    assert traj.turn_rewards == [0.25, 0.75]
    per_token = turn_reward_tokens(len(traj.tokens), traj.turn_spans, traj.turn_rewards)
    mask = np.asarray(traj.mask)
    runs = np.flatnonzero(np.diff(np.r_[0, mask, 0]))  # the policy turns: the runs of 1s in the mask
    (s0, e0), (s1, e1) = runs.reshape(-1, 2)
    assert (per_token[s0:e0] == 0.25).all() and (per_token[s1:e1] == 0.75).all()
    assert (per_token[mask == 0] == 0).all()


def test_turn_rewards_train_only_with_external_agents():
    with pytest.raises(ConfigError, match=r"algorithm.turn_reward_coef=0.5 .* rollout.agents=external"):
        load_config("tiny-cpu", ["algorithm.turn_reward_coef=0.5"])
    cfg = load_config("tiny-cpu", ["algorithm.turn_reward_coef=0.5", "rollout.agents=external"])
    assert cfg.algorithm.turn_reward_coef == 0.5


def tool_result_seen(sample, response: str) -> bool:
    """A session done hook (rollout.session_done_fn): the episode is over once a tool result came back."""
    return "\n[tool] " in response


def test_the_session_done_hook_ends_the_episode_and_says_so(setup):  # noqa: F811
    _, _, samples = setup
    hub, _ = _hub(setup, max_turns=4, done_fn=tool_result_seen)
    seen: dict[str, Any] = {}

    def agent(stop: threading.Event) -> None:
        sid, sample = _claim(hub, stop)
        messages, ended = _msgs(sample), []
        for k in range(2):
            if k:
                messages.append({"role": "tool", "content": "golden plum: 7"})
            turn = hub.chat(sid, {"messages": messages}).result(timeout=60)
            ended.append(turn["ended"])
            messages.append({"role": "assistant", "content": turn["text"]})
        messages.append({"role": "tool", "content": "again"})
        with pytest.raises(SessionError) as e:
            hub.chat(sid, {"messages": messages}).result(timeout=60)
        seen["ended"], seen["refused"] = ended, e.value
        hub.close(sid).result(timeout=60)

    (traj,) = _run(hub, [(0, samples[0])], 1, [agent])
    assert seen["ended"] == ["", "env_done"] and traj.ended == "env_done" and traj.turns == 2
    assert seen["refused"].status == 400 and "rollout.session_done_fn" in seen["refused"].message
    with pytest.raises(ConfigError, match="rollout.session_done_fn=.*rollout.agents=external"):
        load_config("tiny-cpu", ["rollout.session_done_fn=tests.relax.rollout.test_episode_endings:tool_result_seen"])


def broken_hook(sample, response: str) -> bool:
    raise KeyError("no such task state")


def test_a_done_hook_that_raises_ends_that_episode_alone_with_zero_reward(setup):  # noqa: F811
    _, _, samples = setup
    hub, _ = _hub(setup, max_turns=4, done_fn=broken_hook)
    seen: dict[str, Any] = {}

    def agent(stop: threading.Event) -> None:
        sid, sample = _claim(hub, stop)
        messages = _msgs(sample)
        seen["turn"] = turn = hub.chat(sid, {"messages": messages}).result(timeout=60)
        messages += [{"role": "assistant", "content": turn["text"]}, {"role": "tool", "content": "x"}]
        with pytest.raises(SessionError) as e:
            hub.chat(sid, {"messages": messages}).result(timeout=60)
        seen["refused"] = e.value
        hub.post_reward(sid, {"reward": 1.0})  # an agent's reward cannot rescue an episode the hook broke
        hub.close(sid).result(timeout=60)

    (traj,) = _run(hub, [(0, samples[0])], 1, [agent])
    assert seen["turn"]["ended"] == traj.ended == "env_error" and traj.reward == 0.0
    assert "rollout.session_done_fn failed" in traj.error and "KeyError" in traj.error
    assert seen["refused"].status == 400 and "raised: rollout.session_done_fn failed" in seen["refused"].message
