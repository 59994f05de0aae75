"""The trainer section of the config (``trainer``): optimisation, parallel layout, checkpoints.

Beside it, the checks that read only this section: a layout the chosen backend would not honour is
refused before any work starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from relax.config.fields import ConfigError, opt

MEGATRON_FAMILIES = ("qwen2", "qwen3", "llama", "qwen2_moe", "qwen3_moe")
PARALLEL_FIELDS = ("tensor_parallel", "pipeline_parallel", "context_parallel", "expert_parallel")


@dataclass
class TrainerConfig:
    """Optimisation and checkpoints."""

    backend: str = opt("torch", "Training backend.", choices=("torch", "megatron"))
    lr: float = opt(1e-3, "Peak learning rate (AdamW).", range=(0.0, 1.0))
    weight_decay: float = opt(0.0, "AdamW weight decay.", range=(0.0, 1.0))
    warmup_steps: int = opt(5, "Linear warm-up steps.", range=(0, 10_000_000))
    total_steps: int = opt(100, "RL steps in the run.", range=(1, 100_000_000))
    grad_clip: float = opt(1.0, "Max global gradient norm; 0 disables clipping.", range=(0.0, 1e6))
    micro_batch_tokens: int = opt(4096, "Token budget of one micro-batch (pads included).", range=(16, 1 << 30))
    micro_batch_layout: str = opt("pack", "'pack': samples concatenated padding-free with per-sample attention; "
                                  "'bucket': sorted by length, then padded; 'pad': input order, padded; 'prefix': "
                                  "each prompt group's shared prompt and media run once, its responses attend to it "
                                  "through a KV cache (docs/runtime.md; the critic uses 'bucket').",
                                  choices=("pack", "bucket", "pad", "prefix"))
    lr_schedule: str = opt("constant", "After warm-up: constant, or cosine down to 10% at total_steps.",
                           choices=("constant", "cosine"))
    nan_policy: str = opt("skip", "A non-finite loss or gradient: 'skip' the step (logged with the sample ids) "
                          "or 'fail' the run.", choices=("skip", "fail"))
    sft_lr: float = opt(3e-3, "Learning rate of the format warm-start (sft_steps).", range=(0.0, 1.0))
    sft_steps: int = opt(
        0, "Supervised warm-start steps teaching the answer format; 0 skips it.", range=(0, 10_000_000)
    )
    sft_batch_size: int = opt(64, "Demonstrations per format warm-start step (a prompt comes with several random "
                              "answers); fewer make each step cheaper, as for video prompts.", range=(1, 100_000))
    mini_batches: int = opt(1, "Optimizer steps per rollout batch (PPO mini-batches): the batch is split into this "
                            "many equal parts, each one update.", range=(1, 1024))
    critic_lr: float = opt(0.0, "Peak learning rate of the critic (advantage=gae); 0 = trainer.lr. The critic "
                           "shares the actor's warm-up, schedule, clipping and micro-batching.", range=(0.0, 1.0))
    freeze_encoders: list[str] = opt(
        [], "Media encoders held fixed during RL: 'vision' and/or 'audio' (the policy's visual / audio_tower "
        "modules). The LM still learns to read their features (docs/models.md).")
    thaw_encoders_at: int = opt(
        0, "RL step at which the encoders in freeze_encoders start training (gradual unfreezing, docs/models.md); "
        "0, or a step at or past total_steps, keeps them frozen for the whole run. Ignored when freeze_encoders is "
        "empty.", range=(0, 100_000_000))
    thaw_lr_scale: float = opt(
        1.0, "Multiplier of lr for thawed encoders, on top of encoder_lr_scale.", range=(0.0, 1000.0))
    thaw_warmup_steps: int = opt(
        0, "RL steps over which a thawed encoder's lr rises linearly from 0 to its full value, starting at "
        "thaw_encoders_at (docs/models.md); 0 = full at once.", range=(0, 100_000_000))
    encoder_lr_scale: float = opt(
        1.0, "Multiplier of lr for the media encoders' parameters (the policy's visual / audio_tower modules, "
        "docs/models.md).", range=(0.0, 1000.0))
    ppo_epochs: int = opt(1, "Passes over each rollout batch (each pass makes mini_batches updates).", range=(1, 64))
    checkpoint_every: int = opt(20, "Save a checkpoint every k steps.", range=(1, 100_000_000))
    data_parallel: int = opt(1, "Data-parallel processes (gloo on CPU, NCCL on GPU).", range=(1, 100_000))
    tensor_parallel: int = opt(1, "Megatron tensor parallelism.", range=(1, 1024))
    pipeline_parallel: int = opt(1, "Megatron pipeline parallelism.", range=(1, 1024))
    context_parallel: int = opt(1, "Megatron context parallelism: each of these ranks holds a zigzag share of every "
                                   "sequence (attention all-gathers keys and values).", range=(1, 1024))
    expert_parallel: int = opt(1, "Megatron expert parallelism: each MoE layer's experts split over this many "
                                  "data-parallel ranks; must divide data_parallel and the experts.", range=(1, 1024))
    distributed_optimizer: bool = opt(
        False,
        "Megatron backend: step with megatron-core's DistributedOptimizer, each "
        "data-parallel rank keeping the AdamW moments of its slice of the weights.",
    )
    checkpoint_format: str = opt("gathered", "How the actor writes checkpoints: 'gathered' (one file by Hugging Face "
                                 "name, written by rank 0) or 'sharded' (Megatron backend: each model-parallel rank "
                                 "writes its own part).", choices=("gathered", "sharded"))

    @property
    def actor_processes(self) -> int:
        """Processes of the actor: data x tensor x pipeline x context parallel (expert parallel splits the
        data-parallel ranks' experts, so it adds none)."""
        return self.data_parallel * self.tensor_parallel * self.pipeline_parallel * self.context_parallel


def check_freeze_encoder_names(cfg: Any) -> None:
    unknown = sorted(set(cfg.trainer.freeze_encoders) - {"vision", "audio"})
    if unknown:
        raise ConfigError(f"trainer.freeze_encoders: unknown encoder(s) {unknown}; use 'vision' and/or 'audio'")


def check_torch_backend_options(cfg: Any) -> None:
    """Megatron's settings would be ignored by the torch backend."""
    t = cfg.trainer
    if t.backend != "torch":
        return
    bigger = {name: getattr(t, name) for name in PARALLEL_FIELDS if getattr(t, name) > 1}
    if bigger:
        raise ConfigError(f"trainer.{next(iter(bigger))}={next(iter(bigger.values()))} is a Megatron layout; the "
                          f"torch backend would ignore it: set trainer.backend=megatron or remove it")
    if t.distributed_optimizer:
        raise ConfigError("trainer.distributed_optimizer=true is megatron-core's optimizer; the torch backend would "
                          "ignore it: set trainer.backend=megatron or remove it")
    if t.checkpoint_format == "sharded":
        raise ConfigError("trainer.checkpoint_format=sharded writes megatron's model-parallel parts; the torch "
                          "backend's ranks hold whole replicas: set trainer.checkpoint_format=gathered or "
                          "trainer.backend=megatron")


def check_megatron_parallel_options(cfg: Any) -> None:
    """Parallel combinations the Megatron actor does not run."""
    t = cfg.trainer
    if t.backend != "megatron":
        return
    if t.context_parallel > 1 and t.expert_parallel > 1:
        raise ConfigError(f"trainer.context_parallel={t.context_parallel} with expert_parallel={t.expert_parallel}: "
                          f"the Megatron actor splits sequences at expert_parallel=1 only (docs/megatron.md); set "
                          f"one of them to 1")
    if t.expert_parallel > 1 and t.data_parallel % t.expert_parallel:
        raise ConfigError(f"trainer.expert_parallel={t.expert_parallel} splits the experts over data-parallel ranks "
                          f"and must divide trainer.data_parallel={t.data_parallel}: raise data_parallel to a "
                          f"multiple of it")
    if t.expert_parallel > 1 and t.pipeline_parallel > 1:
        raise ConfigError(f"trainer.expert_parallel={t.expert_parallel} with pipeline_parallel="
                          f"{t.pipeline_parallel}: expert-parallel ranks run their micro-batches in lockstep, "
                          f"which megatron's pipeline schedule does not do here; use pipeline_parallel=1")
    if t.micro_batch_layout == "prefix":
        raise ConfigError("trainer.micro_batch_layout=prefix shares a prompt's positions between responses, which "
                          "megatron's GPTModel cannot take: use pack, bucket or pad with trainer.backend=megatron")


def check_freeze_needs_torch(cfg: Any) -> None:
    if cfg.trainer.freeze_encoders and cfg.trainer.backend != "torch":
        raise ConfigError("trainer.freeze_encoders is supported by the torch backend only; "
                          "set trainer.backend=torch or remove it")


def check_thaw_single_rank(cfg: Any) -> None:
    t = cfg.trainer
    if t.thaw_encoders_at and t.freeze_encoders and t.data_parallel > 1:
        raise ConfigError("trainer.thaw_encoders_at needs trainer.data_parallel=1: DDP fixes the parameters it "
                          "synchronises when it wraps the model, so a thawed encoder would drift apart per rank")
