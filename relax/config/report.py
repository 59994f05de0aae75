"""Config section of what a run reports and where: the experiment trackers fed from its metrics.

The tree (``relax.config.tree.RelaxConfig``) holds it as ``report``; beside it, the check that
reads it alone. How a run is reported changes nothing it computes, so a rerun may change any of
these (``relax.services.run_record.RESUMABLE_FIELDS``) and the config hash leaves them out.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

from relax import objstore
from relax.config.fields import ConfigError, opt

TRACKERS = ("tensorboard", "mlflow", "wandb")
# the package each tracker needs, all in the `trackers` extra (TensorBoard's file is written by hand)
_PACKAGES = {"mlflow": "mlflow", "wandb": "wandb"}


@dataclass
class ReportConfig:
    """Experiment trackers (docs/tracking.md). Each is fed from the metrics the roles already write."""

    trackers: list[str] = opt(["tensorboard"], "Where metrics, config and lineage go, any of tensorboard, mlflow, "
                              "wandb; mlflow and wandb need `pip install 'relax[trackers]'`.")
    mlflow_uri: str = opt("", "MLflow tracking URI; empty = a SQLite database <root>/mlflow.db (a local root only).")
    mlflow_experiment: str = opt("relax", "MLflow experiment that holds the runs.")
    registered_model: str = opt("", "MLflow registered model the final checkpoints become versions of; "
                                "empty = relax-<model name>.")
    wandb_project: str = opt("relax", "W&B project.")
    wandb_mode: str = opt("offline", "W&B mode: offline writes run files under <run>/report/wandb (wandb sync "
                          "uploads them later); online needs a login and the network.", choices=("offline", "online"))
    sync_every_s: float = opt(30.0, "How often a running run sends its new metrics to the trackers; 0 = only "
                              "at its end.", range=(0.0, 86400.0))


def check_trackers(cfg: Any) -> None:
    r = cfg.report
    for i, name in enumerate(r.trackers):
        if name not in TRACKERS:
            raise ConfigError(f"report.trackers[{i}] = {name!r} is not a tracker; choose from {list(TRACKERS)}")
        if r.trackers.index(name) != i:
            raise ConfigError(f"report.trackers names {name!r} twice; name each tracker once")
        package = _PACKAGES.get(name)
        if package and importlib.util.find_spec(package) is None:
            raise ConfigError(f"report.trackers names {name!r} but {package} is not installed: "
                              f"pip install 'relax[trackers]', or drop {name!r} from report.trackers")
    if "mlflow" in r.trackers and not r.mlflow_uri and objstore.local_path(cfg.root) is None:
        raise ConfigError(f"report.trackers names mlflow on the object-store root {cfg.root}, where no SQLite "
                          f"database can live: set report.mlflow_uri (an MLflow server, or sqlite:///local/file.db)")
