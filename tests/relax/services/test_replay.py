"""Retraining a run's recorded steps from a checkpoint (`relax replay --retrain`) reproduces
them bit for bit, and says so when they do not."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from relax.config import ConfigError
from relax.services.driver import train
from relax.services.replay import Retrain
from tests.relax.services.runtime_helpers import tiny_config

pytestmark = pytest.mark.slow
RELAX = str(Path(sys.executable).with_name("relax"))


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A colocated tiny run of 6 steps; checkpoints after steps 1, 3, 5 (index s: (s + 1) % 2 == 0)."""
    root = tmp_path_factory.mktemp("retrain") / "root"
    cfg = tiny_config(f"file://{root}", "r", "trainer.total_steps=6", "queue.max_staleness=1",
                      "algorithm.entropy_coef=0.01")  # every step moves the policy, rewarded or not
    train(cfg, progress=False)
    return root


def test_retrained_steps_and_weights_equal_the_runs(finished_run, tmp_path):
    job = Retrain(str(finished_run), "r", 1, str(tmp_path / "copy"))
    steps = list(job.steps())
    assert [c.step for c in steps] == [2, 3, 4, 5]
    assert all(c.same for c in steps), [(c.loss, c.recorded_loss) for c in steps]
    assert all("pg_token_max" in c.terms for c in steps)  # 0 where no group had a reward spread
    assert job.weights is not None and job.weights.identical and job.weights.version == 6
    assert job.weights.max_abs_diff == 0.0


def test_retrain_refuses_a_step_without_a_checkpoint_or_beyond_the_run(finished_run, tmp_path):
    with pytest.raises(ConfigError, match=r"no complete checkpoint at step 2; retrain from one of "
                                          r"\['step-000001', 'step-000003', 'step-000005'\]"):
        Retrain(str(finished_run), "r", 2, str(tmp_path / "a"))
    with pytest.raises(ConfigError, match=r"recorded actor steps up to 5; choose a step in 2..5"):
        Retrain(str(finished_run), "r", 1, str(tmp_path / "b"), to_step=9)
    with pytest.raises(ConfigError, match="no run 'nope'"):
        Retrain(str(finished_run), "nope", 1, str(tmp_path / "c"))


def test_cli_exit_code_tells_a_reproduced_run_from_a_diverged_one(finished_run, tmp_path):
    ok = subprocess.run([RELAX, "replay", str(finished_run), "r", "--retrain", "3", "--json"],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    rows = [json.loads(line) for line in ok.stdout.splitlines()]
    assert [r["step"] for r in rows[:-1]] == [4, 5] and all(r["same"] for r in rows[:-1])
    assert rows[-1]["diverged_steps"] == 0 and rows[-1]["weights"]["identical"]

    # a copy of the run whose checkpoint 3 no longer holds what step 4 trained from
    # (checksums updated, so it loads): the retrained steps and weights must come out different
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(finished_run, bad)
    ckpt = bad / "runs" / "r" / "checkpoints" / "step-000003"
    state = torch.load(io.BytesIO((ckpt / "trainer.pt").read_bytes()), weights_only=False)
    name = next(k for k, v in state["model"].items() if v.is_floating_point())
    state["model"][name] += 0.01
    buf = io.BytesIO()
    torch.save(state, buf)
    (ckpt / "trainer.pt").write_bytes(buf.getvalue())
    meta = json.loads((ckpt / "meta.json").read_text())
    meta.update(sha256=hashlib.sha256(buf.getvalue()).hexdigest(), bytes=len(buf.getvalue()))
    (ckpt / "meta.json").write_text(json.dumps(meta))
    out = subprocess.run([RELAX, "replay", str(bad), "r", "--retrain", "3"], capture_output=True, text=True)
    assert out.returncode == 1, out.stderr
    assert "NO" in out.stdout and "2 of 2 steps diverged; weights after the last step DIFFER" in out.stdout


def test_a_lora_runs_retrained_steps_and_adapter_equal_the_runs(tmp_path):
    """With model.lora the published versions hold the adapter alone: the retrain rebuilds the base
    beside the checkpoint's adapter and must reproduce every step and the adapter bit for bit."""
    root = tmp_path / "root"
    cfg = tiny_config(f"file://{root}", "l", "model.lora.rank=4", "model.lora.alpha=8", "queue.max_staleness=1",
                      "algorithm.entropy_coef=0.01", "algorithm.kl_coef=0.01")  # the adapter-off reference too
    train(cfg, progress=False)
    job = Retrain(str(root), "l", 1, str(tmp_path / "copy"))
    steps = list(job.steps())
    assert [c.step for c in steps] == [2, 3]
    assert all(c.same for c in steps), [(c.loss, c.recorded_loss) for c in steps]
    assert all(c.grad_norm > 0 for c in steps)  # the retrained steps moved the adapter
    assert job.weights is not None and job.weights.identical and job.weights.version == 4
    tensors = [t for f in job.store.manifest(4)["files"] for t in f["tensors"]]
    assert tensors and all(".lora_A." in t or ".lora_B." in t for t in tensors)  # what was compared: the adapter
