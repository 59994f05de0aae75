"""``RunContext``: the handles every role of a run shares: its URLs, dataset snapshot, tokenizer, queues.

Handles only: what a run records (``run.json``) is ``relax.services.run_record``'s, the policy
model is built by ``relax.services.policy``, and the checks before a run starts are
``relax.services.trainable``'s (over ``relax.config``'s preflight and fit checks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from relax import objstore
from relax.config import RelaxConfig
from relax.config.weights import effective_full_every
from relax.data.snapshot import Snapshot
from relax.data.sources import snapshot_from_config
from relax.services.queue_contract import ROLLOUT_TOPIC
from relax.transfer.queue import TransferQueue
from relax.transfer.weights import WeightStore


@dataclass
class RunContext:
    cfg: RelaxConfig
    _splits: dict[str, list] = field(default_factory=dict, repr=False)

    @property
    def root(self) -> str:
        return objstore.absolute_url(self.cfg.root)

    @property
    def run_url(self) -> str:
        return objstore.join(self.root, "runs", self.cfg.run_id)

    # -- data and model ---------------------------------------------------------------------
    @cached_property
    def snapshot_info(self):
        return snapshot_from_config(self.cfg.data, self.root)

    @cached_property
    def snapshot(self) -> Snapshot:
        return Snapshot(self.snapshot_info.url)

    def split(self, name: str) -> list:
        """A snapshot split, read and checksummed once per context (the roles of a colocated run share it)."""
        if name not in self._splits:
            self._splits[name] = list(self.snapshot.samples(name))
        return self._splits[name]

    # relax.models (torch, transformers: ~4 s) is imported where a model is built, so processes that only
    # read the store (`relax status`, the CLI's start-up) stay light
    @cached_property
    def tokenizer(self):
        from relax.models import build_tokenizer

        return build_tokenizer(self.cfg.model.tokenizer)

    @cached_property
    def processor(self):
        """The model's media processor (None for text models), from its config alone: a rollout
        with remote engines expands media placeholders itself and builds no weights."""
        from relax.models import build_processor

        return build_processor(self.cfg.model, self.tokenizer)

    # -- transfer ---------------------------------------------------------------------------
    def queue(self, **kwargs: Any) -> TransferQueue:
        return TransferQueue.from_config(self.cfg, ROLLOUT_TOPIC, **kwargs)

    def weights(self) -> WeightStore:
        w = self.cfg.weights
        return WeightStore(self.cfg.root, self.cfg.run_id, fsync=self.cfg.queue.fsync, max_shard_bytes=w.shard_mb << 20,
                           full_every=effective_full_every(self.cfg), threads=w.transfer_threads)

    @property
    def batch_size(self) -> int:
        return self.cfg.rollout.prompts_per_step * self.cfg.rollout.n_samples_per_prompt
