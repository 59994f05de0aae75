"""Token ids a multimodal model takes as input only (media placeholders and their delimiters).

The engine never samples them: a sampled placeholder asks the model for an image or clip that does not
exist, and the sample could not be trained on.
"""

from __future__ import annotations

import torch

MEDIA_TOKEN_ATTRS = ("image_token_id", "image_token_index", "audio_token_id", "audio_token_index", "video_token_id",
                     "video_token_index", "vision_start_token_id", "vision_end_token_id", "audio_start_token_id",
                     "audio_end_token_id")



def input_only_token_ids(model: torch.nn.Module) -> torch.Tensor | None:
    """Media placeholder ids of a multimodal model (None for a text model): a sampled one would
    ask the model for an image or clip that does not exist, and make the sample untrainable."""
    cfg = model.config
    ids = {getattr(cfg, a) for a in MEDIA_TOKEN_ATTRS if isinstance(getattr(cfg, a, None), int)}
    return torch.tensor(sorted(ids)) if ids else None
