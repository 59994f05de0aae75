"""The multi-turn agent loop on the built-in tool-use task: observations enter the context but
never the loss, and the run trains on those episodes."""

from __future__ import annotations

import numpy as np
import pytest

from relax.pipeline import train_run
from relax.services.run_context import RunContext
from tests.relax.services.runtime_helpers import tiny_config

pytestmark = pytest.mark.slow


def _spans(mask: np.ndarray) -> list[tuple[int, int, int]]:
    """(value, start, end) runs of a 0/1 mask."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((int(mask[start]), start, i))
            start = i
    return out


def test_tool_task_trains_through_the_agent_loop_with_observations_masked(tmp_path):
    cfg = tiny_config(f"file://{tmp_path}", "agent", "data.tasks=[tool_lookup]", "trainer.sft_steps=40",
                      "rollout.max_new_tokens=32", "rollout.max_turns=3", "trainer.total_steps=3")
    result = train_run(cfg, progress=False)  # the pipeline's format warm-start, then RL
    assert result.steps == 3
    ctx = RunContext(cfg)
    queue = ctx.queue()
    queue.refresh()
    ids = list(queue.state.samples)
    rows = queue.read(ids, ["tokens", "loss_mask", "logprobs", "prompt_len", "response"])
    tok = ctx.tokenizer
    multi = 0
    for i in range(len(ids)):
        mask, lps, tokens = rows["loss_mask"][i], rows["logprobs"][i], rows["tokens"][i]
        assert not mask[: rows["prompt_len"][i]].any()  # the prompt is never trained
        assert np.all(lps[mask == 0] == 0) and np.all(lps[mask == 1] < 0)  # behaviour logprobs on policy tokens only
        spans = _spans(mask)
        policy_turns = [s for s in spans if s[0] == 1]
        if len(policy_turns) >= 2:  # a tool turn sits between two policy turns
            multi += 1
            obs = [s for s in spans if s[0] == 0 and policy_turns[0][2] <= s[1] < policy_turns[-1][1]]
            text = tok.decode(tokens[obs[0][1]:obs[0][2]].tolist())
            assert "<|im_start|>tool" in text
            assert "[tool]" in rows["response"][i]
    assert multi > 0, "no episode used the tool"
