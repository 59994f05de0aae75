"""Helpers for tests and benchmarks of tool-using agents: the example agent's path, and supervised
steps on the ``tool_lookup`` task's ideal episodes (a part-taught policy for RL to finish)."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[3]
AGENT = REPO / "examples" / "tool_agent.py"


def teach_tool_use(model: torch.nn.Module, tok: Any, samples: list, steps: int = 80, lr: float = 1e-2,
                   batch_size: int = 0, seed: int = 0, stop: Callable[[int], bool] | None = None,
                   check_every: int = 5) -> int:
    """Supervised steps on each sample's ideal episode (lookup, tool result, answer): the policy then
    calls the tool in its own words, which the gateway must turn into OpenAI tool_calls. ``batch_size``
    > 0: each step on that many episodes drawn at random (``seed``), else on all of them. ``stop``: called
    with the steps taken every ``check_every`` steps (the model in eval mode); True ends the teaching
    there. Returns the steps taken."""
    rows = []
    for s in samples:
        key, code = s.metadata["key"], s.answer
        call = json.dumps({"name": "lookup", "arguments": {"key": key}})
        msgs = [{"role": m.role, "content": m.content} for m in s.messages]
        prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        msgs += [
            {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
            {"role": "tool", "content": f"{key}: {code}"},
            {"role": "assistant", "content": f"<answer>{code}</answer>"},
        ]
        ids = tok(tok.apply_chat_template(msgs, tokenize=False), add_special_tokens=False)["input_ids"]
        n = len(tok(prompt, add_special_tokens=False)["input_ids"])
        rows.append((ids, [-100] * n + ids[n:]))
    rng = random.Random(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for step in range(1, steps + 1):
        batch = rng.sample(rows, batch_size) if batch_size else rows
        width = max(len(ids) for ids, _ in batch)
        ids = torch.tensor([i + [0] * (width - len(i)) for i, _ in batch])
        labels = torch.tensor([x + [-100] * (width - len(x)) for _, x in batch])
        opt.zero_grad()
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
        if stop is not None and step % check_every == 0:
            model.eval()
            if stop(step):
                return step
            model.train()
    model.eval()
    return steps
