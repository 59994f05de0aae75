"""AdamW with a linear warm-up, then a constant or cosine learning rate."""

from __future__ import annotations

import math

import torch

from relax.trainers.model_parallel import hook

SCHEDULES = ("constant", "cosine")


def lr_factor(step: int, warmup_steps: int, total_steps: int, schedule: str = "constant",
              min_ratio: float = 0.1) -> float:
    """Multiplier of the peak LR at optimizer step ``step`` (0-based).

    Warm-up: (step + 1) / warmup_steps, so the first step already moves the weights.
    Cosine: from 1 down to ``min_ratio`` at ``total_steps``.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown LR schedule {schedule!r}; choose one of {SCHEDULES}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(model: torch.nn.Module, lr: float, weight_decay: float, warmup_steps: int, total_steps: int,
                    schedule: str = "constant", lr_scales: dict[str, float] | None = None,
                    ramps: dict[str, tuple[int, int]] | None = None,
                    ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over ``model``'s trainable parameters and its LR schedule.

    ``lr_scales`` maps a module name (one component of a parameter's dotted name, e.g. "visual")
    to a multiplier of ``lr`` for every parameter under it; the schedule scales all groups alike.
    ``ramps`` maps a module name to ``(start, length)``: its parameters' LR is further multiplied
    by ``clamp((step - start + 1) / length, 0, 1)``, a warm-up of its own for an encoder that
    thaws at optimizer step ``start`` (its Adam moments start empty there, and the first update moves
    every weight by ``lr``, however small or noisy its gradient). Groups: decayed, then not decayed (biases
    and norms), then the scaled or ramped ones, so a run without scales keeps the two-group
    layout its checkpoints were saved with.

    A model may name the AdamW that steps it: ``model.adamw_class`` (a ``model_parallel`` hook), called
    as ``torch.optim.AdamW`` is (the Megatron policy's ``DistributedAdam`` under
    ``trainer.distributed_optimizer``)."""
    base_groups = ((1.0, True, ""), (1.0, False, ""))  # kept even when empty: the checkpoint layout
    groups: dict[tuple[float, bool, str], list[torch.nn.Parameter]] = {key: [] for key in base_groups}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        parts = name.split(".")
        scale = next((s for module, s in (lr_scales or {}).items() if module in parts), 1.0)
        ramp = next((module for module in (ramps or {}) if module in parts), "")
        # no weight decay on biases and norms: decaying them only hurts small models
        groups.setdefault((scale, p.ndim >= 2, ramp), []).append(p)
    kept = [(key, params) for key, params in groups.items() if params or key in base_groups]
    adamw = hook(model, "adamw_class") or torch.optim.AdamW
    optimizer = adamw(
        [{"params": params, "lr": lr * scale, "weight_decay": weight_decay if decay else 0.0}
         for (scale, decay, _), params in kept],
        lr=lr, betas=(0.9, 0.999), eps=1e-8)

    def base(step: int) -> float:
        return lr_factor(step, warmup_steps, total_steps, schedule)

    def ramped(start: int, length: int):
        return lambda step: base(step) * min(1.0, max(0.0, (step - start + 1) / max(1, length)))

    lambdas = [ramped(*ramps[ramp]) if ramp else base for (_, _, ramp), _ in kept]
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)
    return optimizer, scheduler
