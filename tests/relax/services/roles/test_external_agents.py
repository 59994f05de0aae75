"""A colocated run whose episodes are all played by external agents (examples/tool_agent.py processes
through the session gateway) trains on exactly their sessions: every batch is the agents' closed
sessions, their multi-turn samples reach the queue with the tool results masked out, the verifier's
reward lands, and the actor's updates move the policy.

The policy starts half-taught the ideal episodes of the run's few prompts (supervised steps on their
lookup-then-answer transcripts) so that some episodes succeed. Whether RL through the gateway then
raises the reward is not asserted: at this scale (4 prompts x 4 samples, a 2-layer model) the built-in
agent loop's reward does not rise within a test's budget either (docs/agents.md, "Learning")."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from relax.engines.guards import TOKEN_ENV
from relax.pipeline import train_run
from relax.services.context import RunContext
from relax.trainers.torch.checkpoint import save_checkpoint
from tests.relax.services.runtime_helpers import tiny_config
from tests.relax.services.test_gateway import AGENT, teach_tool_use

pytestmark = pytest.mark.slow
TOKEN = "external-agents-test-token"
# supervised steps on the 4 prompts' ideal episodes at lr 3e-3: measured with the built-in agent loop
# (4 samples a prompt, temperature 1), 60 steps score 0.06, 80 steps 0.38, 100 steps 0.56
STEPS = 80
RL_STEPS = 4


def test_a_run_played_by_external_agents_trains_on_their_sessions(tmp_path, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)  # the run's token: its gateway checks it, the agents send it
    cfg = tiny_config(f"file://{tmp_path}", "agents", "data.tasks=[tool_lookup]", "data.train_per_task=4",
                      "rollout.agents=external", "rollout.prompts_per_step=4", "rollout.n_samples_per_prompt=4",
                      "rollout.max_new_tokens=32", "rollout.max_turns=3", f"trainer.total_steps={RL_STEPS}",
                      f"trainer.checkpoint_every={RL_STEPS}", "trainer.lr=1e-3")
    ctx = RunContext(cfg)
    model, _ = ctx.build_model()
    teach_tool_use(model, ctx.tokenizer, ctx.split("train"), steps=STEPS, lr=3e-3)
    start = save_checkpoint(f"file://{tmp_path}/half-taught", model, meta={"kind": "test"})
    run_dir = ctx.run_url.removeprefix("file://")
    agents = [subprocess.Popen([sys.executable, str(AGENT), "--run-root", run_dir, "--forever", *extra],
                               env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True) for extra in ([], ["--stream"], [])]
    try:
        result = train_run(cfg, init_checkpoint=start, progress=False)
    finally:
        outs = []
        for p in agents:  # the gateway is gone once the run ends: each agent stops by itself
            try:
                outs.append(p.communicate(timeout=60)[0])
            except subprocess.TimeoutExpired:
                p.kill()
                outs.append(p.communicate()[0])
    assert result.steps == RL_STEPS
    assert all(p.returncode == 0 and "the gateway is gone" in out for p, out in zip(agents, outs, strict=True)), outs
    rollout = sorted(result.metrics("rollout"), key=lambda m: m["batch"])
    assert all(m["sessions_closed"] == m["samples"] == 16 for m in rollout)
    rewards = [m["reward"] for m in rollout]
    print(f"rewards per batch: {[round(r, 2) for r in rewards]}")
    assert rewards[0] > 0  # the verifier scored the agents' transcripts, and some episodes succeed
    store = ctx.weights()
    first, last = store.load(0)[0], store.load(RL_STEPS)[0]
    assert any(not np.array_equal(np.asarray(first[k]), np.asarray(last[k])) for k in first)  # it trained
    queue = ctx.queue()
    queue.refresh()
    rows = queue.read(list(queue.state.samples), ["loss_mask", "prompt_len", "response"])
    multi = [i for i, r in enumerate(rows["response"]) if "\n[tool] " in r]
    assert multi, "no agent episode used the tool"
    for i in multi:  # the tool's result sits between policy turns, outside the loss
        mask = rows["loss_mask"][i][rows["prompt_len"][i]:]
        assert mask[0] == 1 and (mask == 0).any() and mask[-1] == 1

