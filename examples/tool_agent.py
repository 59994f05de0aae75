"""An external tool-using agent for Relax's ``tool_lookup`` task, written against the ``openai`` client only.

It plays the episodes a training run offers through its session gateway (docs/agents.md): open a
session, chat with the ``lookup`` tool the session's sample declares, run that tool itself on the
sample's table whenever the reply calls it, and close the session; the run scores the transcript
with the task's verifier and trains on the tokens its engine sampled. Run it beside a run with
``rollout.agents=external``::

    RELAX_AGENT_TOKEN=<the run's agent token> python examples/tool_agent.py --run-root ./.relax/runs/<run_id> --forever

It imports nothing of Relax: any program that speaks OpenAI's chat API can train a policy this way.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai


def lookup(arguments: str, table: dict[str, str]) -> str:
    """The ``lookup`` tool: the code stored for ``key`` (names match case- and space-insensitively)."""
    try:
        key = json.loads(arguments).get("key")
    except (json.JSONDecodeError, AttributeError):
        return f"error: arguments must be a JSON object with a 'key', got {arguments!r}"
    if key is None:
        return "error: lookup needs an argument 'key'"
    wanted = " ".join(str(key).lower().split())
    for name, code in table.items():
        if " ".join(name.lower().split()) == wanted:
            return f"{name}: {code}"
    return f"error: unknown key '{key}'"


def chat(client: openai.OpenAI, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
         stream: bool) -> dict[str, Any]:
    """One assistant turn as a message dict (content and tool_calls), streamed or not."""
    if not stream:
        reply = client.chat.completions.create(model="policy", messages=messages, tools=tools or openai.NOT_GIVEN)
        return reply.choices[0].message.model_dump(exclude_none=True)
    content, calls = "", {}
    for chunk in client.chat.completions.create(model="policy", messages=messages, tools=tools or openai.NOT_GIVEN,
                                                stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            calls.setdefault(call.index, call.model_dump(exclude_none=True, exclude={"index"}))
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message


def episode(gateway: openai.OpenAI, token: str, session: dict[str, Any], max_turns: int, stream: bool) -> None:
    sid, sample = session["id"], session["sample"]
    client = gateway.with_options(base_url=session["base_url"])  # shares the gateway client's connections
    messages = list(sample["messages"])
    table = sample["metadata"].get("table", {})
    print(f"session {sid} opened: sample {sample['id']}", flush=True)
    for turn in range(max_turns):
        try:
            reply = chat(client, messages, sample.get("tools") or [], stream)
        except openai.BadRequestError as e:  # e.g. the context is full: the episode ends here
            print(f"session {sid} turn {turn}: {e.message}", flush=True)
            break
        messages.append(reply)
        print(f"session {sid} turn {turn}: {reply.get('content', '')!r}", flush=True)
        calls = reply.get("tool_calls") or []
        if not calls:
            break
        for call in calls:
            result = lookup(call["function"]["arguments"], table) if call["function"]["name"] == "lookup" else \
                f"error: unknown tool '{call['function']['name']}'; the only tool is 'lookup'"
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    state = gateway.post(f"/sessions/{sid}/close", cast_to=object, body={})
    print(f"session {sid} closed: reward {state.get('reward')}", flush=True)


def gateway_url(args: argparse.Namespace, wait_s: float | None = None) -> str | None:
    """The gateway's URL: ``--gateway``, or the run's gateway.json (waited for up to ``wait_s``, default
    ``--wait-s``); None when it did not appear in time."""
    if args.gateway:
        return args.gateway
    path = Path(args.run_root) / "gateway.json"
    deadline = time.monotonic() + (args.wait_s if wait_s is None else wait_s)
    while True:  # the run writes it once its gateway listens (again, after a rollout restart)
        try:
            return json.loads(path.read_text())["url"]
        except (OSError, ValueError, KeyError):
            if time.monotonic() > deadline:
                return None
            time.sleep(0.2)


def reconnect(args: argparse.Namespace) -> openai.OpenAI | None:
    """A client on the gateway once it answers again (a restarted rollout serves it anew, on the same port
    unless that was taken: gateway.json is re-read), or None after ``--reconnect-s`` (the run ended)."""
    deadline = time.monotonic() + args.reconnect_s
    while True:
        url = gateway_url(args, wait_s=max(0.0, deadline - time.monotonic()))
        if url is not None:
            client = openai.OpenAI(base_url=url.rstrip("/") + "/v1", api_key=args.token, max_retries=0)
            try:
                client.get("/sessions/-", cast_to=object)
            except openai.APIStatusError:  # any answer (a 404 here) means the gateway is up
                return client
            except openai.APIConnectionError:
                pass
        if time.monotonic() > deadline:
            return None
        time.sleep(0.5)


Episode = Callable[[openai.OpenAI, str, dict[str, Any], int, bool], None]


def main(argv: list[str] | None = None, play_episode: Episode | None = None, doc: str | None = None) -> int:
    """Play episodes with ``play_episode`` (default: chat completions; examples/responses_agent.py and
    examples/messages_agent.py pass their own)."""
    p = argparse.ArgumentParser(description=(doc or __doc__).splitlines()[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--gateway", help="the gateway's URL, e.g. http://127.0.0.1:8765")
    where.add_argument("--run-root", help="the run's folder (<root>/runs/<run_id>): its gateway.json names the URL")
    p.add_argument("--token", default=os.environ.get("RELAX_AGENT_TOKEN"),
                   help="the session gateway's bearer token (default: $RELAX_AGENT_TOKEN)")
    count = p.add_mutually_exclusive_group()
    count.add_argument("--episodes", type=int, default=1, help="episodes to play, then exit")
    count.add_argument("--forever", action="store_true", help="play until the gateway goes away")
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--stream", action="store_true", help="ask for streamed replies")
    p.add_argument("--parallel", type=int, default=1, help="episodes played at once, each on its own thread "
                   "(--episodes counts per thread)")
    p.add_argument("--wait-s", type=float, default=120.0, help="how long to wait for gateway.json")
    p.add_argument("--reconnect-s", type=float, default=60.0, help="how long to wait for a gateway that went "
                   "away (a rollout restart) before deciding the run ended")
    args = p.parse_args(argv)
    args.play_episode = play_episode or episode
    if not args.token:
        sys.exit("no token: pass --token or set RELAX_AGENT_TOKEN to the run's agent token")
    url = gateway_url(args)
    if url is None:
        sys.exit(f"no gateway.json in {args.run_root} after {args.wait_s:g} s: is a run with rollout.agents=external "
                 f"running there?")
    gateway = openai.OpenAI(base_url=url.rstrip("/") + "/v1", api_key=args.token, max_retries=0)
    if args.parallel == 1:
        return play(gateway, args)
    # several episodes at once: the gateway batches their turns into one generation (the client is thread-safe)
    with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
        return max(f.result() for f in [pool.submit(play, gateway, args) for _ in range(args.parallel)])


def play(gateway: openai.OpenAI, args: argparse.Namespace) -> int:
    """Open, play and close episodes one after another (``--episodes`` of them, or until the gateway goes
    for good: one that comes back within ``--reconnect-s``, as a restarted rollout's does, is played on)."""
    played = 0
    while args.forever or played < args.episodes:
        try:
            session = gateway.post("/sessions", cast_to=object, body={"wait_s": 10})
            try:
                args.play_episode(gateway, args.token, session, args.max_turns, args.stream)
            except openai.APIStatusError as e:  # the session was dropped or aborted by the run: play the next one
                print(f"session {session['id']} ended by the gateway: {e.status_code} {e.message}", flush=True)
            played += 1
        except openai.APIStatusError as e:
            if e.status_code != 503:
                raise
            time.sleep(float(e.response.headers.get("retry-after", 1)))  # no episode open yet
        except openai.APIConnectionError:
            print("the gateway went away; waiting for it to come back", flush=True)
            gateway = reconnect(args)
            if gateway is None:
                print("the gateway is gone; stopping", flush=True)
                return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
