"""A colocated run whose episodes are all played by external agents (examples/tool_agent.py processes
through the session gateway) trains on exactly their sessions and raises the tool task's held-out
accuracy: every batch is the agents' closed sessions, their multi-turn samples reach the queue with
the tool results masked out, the verifier's reward lands, and the policy learns.

The policy starts part-taught: supervised steps on the ideal episodes (lookup, result, answer) of the
256 training prompts, stopped where it looks the right item up but copies the code from the tool's
answer only some of the time (held-out >= 0.12: 0.156 at 330 steps on one machine). RL through the gateway
then has to finish teaching the copy (docs/agents.md, ``benchmarks/agents.py``; the bounds below).

The rollout role is killed once mid-batch (RELAX_FAULT ``rollout:midway``: half the batch's sessions
closed, the rest open with agents attached): the run heals, its gateway comes back on the same address
and the agents, which outlive it, play the rest of the run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from relax.cli.train_cmd import run_status
from relax.config.preflight import AGENT_TOKEN_ENV
from relax.pipeline import evaluate, train_run
from relax.services.policy import build_model
from relax.services.run_context import RunContext
from relax.trainers.checkpoint.trainer_state import save_checkpoint
from tests.relax.services.runtime_helpers import tiny_config
from tests.relax.services.tool_episodes import AGENT, teach_tool_use

pytestmark = pytest.mark.slow
TOKEN = "external-agents-test-token"
# supervised steps of 32 episodes at lr 3e-3 until held-out accuracy reaches START (checked every 5 steps
# from MIN_SFT): the jump from ~0.05 to ~0.6 falls anywhere between ~330 and ~380 steps, with the
# machine's floating-point details (measured 0.156 at 330 on one machine, 0.078 at 330 and 0.61 at 380
# on another), so a fixed step count can hand RL a policy it cannot lift within RL_STEPS
MIN_SFT, MAX_SFT, START = 320, 480, 0.12
RL_STEPS = 24
FAULT_BATCH = 3  # the rollout dies with half of this batch played


def test_a_run_played_by_external_agents_trains_on_their_sessions_and_learns(tmp_path, monkeypatch):
    monkeypatch.setenv(AGENT_TOKEN_ENV, TOKEN)  # the agents' token: the gateway checks it, the agents send it
    cfg = tiny_config(f"file://{tmp_path}", "agents", "data.tasks=[tool_lookup]", "data.train_per_task=256",
                      "data.eval_per_task=128", "rollout.agents=external", "rollout.prompts_per_step=16",
                      "rollout.n_samples_per_prompt=8", "rollout.max_new_tokens=32", "rollout.max_turns=3",
                      f"trainer.total_steps={RL_STEPS}", f"trainer.checkpoint_every={RL_STEPS}", "trainer.lr=1e-3")
    ctx = RunContext(cfg)
    model, _ = build_model(ctx)
    start, held_out = f"file://{tmp_path}/part-taught", []

    def part_taught(step: int) -> bool:
        if step < MIN_SFT:
            return False
        save_checkpoint(start, model, meta={"kind": "test", "sft_steps": step})
        held_out.append((step, evaluate(cfg, start).accuracy["tool_lookup"]))
        return held_out[-1][1] >= START

    teach_tool_use(model, ctx.tokenizer, ctx.split("train"), steps=MAX_SFT, lr=3e-3, batch_size=32, stop=part_taught)
    before = held_out[-1][1]
    assert before >= START, f"{MAX_SFT} supervised steps left held-out accuracy at {held_out}"
    run_dir = ctx.run_url.removeprefix("file://")
    # two agent programs, one streaming, each playing several episodes at once on threads
    # (their logs go to files: a pipe nobody reads while the run trains fills up and stalls them)
    logs = [tmp_path / f"agent-{i}.log" for i in range(2)]
    agents = [subprocess.Popen([sys.executable, str(AGENT), "--run-root", run_dir, "--forever", "--max-turns", "3",
                                "--reconnect-s", "15", *extra], env={**os.environ, "PYTHONUNBUFFERED": "1"},
                               stdout=log.open("w"), stderr=subprocess.STDOUT)
              for log, extra in zip(logs, (["--parallel", "24"], ["--stream", "--parallel", "8"]), strict=True)]
    monkeypatch.setenv("RELAX_FAULT", f"rollout:midway:{FAULT_BATCH}:1")  # after the part-taught start: once
    try:
        result = train_run(cfg, init_checkpoint=start, progress=False)
    finally:
        for p in agents:  # the gateway is gone once the run ends: each agent stops by itself
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    outs = [log.read_text() for log in logs]
    assert result.steps == RL_STEPS
    assert all(p.returncode == 0 and "the gateway is gone" in out[-2000:] for p, out in zip(agents, outs, strict=True))
    rollout = sorted(result.metrics("rollout"), key=lambda m: m["batch"])
    assert all(m["sessions_closed"] == m["samples"] == 128 for m in rollout)
    # the rollout died once mid-batch and its restart played that batch again with the same agents
    assert [m["batch"] for m in rollout] == list(range(len(rollout))) and len(rollout) >= RL_STEPS
    assert run_status(cfg.root, "agents")["restarts"] == {"rollout": 1}
    assert any("ended by the gateway: 503" in out or "the gateway went away" in out for out in outs), outs
    rewards = [m["reward"] for m in rollout]
    after = evaluate(cfg, f"{ctx.run_url}/checkpoints/step-{RL_STEPS - 1:06d}").accuracy["tool_lookup"]
    print(f"rewards per batch: {[round(r, 2) for r in rewards]}; held-out {before:.3f} -> {after:.3f}")
    assert rewards[0] > 0  # the verifier scored the agents' transcripts, and some episodes succeed
    # RL through the gateway raises held-out accuracy (128 prompts, greedy). Measured at lr 1e-3 (2e-3
    # collapses, 3e-4 barely moves in 24 steps): 0.156 -> 0.219, 0.141 -> 0.211 and 0.141 -> 0.289. The
    # training reward rises too, but which episodes each agent thread gets changes from run to run, and
    # two runs from the same start measured 0.165 -> 0.181 and 0.163 -> 0.220 (first and last six batches):
    # too noisy for a bound, so the halves are only required not to fall
    assert sum(rewards[12:]) >= sum(rewards[:12]), rewards
    assert after > before + 0.03, (before, after)
    queue = ctx.queue()
    queue.refresh()
    rows = queue.read(list(queue.state.samples), ["loss_mask", "prompt_len", "response"])
    multi = [i for i, r in enumerate(rows["response"]) if "\n[tool] " in r]
    assert multi, "no agent episode used the tool"
    for i in multi:  # the tool's result sits between policy turns, outside the loss
        mask = rows["loss_mask"][i][rows["prompt_len"][i]:]
        assert mask[0] == 1 and (mask == 0).any() and mask[-1] == 1

