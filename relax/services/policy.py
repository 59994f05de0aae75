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
    model = apply_lora(model, m)
    if m.lora.init_checkpoint:
        load_adapter_state(model, read_state(m.lora.init_checkpoint)[1]["model"], m.lora.init_checkpoint)
    return model, processor
