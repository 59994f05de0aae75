"""Weight-init tweaks of the built-in tiny media towers, tuned to the toy tasks (docs/models.md).

A real VLM's or audio LM's encoder arrives pretrained; the tiny ones are drawn at random by
transformers, and two of their first layers are redrawn here so that RL on the synthetic
tasks can read colour and pitch at all. ``relax.models.builders.build_policy`` applies both,
in this order, inside the seeded RNG that builds a built-in model; local checkpoints are
loaded as saved and never pass through here. Changing either changes what a seed builds:
bump ``relax.models.builders.BUILTIN_VERSION`` with it.
"""

from __future__ import annotations

import torch

# The built-in towers' module names (Qwen2.5-VL / Qwen2.5-Omni vision, Qwen2-Audio / Omni audio).
VISION_STEM = "visual.patch_embed.proj"
AUDIO_CONVS = ("audio_tower.conv1", "audio_tower.conv2")


def init_tiny_towers(model: torch.nn.Module) -> None:
    """Both tweaks, in the order a built-in model's seed expects: the colour stem, then the audio convs."""
    init_colour_stem(model)
    init_audio_convs(model)


def init_colour_stem(model: torch.nn.Module) -> None:
    """Start channels 0-2 of each vision patch embedding as per-colour-channel patch means.

    The patch embedding is a Conv3d, weight ``(D, 3, T, P, P)``; output ``k < 3`` becomes
    ``mean over the T*P*P pixels of input channel k``: a patch a fraction ``f`` covered by
    a shape of normalised colour ``(r, g, b)`` on the zero background gives ``f * (r, g, b)``.
    A random stem mixes the colour with the shape's footprint instead, which RL did not untangle.
    The other D-3 channels keep their random init; models without a vision tower are left alone."""
    for name, module in model.named_modules():
        if name.endswith(VISION_STEM):
            weight = module.weight
            with torch.no_grad():  # eye(3) picks channel k for output k; / pixels makes the sum a mean
                weight[:3] = torch.eye(3, dtype=weight.dtype)[:, :, None, None, None] / weight[0, 0].numel()


def init_audio_convs(model: torch.nn.Module, gain: float = 2.0) -> None:
    """Re-draw the audio tower's two input convs with fan-in variance ``gain / (in_channels * kernel)``.

    The Whisper-style tower adds a position table to ``gelu(conv2(gelu(conv1(mel))))``; at
    transformers' std 0.02 the clip's content is a fraction of a percent of each token the LM
    reads. He initialisation (``gain`` 2 for the GELU; He et al. 2015, eq. 10) brings it to
    about norm 0.5 a frame on the tones task's log-mel clips."""
    for name, module in model.named_modules():
        if name.endswith(AUDIO_CONVS):
            fan_in = module.weight.shape[1] * module.weight.shape[2]
            with torch.no_grad():
                module.weight.normal_(0.0, (gain / fan_in) ** 0.5)
