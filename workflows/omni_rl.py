"""The main Relax pipeline: ``pyflyte run workflows/omni_rl.py omni_rl`` (``make run``).

Steps, each a task in tasks/ (docs/workflows.md has the details):
  1. hash the configured dataset and snapshot it under the run root, cached by content hash;
  2. pin the root to an absolute URL, so every cache key below names one place;
  3. SFT format warm-start (cached; skipped when ``trainer.sft_steps`` is 0);
  4. evaluate the policy RL starts from (cached on the checkpoint);
  5. train: one Ray task (or one per role group when disaggregated) sized by ``cfg.resources``;
     a re-run resumes the run and, when it is complete, trains nothing;
  6. evaluate the final checkpoint;
  7. register it: a ``relax_checkpoint`` Artifact, a Deck, the before/after table on stdout.

The input is the whole ``RelaxConfig`` (default: the ``omni-cpu`` preset, one task per modality
on the tiny omni model); from the CLI pass
``--cfg cfg.yaml`` or ``--cfg cfg.json`` (``relax config show --json > cfg.json`` writes one).
``pyflyte run`` parses it with ``RelaxConfig.from_json``, so an unknown key or a wrong type fails,
naming the field, before any task runs.
"""

from __future__ import annotations

from flytekit import workflow

from relax.config import RelaxConfig, load_config
from tasks.data import hash_dataset, pin_root, snapshot_dataset
from tasks.evaluate import evaluate
from tasks.register import OmniRLResult, register
from tasks.train import train
from tasks.warm_start import warm_start


@workflow
def omni_rl(cfg: RelaxConfig = load_config("omni-cpu")) -> OmniRLResult:
    key = hash_dataset(cfg=cfg)
    snapshot = snapshot_dataset(data=cfg.data, key=key)
    run_cfg = pin_root(cfg=cfg, key=key)
    start = warm_start(cfg=run_cfg, snapshot_id=snapshot.id)
    before = evaluate(cfg=run_cfg, checkpoint=start)
    summary = train(cfg=run_cfg, init_checkpoint=start)
    after = evaluate(cfg=run_cfg, checkpoint=summary.checkpoint)
    return register(cfg=run_cfg, snapshot=snapshot, before=before, after=after, summary=summary).result
