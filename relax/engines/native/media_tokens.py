"""Media prompts in the engine: the input-only token ids of a multimodal model, and which requests share a prefill.

Input-only ids are media placeholders and their delimiters.

The engine never samples input-only ids: a sampled placeholder asks the model for an image or clip
that does not exist, and the sample could not be trained on.
"""

from __future__ import annotations

from typing import Any

import torch

from relax.models.video_inputs import audio_in_video

MEDIA_TOKEN_ATTRS = ("image_token_id", "image_token_index", "audio_token_id", "audio_token_index", "video_token_id",
                     "video_token_index", "vision_start_token_id", "vision_end_token_id", "audio_start_token_id",
                     "audio_end_token_id")


def input_only_token_ids(model: torch.nn.Module) -> torch.Tensor | None:
    """Media placeholder ids of a multimodal model (None for a text model): a sampled one would
    ask the model for an image or clip that does not exist, and make the sample untrainable."""
    cfg = model.config
    ids = {getattr(cfg, a) for a in MEDIA_TOKEN_ATTRS if isinstance(getattr(cfg, a, None), int)}
    return torch.tensor(sorted(ids)) if ids else None


def same_media_prompts(admitted: list[tuple[Any, list[int]]]) -> list[list[tuple[Any, list[int]]]]:
    """Media requests grouped by prompt, in arrival order: the same ids with the same media
    tensors (the rollout sends a prompt's n samples as n requests sharing one encoding)."""
    groups: dict[tuple, list[tuple[Any, list[int]]]] = {}
    for p, slots in admitted:
        key = (tuple(p.req.input_ids), tuple(sorted((k, id(v)) for k, v in p.req.mm_inputs.items())))
        groups.setdefault(key, []).append((p, slots))
    return list(groups.values())


def by_video_audio(groups: list[list[tuple[Any, list[int]]]]) -> tuple[list, list]:
    """Prompt groups without and with video audio tracks: Qwen2.5-Omni takes one
    ``use_audio_in_video`` flag per forward, so the two kinds prefill in batches of their own."""
    flagged = [audio_in_video(rows[0][0].req.mm_inputs) for rows in groups]
    return [g for g, f in zip(groups, flagged, strict=True) if not f], [
        g for g, f in zip(groups, flagged, strict=True) if f
    ]
