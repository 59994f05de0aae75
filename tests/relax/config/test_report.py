"""The report section: which trackers, and what each needs to be fed."""

from __future__ import annotations

import pytest

from relax.config import ConfigError, config_hash, load_config


def test_trackers_default_to_tensorboard_and_accept_the_three():
    assert load_config(None, []).report.trackers == ["tensorboard"]
    assert load_config(None, ["report.trackers=[tensorboard,mlflow,wandb]"]).report.trackers == [
        "tensorboard", "mlflow", "wandb"]


@pytest.mark.parametrize(("trackers", "message"), [
    ("[mlfow]", r"report.trackers\[0\] = 'mlfow' is not a tracker; choose from \['tensorboard', 'mlflow', 'wandb'\]"),
    ("[wandb,wandb]", "report.trackers names 'wandb' twice"),
])
def test_an_unknown_or_repeated_tracker_is_named(trackers, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [f"report.trackers={trackers}"])


def test_mlflow_on_an_object_store_root_needs_a_uri():
    with pytest.raises(ConfigError, match=r"object-store root s3://b/r, where no SQLite .*set report.mlflow_uri"):
        load_config(None, ["root=s3://b/r", "report.trackers=[mlflow]"])
    cfg = load_config(None, ["root=s3://b/r", "report.trackers=[mlflow]", "report.mlflow_uri=http://mlflow:5000"])
    assert cfg.report.mlflow_uri == "http://mlflow:5000"


def test_warm_start_is_not_a_run_id():
    with pytest.raises(ConfigError, match="run_id = 'warm-start' is where lineage names format warm-starts"):
        load_config(None, ["run_id=warm-start"])


def test_where_metrics_go_leaves_the_config_hash_alone():
    assert config_hash(load_config(None, [])) == config_hash(load_config(None, ["report.trackers=[mlflow]"]))
    assert config_hash(load_config(None, [])) != config_hash(load_config(None, ["seed=1"]))
