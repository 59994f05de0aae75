"""The gateway's three APIs driven by the official ``openai`` (its Responses client) and ``anthropic``
clients and by agent frameworks, unchanged: the OpenAI Agents SDK (``Runner.run`` over its Responses
model and its chat-completions model) and LangChain (``ChatOpenAI.bind_tools``, invoked and
streamed). Each plays full tool episodes, streamed or not, that become trainable trajectories; then
the tool-choice constraints, and errors in each API's own shape. The tiny policy is taught the task's
tool-use transcript first (tests/relax/services/tool_episodes.py), so its replies call the tool."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from typing import Any

import anthropic
import openai
import pytest
import torch

from relax.config import load_config
from relax.config.preflight import AGENT_TOKEN_ENV
from relax.data.suite import generate_suite
from relax.data.suite.tool_lookup import run_lookup
from relax.engines.types import SamplingParams
from relax.models import build_policy, build_tokenizer
from relax.rollout.engine_pool import LocalEngines
from relax.rollout.rewards import RewardDispatcher
from relax.rollout.sessions import SessionHub
from relax.services.api.gateway import Gateway
from tests.relax.services.tool_episodes import REPO, teach_tool_use

pytestmark = pytest.mark.slow
TOKEN = "gateway-apis-token"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tok = build_tokenizer("bpe-tiny")
    model, _ = build_policy(load_config("tiny-cpu", []).model, tok, seed=0)
    samples = generate_suite(["tool_lookup"], seed=0, train_per_task=2, eval_per_task=2)["train"]
    teach_tool_use(model, tok, samples)
    pool = LocalEngines(model, tok, max_batch_size=8, max_seq_len=256, seed=0)
    hub = SessionHub(pool, tok, None, RewardDispatcher(), SamplingParams(max_new_tokens=32, stop=["</answer>"]),
                     max_seq_len=256, timeout_s=20.0)
    gw = Gateway(hub, "127.0.0.1", 0, token=TOKEN).start()
    yield gw, hub, samples
    gw.stop()
    pool.close()


def _open(url: str) -> dict[str, Any]:
    gateway = openai.OpenAI(base_url=f"{url}/v1", api_key=TOKEN, max_retries=0)
    return gateway.post("/sessions", cast_to=object, body={"wait_s": 30})


def _close(url: str, sid: str) -> dict[str, Any]:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=TOKEN, max_retries=0).post(
        f"/sessions/{sid}/close", cast_to=object, body={})


def _tool(sample: dict[str, Any], name: str, arguments: dict[str, Any]) -> str:
    return run_lookup({"name": name, "arguments": arguments}, sample["metadata"]["table"])[0]


def responses_episode(url: str, stream: bool, chained: bool, log: list) -> None:
    """Two turns through /v1/responses: the tool's output sent after previous_response_id, or with the
    whole conversation (the first response's output items resent as input)."""
    session = _open(url)
    client = openai.OpenAI(base_url=session["base_url"], api_key=TOKEN, max_retries=0)
    sample = session["sample"]
    tools = [{"type": "function", **t["function"]} for t in sample["tools"]]
    (system, user) = sample["messages"]

    def create(**kw: Any) -> Any:
        if not stream:
            return client.responses.create(model="policy", tools=tools, **kw)
        events = list(client.responses.create(model="policy", tools=tools, stream=True, **kw))
        assert events[0].type == "response.created" and events[-1].type == "response.completed"
        return events[-1].response

    first = create(instructions=system["content"], input=user["content"])
    calls = [o for o in first.output if o.type == "function_call"]
    if calls:
        outputs = [{"type": "function_call_output", "call_id": c.call_id,
                    "output": _tool(sample, c.name, json.loads(c.arguments))} for c in calls]
        if chained:
            second = create(previous_response_id=first.id, input=outputs)
        else:
            items = [{"role": "user", "content": user["content"]},
                     *[o.model_dump(exclude_none=True) for o in first.output], *outputs]
            second = create(instructions=system["content"], input=items)
        log.append(("responses", second.output_text))
    log.append(("closed", _close(url, session["id"])))


def messages_episode(url: str, stream: bool, log: list) -> None:
    """Two turns through /v1/messages with the anthropic client: tool_use, then a tool_result."""
    session = _open(url)
    client = anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key=TOKEN, max_retries=0)
    sample = session["sample"]
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in sample["tools"]]
    (system, user) = sample["messages"]
    messages: list[dict[str, Any]] = [{"role": "user", "content": user["content"]}]

    def create() -> Any:
        kw = {"model": "policy", "max_tokens": 32, "system": system["content"], "messages": messages, "tools": tools}
        if not stream:
            return client.messages.create(**kw)
        with client.messages.stream(**kw) as s:
            return s.get_final_message()

    first = create()
    uses = [b for b in first.content if b.type == "tool_use"]
    if uses:
        assert first.stop_reason == "tool_use"
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]})
        messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": b.id,
                                                      "content": _tool(sample, b.name, b.input)} for b in uses]})
        second = create()
        log.append(("messages", second.content[0].text if second.content else ""))
    log.append(("closed", _close(url, session["id"])))


