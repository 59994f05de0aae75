"""AdamW with a linear warm-up, then a constant or cosine learning rate."""

from __future__ import annotations

import math

import torch

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
                    schedule: str = "constant") -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    # no weight decay on biases and norms: decaying them only hurts small models
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.999), eps=1e-8)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, warmup_steps, total_steps, schedule))
    return optimizer, scheduler
