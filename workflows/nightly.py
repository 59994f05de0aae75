"""Nightly retraining: the launch plan ``omni_rl_nightly`` runs ``omni_rl_retrain`` at 03:00 UTC.

Each tick is its own run, ``<cfg.run_id>-YYYYmmdd-HHMM``, that starts from the newest final
checkpoint under ``cfg.root`` (``model.init_checkpoint``) and trains on a fresh snapshot of the
configured data (a changed dataset gets a new snapshot id), so the lineage chain of tonight's
checkpoint runs back through every earlier night to the first run.

The launch plan's default ``cfg`` is fixed at registration: the omni-cpu preset, or the preset or
config file named by ``RELAX_NIGHTLY_CONFIG`` (on a cluster: a bucket root and a GPU preset)::

    RELAX_NIGHTLY_CONFIG=nightly.yaml pyflyte register --image ... workflows/
    flytectl update launchplan -p relax -d production omni_rl_nightly --version <v> --activate

Locally a launch plan only forwards its inputs (nothing is scheduled); call it from Python with an
explicit ``kickoff_time`` to try a tick (tests/workflows/test_nightly.py does).
"""

from __future__ import annotations

import os
from datetime import datetime

from flytekit import CronSchedule, LaunchPlan, workflow

from relax.config import RelaxConfig, load_config
from tasks.register import OmniRLResult
from tasks.retrain import retrain_config
from workflows.omni_rl import omni_rl

NIGHTLY_ENV = "RELAX_NIGHTLY_CONFIG"


@workflow
def omni_rl_retrain(cfg: RelaxConfig, kickoff_time: datetime) -> OmniRLResult:
    run_cfg = retrain_config(cfg=cfg, kickoff_time=kickoff_time)
    return omni_rl(cfg=run_cfg)


def nightly_default() -> RelaxConfig:
    source = os.environ.get(NIGHTLY_ENV)
    return load_config(source or "omni-cpu")


omni_rl_nightly = LaunchPlan.get_or_create(
    omni_rl_retrain,
    name="omni_rl_nightly",
    default_inputs={"cfg": nightly_default()},
    schedule=CronSchedule(schedule="0 3 * * *", kickoff_time_input_arg="kickoff_time"),
)
