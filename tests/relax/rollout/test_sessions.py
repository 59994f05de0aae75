"""The session hub with a real in-process engine on the tiny model: agents (threads here, calling the
hub as the gateway's handlers do) chat through sessions while the rollout's thread runs the batch."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from relax.config import load_config
from relax.data.suite import generate_suite
from relax.engines.types import SamplingParams
from relax.models import build_policy, build_tokenizer
from relax.rollout.engine_pool import LocalEngines
from relax.rollout.episodes import Trajectory, observation_tokens
from relax.rollout.prompts import encode_prompt
from relax.rollout.rewards import RewardDispatcher
from relax.rollout.sessions import BatchFailed, SessionError, SessionHub

MAX_SEQ_LEN = 256


class RecordingPool:
    """The real engine pool, keeping what it returned per request id (what the engine sampled)."""

    def __init__(self, pool: LocalEngines):
        self.pool, self.sampled = pool, {}

    @property
    def weight_version(self) -> int:
        return self.pool.weight_version

    def generate(self, prompts, params, rids, should_abort=None):
        out = self.pool.generate(prompts, params, rids, should_abort)
        for rid, p, cs in zip(rids, prompts, out, strict=True):
            self.sampled[rid] = (list(p.input_ids), cs[0])
        return out


@pytest.fixture(scope="module")
def setup():
    tok = build_tokenizer("bpe-tiny")
    model, _ = build_policy(load_config("tiny-cpu", []).model, tok, seed=0)
    samples = generate_suite(["tool_lookup"], seed=0, train_per_task=4, eval_per_task=2)["train"]
    pool = LocalEngines(model, tok, max_batch_size=8, max_seq_len=MAX_SEQ_LEN, seed=0)
    yield tok, pool, samples
    pool.close()


def _hub(setup, **kw: Any) -> tuple[SessionHub, RecordingPool]:
    tok, pool, _ = setup
    rec = RecordingPool(pool)
    hub = SessionHub(rec, tok, None, RewardDispatcher(), SamplingParams(max_new_tokens=12, stop=["</answer>"]),
                     max_seq_len=MAX_SEQ_LEN, **kw)
    return hub, rec


def _run(hub: SessionHub, prompts: list, n: int, agents: list[Callable[[threading.Event], None]]) -> list[Trajectory]:
    """run_batch on this thread while each agent runs on its own; an agent's exception fails the test."""
    stop, errors = threading.Event(), []

    def guarded(agent):
        try:
            agent(stop)
        except BaseException as e:  # reported below, on the test's thread; the batch cannot finish without it
            errors.append(e)
            hub.shutdown()

    threads = [threading.Thread(target=guarded, args=(a,), daemon=True) for a in agents]
    for t in threads:
        t.start()
    try:
        trajs = hub.run_batch(prompts, n)
    except BatchFailed:
        if not errors:
            raise
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    if errors:
        raise errors[0]
    return trajs


def _claim(hub: SessionHub, stop: threading.Event) -> tuple[str, Any] | None:
    while not stop.is_set():
        claimed = hub.open_session()
        if claimed is not None:
            return claimed
        time.sleep(0.005)
    return None


def _msgs(sample) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} for m in sample.messages]


def tool_agent(hub: SessionHub, log: dict[str, Any], turns: int = 2) -> Callable[[threading.Event], None]:
    """Plays sessions until stopped: a tool result after each turn, then close."""
    def play(stop: threading.Event) -> None:
        while (claimed := _claim(hub, stop)) is not None:
            sid, sample = claimed
            messages = _msgs(sample)
            for k in range(turns):
                if k:
                    messages.append({"role": "tool", "content": f"golden plum: {10 + k}"})
                turn = hub.chat(sid, {"messages": messages}).result(timeout=60)
                messages.append({"role": "assistant", "content": turn["text"]})
            log.setdefault("closed", []).append((sid, hub.close(sid).result(timeout=60)))
    return play


