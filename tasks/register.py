"""Register a run's final checkpoint: a Flyte Artifact, a Deck, and the workflow's result.

* The checkpoint is returned as a ``FlyteDirectory`` annotated with the ``relax_checkpoint``
  Artifact, partitioned by model, dataset snapshot and run, so a Flyte backend with the artifact
  service can find "the newest checkpoint of model M on dataset D" (``RelaxCheckpoint.query(...)``).
  The directory is not copied: Flyte records the URL where relax wrote it (a local path or a
  bucket), so the artifact and the lineage records name the same object.
* Local runs record no artifacts (local execution has no artifact service); relax's own lineage records are the local
truth,
  and the result carries the chain.
* The Deck shows the reward curves, the lineage graph and the before/after accuracy table; the
  same table is printed, so ``make run`` shows it on the terminal.
* The lineage also goes to the configured trackers (``report.trackers``: the checkpoint as an MLflow
  model version, a W&B artifact), where it can be queried without Flyte's artifact service.
"""

from __future__ import annotations

import base64
import html
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Annotated, Any, NamedTuple

from flytekit import Artifact, Deck, Resources, task
from flytekit.types.directory import FlyteDirectory

from relax import objstore, pipeline
from relax.config import RelaxConfig
from relax.data.snapshot import SnapshotInfo
from relax.pipeline import EvalReport, TrainSummary
from relax.services.report.accuracy import write_accuracy
from relax.services.report.metrics import write_report
from relax.services.run_context import RunContext
from relax.services.trackers.feed import sync_run
from tasks.image import task_image

RelaxCheckpoint = Artifact(name="relax_checkpoint", partition_keys=["model", "dataset", "run"])


@dataclass
class LineageStep:
    """One checkpoint of the chain; ``parent`` is ``run/checkpoint`` or "" for the first."""

    run_id: str = ""
    checkpoint: str = ""
    step: int = 0
    dataset_snapshot: str = ""
    parent: str = ""
    samples: int = 0


@dataclass
class Lineage:
    """The dataset snapshot -> samples -> checkpoint chain of a run, newest checkpoint first."""

    head: str = ""
    chain_text: str = ""
    steps: list[LineageStep] = field(default_factory=list)


@dataclass
class OmniRLResult:
    """What ``omni_rl`` returns: the data it trained on, the scores before and after, the checkpoint."""

    snapshot: SnapshotInfo
    eval_before: EvalReport
    eval_after: EvalReport
    train: TrainSummary
    checkpoint: FlyteDirectory
    lineage: Lineage

    def __str__(self) -> str:
        # pyflyte run ends a local run with click.echo(result): the dataclass repr (every eval
        # confusion count, every lineage step) ran to pages, so print what a user reads instead
        return "\n".join([
            f"run {self.train.run_id}: {self.train.steps} actor steps on data {self.snapshot.id}, "
            f"training reward {self.train.reward_first:.3f} -> {self.train.reward_last:.3f}",
            self.eval_after.table(self.eval_before),
            f"checkpoint: {self.checkpoint.path}",
            f"curves and metrics: {self.train.report_dir}",
            f"lineage: {len(self.lineage.steps)} checkpoint{'' if len(self.lineage.steps) == 1 else 's'}, "
            f"newest {self.lineage.head}",
        ])


class Registered(NamedTuple):
    """The register task's outputs: the checkpoint as an Artifact, and the workflow's result."""

    checkpoint: Annotated[FlyteDirectory, RelaxCheckpoint]
    result: OmniRLResult


def lineage_from_graph(raw: dict[str, Any]) -> Lineage:
    """``pipeline.lineage``'s graph (``chain_to_json``: nodes oldest first) as typed steps, newest first."""
    steps = []
    for node in reversed(raw["records"]["nodes"]):
        if node["kind"] != "checkpoint":
            continue
        parent = node.get("parent") or {}
        steps.append(LineageStep(
            run_id=node["run_id"], checkpoint=node["checkpoint"], step=node["step"],
            dataset_snapshot=node["dataset_snapshot"], samples=node["sample_count"],
            parent=f"{parent['run_id']}/{parent['checkpoint']}" if parent else ""))
    return Lineage(head=raw["records"]["head"] or "", chain_text=raw["chain_text"], steps=steps)


def deck_html(before: EvalReport, after: EvalReport, curves_png: bytes | None, lineage_svg: str,
              summary: TrainSummary) -> str:
    """The Deck page: run summary, accuracy table, reward curves (inline PNG) and lineage graph (SVG)."""
    parts = [f"<h3>Run {html.escape(summary.run_id)}: {summary.steps} steps, reward "
             f"{summary.reward_first:.3f} &rarr; {summary.reward_last:.3f}</h3>",
             f"<p>checkpoint <code>{html.escape(summary.checkpoint)}</code></p>",
             f"<h4>Accuracy before / after</h4><pre>{html.escape(after.table(before))}</pre>"]
    if curves_png:
        parts.append('<h4>Reward curves</h4><img alt="reward curves" src="data:image/png;base64,'
                     f'{base64.b64encode(curves_png).decode()}"/>')
    if lineage_svg:
        parts.append(f"<h4>Lineage</h4>{lineage_svg}")
    return "\n".join(parts)


def _read_optional(url: str) -> bytes | None:
    return objstore.read_bytes(url) if url and objstore.exists(url) else None


def checkpoint_dir(url: str) -> FlyteDirectory:
    """The checkpoint where relax wrote it: a local path (file:// stripped) or the bucket URL."""
    path = url[len("file://"):] if url.startswith("file://") else url
    return FlyteDirectory(path, remote_directory=False)


@task(enable_deck=True, retries=2, timeout=timedelta(hours=1), requests=Resources(cpu="1", mem="2Gi"),
      container_image=task_image())
def register(cfg: RelaxConfig, snapshot: SnapshotInfo, before: EvalReport, after: EvalReport,
             summary: TrainSummary) -> Registered:
    """Publish the final checkpoint as a ``relax_checkpoint`` Artifact, a Deck with curves, lineage and
    the accuracy table; print the table; return the checkpoint and the workflow result."""
    raw = pipeline.lineage(cfg, summary.run_id)
    lineage = lineage_from_graph(raw)
    table = after.table(before)
    print(f"run {summary.run_id}: {summary.steps} steps, checkpoint {summary.checkpoint}\n{table}", flush=True)
    if summary.report_dir:  # what `make check-readme` compares with the README's table
        write_accuracy(summary.report_dir, before, after)
        # the curves again, now with the held-out accuracy panel: the Deck shows what `relax report` writes
        write_report(summary.run_url, tensorboard="tensorboard" in cfg.report.trackers)
    curves = _read_optional(objstore.join(summary.report_dir, "curves.png")) if summary.report_dir else None
    Deck("Relax run", deck_html(before, after, curves, raw.get("svg", ""), summary))
    page = _read_optional(objstore.join(summary.report_dir, "report.html")) if summary.report_dir else None
    if page:
        Deck("Report", page.decode())
    # the lineage where users query it (MLflow's registry, W&B artifacts), which open-source Flyte's
    # backend cannot: the train task sent it already unless that tracker was down then; never fails the task
    sync_run(RunContext(cfg))
    ckpt = RelaxCheckpoint.create_from(checkpoint_dir(summary.checkpoint), model=cfg.model.name_or_path,
                                       dataset=snapshot.id, run=summary.run_id)
    result = OmniRLResult(snapshot=snapshot, eval_before=before, eval_after=after, train=summary,
                          checkpoint=ckpt, lineage=lineage)
    return Registered(checkpoint=ckpt, result=result)
