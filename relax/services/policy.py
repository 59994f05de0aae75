"""The run's policy model, built alike in every process that needs its weights.

Not a handle on ``RunContext``: each call builds a fresh model (seeded, so identical everywhere),
which its caller owns. ``relax.models`` (torch, transformers: ~4 s) is imported here, when a model
is built, so processes that only read the store stay light.
"""

from __future__ import annotations

from typing import Any

from relax.services.run_context import RunContext


def build_model(ctx: RunContext) -> tuple[Any, Any]:
    """``(model, processor)``: the initial policy (seeded), identical in every process."""
    from relax.models import build_policy

    return build_policy(ctx.cfg.model, ctx.tokenizer, seed=ctx.cfg.seed)


def build_actor_model(ctx: RunContext) -> tuple[Any, Any]:
    """``(model, processor)`` as the actor trains it: :func:`build_model`'s, wrapped in LoRA adapters with
    ``model.lora`` (relax.models.lora). The base the adapters apply to is loaded here, before the
    wrapping (``model.init_checkpoint``: a full checkpoint), since a LoRA checkpoint holds the adapter
    alone and every incarnation of the actor rebuilds the base; then ``model.lora.init_checkpoint``'s adapter."""
    model, processor = build_model(ctx)
    m = ctx.cfg.model
    if not m.lora.rank:
        return model, processor
    from relax.models.lora import apply_lora, load_adapter_state
    from relax.trainers.checkpoint.trainer_state import load_checkpoint, read_state

    if m.init_checkpoint:
        load_checkpoint(m.init_checkpoint, model, restore_rng=False)
    model = apply_lora(model, m, seed=ctx.cfg.seed)
    if m.lora.init_checkpoint:
        load_adapter_state(model, read_state(m.lora.init_checkpoint)[1]["model"], m.lora.init_checkpoint)
    return model, processor


def lora_of(url: str) -> dict[str, Any] | None:
    """The adapter record of checkpoint ``url`` (``meta.json``'s ``lora``), None for a full checkpoint."""
    from relax.trainers.checkpoint.files import read_meta

    info = read_meta(url).get("lora")
    return info if isinstance(info, dict) else None


def checkpoint_adapter(ctx: RunContext, url: str) -> tuple[Any, Any]:
    """``(PEFT model, processor)`` of LoRA checkpoint ``url``: its base (the model and base checkpoint its
    record names) with its adapter, shaped as the record says whatever ``ctx``'s ``model.lora`` is."""
    import dataclasses

    from relax.models.lora import apply_lora, load_adapter_state
    from relax.trainers.checkpoint.trainer_state import load_checkpoint, read_state

    info = lora_of(url)
    if info is None:
        raise ValueError(f"checkpoint {url} holds whole weights, not a LoRA adapter (no 'lora' in its meta.json)")
    m = ctx.cfg.model
    lora = dataclasses.replace(m.lora, rank=info["rank"], alpha=info["alpha"], target_modules=info["target_modules"])
    m = dataclasses.replace(m, lora=lora, init_checkpoint=info["base_checkpoint"])
    from relax.models import build_policy

    model, processor = build_policy(m, ctx.tokenizer, seed=ctx.cfg.seed)
    if m.init_checkpoint:
        load_checkpoint(m.init_checkpoint, model, restore_rng=False)
    model = apply_lora(model, m)
    load_adapter_state(model, read_state(url)[1]["model"], url)
    return model, processor


def checkpoint_policy(ctx: RunContext, url: str) -> tuple[Any, Any]:
    """``(model, processor)``: the plain policy of checkpoint ``url``, a LoRA adapter merged onto its base."""
    from relax.trainers.checkpoint.trainer_state import load_checkpoint

    if lora_of(url) is not None:
        model, processor = checkpoint_adapter(ctx, url)
        return model.merge_and_unload(), processor
    model, processor = build_model(ctx)
    load_checkpoint(url, model, restore_rng=False)
    return model, processor
