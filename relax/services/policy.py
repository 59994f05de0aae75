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