def test_recorded_tokens_are_the_engines_and_observations_are_masked(setup):
    tok, _, samples = setup
    hub, rec = _hub(setup)
    log: dict[str, Any] = {}
    prompts = [(0, samples[0]), (1, samples[1])]
    trajs = _run(hub, prompts, 2, [tool_agent(hub, log), tool_agent(hub, log)])
    assert [(t.position, t.index) for t in trajs] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    by_rid = sorted(rec.sampled.items(), key=lambda kv: len(kv[1][0]))
    for t in trajs:
        # the prompt is the chat template of the agent's messages: the same ids the built-in runner uses
        assert t.tokens[:t.prompt_len] == encode_prompt(t.sample, [], [], tok, None).input_ids
        assert t.turns == 2 and t.mask[:t.prompt_len] == [0] * t.prompt_len
        turns = [(ids, c) for _, (ids, c) in by_rid if t.tokens[:len(ids)] == ids and
                 t.tokens[len(ids):len(ids) + len(c.output_ids)] == c.output_ids]
        assert len(turns) == 2, "each turn's context is the trajectory so far"
        (ids1, c1), (ids2, c2) = turns
        end1 = len(ids1) + len(c1.output_ids)
        assert t.tokens[len(ids1):end1] == c1.output_ids and t.logprobs[len(ids1):end1] == list(c1.logprobs)
        assert t.mask[len(ids1):end1] == [1] * len(c1.output_ids)
        # between the turns: the tool message, tokenized as the built-in agent loop does, never trained
        obs = observation_tokens(t.tokens[:end1], [{"role": "tool", "content": "golden plum: 11"}], [], [], tok, None)
        assert t.tokens[end1:len(ids2)] == obs.input_ids
        assert t.mask[end1:len(ids2)] == [0] * len(obs.input_ids) and "<|im_start|>tool" in tok.decode(obs.input_ids)
        assert t.tokens[len(ids2):] == c2.output_ids and t.mask[len(ids2):] == [1] * len(c2.output_ids)
        assert len(t.tokens) == len(t.mask) == len(t.logprobs) and t.versions == [-1, -1]
        # the transcript the verifier scores, as the built-in loop builds it
        text1, text2 = (tok.decode(c.output_ids, skip_special_tokens=True) for c in (c1, c2))
        assert t.response == f"{text1}\n[tool] golden plum: 11\n{text2}"
    closed = log["closed"]
    assert len(closed) == 4 and all(state["state"] == "closed" for _, state in closed)
    assert hub.take_counts() == {"sessions_opened": 4, "sessions_closed": 4, "sessions_dropped": 0,
                                 "sessions_released": 0, "session_turns": 8}


def test_bad_requests_are_400s_and_leave_the_session_usable(setup):
    _, _, samples = setup
    hub, _ = _hub(setup)
    seen: dict[str, Any] = {}

    def agent(stop: threading.Event) -> None:
        sid, sample = _claim(hub, stop)
        messages = _msgs(sample)
        first = hub.chat(sid, {"messages": messages}).result(timeout=60)
        messages.append({"role": "assistant", "content": first["text"]})
        altered = [messages[0], {"role": "user", "content": "another question"}, *messages[2:],
                   {"role": "tool", "content": "x"}]
        too_long = [*messages, {"role": "tool", "content": "golden plum " * 200}]
        extra_assistant = [*messages, {"role": "assistant", "content": "made up"}]
        for name, body in (("history", altered), ("context", too_long), ("assistant", extra_assistant),
                           ("nothing new", messages)):
            with pytest.raises(SessionError) as e:
                hub.chat(sid, {"messages": body}).result(timeout=60)
            seen[name] = e.value
        before = hub.describe(sid)
        ok = hub.chat(sid, {"messages": [*messages, {"role": "tool", "content": "golden plum: 42"}]}).result(60)
        seen["after"] = (before, ok, hub.describe(sid))
        hub.post_reward(sid, {"reward": 0.5})
        hub.close(sid).result(timeout=60)
        with pytest.raises(SessionError) as e:
            hub.post_reward(sid, {"reward": 1.0})
        seen["reward after close"] = e.value
        with pytest.raises(SessionError) as e:
            hub.chat("nope", {"messages": messages})
        seen["unknown"] = e.value

    (traj,) = _run(hub, [(0, samples[0])], 1, [agent])
    assert seen["history"].status == 400 and "messages[1]" in seen["history"].message
    assert seen["context"].status == 400 and "model.max_seq_len" in seen["context"].message
    assert seen["assistant"].status == 400 and "messages[3]" in seen["assistant"].message
    assert seen["nothing new"].status == 400
    before, ok, after = seen["after"]
    assert before["turns"] == 1 and after["turns"] == 2 and ok["text"] is not None  # the refusals changed nothing
    assert traj.turns == 2 and traj.reward == 0.5  # the posted reward, not the verifier's
    assert seen["reward after close"].status == 409 and seen["reward after close"].message.startswith(
        f"session {after['id']} is closed")
    assert seen["unknown"].status == 404


