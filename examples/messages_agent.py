"""An external agent for Relax's ``tool_lookup`` task written against Anthropic's Messages API (``anthropic``).

The same episodes as examples/tool_agent.py, asked through the session's ``/v1/messages`` with the
official ``anthropic`` client (``base_url`` is the session's ``anthropic_base_url``; the run's agent
token goes as ``api_key``, sent as ``x-api-key``): the sample's system message as ``system``, the
``lookup`` tool with its ``input_schema``, ``tool_use`` blocks answered with ``tool_result`` blocks.
Same options as tool_agent.py::

    RELAX_AGENT_TOKEN=<agent token> python examples/messages_agent.py --run-root ./.relax/runs/<run> --forever
"""

from __future__ import annotations

import json
import sys
from typing import Any

import anthropic
import openai
from tool_agent import lookup, main

_shared: dict[str, anthropic.Anthropic] = {}  # one HTTP client for every session, as tool_agent.py shares its own


def episode(gateway: openai.OpenAI, token: str, session: dict[str, Any], max_turns: int, stream: bool) -> None:
    sid, sample = session["id"], session["sample"]
    if token not in _shared:  # a fresh client per episode cost more than the episode itself on 2 cores
        _shared[token] = anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key=token, max_retries=0)
    client = _shared[token].with_options(base_url=session["anthropic_base_url"])
    tools = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
              "input_schema": t["function"]["parameters"]} for t in sample.get("tools") or []]
    system = "".join(m["content"] for m in sample["messages"] if m["role"] == "system")
    messages: list[dict[str, Any]] = [m for m in sample["messages"] if m["role"] != "system"]
    for turn in range(max_turns):
        kw = {"model": "policy", "max_tokens": 64, "system": system or anthropic.NOT_GIVEN, "messages": messages,
              "tools": tools or anthropic.NOT_GIVEN}
        try:
            if stream:
                with client.messages.stream(**kw) as events:
                    reply = events.get_final_message()
            else:
                reply = client.messages.create(**kw)
        except anthropic.BadRequestError as e:  # e.g. the context is full: the episode ends here
            print(f"session {sid} turn {turn}: {e.message}", flush=True)
            break
        text = "".join(b.text for b in reply.content if b.type == "text")
        print(f"session {sid} turn {turn}: {text!r}", flush=True)
        uses = [b for b in reply.content if b.type == "tool_use"]
        if not uses:
            break
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
        table = sample["metadata"].get("table", {})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": b.id, "content": lookup(json.dumps(b.input), table)
             if b.name == "lookup" else f"error: unknown tool '{b.name}'; the only tool is 'lookup'"} for b in uses]})
    state = gateway.post(f"/sessions/{sid}/close", cast_to=object, body={})
    print(f"session {sid} closed: reward {state.get('reward')}", flush=True)


if __name__ == "__main__":
    sys.exit(main(play_episode=episode, doc=__doc__))
