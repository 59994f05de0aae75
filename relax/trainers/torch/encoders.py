"""The media encoders of a policy as the torch trainers see them: which parameters they are,
holding them fixed, and the actor's encoder schedule (docs/models.md).

``trainer.freeze_encoders`` holds the named towers fixed; with ``thaw_encoders_at`` they train
again from that RL step, at ``lr x encoder_lr_scale x thaw_lr_scale``, optionally ramped up over
``thaw_warmup_steps``. The towers join the optimizer from the start either way, so the parameter
groups (and every checkpoint's optimizer state) have one layout before and after the thaw.
"""

from __future__ import annotations

import torch

from relax.config import TrainerConfig

# The module (a component of the parameter names) of each media encoder in the supported families.
ENCODER_MODULES = {"vision": "visual", "audio": "audio_tower"}


def encoder_parameters(model: torch.nn.Module, kind: str) -> list[torch.nn.Parameter]:
    """The parameters of the model's ``kind`` ('vision' or 'audio') encoder; empty if it has none."""
    return [p for n, p in model.named_parameters() if ENCODER_MODULES[kind] in n.split(".")]


def freeze_encoders(model: torch.nn.Module, which: list[str]) -> int:
    """Stop gradients into the named media encoders ('vision', 'audio'); returns the parameters frozen.

    Raises ValueError naming the encoder when the model has none of it (a text model asked to
    freeze 'vision' is a config mistake, not a no-op)."""
    frozen = 0
    for kind in which:
        if kind not in ENCODER_MODULES:
            raise ValueError(
                f"trainer.freeze_encoders: unknown encoder {kind!r}; choose from {sorted(ENCODER_MODULES)}"
            )
        params = encoder_parameters(model, kind)
        if not params:
            raise ValueError(f"trainer.freeze_encoders: the model has no {kind} encoder "
                             f"(no '{ENCODER_MODULES[kind]}' module); remove {kind!r}")
        for p in params:
            p.requires_grad_(False)
            frozen += p.numel()
    return frozen


class EncoderSchedule:
    """One actor's encoders: frozen, thawed at ``thaw_encoders_at``, and their optimizer groups.

    Build it on the bare model before the optimizer collects parameters; pass ``lr_scales`` and
    ``ramps`` to the optimizer, then call :meth:`hold` to freeze the towers that thaw later."""

    def __init__(self, model: torch.nn.Module, t: TrainerConfig, updates: int):
        """``updates``: optimizer steps per RL step (the schedule counts those)."""
        self.frozen = list(t.freeze_encoders) if t.thaw_encoders_at else []  # thawed at thaw_update
        self.thaw_step = t.thaw_encoders_at
        self.thaw_update = t.thaw_encoders_at * updates
        if not self.frozen:
            freeze_encoders(model, list(t.freeze_encoders))  # frozen for good: they stay out of the optimizer
        for kind in self.frozen:  # trainable while the optimizer collects them, even in a model frozen before
            for p in encoder_parameters(model, kind):
                p.requires_grad_(True)
        thawed = {ENCODER_MODULES[kind] for kind in self.frozen}
        self.lr_scales = {module: t.encoder_lr_scale * (t.thaw_lr_scale if module in thawed else 1.0)
                          for module in ENCODER_MODULES.values()}
        self.ramps = ({module: (self.thaw_update, t.thaw_warmup_steps * updates) for module in thawed}
                      if t.thaw_warmup_steps else None)

    def hold(self, model: torch.nn.Module) -> None:
        """Freeze the towers that thaw later (once the optimizer holds them)."""
        freeze_encoders(model, self.frozen)

    def thaw_if_due(self, model: torch.nn.Module, updates_done: int) -> list[str]:
        """Let gradients into the held towers once ``updates_done`` optimizer steps reach the thaw;
        returns the encoders it thawed (none before the thaw, and after it)."""
        if not self.frozen or updates_done < self.thaw_update:
            return []
        thawed, self.frozen = self.frozen, []
        for kind in thawed:
            for p in encoder_parameters(model, kind):
                p.requires_grad_(True)
        return thawed
