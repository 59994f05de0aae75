"""Config checks of the optional training modes: MoE routing replay (R3) and on-policy distillation.

Each mode needs settings beside it to mean anything; a mode that would be accepted and then
ignored, or a setting only a mode reads left set without it, is refused naming the field and
the way out (``relax.config_checks.cross_checks`` runs these).
"""

from __future__ import annotations

from typing import Any

from relax.config_errors import ConfigError

MOE_FAMILIES = ("qwen2_moe", "qwen3_moe")


def routing_replay_checks(cfg: Any) -> None:
    """algorithm.routing_replay needs an MoE model on full rows (megatron: one pipeline stage); engines record
    routes (the native one, or SGLang with --enable-return-routed-experts, which the launchers pass)."""
    if not cfg.algorithm.routing_replay:
        return
    t = cfg.trainer
    clash = [(cfg.model.family not in MOE_FAMILIES, f"model.family={cfg.model.family} (routes exist for "
              f"{'/'.join(MOE_FAMILIES)} only)"),
             (t.micro_batch_layout == "prefix", "trainer.micro_batch_layout=prefix (replay needs full rows)"),
             (t.backend == "megatron" and t.pipeline_parallel > 1,
              f"trainer.pipeline_parallel={t.pipeline_parallel} (megatron's schedule does not replay routes yet)")]
    found = [why for bad, why in clash if bad]
    if found:
        raise ConfigError(f"algorithm.routing_replay=true cannot run with {'; '.join(found)}: change those or set "
                          f"routing_replay=false")


def distill_checks(cfg: Any) -> None:
    """On-policy distillation needs a teacher, and a teacher needs distillation: neither is accepted and ignored."""
    a, teacher = cfg.algorithm, cfg.teacher.name_or_path
    if a.mode == "distill" and a.distill_coef == 0:
        raise ConfigError("algorithm.mode=distill trains on the distill term alone: set algorithm.distill_coef > 0 "
                          "(1.0 is the plain reverse KL)")
    if a.distill_coef > 0 and not teacher:
        raise ConfigError(f"algorithm.distill_coef={a.distill_coef:g} distils from a teacher: set teacher.name_or_path "
                          f"(a model folder or built-in name; teacher.checkpoint for trained weights)")
    if a.distill_topk and a.distill_coef == 0:
        raise ConfigError(f"algorithm.distill_topk={a.distill_topk} weights its KL to the teacher by "
                          f"algorithm.distill_coef, which is 0: set distill_coef > 0 or distill_topk=0")
    if teacher and a.distill_coef == 0:
        raise ConfigError(f"teacher.name_or_path={teacher!r} scores tokens nobody uses: set algorithm.distill_coef > 0 "
                          f"(and algorithm.mode=distill for distillation alone), or unset the teacher")
    if a.mode == "distill" and a.advantage == "gae":
        raise ConfigError("algorithm.mode=distill takes the distill term as the advantage: a critic (advantage=gae) "
                          "would train for nothing; use algorithm.advantage=grpo (unused in this mode)")
    if a.mode == "distill" and cfg.data.reward_role:
        raise ConfigError("algorithm.mode=distill trains without the reward, and data.reward_role=true gives it a "
                          "role of its own: set data.reward_role=false")