def sdk_episode(url: str, api: str, log: list) -> None:
    """One episode of an OpenAI Agents SDK agent with a function tool, through ``Runner.run``: over the
    SDK's Responses model (``api="responses"``) or its chat-completions model (``"chat"``)."""
    import agents  # imported here: the frameworks take seconds to import, and only these tests use them
    agents.set_tracing_disabled(True)  # the SDK would export traces to OpenAI: no network in tests
    session = _open(url)
    sample = session["sample"]
    (system, user) = sample["messages"]

    @agents.function_tool
    def lookup(key: str) -> str:
        """Return the secret code stored for an item.

        Args:
            key: The item's name, e.g. 'golden plum'.
        """
        log.append((f"tool sdk {api}", key))
        return _tool(sample, "lookup", {"key": key})

    async def run() -> Any:
        async with openai.AsyncOpenAI(base_url=session["base_url"], api_key=TOKEN, max_retries=0) as client:
            kind = agents.OpenAIResponsesModel if api == "responses" else agents.OpenAIChatCompletionsModel
            agent = agents.Agent(name="tool_lookup", instructions=system["content"], model=kind("policy", client),
                                 tools=[lookup])
            try:
                return (await agents.Runner.run(agent, user["content"], max_turns=3)).final_output
            except agents.MaxTurnsExceeded:  # the policy kept calling the tool: the agent's own limit ends it
                return None

    log.append((f"sdk {api}", asyncio.run(run())))
    log.append(("closed", _close(url, session["id"])))


def langchain_episode(url: str, stream: bool, log: list) -> None:
    """One episode through LangChain: ``ChatOpenAI(...).bind_tools`` with the task's tool schema, invoked or
    streamed (the chunks summed), the tool's result sent back as a ``ToolMessage``."""
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
    from langchain_openai import ChatOpenAI
    session = _open(url)
    sample = session["sample"]
    (system, user) = sample["messages"]
    llm = ChatOpenAI(model="policy", base_url=session["base_url"], api_key=TOKEN, max_retries=0)
    llm = llm.bind_tools(sample["tools"])
    messages: list[Any] = [SystemMessage(system["content"]), HumanMessage(user["content"])]

    def ask() -> Any:
        if not stream:
            return llm.invoke(messages)
        chunks = iter(llm.stream(messages))
        reply = next(chunks)
        for chunk in chunks:
            reply += chunk
        return reply

    mode = "langchain stream" if stream else "langchain invoke"
    first = ask()
    if first.tool_calls:
        messages.append(first)
        messages += [ToolMessage(_tool(sample, c["name"], c["args"]), tool_call_id=c["id"]) for c in first.tool_calls]
        log += [(f"tool {mode}", c["args"]) for c in first.tool_calls]
        log.append((mode, ask().content))
    log.append(("closed", _close(url, session["id"])))


