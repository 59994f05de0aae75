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
              f"trainer.pipeline_parallel={t.pipeline_parallel} (megatron's schedule does not replay routes yet)"),
             (t.backend == "megatron" and t.context_parallel > 1,
              f"trainer.context_parallel={t.context_parallel} (the replayed routes are not split over context ranks)")]
    found = [why for bad, why in clash if bad]
    if found:
        raise ConfigError(f"algorithm.routing_replay=true cannot run with {'; '.join(found)}: change those or set "
                          f"routing_replay=false")


def distill_checks(cfg: Any) -> None:
    """On-policy distillation needs a teacher, and a teacher needs distillation: neither is accepted and ignored."""
    a, t = cfg.algorithm, cfg.teacher
    teacher = t.name_or_path or t.url
    if t.url:
        remote_teacher_checks(cfg)
    if a.mode == "distill" and a.distill_coef == 0:
        raise ConfigError("algorithm.mode=distill trains on the distill term alone: set algorithm.distill_coef > 0 "
                          "(1.0 is the plain reverse KL)")
    if a.distill_coef > 0 and not teacher:
        raise ConfigError(f"algorithm.distill_coef={a.distill_coef:g} distils from a teacher: set teacher.name_or_path "
                          f"(a model folder or built-in name; teacher.checkpoint for trained weights) or teacher.url")
    if a.distill_topk and a.distill_coef == 0:
        raise ConfigError(f"algorithm.distill_topk={a.distill_topk} weights its KL to the teacher by "
                          f"algorithm.distill_coef, which is 0: set distill_coef > 0 or distill_topk=0")
    if teacher and a.distill_coef == 0:
        raise ConfigError(f"teacher {teacher!r} scores tokens nobody uses: set algorithm.distill_coef > 0 "
                          f"(and algorithm.mode=distill for distillation alone), or unset the teacher")
    if a.mode == "distill" and a.advantage == "gae":
        raise ConfigError("algorithm.mode=distill takes the distill term as the advantage: a critic (advantage=gae) "
                          "would train for nothing; use algorithm.advantage=grpo (unused in this mode)")
    if a.mode == "distill" and cfg.data.reward_role:
        raise ConfigError("algorithm.mode=distill trains without the reward, and data.reward_role=true gives it a "
                          "role of its own: set data.reward_role=false")


def remote_teacher_checks(cfg: Any) -> None:
    """teacher.url: an http(s) engine server alone (no local model beside it), scoring at temperature 1 as
    SGLang's prompt log-probs are (relax.engines.native.scoring), so the rollout must sample at 1."""
    t = cfg.teacher
    if not t.url.startswith(("http://", "https://")):
        raise ConfigError(f"teacher.url={t.url!r} must be an http:// or https:// engine server URL")
    if t.name_or_path or t.checkpoint:
        raise ConfigError(f"teacher.url={t.url!r} serves the teacher, and teacher.name_or_path/checkpoint would build "
                          f"another one here: set one of them, not both")
    if cfg.rollout.temperature != 1.0:
        raise ConfigError(f"teacher.url scores tokens at temperature 1 (SGLang's prompt log-probs ignore the sampling "
                          f"temperature) but rollout.temperature={cfg.rollout.temperature:g}: sample at 1, or use a "
                          f"local teacher (teacher.name_or_path), which scores at the rollout's temperature")
    if t.url.startswith("http://") and not t.allow_plain_http and not _loopback(t.url):
        raise ConfigError(f"teacher.url={t.url!r} is plain http to another machine: the rows and RELAX_TEACHER_API_KEY "
                          f"would travel unencrypted. Use https://, or set teacher.allow_plain_http=true on a network "
                          f"you trust")


def _loopback(url: str) -> bool:
    import ipaddress
    from urllib.parse import urlsplit

    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
