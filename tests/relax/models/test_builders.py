"""Tiny policies: deterministic under the seed, run a forward pass, save/load round trip."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from relax.config import ModelConfig  # noqa: E402
from relax.models.builders import build_policy, count_parameters, pinned_parameters  # noqa: E402
from relax.models.tokenizers import build_tokenizer  # noqa: E402

CASES = [
    ("tiny-qwen2", "qwen2", "Qwen2ForCausalLM"),
    ("tiny-qwen2", "qwen3", "Qwen3ForCausalLM"),
    ("tiny-qwen2", "llama", "LlamaForCausalLM"),
    ("tiny-qwen2-vl", "qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
    ("tiny-qwen2-audio", "qwen2_audio", "Qwen2AudioForConditionalGeneration"),
    ("tiny-omni", "qwen2_5_omni", "Qwen2_5OmniThinkerForConditionalGeneration"),
]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer("bpe-tiny")


def _ids(tok) -> torch.Tensor:
    text = tok.apply_chat_template([{"role": "user", "content": "What is 1 + 5?"}], tokenize=False,
                                   add_generation_prompt=True)
    return torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])


@pytest.mark.parametrize(("name", "family", "cls"), CASES)
def test_builds_deterministically_and_runs(tok, name: str, family: str, cls: str) -> None:
    cfg = ModelConfig(name_or_path=name, family=family)
    rng_before = torch.random.get_rng_state()
    a, proc_a = build_policy(cfg, tok, seed=3)
    assert torch.equal(torch.random.get_rng_state(), rng_before), "building must not consume the caller's RNG"
    b, _ = build_policy(cfg, tok, seed=3)
    c, _ = build_policy(cfg, tok, seed=4)
    assert type(a).__name__ == cls
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)
    assert all(v.dtype == torch.float32 for v in sa.values())
    assert (proc_a is None) == (name == "tiny-qwen2")
    assert 100_000 < count_parameters(a) < 1_000_000
    ids = _ids(tok)
    with torch.no_grad():
        logits = a(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    assert logits.shape == (1, ids.shape[1], len(tok))
    assert torch.isfinite(logits).all()


def test_sizes_follow_config(tok) -> None:
    model, _ = build_policy(ModelConfig(hidden_size=32, num_layers=1, num_heads=2), tok, seed=0)
    assert model.config.hidden_size == 32 and model.config.num_hidden_layers == 1
    assert model.config.vocab_size == len(tok)
    with pytest.raises(ValueError, match="divisible"):
        build_policy(ModelConfig(hidden_size=30, num_heads=4), tok, seed=0)


@pytest.mark.parametrize(("name", "family"), [("tiny-qwen2", "qwen2"), ("tiny-qwen2-vl", "qwen2_5_vl"),
                                               ("tiny-qwen2-audio", "qwen2_audio")])
def test_save_load_round_trip(tok, tmp_path, name: str, family: str) -> None:
    model, _ = build_policy(ModelConfig(name_or_path=name, family=family), tok, seed=1)
    model.save_pretrained(tmp_path)
    loaded, proc = build_policy(ModelConfig(name_or_path=str(tmp_path), family=family), tok, seed=999)
    assert type(loaded) is type(model)
    assert (proc is None) == (name == "tiny-qwen2")
    ids = _ids(tok)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, loaded(input_ids=ids).logits)


def test_unknown_name_is_a_clear_error(tok, tmp_path) -> None:
    with pytest.raises(ValueError, match="never downloaded"):
        build_policy(ModelConfig(name_or_path="Qwen/Qwen2-0.5B"), tok, seed=0)
    with pytest.raises(ValueError, match="text model"):
        build_policy(ModelConfig(name_or_path="tiny-qwen2", family="qwen2_audio"), tok, seed=0)


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


def test_pinned_parameters_match_whole_name_components_or_rows_of_one_and_name_a_bad_pattern(tok) -> None:
    model, _ = build_policy(ModelConfig(name_or_path="tiny-omni", family="qwen2_5_omni"), tok, seed=0)
    stem = "model.visual.patch_embed.proj.weight"

    def pinned(*patterns: str) -> list[tuple[str, tuple[int, int] | None]]:
        return [(pin.name, pin.rows) for pin in pinned_parameters(model, list(patterns))]

    assert pinned("visual.patch_embed", "visual.patch_embed.proj") == [(stem, None)]  # the conv has no bias; once
    assert {n for n, _ in pinned("merger")} == {n for n, _ in model.named_parameters() if ".merger." in n}
    assert pinned("visual.patch_embed.proj.weight[0:3]", "patch_embed.proj.weight[60:]") == [(stem, (0, 3)), (stem, (60, 64))]
    with pytest.raises(ValueError, match="'visual.patch' matches no parameter"):
        pinned("visual.patch")  # a prefix of a component is not a component
    with pytest.raises(ValueError, match="must name one parameter"):
        pinned("visual.merger[0:3]")  # rows of which of its four parameters?
    with pytest.raises(ValueError, match=r"first dimension 64"):
        pinned("visual.patch_embed.proj.weight[3:65]")


@pytest.mark.parametrize(("name", "family"), [("tiny-qwen2-audio", "qwen2_audio"), ("tiny-omni", "qwen2_5_omni")])
def test_audio_convs_carry_the_clip_beside_the_position_table(tok, name: str, family: str) -> None:
    from relax.data.tasks import tones
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