def _engine_turns(hub: SessionHub, t: Any) -> None:
    """A two-turn episode trains on the policy's turns only, with the engine's log-probs there (the
    policy's own, recomputed over the recorded tokens: nothing was re-tokenised); the tool's result
    sits between them, masked out of the loss (log-prob 0)."""
    assert "\n[tool] " in t.response and len(t.turn_spans) == 2
    trained = [i for i in range(t.prompt_len, len(t.tokens)) if t.mask[i]]
    masked = [i for i in range(t.prompt_len, len(t.tokens)) if not t.mask[i]]
    assert masked and trained == [i for a, b in t.turn_spans for i in range(a, b)]
    assert all(t.logprobs[i] == 0 for i in masked)
    with torch.no_grad():
        logits = hub.pool.engine.model(input_ids=torch.tensor([t.tokens])).logits[0].float()
    policy = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(t.tokens[1:])[:, None])[:, 0]
    recorded = torch.tensor([t.logprobs[i] for i in trained])
    assert torch.allclose(recorded, policy[[i - 1 for i in trained]], atol=1e-3), (recorded, policy)


def _trainable(hub: SessionHub, trajs: list, log: list, modes: tuple[str, ...]) -> set[str]:
    """The episodes are trainable samples: the engine's tokens and log-probs on the policy's turns, the
    tool's result in the context but masked out of the loss, and every final reply the framework handed
    its caller is the policy's own text in the recorded episode. Returns what the agents did (``log``'s
    kinds with text: ``tool <mode>`` once a mode called the tool, ``<mode>`` once it answered after it)."""
    assert len(trajs) == 4 and len([x for x in log if x[0] == "closed"]) == 4
    two = [t for t in trajs if t.turns == 2]
    assert two, [t.response for t in trajs]
    for t in two:
        _engine_turns(hub, t)
    finals = [text for kind, text in log if kind in modes and text]
    assert finals and all(any(text in t.response for t in trajs) for text in finals), (finals, trajs)
    return {kind for kind, text in log if text}


def _play(hub: SessionHub, prompts: list, n: int, agents: list) -> list:
    errors: list[BaseException] = []

    def guarded(fn) -> None:
        try:
            fn()
        except BaseException as e:
            errors.append(e)
            hub.shutdown()

    threads = [threading.Thread(target=guarded, args=(a,), daemon=True) for a in agents]
    for t in threads:
        t.start()
    try:
        trajs = hub.run_batch(prompts, n)
    finally:
        for t in threads:
            t.join(60)
    if errors:
        raise errors[0]
    return trajs


def test_the_openai_responses_client_plays_tool_episodes_that_train(served):
    gw, hub, samples = served
    log: list = []
    agents = [lambda s=s, c=c: responses_episode(gw.url, s, c, log) for s in (False, True) for c in (False, True)]
    trajs = _play(hub, [(0, samples[0]), (1, samples[1])], 2, agents)
    assert len(trajs) == 4 and len([x for x in log if x[0] == "closed"]) == 4
    two = [t for t in trajs if t.turns == 2]
    assert two, [t.response for t in trajs]  # previous_response_id and resent items both continued the session
    for t in two:  # the tool output is in the context, masked out of the loss; the replies trained
        assert "\n[tool] " in t.response and 0 in t.mask[t.prompt_len:] and sum(t.mask) > 0
        _engine_turns(hub, t)
    assert max(t.reward for t in trajs) == 1.0


def test_the_anthropic_client_plays_tool_episodes_that_train(served):
    gw, hub, samples = served
    log: list = []
    agents = [lambda s=s: messages_episode(gw.url, s, log) for s in (False, True, False, True)]
    trajs = _play(hub, [(0, samples[0]), (1, samples[1])], 2, agents)
    assert len(trajs) == 4
    two = [t for t in trajs if t.turns == 2]
    assert two, [t.response for t in trajs]
    for t in two:
        assert "\n[tool] " in t.response and 0 in t.mask[t.prompt_len:] and sum(t.mask) > 0
        _engine_turns(hub, t)
    assert max(t.reward for t in trajs) == 1.0


def test_the_agents_sdk_plays_tool_episodes_with_both_its_models(served):
    gw, hub, samples = served
    log: list = []
    players = [lambda a=a: sdk_episode(gw.url, a, log) for a in ("responses", "chat", "responses", "chat")]
    trajs = _play(hub, [(0, samples[0]), (1, samples[1])], 2, players)
    played = _trainable(hub, trajs, log, ("sdk responses", "sdk chat"))
    # each model called the tool and answered after its result; the verifier rewards a right answer
    assert {"tool sdk responses", "sdk responses", "tool sdk chat", "sdk chat"} <= played, log
    assert max(t.reward for t in trajs) == 1.0


