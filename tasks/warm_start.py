"""The SFT format warm-start: a few supervised steps that teach the answer format before RL.

Why a separate, cached task: the warm-start depends only on the config and the dataset snapshot,
so re-running the workflow (or a retry of the train step) must not redo it. Flyte caches it on
(config, snapshot id); relax also stores it under ``<root>/warm_start/<key>`` and reuses it, so a
cache miss (a new Flyte cache, ``--overwrite-cache``) still costs no training.
"""

from __future__ import annotations

from datetime import timedelta

from flytekit import Cache, Resources, task

from relax import pipeline
from relax.config import RelaxConfig
from relax.models.builders import BUILTIN_VERSION
from relax.trainers.torch.sft import FORMAT_RECIPE
from tasks.image import task_image

# Follows the built-in models and the warm-start recipe, so neither can change under a cached
# output; bump the leading number when the checkpoint format changes.
WARM_START_CACHE_VERSION = f"3-models{BUILTIN_VERSION}-recipe{FORMAT_RECIPE}"


@task(cache=Cache(version=WARM_START_CACHE_VERSION), retries=2, timeout=timedelta(hours=6),
      requests=Resources(cpu="2", mem="4Gi"), container_image=task_image())
def warm_start(cfg: RelaxConfig, snapshot_id: str) -> str:
    """Run (or reuse) the format warm-start of ``cfg`` on snapshot ``snapshot_id``; returns the checkpoint
    URL that RL starts from: the warm-start checkpoint, else ``cfg.model.init_checkpoint`` ("" = the
    configured model as built)."""
    return pipeline.warm_start(cfg, snapshot_id) or cfg.model.init_checkpoint