def test_an_idle_session_is_dropped_and_its_episode_offered_again(setup):
    _, _, samples = setup
    hub, _ = _hub(setup, timeout_s=0.3)
    abandoned: dict[str, Any] = {}
    log: dict[str, Any] = {}
    started = threading.Event()

    def quitter(stop: threading.Event) -> None:  # one turn, then silence: as an agent that died
        sid, sample = _claim(hub, stop)
        abandoned["turn"] = hub.chat(sid, {"messages": _msgs(sample)}).result(timeout=60)
        abandoned["id"], abandoned["traj"] = sid, hub._sessions[sid].traj
        started.set()

    def late(stop: threading.Event) -> None:
        started.wait(60)
        tool_agent(hub, log, turns=1)(stop)

    trajs = _run(hub, [(0, samples[0])], 1, [quitter, late])
    assert hub.describe(abandoned["id"])["state"] == "dropped"
    assert len(trajs) == 1 and trajs[0] is not abandoned["traj"]  # the dropped session left nothing
    assert len(log["closed"]) == 1 and log["closed"][0][0] != abandoned["id"]
    assert hub.take_counts()["sessions_dropped"] == 1
    with pytest.raises(SessionError) as e:
        hub.chat(abandoned["id"], {"messages": []})
    assert e.value.status == 409 and "dropped" in e.value.message


def _closer(hub: SessionHub, closed: list[str]) -> Callable[[threading.Event], None]:
    """Opens sessions and closes them before any chat turn, as long as there are any to open."""
    def play(stop: threading.Event) -> None:
        while (claimed := _claim(hub, stop)) is not None:
            try:
                hub.close(claimed[0]).result(timeout=60)
            except SessionError:
                return
            closed.append(claimed[0])
    return play


def test_sessions_closed_before_any_turn_do_not_fail_the_batch(setup):
    # an agent that opens and closes without chatting (it looked and passed) used to count as a drop: four of
    # them failed the whole batch. Beside a working agent the batch finishes; the empty ones are only counted
    _, _, samples = setup
    hub, _ = _hub(setup, max_retries=1)
    log: dict[str, Any] = {}
    empty: list[str] = []
    trajs = _run(hub, [(0, samples[0]), (1, samples[1])], 2, [_closer(hub, empty), tool_agent(hub, log, turns=1)])
    assert len(trajs) == 4 and all(t.turns == 1 for t in trajs)
    counts = hub.take_counts()
    assert counts["sessions_dropped"] == 0 and counts["sessions_closed"] == 4
    assert counts["sessions_released"] == len(empty) and len(empty) > 1 + 1  # past max_retries, harmlessly


def test_an_episode_no_agent_ever_plays_fails_the_batch_naming_it(setup, monkeypatch):
    import relax.rollout.sessions as sessions

    monkeypatch.setattr(sessions, "RELEASE_LIMIT", 20)  # a livelock guard; 1000 in a run
    _, _, samples = setup
    hub, _ = _hub(setup)
    with pytest.raises(BatchFailed, match="opened and closed without a chat turn 21 times: no agent plays it"):
        _run(hub, [(0, samples[0])], 1, [_closer(hub, [])])


def test_a_slot_dropped_past_max_retries_fails_the_batch(setup):
    _, _, samples = setup
    hub, _ = _hub(setup, max_retries=1, timeout_s=0.2)

    def quitter(stop: threading.Event) -> None:  # one turn, then silence, on every session it gets
        while (claimed := _claim(hub, stop)) is not None:
            try:
                hub.chat(claimed[0], {"messages": _msgs(claimed[1])}).result(timeout=60)
            except SessionError:
                return

    with pytest.raises(BatchFailed, match="dropped 2 times.*session_max_retries"):
        _run(hub, [(0, samples[0])], 1, [quitter])


def test_a_reward_outside_the_configured_range_is_a_400_and_changes_nothing(setup):
    # 1e39 is finite as a Python float but inf in the float32 reward column: every advantage of its batch
    # would be NaN; -1e30 and 2.0 lie outside the range the run allows (rollout.agent_reward_min/max)
    _, _, samples = setup
    hub, _ = _hub(setup, reward_range=(-1.0, 1.0))
    refused: list[tuple[Any, str]] = []

    def agent(stop: threading.Event) -> None:
        while (claimed := _claim(hub, stop)) is not None:
            sid, sample = claimed
            hub.chat(sid, {"messages": _msgs(sample)}).result(timeout=60)
            for bad in ({"reward": 1e39}, {"reward": -1e30}, {"reward": 2.0},
                        {"reward": 0.5, "turn_rewards": [1e39]}):
                with pytest.raises(SessionError) as e:
                    hub.post_reward(sid, bad)
                refused.append((e.value.status, e.value.message))
            hub.post_reward(sid, {"reward": -0.25})
            hub.close(sid).result(timeout=60)

    trajs = _run(hub, [(0, samples[0])], 1, [agent])
    assert [t.reward for t in trajs] == [-0.25]  # the refused posts left no trace
    assert all(status == 400 and "in [-1, 1] (rollout.agent_reward_min/max)" in msg for status, msg in refused)
    assert len(refused) == 4


