"""The end-to-end pipeline, the one home of snapshot -> warm start -> train -> evaluate.

:func:`snapshot` -> :func:`warm_start` -> :func:`evaluate` (before) -> :func:`train_run` ->
:func:`evaluate` (after) -> :func:`lineage`. Each Flyte task (``tasks/``) calls one of these;
:func:`run` calls them all in order without Flyte (``relax run``). Every step is idempotent
on the run root, so a retried or re-run step reuses what an earlier attempt finished:
a warm start is keyed by everything that determines it, a run resumes from its newest
checkpoint, and evaluation only reads. Nothing here imports Flyte.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from dataclasses import dataclass

from relax import objstore
from relax.config import RelaxConfig, TrainerConfig, config_to_dict
from relax.config.tree import WARM_START_RUN
from relax.data.snapshot import SnapshotInfo
from relax.data.sources import snapshot_from_config
from relax.models.builders import BUILTIN_MODELS, BUILTIN_VERSION
from relax.rollout.evaluation import EvalReport, evaluate_policy, per_task_limit
from relax.services.driver import TrainSummary, train
from relax.services.policy import build_model, checkpoint_policy
from relax.services.report.accuracy import write_accuracy
from relax.services.report.metrics import write_report
from relax.services.run_context import RunContext
from relax.services.trainable import check_trainable
from relax.trainers.checkpoint.files import read_meta
from relax.trainers.checkpoint.trainer_state import save_checkpoint
from relax.trainers.torch.sft import FORMAT_RECIPE, format_warmup
from relax.transfer.lineage import (
    LineageRecord,
    chain,
    chain_to_json,
    chain_to_text,
    code_version,
    list_records,
    list_runs,
    record_url,
    write_record,
)
from relax.transfer.lineage_render import render_svg

log = logging.getLogger(__name__)
__all__ = ["EvalReport", "PipelineResult", "TrainSummary", "evaluate", "latest_checkpoint", "lineage", "run",
           "snapshot", "train_run", "warm_start"]


def snapshot(cfg: RelaxConfig) -> SnapshotInfo:
    """Write (or reuse) the content-hashed snapshot of ``cfg``'s dataset under its root."""
    return snapshot_from_config(cfg.data, objstore.absolute_url(cfg.root))


def warm_start_key(cfg: RelaxConfig, snapshot_id: str) -> str:
    """Everything a format warm-start depends on: model, tokenizer, seed, SFT settings, data."""
    parts = {"model": {k: v for k, v in config_to_dict(cfg)["model"].items() if k != "init_checkpoint"},
             "seed": cfg.seed, "sft_steps": cfg.trainer.sft_steps, "sft_lr": cfg.trainer.sft_lr,
             "difficulty": cfg.data.difficulty, "snapshot": snapshot_id, "recipe": FORMAT_RECIPE}
    if cfg.trainer.sft_batch_size != TrainerConfig.sft_batch_size:  # so warm-starts stored before it keep their key
        parts["sft_batch_size"] = cfg.trainer.sft_batch_size
    if cfg.model.name_or_path in BUILTIN_MODELS:
        parts["builtin_version"] = BUILTIN_VERSION
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def warm_start(cfg: RelaxConfig, snapshot_id: str) -> str:
    """Format warm-start (``trainer.sft_steps`` supervised steps on *random* answers, so it teaches
    the answer format and nothing about correct answers); returns its checkpoint URL, or "" when
    ``sft_steps`` is 0. Stored under ``<root>/warm_start/<key>`` and reused when present."""
    if cfg.trainer.sft_steps == 0:
        return ""
    ctx = RunContext(cfg)
    check_trainable(ctx, teacher=False)
    if ctx.snapshot_info.id != snapshot_id:
        raise ValueError(f"the config's dataset is snapshot {ctx.snapshot_info.id}, not {snapshot_id}: "
                         f"snapshot it first (the workflow's snapshot step)")
    key = warm_start_key(cfg, snapshot_id)
    url = objstore.join(ctx.root, "warm_start", key)
    if objstore.exists(objstore.join(url, "meta.json")):
        log.info("format warm-start %s exists; reusing it", url)
    else:
        model, processor = build_model(ctx)
        results = format_warmup(model, ctx.tokenizer, ctx.split("train"), cfg.trainer.sft_steps,
                                lr=cfg.trainer.sft_lr, seed=cfg.seed, difficulty=cfg.data.difficulty,
                                processor=processor, media_loader=ctx.snapshot.load_media,
                                batch_size=cfg.trainer.sft_batch_size)
        url = save_checkpoint(url, model, meta={"kind": "format_warm_start", "snapshot": snapshot_id,
                                                "steps": len(results), "final_loss": results[-1].loss})
    # one written before warm starts had records gets its record now, so every run from it has its parent
    if not objstore.exists(record_url(ctx.root, WARM_START_RUN, key)):
        meta = read_meta(url)
        write_record(ctx.root, LineageRecord(
            WARM_START_RUN, key, int(meta.get("steps", cfg.trainer.sft_steps)), None, snapshot_id, key,
            code_version(), created_at=time.time(),
            extra={"kind": "format_warm_start", "checkpoint_url": url, "sft_steps": meta.get("steps"),
                   "final_loss": meta.get("final_loss"), "model": cfg.model.name_or_path}))
    return url


