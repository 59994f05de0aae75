"""Retrain a finished (or crashed) run's actor steps from one of its checkpoints, and compare.

``relax replay ROOT RUN --retrain FROM`` copies what the actor needs (the dataset snapshot,
the queue, the weight store, checkpoint FROM and the lineage up to it) into a scratch root,
resumes an :class:`~relax.services.roles.actor.ActorRole` there and lets it take the recorded
steps FROM+1.. again: the consumer group hands back exactly the samples each step trained
on, so on CPU every step's loss and gradient norm must equal the recorded ones, and the
weights after the last step must equal the published version, bit for bit. Where they do
not, the run was not reproducible; where they do, each step's per-term metrics
(``pg_token_max``, ``kl_topk_token_max``, ``kl_sampled_token_max``, ``is_weight_max``) say which
loss term made a spike, for any step of the run, without having logged it then. The source
root is only read.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from relax import objstore
from relax.config import ConfigError, config_from_dict, saved_config
from relax.services.report.metrics import read_metrics
from relax.services.roles.actor import ActorRole, checkpoint_name
from relax.services.roles.factory import role_threads
from relax.services.run_context import RunContext
from relax.transfer.lineage import record_url
from relax.transfer.weights import WeightStore

# the per-step figures shown beside the recorded ones: which loss term made the step's gradient
TERM_METRICS = ("pg_token_max", "kl_topk_token_max", "kl_sampled_token_max", "distill_topk_kl_token_max",
                "is_weight_max", "kept_frac")


@dataclass
class StepComparison:
    step: int
    loss: float
    grad_norm: float
    recorded_loss: float | None  # None: the run's metrics have no row for the step
    recorded_grad_norm: float | None
    terms: dict[str, float]

    @property
    def same(self) -> bool:
        return _equal(self.loss, self.recorded_loss) and _equal(self.grad_norm, self.recorded_grad_norm)


def _equal(a: float, b: float | None) -> bool:
    return b is not None and (a == b or (math.isnan(a) and math.isnan(b)))  # a skipped step's NaN norm, both times


@dataclass
class WeightComparison:
    version: int
    identical: bool
    max_abs_diff: float
    worst_tensor: str


def copy_for_retrain(root: str, run_id: str, from_step: int, into: str) -> None:
    """Copy what resuming at checkpoint ``from_step`` of run ``run_id`` (its run.json checked by
    the caller) reads into the local folder ``into``."""
    src = objstore.absolute_url(root)
    run = objstore.join(src, "runs", run_id)
    name = checkpoint_name(from_step)
    if not (objstore.exists(objstore.join(run, "checkpoints", name, "meta.json"))
            and objstore.exists(record_url(src, run_id, name))):
        have = [n for n in objstore.list_dir(objstore.join(run, "checkpoints")) if n.startswith("step-")]
        raise ConfigError(f"run {run_id!r} has no complete checkpoint at step {from_step}; "
                          f"retrain from one of {sorted(have) or 'none'}")
    fs, _ = objstore.open_fs(src)
    dst = objstore.join(objstore.absolute_url(into), "runs", run_id)

    def get(url: str, to: str) -> None:
        _, path = objstore.open_fs(url)
        _, target = objstore.open_fs(to)
        fs.get(path, target, recursive=True)

    get(objstore.join(src, "datasets"), objstore.join(objstore.absolute_url(into), "datasets"))
    for part in ("queue", "weights"):
        get(objstore.join(run, part), objstore.join(dst, part))
    get(objstore.join(run, "checkpoints", name), objstore.join(dst, "checkpoints", name))
    objstore.write_bytes(objstore.join(dst, "run.json"), objstore.read_bytes(objstore.join(run, "run.json")))
    record = record_url(src, run_id, name)  # the resume point's record; later ones the retrain writes again
    objstore.write_bytes(record_url(into, run_id, name), objstore.read_bytes(record))


class Retrain:
    """Resume a copy of run ``run_id`` at checkpoint ``from_step`` (``copy_for_retrain`` into the
    local folder ``into``) and retrain its recorded steps up to ``to_step`` (default: the last).
    ``steps()`` yields each step against its record; afterwards ``weights`` compares the final
    weights with the run's published version (None when retention deleted that version)."""

    def __init__(self, root: str, run_id: str, from_step: int, into: str, to_step: int | None = None):
        src_run = objstore.join(objstore.absolute_url(root), "runs", run_id)
        if not objstore.exists(objstore.join(src_run, "run.json")):
            raise ConfigError(f"no run {run_id!r} under {root} (no run.json); check the root and run id")
        config = json.loads(objstore.read_bytes(objstore.join(src_run, "run.json")))["config"]
        self.recorded = {m["step"]: m for m in read_metrics(src_run, "actor")}
        last = max(self.recorded, default=from_step)
        self.to_step = last if to_step is None else to_step
        if not from_step < self.to_step <= last:
            raise ConfigError(f"retrain to step {self.to_step}: the run recorded actor steps up to {last}; "
                              f"choose a step in {from_step + 1}..{last}")
        copy_for_retrain(root, run_id, from_step, into)
        cfg = config_from_dict(saved_config(config))
        cfg.root = objstore.absolute_url(into)
        self.store = WeightStore(root, run_id)  # the source's: the copy's retention may delete versions
        if cfg.topology != "colocated":  # colocated, the actor ran with torch's default thread count
            torch.set_num_threads(role_threads("actor", cfg))
        self.role = ActorRole(RunContext(cfg))
        self.weights: WeightComparison | None = None

    def steps(self) -> Iterator[StepComparison]:
        role = self.role
        try:
            while role.step_index <= self.to_step:
                m = role.step()
                rec = self.recorded.get(m["step"], {})
                yield StepComparison(m["step"], m["loss"], m["grad_norm"], rec.get("loss"), rec.get("grad_norm"),
                                     {k: m[k] for k in TERM_METRICS if k in m})
            self.weights = compare_weights(self.store, role.version, role.ranks.call("weights", role.version == 0))
        finally:
            role.close()


def compare_weights(store: WeightStore, version: int, state: dict[str, Any]) -> WeightComparison | None:
    """The retrained weights against the run's published ``version``; None if retention deleted it."""
    if version not in store.versions():
        return None
    published, _ = store.load(version)
    worst, name = 0.0, ""
    for key, tensor in state.items():
        diff = float((tensor.detach().float() - published[key].float()).abs().max()) if tensor.numel() else 0.0
        if diff > worst or (diff != diff):
            worst, name = diff, key
    identical = published.keys() == state.keys() and all(torch.equal(state[k], published[k]) for k in state)
    return WeightComparison(version, identical, worst, name)
