"""The one config tree of Relax (``RelaxConfig``), whose defaults are the ``tiny-cpu`` preset, and its checks.

The tree is a plain dataclass so it is also a Flyte task/workflow input. Its sections live in
modules of their own, each with the checks that read it alone; the checks that span sections are
``relax.config.cross``'s. :data:`CHECKS` runs them all, in one order, after every field's
``choices`` and ``range``; loading (presets, YAML, ``key=value`` overrides) is ``relax.config.loader``'s.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from relax.config import algorithm, cross, data, genrm, model, report, rollout, runtime, trainer
from relax.config.algorithm import AlgorithmConfig
from relax.config.data import DataConfig
from relax.config.fields import ConfigError, build, check_fields, opt, section
from relax.config.genrm import GenRMConfig
from relax.config.model import ModelConfig, TeacherConfig
from relax.config.report import ReportConfig
from relax.config.rollout import RolloutConfig
from relax.config.runtime import QueueConfig, ResourcesConfig, SupervisorConfig
from relax.config.trainer import TrainerConfig
from relax.config.weights import WeightsConfig


@dataclass
class RelaxConfig:
    """The whole run. ``relax config show`` prints it; docs/configuration.md lists every field."""

    run_id: str = opt("tiny-cpu", "Name of the run; the same run id resumes the run under <root>/runs/<run_id>.")
    root: str = opt("file://./.relax", "Where everything is kept: datasets, queues, weights, checkpoints, "
                    "lineage. Any fsspec URL (a folder, s3://bucket/prefix, gs://...).")
    seed: int = opt(0, "Seed for training and sampling.", range=(0, 2**63 - 1))
    topology: str = opt("colocated", "How roles are placed (docs/architecture.md).",
                        choices=("colocated", "async", "disaggregated"))
    model: ModelConfig = section(ModelConfig, "Policy model.")
    data: DataConfig = section(DataConfig, "Prompt data and the dataset snapshot.")
    rollout: RolloutConfig = section(RolloutConfig, "Generation.")
    algorithm: AlgorithmConfig = section(AlgorithmConfig, "RL algorithm.")
    teacher: TeacherConfig = section(TeacherConfig, "On-policy distillation's teacher.")
    genrm: GenRMConfig = section(GenRMConfig, "Generative reward model: a judge served by the reward role.")
    trainer: TrainerConfig = section(TrainerConfig, "Optimisation and checkpoints.")
    queue: QueueConfig = section(QueueConfig, "TransferQueue.")
    weights: WeightsConfig = section(WeightsConfig, "Policy versions in the WeightStore: deltas and transfer.")
    resources: ResourcesConfig = section(ResourcesConfig, "Cluster resources.")
    supervisor: SupervisorConfig = section(SupervisorConfig, "Role restarts and role logs.")
    report: ReportConfig = section(ReportConfig, "Experiment trackers (MLflow, W&B, TensorBoard).")

    @classmethod
    def from_json(cls, text: str) -> RelaxConfig:
        """Strict parse of a (partial) JSON config; ``pyflyte run ... --cfg file.json`` goes through here,
        so a typo in a key fails with the closest valid key instead of being dropped."""
        cfg = build(cls, json.loads(text), prefix="")
        validate(cfg)
        return cfg


WARM_START_RUN = "warm-start"  # the run id lineage gives format warm-starts (relax.transfer.lineage)
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # what becomes a path segment (as lineage names)


def check_run_id(cfg: Any) -> None:
    if cfg.run_id == WARM_START_RUN:
        raise ConfigError(f"run_id = {cfg.run_id!r} is where lineage names format warm-starts; choose another run_id")
    if not SAFE_NAME.fullmatch(cfg.run_id):
        raise ConfigError(f"run_id = {cfg.run_id!r} becomes a folder under <root>/runs/: use a name without '/' of "
                          f"letters, digits, '.', '_' or '-', starting with a letter or digit")


# every rule that spans fields, in the order they run: the first that fails names the fix
CHECKS: tuple[Callable[[Any], None], ...] = (
    check_run_id, runtime.check_gpu_budget, cross.check_gae_has_critic, trainer.check_freeze_encoder_names,
    trainer.check_torch_backend_options, cross.check_megatron_family, trainer.check_megatron_parallel_options,
    trainer.check_freeze_needs_torch, trainer.check_thaw_single_rank, cross.check_colocated_actor_ranks,
    cross.check_ranks_have_samples, data.check_one_reward_source, cross.check_near_miss_credit,
    data.check_judge_url, genrm.check_genrm, algorithm.check_reference_role, algorithm.check_turn_rewards,
    cross.check_exact_staleness,
    algorithm.check_conventions, cross.check_routing_replay,
    model.check_teacher_url, cross.check_remote_teacher_temperature, model.check_teacher_plain_http,
    cross.check_distillation, cross.check_overlong_buffer, algorithm.check_stuck_group_push,
    algorithm.check_kl_topk, cross.check_reward_role, cross.check_external_agents,
    rollout.check_agent_reward_range, rollout.check_max_episode_tokens, rollout.check_session_done_fn,
    rollout.check_gateway_port,
    rollout.check_engine_kind_options,
    cross.check_sglang_engine_gpus, rollout.check_engine_launcher, rollout.check_max_engine_processes,
    model.check_builtin_family, model.check_lora_targets, cross.check_lora, data.check_data_format,
    cross.check_partial_rollout_abort, data.check_snapshot, report.check_trackers,
)


def validate(cfg: RelaxConfig) -> None:
    """Every field's choices and range, then every rule that spans fields (:data:`CHECKS`)."""
    check_fields(cfg)
    for check in CHECKS:
        check(cfg)