def train_run(cfg: RelaxConfig, init_checkpoint: str = "", fork: bool = False, progress: bool = True,
              engine_urls: list[str] | None = None) -> TrainSummary:
    """Run or resume ``cfg.run_id`` to ``trainer.total_steps``, starting from ``init_checkpoint``
    (else ``cfg.model.init_checkpoint``, else the format warm-start when ``trainer.sft_steps`` > 0)."""
    start = init_checkpoint or cfg.model.init_checkpoint
    if not start and cfg.trainer.sft_steps:
        start = warm_start(cfg, RunContext(cfg).snapshot_info.id)
    if start and not objstore.exists(objstore.join(start, "meta.json")):
        # the usual cause: a root deleted by hand while Flyte's cache still returns URLs under it
        raise FileNotFoundError(
            f"the checkpoint RL starts from, {start}, is gone (no meta.json). If it came from Flyte's cache "
            f"and its root was deleted, rerun with `pyflyte run --overwrite-cache ...` (make run does so when "
            f"./.relax is missing); otherwise fix model.init_checkpoint")
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, init_checkpoint=start))
    return train(cfg, fork=fork, progress=progress, engine_urls=engine_urls)


def evaluate(cfg: RelaxConfig, checkpoint: str = "", limit: int | None = None) -> EvalReport:
    """Greedy held-out accuracy of ``checkpoint`` (a checkpoint folder; "" = the initial policy,
    i.e. ``cfg.model.init_checkpoint`` when set) on the snapshot's eval split, ``limit`` per task."""
    ctx = RunContext(cfg)
    check_trainable(ctx, teacher=False)  # a text model on image/audio tasks fails here, naming the fix
    source = checkpoint or cfg.model.init_checkpoint
    model, processor = checkpoint_policy(ctx, source) if source else build_model(ctx)  # LoRA: merged on its base
    model.eval()
    r = cfg.rollout
    report = evaluate_policy(model, ctx.tokenizer, processor, per_task_limit(ctx.split("eval"), limit),
                             media_loader=ctx.snapshot.load_media, reward_fn=cfg.data.reward_fn,
                             max_new_tokens=r.max_new_tokens, max_turns=r.max_turns, stop=r.stop,
                             max_seq_len=cfg.model.max_seq_len, seed=cfg.seed)
    report.checkpoint = checkpoint
    return report


def lineage(cfg: RelaxConfig, run_id: str | None = None) -> dict:
    """The run's newest checkpoint and its ancestors (across runs): records, text and an SVG graph."""
    records = chain(cfg.root, run_id or cfg.run_id)
    return {"records": chain_to_json(records), "chain_text": chain_to_text(records), "svg": render_svg(records)}


def latest_checkpoint(root: str, exclude_run: str = "") -> str:
    """The newest checkpoint of any run under ``root`` (by lineage record time), "" if none:
    where a scheduled retraining starts from."""
    newest = None
    for run in list_runs(root):
        if run == exclude_run:
            continue
        for record in list_records(root, run):
            if newest is None or record.created_at > newest.created_at:
                newest = record
    return str(newest.extra.get("checkpoint_url", "")) if newest is not None else ""


@dataclass
class PipelineResult:
    """What :func:`run` produced: the data, the scores before and after RL, the run and its lineage."""

    snapshot: SnapshotInfo
    before: EvalReport
    after: EvalReport
    train: TrainSummary
    lineage_text: str = ""
    start: str = ""  # the checkpoint RL started from ("" = the model as built)


def run(cfg: RelaxConfig, progress: bool = True, eval_limit: int | None = None) -> PipelineResult:
    """The whole pipeline in this process, as the ``omni_rl`` workflow runs it: snapshot, warm start,
    evaluate, train, evaluate, lineage. Rerunning resumes (every step is idempotent on the root)."""
    cfg = dataclasses.replace(cfg, root=objstore.absolute_url(cfg.root))
    info = snapshot(cfg)
    start = warm_start(cfg, info.id) or cfg.model.init_checkpoint
    before = evaluate(cfg, start, limit=eval_limit)
    summary = train_run(cfg, init_checkpoint=start, progress=progress)
    after = evaluate(cfg, summary.checkpoint, limit=eval_limit)
    write_accuracy(summary.report_dir, before, after)
    write_report(summary.run_url, tensorboard="tensorboard" in cfg.report.trackers)  # now with held-out accuracy
    return PipelineResult(info, before, after, summary, chain_to_text(chain(cfg.root, cfg.run_id)), start)
