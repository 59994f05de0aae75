"""``relax run`` (the whole pipeline without Flyte) and ``relax eval``, as a user calls them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from relax.cli.main import main

ARGS = ["data.tasks=[arithmetic]", "data.train_per_task=16", "data.eval_per_task=3", "rollout.prompts_per_step=2",
        "rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=6", "trainer.total_steps=2",
        "trainer.checkpoint_every=1", "trainer.sft_steps=2", "run_id=cli-run"]


def _relax(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "relax.cli.main", *args], capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_run_warm_starts_trains_and_evaluates_then_eval_scores_the_checkpoint(tmp_path):
    root = f"file://{tmp_path}"
    out = _relax("run", f"root={root}", *ARGS, "--no-progress", "--json")
    assert out.returncode == 0, out.stderr
    scores = json.loads(out.stdout.strip().splitlines()[-1])
    assert scores["steps"] == 2 and scores["checkpoint"].endswith("runs/cli-run/checkpoints/step-000001")
    assert set(scores["before"]) == set(scores["after"]) == {"text"}
    assert "arithmetic" in out.stdout and "before" in out.stdout  # the before/after table
    assert "cli-run/step-000001" in out.stdout  # the lineage chain
    # the warm start is the pipeline's, keyed and stored under the root; the run started from it
    record = json.loads((tmp_path / "runs" / "cli-run" / "run.json").read_text())
    assert "/warm_start/" in record["config"]["model"]["init_checkpoint"]

    ev = _relax("eval", f"root={root}", *ARGS, "--checkpoint", scores["checkpoint"], "--json")
    assert ev.returncode == 0, ev.stderr
    report = json.loads(ev.stdout)
    assert report["n"] == {"arithmetic": 3}
    assert report["by_modality"] == pytest.approx(scores["after"])  # greedy: the same score twice

    two = _relax("eval", "tiny-cpu", "omni-cpu", f"root={root}")
    assert two.returncode == 2 and "at most one preset" in two.stderr


def test_eval_show_prints_prompts_responses_and_rewards(tmp_path, capsys):
    # a user's own rows: the scores alone (0.000) never said what the model wrote
    rows = [{"id": f"q{i}", "messages": f"What is {i} + 1? Reply as <answer>N</answer>.", "answer": str(i + 1)}
            for i in range(8)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["eval", f"root={tmp_path / 'root'}", f"data.train_url={tmp_path / 'rows.jsonl'}", "data.eval_fraction=0.5",
            "rollout.max_new_tokens=4"]
    assert main([*args, "--show", "2"]) == 0
    out = capsys.readouterr().out
    assert "custom" in out.split("\n\n")[0]  # the accuracy table first
    shown = out.split("held-out prompts, answered greedily:\n")[1].strip().split("\n\n")
    assert len(shown) == 2
    for block in shown:
        head, prompt, answer, response = block.splitlines()
        row = rows[int(head.split()[1][1:])]
        assert head.startswith(f"[custom] {row['id']}  reward ")
        assert prompt == f"  prompt:   {row['messages']!r}" and answer == f"  answer:   {row['answer']!r}"
        assert response.startswith("  response: '")

    assert main([*args, "--show", "100", "--json"]) == 0  # more than there are: all of them
    report = json.loads(capsys.readouterr().out)
    assert {"id", "prompt", "answer", "response", "reward"} <= set(report["examples"][0])
    rewards = [e["reward"] for e in report["examples"]]
    assert len(rewards) == report["n"]["custom"] and sum(rewards) / len(rewards) == report["accuracy"]["custom"]
