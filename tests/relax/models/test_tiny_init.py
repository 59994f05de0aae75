"""The built-in towers' init tweaks (relax.models.tiny_init), seen through the models build_policy builds."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from relax.config import ModelConfig  # noqa: E402
from relax.models.builders import build_policy  # noqa: E402
from relax.models.tokenizers import build_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer("bpe-tiny")


@pytest.mark.parametrize(("name", "family"), [("tiny-qwen2-vl", "qwen2_5_vl"), ("tiny-omni", "qwen2_5_omni")])
def test_vision_stem_starts_with_the_mean_colour_of_each_patch(tok, name: str, family: str) -> None:
    import io

    from PIL import Image

    from relax.models.processors import media_features

    model, proc = build_policy(ModelConfig(name_or_path=name, family=family), tok, seed=0)
    stem = model.get_submodule("model.visual.patch_embed")

    def features(colour: tuple[int, int, int], covered_rows: int) -> torch.Tensor:
        image = Image.new("RGB", (56, 56), (255, 255, 255))  # 4x4 patches of 14 pixels
        image.paste(colour, (0, 0, 56, covered_rows))
        png = io.BytesIO()
        image.save(png, format="PNG")
        out, _, _ = media_features([png.getvalue()], [], proc)
        with torch.no_grad():
            return stem(out["pixel_values"])[:, :3]  # (patches, 3)

    # Pixels normalise as (x/255 - 1) / 0.5 (TINY_IMAGE_NORM): red (220, 30, 30) ->
    # (220/255 - 1) * 2 = -0.2745 and (30/255 - 1) * 2 = -1.7647 for green and blue.
    red = torch.tensor([-0.2745, -1.7647, -1.7647])
    full = features((220, 30, 30), 56)
    assert torch.allclose(full, red.expand(16, 3), atol=1e-3)  # every patch: the colour itself
    # Top 7 of 56 rows red: the 4 top patches are half covered (7 of 14 rows), the other 12 white (0).
    half = features((220, 30, 30), 7)
    covered = half.abs().sum(1) > 0
    assert covered.sum() == 4
    assert torch.allclose(half[covered], (red / 2).expand(4, 3), atol=1e-3)
    # Channels 3.. stay random: the init only fixes the three colour channels.
    assert stem.proj.weight[3:].std() > 0



@pytest.mark.parametrize(("name", "family"), [("tiny-qwen2-audio", "qwen2_audio"), ("tiny-omni", "qwen2_5_omni")])
def test_audio_convs_carry_the_clip_beside_the_position_table(tok, name: str, family: str) -> None:
    from relax.data.suite import tones
    from relax.models.processors import media_features

    model, proc = build_policy(ModelConfig(name_or_path=name, family=family), tok, seed=0)
    tower = next(m for n, m in model.named_modules() if n.endswith("audio_tower"))
    # He init: weight std sqrt(2 / fan_in), fan_in = 32 mel bins (or channels) x kernel 3 = 96 -> 0.1443;
    # transformers' own init would leave 0.02.
    for conv in (tower.conv1, tower.conv2):
        assert conv.weight.std().item() == pytest.approx((2 / 96) ** 0.5, rel=0.05)
    clips = [s.audios[0].data for s in tones.generate(0, "train", 8, 1)]
    out, _, _ = media_features([], clips, proc)
    mel = out["input_features"][..., :100]  # the clip's 100 frames, without the padding
    with torch.no_grad():
        content = torch.nn.functional.gelu(tower.conv2(torch.nn.functional.gelu(tower.conv1(mel))))
    # What the LM reads per frame is content + a position table of norm sqrt(32 / 2) = 4 (omni).
    # The log-mel clips have std ~0.2, so a variance-preserving pair of convs keeps ~0.2 * sqrt(32)
    # ~ 1 times a GELU's shrinkage: about 0.5. At std 0.02 it was 0.01 (0.25% of the token).
    per_frame = content.transpose(1, 2).norm(dim=-1).mean().item()
    assert 0.2 < per_frame < 2.0
    # The clips differ, not only the frames: the content is not a constant the LM could ignore.
    assert (content - content.mean(0)).transpose(1, 2).norm(dim=-1).mean().item() > 0.1


def test_a_model_without_media_towers_is_left_alone(tok) -> None:
    from relax.models.tiny_init import init_tiny_towers

    model, _ = build_policy(ModelConfig(), tok, seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    init_tiny_towers(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