PNG = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5E"
       "rkJggg==")


def test_content_the_policy_cannot_take_is_that_sessions_400_not_a_failed_batch(setup):
    # a screenshot in a tool result on a text-only policy used to fail the batch (503 to every open session, a
    # rollout restart); now it is a 400 for the session that sent it, which stays usable, and the batch finishes
    _, _, samples = setup
    hub, _ = _hub(setup)
    seen: dict[str, Any] = {}
    log: dict[str, Any] = {}

    def screenshotter(stop: threading.Event) -> None:
        sid, sample = _claim(hub, stop)
        messages = _msgs(sample)
        first = hub.chat(sid, {"messages": messages}).result(timeout=60)
        messages.append({"role": "assistant", "content": first["text"]})
        image = {"role": "tool", "content": [{"type": "text", "text": "the page:"},
                                             {"type": "image_url", "image_url": {"url": PNG}}]}
        placeholder = {"role": "tool", "content": "a literal <image> the template cannot match"}
        for name, extra in (("image", image), ("placeholder", placeholder)):
            with pytest.raises(SessionError) as e:
                hub.chat(sid, {"messages": [*messages, extra]}).result(timeout=60)
            seen[name] = e.value
        hub.chat(sid, {"messages": [*messages, {"role": "tool", "content": "golden plum: 7"}]}).result(timeout=60)
        seen["state"] = hub.describe(sid)
        hub.close(sid).result(timeout=60)

    trajs = _run(hub, [(0, samples[0]), (1, samples[1])], 1, [screenshotter, tool_agent(hub, log, turns=2)])
    assert seen["image"].status == 400 and "messages[3].content[1] is an image_url part" in seen["image"].message
    assert "takes no images" in seen["image"].message
    assert seen["placeholder"].status == 400 and "cannot be turned into the policy's context" in \
        seen["placeholder"].message
    assert seen["state"]["turns"] == 2 and seen["state"]["state"] == "open"
    assert len(trajs) == 2 and all(t.turns == 2 for t in trajs)
    assert hub.take_counts()["sessions_dropped"] == 0


def test_tool_choice_is_honoured_by_a_masked_forced_prefix_and_refused_when_it_cannot_be(setup):
    tok, _, samples = setup
    hub, rec = _hub(setup)
    seen: dict[str, Any] = {}
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]

    def agent(stop: threading.Event) -> None:
        sid, sample = _claim(hub, stop)
        messages = _msgs(sample)
        for name, bad in (("unknown", {"type": "function", "function": {"name": "fetch"}}), ("temp", None)):
            body = {"messages": messages, "tools": tools, "tool_choice": bad} if bad else \
                {"messages": messages, "temperature": 0.3}
            with pytest.raises(SessionError) as e:
                hub.chat(sid, body).result(timeout=60)
            seen[name] = e.value
        forced = {"type": "function", "function": {"name": "lookup"}}
        seen["turn"] = hub.chat(sid, {"messages": messages, "tools": tools, "tool_choice": forced,
                                      "parallel_tool_calls": False}).result(timeout=60)
        seen["traj"] = hub._sessions[sid].traj
        hub.close(sid).result(timeout=60)

    _run(hub, [(0, samples[0])], 1, [agent])
    assert seen["unknown"].status == 400 and "names function 'fetch'" in seen["unknown"].message
    assert seen["temp"].status == 400 and "temperature=0.3 differs" in seen["temp"].message
    turn, traj = seen["turn"], seen["traj"]
    prefix = '<tool_call>{"name": "lookup", "arguments": '
    assert turn["text"].startswith(prefix)
    forced = tok(prefix, add_special_tokens=False)["input_ids"]
    (fed, sampled), = rec.sampled.values()
    # the engine was given the prompt and the forced prefix; the prefix is recorded as masked context, the
    # sampled tokens and log-probs after it are the engine's
    assert fed == traj.tokens[:len(fed)] and fed[traj.prompt_len:] == forced
    assert traj.mask[traj.prompt_len:len(fed)] == [0] * len(forced)
    assert traj.tokens[len(fed):] == sampled.output_ids and traj.mask[len(fed):] == [1] * len(sampled.output_ids)
