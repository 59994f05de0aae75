"""The checks of a config against what a run built from it: the dataset's rows, vocabularies, the model's layout.

``relax.config.preflight`` checks the environment before anything is built; these need what the
layers above build first (the snapshot's rows, the tokenizers, the model's Hugging Face config),
and take it as plain values, so the checks themselves stay here with every other config check.
``relax.services.trainable`` builds those values and calls them.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from relax.config.fields import ConfigError
from relax.config.model import AUDIO_FAMILIES, IMAGE_FAMILIES


def check_rows(cfg: Any, rows: Sequence[Any], engine_urls: list[str] | None = None, *,
               agent_tasks: Collection[str] = ()) -> None:
    """The training rows (``.task``, ``.images``, ``.audios``, ``.videos``) are ones the configured
    model, trainer and engines take. ``agent_tasks``: the tasks whose episodes run in an env."""
    family = cfg.model.family
    for kind, has, families in (("images", lambda s: s.images, IMAGE_FAMILIES),
                                ("audio", lambda s: s.audios, AUDIO_FAMILIES),
                                ("videos", lambda s: s.videos, IMAGE_FAMILIES)):
        tasks = sorted({s.task for s in rows if has(s)})
        if tasks and family not in families:
            raise ConfigError(f"tasks {tasks} carry {kind}, but model.family={family!r} takes none; use a "
                              f"family in {list(families)} (e.g. model.name_or_path=tiny-omni "
                              f"model.family=qwen2_5_omni) or drop those tasks")
    if cfg.data.reward_role:
        agents = sorted({s.task for s in rows if s.task in agent_tasks})
        if agents:
            raise ConfigError(f"data.reward_role=true: tasks {agents} are agent episodes whose reward comes from "
                              f"their env during the rollout; drop them or set data.reward_role=false")
    media = sorted({s.task for s in rows if s.images or s.audios or s.videos})
    if media and cfg.trainer.backend != "torch":
        raise ConfigError(f"tasks {media} carry images/audio; trainer.backend={cfg.trainer.backend!r} "
                          f"trains text only, use trainer.backend=torch")
    videos = sorted({s.task for s in rows if s.videos})
    r = cfg.rollout
    if videos and (engine_urls or r.engine_processes > 0 or r.engine == "sglang"):
        raise ConfigError(f"tasks {videos} carry videos, which only the in-process native engine takes yet (HTTP "
                          f"engines are sent images and audio): use rollout.engine=native with "
                          f"rollout.engine_processes=0 and no --engine-url")


def check_served_teacher_rows(cfg: Any, rows: Sequence[Any]) -> None:
    """teacher.url scores token ids alone: text rows only."""
    media = next((s for s in rows if s.images or s.audios or s.videos), None)
    if cfg.teacher.url and media is not None:
        raise ConfigError(f"teacher.url={cfg.teacher.url} scores token ids only, and training row {media.id!r} "
                          f"({media.task}) carries media: distil media tasks from a local teacher "
                          f"(teacher.name_or_path)")


def check_teacher_vocab(cfg: Any, teacher_vocab: dict[str, int], student_vocab: dict[str, int]) -> None:
    """On-policy distillation compares log-probs token by token: one vocabulary (same tokens, same ids)."""
    t, m = cfg.teacher, cfg.model
    if teacher_vocab != student_vocab:
        raise ConfigError(f"teacher.tokenizer={t.tokenizer!r} ({len(teacher_vocab)} tokens) is not the student's "
                          f"model.tokenizer={m.tokenizer!r} ({len(student_vocab)} tokens): distillation compares the "
                          f"two models token by token, so they need one vocabulary; use a teacher trained "
                          f"with the student's tokenizer")


def check_served_vocab(cfg: Any, served: int | None, student: int) -> None:
    """The server at teacher.url knows every id the student emits."""
    if served is not None and served < student:
        raise ConfigError(f"teacher.url={cfg.teacher.url} serves a {served}-token vocabulary and the student's "
                          f"tokenizer has {student} tokens: serve the teacher with the student's tokenizer")


def check_megatron_layout(cfg: Any, layout: Any, tp_problem: str | None, *, cuda: bool) -> None:
    """The trainer's tensor/pipeline/expert sizes divide the model (``layout``: its ``num_layers`` and
    ``num_experts``; ``tp_problem``: why its heads, query groups or vocabulary do not split tensor_parallel
    ways, or None), checked before any process group starts."""
    t = cfg.trainer
    if tp_problem:
        raise ConfigError(f"trainer.tensor_parallel={t.tensor_parallel} does not divide this model: {tp_problem}")
    if layout.num_layers % t.pipeline_parallel:
        raise ConfigError(f"trainer.pipeline_parallel={t.pipeline_parallel} does not divide the model's "
                          f"{layout.num_layers} layers: choose a divisor of {layout.num_layers}")
    if layout.num_experts and t.pipeline_parallel > 1 and not cuda:
        raise ConfigError(f"trainer.pipeline_parallel={t.pipeline_parallel} with an MoE model needs megatron's "
                          f"alltoall token dispatcher, which needs CUDA: use pipeline_parallel=1 on a CPU")
    if t.expert_parallel > 1 and (not layout.num_experts or layout.num_experts % t.expert_parallel):
        raise ConfigError(f"trainer.expert_parallel={t.expert_parallel} splits an MoE model's experts and this "
                          f"model has {layout.num_experts} per layer: use an MoE family (qwen2_moe, qwen3_moe) "
                          f"whose expert count it divides, or expert_parallel=1")
    if layout.num_experts and t.tensor_parallel > 1:  # megatron trains MoE + TP only with sequence parallel
        raise ConfigError(f"trainer.tensor_parallel={t.tensor_parallel} with an MoE model needs megatron's "
                          f"sequence parallelism, which the actor does not run yet (docs/megatron.md): use "
                          f"tensor_parallel=1 with data_parallel")
