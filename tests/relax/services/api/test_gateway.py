"""The session gateway over real HTTP, with examples/tool_agent.py (the official ``openai`` client) in
processes of its own: multi-turn tool episodes, streamed or not, the errors of the session API, and an
agent killed mid-episode.

The tiny policy is first taught the tool-use transcript of the two prompts used here (a few seconds of
supervised steps), so that its replies do call the tool and the verifier's reward can land."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from relax.config import load_config
from relax.config.preflight import AGENT_TOKEN_ENV
from relax.data.suite import generate_suite
from relax.engines.types import SamplingParams
from relax.models import build_policy, build_tokenizer
from relax.rollout.engine_pool import LocalEngines
from relax.rollout.rewards import RewardDispatcher
from relax.rollout.sessions import SessionHub
from relax.services.api.gateway import Gateway
from tests.relax.services.tool_episodes import AGENT, teach_tool_use

pytestmark = pytest.mark.slow
TOKEN = "gateway-test-token"


class GatedPool:
    """The real engine pool; with ``gate`` set, its second generate call waits for the gate first."""

    def __init__(self, pool: LocalEngines):
        self.pool, self.gate, self.calls = pool, None, 0

    @property
    def weight_version(self) -> int:
        return self.pool.weight_version

    def generate(self, prompts, params, rids, should_abort=None):
        self.calls += 1
        if self.gate is not None and self.calls == 2:
            assert self.gate.wait(60), "the test never opened the gate"
        return self.pool.generate(prompts, params, rids, should_abort)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    tok = build_tokenizer("bpe-tiny")
    model, _ = build_policy(load_config("tiny-cpu", []).model, tok, seed=0)
    samples = generate_suite(["tool_lookup"], seed=0, train_per_task=2, eval_per_task=2)["train"]
    teach_tool_use(model, tok, samples)
    pool = GatedPool(LocalEngines(model, tok, max_batch_size=8, max_seq_len=256, seed=0))
    hub = SessionHub(pool, tok, None, RewardDispatcher(), SamplingParams(max_new_tokens=32, stop=["</answer>"]),
                     max_seq_len=256, timeout_s=2.0)
    run = tmp_path_factory.mktemp("run")
    gw = Gateway(hub, "127.0.0.1", 0, token=TOKEN, run_url=f"file://{run}").start()
    yield gw, hub, pool, samples, run
    gw.stop()
    pool.pool.close()


def _agent(run: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, AGENT_TOKEN_ENV: TOKEN, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, str(AGENT), "--run-root", str(run), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _call(url: str, body: Any = None, token: str | None = TOKEN, method: str = "POST") -> tuple[int, dict, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def test_agent_processes_run_multi_turn_tool_episodes_streamed_or_not(gateway):
    gw, hub, _, samples, run = gateway
    assert json.loads((run / "gateway.json").read_text()) == {"url": gw.url}  # how agents find it; no token
    agents = [_agent(run, "--episodes", "4"), _agent(run, "--episodes", "4", "--stream")]
    trajs = hub.run_batch([(0, samples[0]), (1, samples[1])], 4)
    outs = [p.communicate(timeout=60)[0] for p in agents]
    assert [p.returncode for p in agents] == [0, 0], outs
    assert len(trajs) == 8 and [t.position for t in trajs] == [0] * 4 + [1] * 4
    for out in outs:  # each process, streaming or not, got tool calls back and answered after the tool's result
        assert "turn 1" in out and "'<tool_call>" in out and "'<answer>" in out, out
    two = [t for t in trajs if t.turns == 2]
    assert two, [t.response for t in trajs]
    for t in two:  # the agent's tool message is in the context, masked out of the loss
        assert "\n[tool] " in t.response and 0 in t.mask[t.prompt_len:] and sum(t.mask) > 0
    assert max(t.reward for t in trajs) == 1.0  # the verifier scored the transcripts the agents never saw scored
    counts = hub.take_counts()
    assert counts["sessions_opened"] == counts["sessions_closed"] == 8 and counts["sessions_dropped"] == 0
    closed = [line.split()[1] for out in outs for line in out.splitlines() if line.endswith(("1.0", "0.0"))]
    status, _, body = _call(f"{gw.url}/v1/sessions/{closed[0]}/reward", {"reward": 1.0})
    assert status == 409 and f"session {closed[0]} is closed" in body["error"]["message"]


def test_the_session_api_answers_bad_requests_with_their_status(gateway):
    gw, *_ = gateway
    # the engines' token (conftest sets RELAX_ENGINE_TOKEN) opens no session: the gateway has its own
    for token in (None, "wrong", os.environ["RELAX_ENGINE_TOKEN"]):
        status, headers, body = _call(f"{gw.url}/v1/sessions", {}, token=token)
        assert status == 401 and headers.get("www-authenticate") == "Bearer", body
    status, headers, body = _call(f"{gw.url}/v1/sessions", {})  # no batch is running: no episode to hand out
    assert status == 503 and headers.get("retry-after") == "1" and "retry" in body["error"]["message"]
    for path, method in (("/v1/sessions/nope", "GET"), ("/v1/sessions/nope/close", "POST"),
                         ("/v1/sessions/nope/v1/chat/completions", "POST")):
        status, _, body = _call(gw.url + path, {"messages": [{"role": "user", "content": "hi"}]}
                                if method == "POST" else None, method=method)
        assert status == 404 and "nope" in body["error"]["message"], (path, body)
    status, _, body = _call(f"{gw.url}/v1/sessions/nope/reward", {"reward": 1.0})
    assert status == 409 and "session nope is unknown" in body["error"]["message"]
    # unknown routes and methods, and bodies that are no JSON object, answer the documented shape too
    for path, method, body in (("/v1/nothing/here", "POST", {}), ("/v1/sessions", "GET", None),
                               ("/v1/sessions/nope/reward", "POST", [1, 2])):
        status, _, answer = _call(gw.url + path, body, method=method)
        assert status in (400, 404, 405) and set(answer) == {"error"}, (path, answer)
        assert set(answer["error"]) == {"message", "type", "param", "code"} and answer["error"]["code"] == status
    assert "no route /v1/nothing/here" in _call(f"{gw.url}/v1/nothing/here", {})[2]["error"]["message"]


def test_an_agent_killed_mid_episode_leaves_no_sample(gateway):
    gw, hub, pool, samples, run = gateway
    pool.gate, pool.calls = threading.Event(), 0
    killed: dict[str, Any] = {}
    doomed = _agent(run, "--forever")

    def kill_after_first_turn() -> None:  # its second turn is held at the engine until it is dead
        for line in doomed.stdout:
            if " opened" in line:
                killed["id"] = line.split()[1]
            if " turn 0" in line:
                doomed.send_signal(signal.SIGKILL)
                doomed.wait()
                pool.gate.set()
                return

    watcher = threading.Thread(target=kill_after_first_turn, daemon=True)
    watcher.start()
    rescuer = threading.Thread(target=lambda: (pool.gate.wait(60), killed.update(
        rescuer=_agent(run, "--forever", "--reconnect-s", "1"))))
    rescuer.start()
    try:
        (traj,) = hub.run_batch([(0, samples[0])], 1)
    finally:
        pool.gate.set()
    watcher.join(10)
    rescuer.join(10)
    status, _, dead = _call(f"{gw.url}/v1/sessions/{killed['id']}", method="GET")
    # mid-episode: a tool call answered, its result maybe sent (the gate held that turn until the kill), no close
    assert status == 200 and dead["state"] == "dropped" and dead["turns"] in (1, 2)
    counts = hub.take_counts()
    assert counts["sessions_dropped"] == 1 and counts["sessions_closed"] == 1 and counts["sessions_opened"] == 2
    assert traj.turns >= 1 and traj.sample.id == samples[0].id  # the one sample came from the rescuer's session
    gw.stop()  # the agent still polling for episodes exits cleanly once the gateway is gone
    out = killed["rescuer"].communicate(timeout=60)[0]
    assert killed["rescuer"].returncode == 0 and "the gateway is gone" in out, out


def test_the_gateway_will_not_start_without_a_token_of_its_own(gateway, monkeypatch):
    from relax.services.api.gateway import GatewayStartError

    _, hub, *_ = gateway
    monkeypatch.delenv(AGENT_TOKEN_ENV, raising=False)
    with pytest.raises(GatewayStartError, match=f"set {AGENT_TOKEN_ENV} to a secret for your agents"):
        Gateway(hub, "127.0.0.1", 0)
    monkeypatch.setenv(AGENT_TOKEN_ENV, os.environ["RELAX_ENGINE_TOKEN"])  # the engines' token reused
    with pytest.raises(GatewayStartError, match="not RELAX_ENGINE_TOKEN"):
        Gateway(hub, "127.0.0.1", 0)


def test_a_restarted_gateway_keeps_its_address_and_its_agents(gateway, tmp_path):
    # a rollout role that dies mid-batch takes its gateway with it; the restarted role's gateway binds the
    # port the run's gateway had (rollout.gateway_port=0), and an agent attached to the first plays the
    # restarted batch without being started again
    _, _, pool, samples, _ = gateway
    tok = build_tokenizer("bpe-tiny")
    params = SamplingParams(max_new_tokens=32, stop=["</answer>"])

    def hub() -> SessionHub:
        return SessionHub(pool.pool, tok, None, RewardDispatcher(), params, max_seq_len=256, timeout_s=5.0)

    first_hub = hub()
    first = Gateway(first_hub, "127.0.0.1", 0, token=TOKEN, run_url=f"file://{tmp_path}").start()
    agent = _agent(tmp_path, "--forever", "--reconnect-s", "5")
    failed: list[BaseException] = []
    batch = threading.Thread(target=lambda: _catch(failed, first_hub.run_batch, [(0, samples[0])], 2), daemon=True)
    batch.start()
    lines = []
    for line in agent.stdout:  # the agent is mid-batch: one episode played, one more open
        lines.append(line)
        if "closed: reward" in line:
            break
    first.stop()  # the role dies: its batch fails, its sessions are aborted
    batch.join(30)
    assert failed and "gateway stopped" in str(failed[0])
    second_hub = hub()
    second = Gateway(second_hub, "127.0.0.1", 0, token=TOKEN, run_url=f"file://{tmp_path}").start()
    try:
        assert second.url == first.url  # the address agents hold is the same
        trajs = second_hub.run_batch([(0, samples[0]), (1, samples[1])], 1)
    finally:
        second.stop()
    out = "".join(lines) + agent.communicate(timeout=60)[0]
    assert agent.returncode == 0 and "waiting for it to come back" in out and "the gateway is gone" in out, out
    assert len(trajs) == 2 and all(t.turns >= 1 for t in trajs)
    assert second_hub.take_counts()["sessions_closed"] == 2


def _catch(into: list, fn, *args) -> None:
    try:
        fn(*args)
    except BaseException as e:
        into.append(e)
