"""An external agent for Relax's ``tool_lookup`` task written against OpenAI's Responses API (``openai`` only).

The same episodes as examples/tool_agent.py, asked through the session's ``/v1/responses``: the
sample's system message as ``instructions``, the ``lookup`` tool as a function tool, and each turn
after the first sent with ``previous_response_id`` (the gateway holds the conversation) and the
``function_call_output`` items of the tool's results. Same options as tool_agent.py::

    RELAX_AGENT_TOKEN=<agent token> python examples/responses_agent.py --run-root ./.relax/runs/<run> --forever
"""

from __future__ import annotations

import sys
from typing import Any

import openai
from tool_agent import lookup, main


def episode(gateway: openai.OpenAI, token: str, session: dict[str, Any], max_turns: int, stream: bool) -> None:
    sid, sample = session["id"], session["sample"]
    client = gateway.with_options(base_url=session["base_url"])
    tools = [{"type": "function", **t["function"]} for t in sample.get("tools") or []]
    system = [m["content"] for m in sample["messages"] if m["role"] == "system"]
    items: list[dict[str, Any]] = [m for m in sample["messages"] if m["role"] != "system"]
    previous = None
    for turn in range(max_turns):
        kw: dict[str, Any] = {"model": "policy", "input": items, "tools": tools or openai.NOT_GIVEN,
                              "instructions": system[0] if system and previous is None else openai.NOT_GIVEN,
                              "previous_response_id": previous or openai.NOT_GIVEN}
        try:
            if stream:
                reply = [e for e in client.responses.create(stream=True, **kw) if e.type.startswith("response.")
                         and e.type.endswith(("completed", "incomplete"))][-1].response
            else:
                reply = client.responses.create(**kw)
        except openai.BadRequestError as e:  # e.g. the context is full: the episode ends here
            print(f"session {sid} turn {turn}: {e.message}", flush=True)
            break
        print(f"session {sid} turn {turn}: {reply.output_text!r}", flush=True)
        calls = [o for o in reply.output if o.type == "function_call"]
        if not calls:
            break
        previous = reply.id
        items = [{"type": "function_call_output", "call_id": c.call_id,
                  "output": lookup(c.arguments, sample["metadata"].get("table", {})) if c.name == "lookup"
                  else f"error: unknown tool '{c.name}'; the only tool is 'lookup'"} for c in calls]
    state = gateway.post(f"/sessions/{sid}/close", cast_to=object, body={})
    print(f"session {sid} closed: reward {state.get('reward')}", flush=True)


if __name__ == "__main__":
    sys.exit(main(play_episode=episode, doc=__doc__))
