"""`make run` killed mid-training (SIGKILL) and run again with the same run id resumes and finishes
with one continuous lineage chain.

In `make run`'s topology, disaggregated. The colocated one resumes through the same checkpoint and
queue records (tests/relax/services/topologies/test_colocated.py stops and resumes it, and
tests/relax/transfer/test_crash.py SIGKILLs the queue's writer at random points), so a second
workflow run for it (45 s) was dropped to keep `make test` within its budget."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from relax import objstore
from relax.config import config_to_dict, load_config
from relax.pipeline import lineage
from tests.polling import wait_until

REPO = Path(__file__).resolve().parents[2]
PYFLYTE = str(Path(sys.executable).with_name("pyflyte"))
STEPS = 16  # killed at step 7's checkpoint: half the run is still to go
SMALL = ["data.tasks=[largest]", "data.train_per_task=32", "data.eval_per_task=4", f"trainer.total_steps={STEPS}",
         "trainer.checkpoint_every=4", "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=2",
         "rollout.max_new_tokens=6", "trainer.sft_steps=2", "run_id=killed"]


def pyflyte(cfg_file: Path, home: Path, cwd: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([PYFLYTE, "run", str(REPO / "workflows" / "omni_rl.py"), "omni_rl", "--cfg",
                             str(cfg_file)], cwd=cwd, env={**os.environ, "HOME": str(home), **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


@pytest.mark.slow
@pytest.mark.ray
def test_sigkill_mid_training_then_rerun_resumes_with_one_lineage_chain(tmp_path, ray_session):
    cfg = load_config(None, [f"root=file://{tmp_path}/root", "topology=disaggregated", "queue.max_staleness=2",
                             *SMALL])
    cfg_file = tmp_path / "cfg.yaml"
    cfg_file.write_text(yaml.safe_dump(config_to_dict(cfg)))
    # the Ray task joins the session's cluster, so killing the workflow kills only its driver
    env = {"RAY_ADDRESS": ray_session.get_runtime_context().gcs_address}
    run_url = f"file://{tmp_path}/root/runs/killed"
    first = pyflyte(cfg_file, tmp_path / "home", tmp_path, env)

    def second_checkpoint() -> bool:
        assert first.poll() is None, first.stdout.read()[-3000:]
        return objstore.exists(f"{run_url}/checkpoints/step-000007/meta.json")

    try:
        # kill once two checkpoints exist and training is still going
        wait_until(second_checkpoint, 300, interval=0.2, what="a second checkpoint")
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    killed_at = max(int(n[5:]) for n in objstore.list_dir(f"{run_url}/checkpoints") if n.startswith("step-"))
    assert killed_at < STEPS - 1  # it really was interrupted

    second = pyflyte(cfg_file, tmp_path / "home", tmp_path, env)
    out, _ = second.communicate(timeout=600)
    assert second.returncode == 0, out[-3000:]
    assert "before" in out and "after" in out  # the evaluation table

    graph = lineage(cfg)["records"]
    assert graph["head"] == f"killed/step-{STEPS - 1:06d}"
    nodes = [n for n in graph["nodes"] if n["kind"] == "checkpoint"]
    warm = [n for n in nodes if n["id"].startswith("checkpoint:warm-start/")]
    checkpoints = [n for n in nodes if n["id"].startswith("checkpoint:killed/")]
    assert len(warm) == 1 and len(nodes) == len(checkpoints) + 1  # the chain starts at the format warm start
    steps = [n["step"] for n in checkpoints]  # oldest first
    assert steps == list(range(3, STEPS, 4))  # every checkpoint, before and after the kill, in order
    parents = {e["from"]: e["to"] for e in graph["edges"] if e["kind"] == "parent"}
    assert parents[checkpoints[0]["id"]] == warm[0]["id"]
    for older, newer in zip(checkpoints, checkpoints[1:], strict=False):
        assert parents[newer["id"]] == older["id"]  # one unbroken chain across the kill
    assert sum(n["sample_count"] for n in checkpoints) == STEPS * 2 * 2  # every trained sample counted once
