"""Held-out evaluation of one checkpoint: greedy accuracy per task and per modality.

Cached on (config, checkpoint URL): a checkpoint directory is write-once, so its score never
changes, and a re-run of the workflow re-evaluates nothing. The "before" evaluation passes the
checkpoint RL starts from ("" = the model as built from ``cfg.model``).
"""

from __future__ import annotations

from datetime import timedelta

from flytekit import Cache, Resources, task

from relax import pipeline
from relax.config import RelaxConfig
from relax.pipeline import EvalReport
from tasks.image import task_image

# bump when the evaluation protocol (prompts, decoding, scoring), the report or a built-in model changes
# (2: tiny vision models map white to zero; 3: accuracy per kind of question; 4: the responses, EvalReport.examples)
EVAL_CACHE_VERSION = "4"


@task(cache=Cache(version=EVAL_CACHE_VERSION), retries=2, timeout=timedelta(hours=4),
      requests=Resources(cpu="2", mem="4Gi"), container_image=task_image())
def evaluate(cfg: RelaxConfig, checkpoint: str) -> EvalReport:
    """Greedy accuracy of ``checkpoint`` on the held-out split of every configured task."""
    return pipeline.evaluate(cfg, checkpoint)
