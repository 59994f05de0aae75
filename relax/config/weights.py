"""The weights section of the config (``weights``): how policy versions are stored and moved.

Read by ``relax.services.run_context.RunContext.weights`` (the WeightStore every role opens) and
by the engines' loads (``relax.transfer.weight_updates``); docs/weight_sync.md explains the choices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from relax.config.fields import opt


@dataclass
class WeightsConfig:
    """Policy versions in the WeightStore (docs/weight_sync.md)."""

    full_every: int = opt(
        8, "A full weight version at least every this many versions; those between are stored as exact deltas from "
        "the version before when that is fewer bytes (1 = every version full). SGLang engines loading from disk "
        "always get full versions.", range=(1, 1_000_000))
    shard_mb: int = opt(512, "Largest weight file in MiB: a version is split into files of at most this size, "
                        "written and read concurrently.", range=(1, 1 << 20))
    transfer_threads: int = opt(8, "Weight files (and S3 parts) moved at once by one publish or load.",
                                range=(1, 256))


def effective_full_every(cfg: Any) -> int:
    """``weights.full_every``, or 1 where some engine reads whole folders (SGLang's disk load)."""
    r = cfg.rollout
    return 1 if r.engine == "sglang" and r.weight_sync == "disk" else cfg.weights.full_every