def test_langchain_bind_tools_plays_tool_episodes_invoked_and_streamed(served):
    gw, hub, samples = served
    log: list = []
    players = [lambda s=s: langchain_episode(gw.url, s, log) for s in (False, True, False, True)]
    trajs = _play(hub, [(0, samples[0]), (1, samples[1])], 2, players)
    played = _trainable(hub, trajs, log, ("langchain invoke", "langchain stream"))
    assert {"tool langchain invoke", "langchain invoke", "tool langchain stream", "langchain stream"} <= played, log
    assert max(t.reward for t in trajs) == 1.0


def test_tool_choice_through_each_api_and_errors_in_each_apis_shape(served):
    gw, hub, samples = served
    seen: dict[str, Any] = {}

    def agent() -> None:
        session = _open(gw.url)
        sample, sid = session["sample"], session["id"]
        (system, user) = sample["messages"]
        oa = openai.OpenAI(base_url=session["base_url"], api_key=TOKEN, max_retries=0)
        an = anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key=TOKEN, max_retries=0)
        tools = [{"type": "function", **t["function"]} for t in sample["tools"]]
        with pytest.raises(openai.BadRequestError) as e:  # a function it was not given
            oa.responses.create(model="p", instructions=system["content"], input=user["content"], tools=tools,
                                tool_choice={"type": "function", "name": "fetch"})
        seen["responses 400"] = e.value.body
        with pytest.raises(anthropic.BadRequestError) as e:
            an.messages.create(model="p", max_tokens=8, messages=[{"role": "user", "content": "hi"}],
                               tool_choice={"type": "any"})
        seen["messages 400"] = e.value.body
        with pytest.raises(anthropic.AuthenticationError) as e:
            anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key="wrong", max_retries=0).messages.create(
                model="p", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
        seen["messages 401"] = e.value.body
        with pytest.raises(anthropic.NotFoundError) as e:
            anthropic.Anthropic(base_url=f"{gw.url}/v1/sessions/nope", auth_token=TOKEN, max_retries=0).messages.create(
                model="p", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
        seen["messages 404"] = e.value.body
        forced = oa.chat.completions.create(model="p", messages=sample["messages"], tools=sample["tools"],
                                            tool_choice={"type": "function", "function": {"name": "lookup"}},
                                            parallel_tool_calls=False)
        seen["forced"] = forced.choices[0].message
        _close(gw.url, sid)

    _play(hub, [(0, samples[0])], 1, [agent])
    assert "names function 'fetch'" in seen["responses 400"]["message"]
    for key, kind in (("messages 400", "invalid_request_error"), ("messages 401", "authentication_error"),
                      ("messages 404", "not_found_error")):
        assert seen[key]["type"] == "error" and seen[key]["error"]["type"] == kind, seen[key]
    assert "'required' needs tools" in seen["messages 400"]["error"]["message"]
    forced = seen["forced"]
    assert forced.content.startswith('<tool_call>{"name": "lookup", "arguments": ')
    assert forced.tool_calls is None or [c.function.name for c in forced.tool_calls] == ["lookup"]


def test_the_example_agents_of_both_apis_play_episodes(served):
    gw, hub, samples = served
    env = {**os.environ, AGENT_TOKEN_ENV: TOKEN, "PYTHONUNBUFFERED": "1"}
    agents = [subprocess.Popen([sys.executable, str(REPO / "examples" / name), "--gateway", gw.url, "--episodes", "2",
                                *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for name in ("responses_agent.py", "messages_agent.py") for extra in ((), ("--stream",))]
    trajs = hub.run_batch([(0, samples[0]), (1, samples[1])], 4)
    outs = [p.communicate(timeout=60)[0] for p in agents]
    assert [p.returncode for p in agents] == [0, 0, 0, 0], outs
    for out in outs:  # every example, streaming or not, answered a tool call
        assert "turn 1" in out and "closed: reward" in out, out
    assert len(trajs) == 8 and max(t.reward for t in trajs) == 1.0
    assert sum(t.turns == 2 for t in trajs) >= 4
