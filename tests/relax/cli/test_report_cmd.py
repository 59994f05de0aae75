"""``relax train`` with MLflow as a user runs it (progress lines in its log), then ``relax report``."""

from __future__ import annotations

import subprocess
import sys

import pytest
from PIL import Image

from relax.cli.main import main
from tests.relax.cli.test_train_cmd import ARGS


@pytest.mark.slow
def test_train_logs_progress_lines_and_mlflow_then_report_regenerates(tmp_path, capsys):
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    root = f"file://{tmp_path}"
    args = [a for a in ARGS if not a.startswith("trainer.total_steps")] + ["trainer.total_steps=4"]
    # disaggregated, as make run: the rollout's reward reaches the line from another process's metrics
    out = subprocess.run([sys.executable, "-m", "relax.cli.main", "train", f"root={root}", *args,
                          "topology=disaggregated", "report.trackers=[tensorboard,mlflow]"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    # stderr is a pipe here, as in a log or CI: a line per tenth of the run (every step of 4) and no bar
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("step ")]
    assert [ln.split()[1] for ln in lines] == ["1/4", "2/4", "3/4", "4/4"] and "ETA 0s" in lines[-1]
    assert "samples/s" in lines[0] and "train:" not in out.stderr
    assert 0.0 <= float(lines[-1].split()[3]) <= 1.0  # the reward: read from the rollout's records, not nan
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (version,) = client.search_model_versions("name = 'relax-tiny-qwen2'")
    assert version.tags["relax_checkpoint"] == "cli/step-000003"

    report = tmp_path / "runs" / "cli" / "report"
    (report / "curves.png").unlink()
    assert main(["report", str(tmp_path), "cli"]) == 0
    assert "report.html" in capsys.readouterr().out
    assert Image.open(report / "curves.png").size == (1130, 1230) and "<img" in (report / "report.html").read_text()
    assert main(["report", "sync", str(tmp_path), "cli"]) == 0  # nothing missed: nothing sent twice
    assert "mlflow up to date" in capsys.readouterr().out
    assert len(client.search_model_versions("name = 'relax-tiny-qwen2'")) == 1
    assert main(["report", "sync", str(tmp_path), "cli", "trainer.lr=0.5"]) == 2  # only the report section
    assert "trainer.lr: only the report section may change here" in capsys.readouterr().err
    assert main(["report", str(tmp_path), "nope"]) == 2
