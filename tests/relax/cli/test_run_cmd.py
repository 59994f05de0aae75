"""``relax run`` (the whole pipeline without Flyte) and ``relax eval``, as a user calls them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ARGS = ["data.tasks=[arithmetic]", "data.train_per_task=16", "data.eval_per_task=3", "rollout.prompts_per_step=2",
        "rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=6", "trainer.total_steps=2",
        "trainer.checkpoint_every=1", "trainer.sft_steps=2", "run_id=cli-run"]


def _relax(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "relax.cli.main", *args], capture_output=True, text=True, timeout=600)


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
