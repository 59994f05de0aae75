"""Config sections of the runtime under the roles: the TransferQueue, cluster resources, supervision.

The tree (``relax.config.tree.RelaxConfig``) holds them as ``queue``, ``resources`` and
``supervisor``; beside them, the checks that read only these sections.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from relax.config.fields import ConfigError, opt


@dataclass
class QueueConfig:
    """The TransferQueue between roles (docs/transfer.md)."""

    max_staleness: int = opt(1, "Most policy versions a trained sample may lag; 0 = synchronous on-policy.",
                             range=(0, 1000))
    exact_staleness: bool = opt(
        False, "Generate batch k with policy version max(0, k - max_staleness) exactly, never a newer one already "
        "published, so a run is a function of its config and seed however fast each role runs (docs/runtime.md). "
        "Needs rollout.partial_rollout=wait.")
    poll_interval_s: float = opt(0.05, "First poll delay of a waiting consumer (or producer, or weight "
                                 "loader); later delays are a quarter of the time already waited, up to "
                                 "max_poll_interval_s. Across processes this is the put-to-visible latency.",
                                 range=(0.001, 60.0))
    max_poll_interval_s: float = opt(1.0, "Longest poll delay of a waiting consumer.", range=(0.001, 600.0))
    lease_timeout_s: float = opt(30.0, "A writer on another host with no heartbeat for this long is taken "
                                 "over (on the same host a dead pid is taken over at once).", range=(1.0, 86400.0))
    fsync: bool = opt(False, "fsync local queue writes so they survive a power loss (a process crash never "
                      "needs it; checksums catch torn shards either way).")
    keep_checkpoints: int = opt(3, "Checkpoints kept; shards only they reference are retained.", range=(1, 10_000))


@dataclass
class ResourcesConfig:
    """What the Ray cluster(s) get. On a laptop only num_cpus matters."""

    num_cpus: int = opt(2, "Logical CPUs of the local Ray cluster / the Ray head.", range=(1, 100_000))
    num_gpus: int = opt(0, "GPUs in all.", range=(0, 100_000))
    rollout_gpus: int = opt(0, "GPUs given to rollout engines.", range=(0, 100_000))
    actor_gpus: int = opt(0, "GPUs given to the actor (and critic/reference when colocated).", range=(0, 100_000))
    workers: int = opt(0, "Ray worker nodes beside the head (cluster runs).", range=(0, 100_000))
    cpus_per_worker: int = opt(4, "CPUs per Ray worker node.", range=(1, 100_000))
    gpus_per_worker: int = opt(0, "GPUs per Ray worker node.", range=(0, 1024))
    memory_gib: int = opt(8, "Memory per Ray node in GiB.", range=(1, 100_000))


@dataclass
class SupervisorConfig:
    """How the controller heals a run (docs/runtime.md, "Self-healing"): a role that dies is restarted
    with backoff and resumes from the queue and its checkpoint; a fault that repeats stops the run."""

    max_restarts: int = opt(
        3, "Restarts of one role within restart_window_s after which the run stops with that role's error; "
        "0 = never restart (any role failure stops the run).", range=(0, 10_000))
    restart_window_s: float = opt(600.0, "Seconds over which a role's restarts are counted against max_restarts.",
                                  range=(1.0, 10_000_000.0))
    backoff_s: float = opt(1.0, "Delay before a role's first restart in the window; each further restart "
                           "doubles it, up to backoff_max_s.", range=(0.0, 3600.0))
    backoff_max_s: float = opt(30.0, "Longest delay before a restart.", range=(0.0, 86400.0))
    hang_timeout_s: float = opt(
        900.0, "A role with no progress for this long (waiting for input counts as progress) is killed and "
        "restarted like one that died; 0 = never. make run's longest gap is 4.2 s (docs/runtime.md, Hung roles).",
        range=(0.0, 86400.0 * 7))
    heartbeat_s: float = opt(5.0, "How often a role publishes its last progress to runs/<id>/heartbeats/ "
                             "(one small write each; `relax status` shows it).", range=(0.05, 3600.0))
    log_max_mb: float = opt(64.0, "A role's log file (runs/<id>/logs/<role>/<attempt>.log) rotates past this "
                            "size.", range=(0.01, 1_000_000.0))
    log_backups: int = opt(2, "Rotated files kept per attempt (<attempt>.log.1 is the newest).", range=(0, 100))


def check_gpu_budget(cfg: Any) -> None:
    r = cfg.resources
    if r.rollout_gpus + r.actor_gpus > r.num_gpus:
        raise ConfigError(
            f"resources.rollout_gpus ({r.rollout_gpus}) + resources.actor_gpus ({r.actor_gpus}) exceed "
            f"resources.num_gpus ({r.num_gpus}); raise num_gpus or lower the role GPUs"
        )
