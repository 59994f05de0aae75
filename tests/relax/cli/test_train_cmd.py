"""``relax train`` then ``relax status``; a changed config under the same run id is one error line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from relax.cli.main import main

ARGS = ["data.tasks=[arithmetic]", "data.train_per_task=32", "data.eval_per_task=4", "rollout.prompts_per_step=2",
        "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=4", "trainer.total_steps=2", "run_id=cli"]


def _relax(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "relax.cli.main", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_train_status_and_config_mismatch(tmp_path):
    root = f"file://{tmp_path}"
    out = _relax("train", f"root={root}", *ARGS, "--no-progress")
    assert out.returncode == 0, out.stderr
    assert "run cli: 2 steps, policy version 2" in out.stdout and "curves.png" in out.stdout
    st = _relax("status", root, "cli", "--json")
    assert st.returncode == 0, st.stderr
    status = json.loads(st.stdout)
    assert status["actor_train_steps"] == 2 and status["weight_versions"][-1] == 2
    assert status["roles"]["actor"]["step"] == 1
    bad = _relax("train", f"root={root}", *ARGS, "trainer.lr=0.5", "--no-progress")
    assert bad.returncode == 2 and bad.stderr.startswith("error: run 'cli'") and "trainer.lr" in bad.stderr
    media = _relax("train", f"root={root}", *ARGS[1:], "run_id=m", "data.tasks=[shapes]", "--no-progress")
    assert media.returncode == 2 and "shapes" in media.stderr


def test_status_of_a_root_without_runs_says_so_and_fails(tmp_path, capsys):
    # it printed nothing and exited 0, as a root whose runs had nothing to report would
    assert main(["status", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: no run root at file://{tmp_path}/nope: nothing is there. A root holds "
                          f"runs/<run_id>/run.json") and f"relax train root={tmp_path}/nope" in err
    (tmp_path / "nope" / "runs" / "half").mkdir(parents=True)  # a folder, but no run.json: no run
    assert main(["status", str(tmp_path / "nope"), "--json"]) == 2
    assert capsys.readouterr().err.startswith(f"error: no runs under file://{tmp_path}/nope (no runs/<run_id>/")
    (tmp_path / "nope" / "runs" / "half" / "run.json").write_text("{}")
    assert main(["status", str(tmp_path / "nope"), "hlaf"]) == 2
    assert capsys.readouterr().err == f"error: no run 'hlaf' under file://{tmp_path}/nope; the runs there are half\n"
