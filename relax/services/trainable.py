"""``check_trainable(ctx)``: before any role starts, the config is checked against everything the run would meet.

The extension points import (``data.reward_fn``, ``rollout.env_fn``); then the config's
:func:`~relax.config.preflight.preflight` (the environment: folders, packages, GPUs, tokens;
nothing written yet); then the checks that need what this layer builds: the tokenizers, the
model's Megatron layout and the dataset snapshot's training rows (and, after them, a served
teacher's answer). The checks themselves are ``relax.config``'s; this module only builds what they read.
"""

from __future__ import annotations

from relax.config.fit import (
    check_megatron_layout,
    check_rows,
    check_served_teacher_rows,
    check_served_vocab,
    check_teacher_vocab,
)
from relax.config.preflight import check_served_teacher, preflight
from relax.data.suite import TASKS, load_env_fn, load_reward_fn
from relax.services.run_context import RunContext


def check_trainable(ctx: RunContext, engine_urls: list[str] | None = None, *, teacher: bool = True) -> None:
    """Fail before any role starts on data the configured engines cannot serve, or on an
    extension point (``data.reward_fn``, ``rollout.env_fn``) that does not import. ``teacher``:
    also the distillation teacher (False for work that never scores with it: the format warm-start,
    evaluation, which must not ask a served teacher for its vocabulary each time)."""
    cfg = ctx.cfg
    _ = cfg.data.reward_fn and load_reward_fn(cfg.data.reward_fn)
    _ = cfg.rollout.env_fn and load_env_fn(cfg.rollout.env_fn)
    preflight(cfg, engine_urls, teacher=teacher)
    if teacher and cfg.teacher.name_or_path and cfg.teacher.tokenizer and cfg.teacher.tokenizer != cfg.model.tokenizer:
        from relax.models import build_tokenizer

        check_teacher_vocab(cfg, build_tokenizer(cfg.teacher.tokenizer).get_vocab(), ctx.tokenizer.get_vocab())
    if cfg.trainer.backend == "megatron":
        _check_megatron_layout(ctx)
    train = ctx.split("train")  # the dataset snapshot: made here if this is the run's first start
    if teacher and cfg.teacher.url:
        check_served_teacher_rows(cfg, train)
        check_served_vocab(cfg, check_served_teacher(cfg), len(ctx.tokenizer))
    check_rows(cfg, train, engine_urls, agent_tasks={name for name, task in TASKS.items() if task.make_env})


def _check_megatron_layout(ctx: RunContext) -> None:
    """The model's Megatron layout, read from its Hugging Face config (no weights built)."""
    import torch

    from relax.models.builders import policy_config
    from relax.trainers.megatron.convert import check_tp, layout_from_hf_config

    layout = layout_from_hf_config(policy_config(ctx.cfg.model, ctx.tokenizer))
    try:
        check_tp(layout, ctx.cfg.trainer.tensor_parallel)
        tp_problem = None
    except ValueError as e:
        tp_problem = str(e)
    check_megatron_layout(ctx.cfg, layout, tp_problem, cuda=torch.cuda.is_available())
