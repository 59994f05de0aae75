"""Build the policy model named by a :class:`~relax.config.ModelConfig`, offline.

Built-in tiny models are constructed from a config alone under a fixed seed, so tests and
smoke runs need no download and the same seed always gives the same ``state_dict``:

* ``tiny-qwen2`` — a text decoder: Qwen2 (``family='qwen2'``), Qwen3 or Llama; or a mixture of
  experts, Qwen2-MoE (shared expert) or Qwen3-MoE (``MOE_TINY``: 4 experts, top-2).
* ``tiny-qwen2-vl`` — Qwen2.5-VL with a 1-block vision tower (patch 14, no spatial merge);
  its image token is the tokenizer's ``<image>`` id.
* ``tiny-qwen2-audio`` — Qwen2-Audio with a 1-layer Whisper-style encoder over 32 mel bins
  and 2 s windows; its audio token is the tokenizer's ``<audio>`` id.
* ``tiny-omni`` — the Qwen2.5-Omni *thinker* (vision + audio + text, no talker).

Their media towers then get the init tweaks of ``relax.models.tiny_init`` (colour stem,
He-initialised audio convs), under the same seed.

A local folder is loaded with the class its ``config.json`` names, ``local_files_only``.
Sizes of the decoder come from ``ModelConfig`` (hidden_size, num_layers, num_heads,
max_seq_len); the vocabulary size comes from the tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from relax.config import ModelConfig
from relax.models.processors import MediaProcessor, build_media_processor
from relax.models.tiny_init import init_tiny_towers
from relax.models.tokenizers import (
    AUDIO_END,
    AUDIO_START,
    AUDIO_TOKEN,
    IMAGE_TOKEN,
    VIDEO_TOKEN,
    VISION_END,
    VISION_START,
)

BUILTIN_MODELS = ("tiny-qwen2", "tiny-qwen2-vl", "tiny-qwen2-audio", "tiny-omni")

# Tiny media encoders: one block each, small widths. Patch 14 is Qwen's own; the 2x2 spatial
# merge is not: a 56x56 shapes image is 4x4 patches, and merged into 4 tokens the tiny policy
# learned shapes far slower under RL (held-out 0.42 after 300 shapes-only steps, against 0.63
# with the 16 unmerged patch tokens, for 1.14x the step time). Width 64, not 32: frozen for 200
# steps and then thawed, the 64-wide tower learned shapes alone to 0.78 / 0.81 held-out in 400
# RL steps (seeds 0 / 1), the 32-wide one to 0.70 / 0.52 (docs/history/learning-recipe.md).
VISION_TINY = {"depth": 1, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2, "patch_size": 14,
               "spatial_merge_size": 1, "temporal_patch_size": 2, "window_size": 56, "fullatt_block_indexes": [0]}
# 32 mel bins and 100 encoder positions = 200 mel frames = a 2 s window at 16 kHz / hop 160.
AUDIO_TINY = {"num_mel_bins": 32, "encoder_layers": 1, "encoder_attention_heads": 2, "encoder_ffn_dim": 64,
              "d_model": 32, "max_source_positions": 100}
# Pixel normalisation of the built-in vision towers, saved in config.json as ``relax_image_norm``
# (relax.models.processors reads it). A randomly initialised tower learns an order of magnitude
# faster when the white background of the synthetic tasks maps to zero: with CLIP's mean/std
# every patch is dominated by the same white vector and the tiny tower's features barely
# differ between pictures (held-out colour accuracy stayed at chance after 300x32 supervised
# steps; with this normalisation 0.75). Real checkpoints keep CLIP's constants.
# Bump when a built-in model or its processor changes what a given seed produces: cached
# warm-starts (relax.pipeline.warm_start_key) are keyed on it. 2: relax_image_norm.
# 3: no spatial merge in the tiny vision tower. 4: colour stem (tiny_init.init_colour_stem). 5: vision width 64.
# 6: He-initialised audio convs (tiny_init.init_audio_convs).
BUILTIN_VERSION = 6
# Mixture-of-experts decoders: 4 experts per layer, top-2 routing, every layer sparse; Qwen3-MoE
# renormalises the top-k gate weights (its released configs do), Qwen2-MoE does not.
MOE_TINY = {
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "norm_topk_prob": False},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "norm_topk_prob": True},
}
TINY_IMAGE_NORM = {"mean": [1.0, 1.0, 1.0], "std": [0.5, 0.5, 0.5]}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _mrope_section(head_dim: int) -> list[int]:
    """Split ``head_dim // 2`` rotary pairs over (time, height, width) as Qwen2-VL does (1:1.5:1.5)."""
    half = head_dim // 2
    t = max(1, half // 4)
    h = (half - t) // 2
    return [t, h, half - t - h]


def _text_kwargs(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    if cfg.hidden_size % cfg.num_heads:
        raise ValueError(f"model.hidden_size {cfg.hidden_size} must be divisible by model.num_heads {cfg.num_heads}")
    head_dim = cfg.hidden_size // cfg.num_heads
    if head_dim % 2:
        raise ValueError(f"head dim hidden_size/num_heads = {head_dim} must be even for rotary embeddings")
    return {
        "vocab_size": len(tokenizer),
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.hidden_size * 3,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_heads,
        "max_position_embeddings": max(cfg.max_seq_len, 256),
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "tie_word_embeddings": True,
    }


def _token_id(tokenizer: PreTrainedTokenizerBase, token: str) -> int:
    vocab = tokenizer.get_vocab()
    if token not in vocab:
        raise ValueError(f"the tokenizer has no {token!r} token; build it with relax.models.build_tokenizer")
    return vocab[token]


def tiny_config(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig:
    """The transformers config of the built-in tiny model ``cfg.name_or_path``."""
    name = cfg.name_or_path
    text = _text_kwargs(cfg, tokenizer)
    head_dim = cfg.hidden_size // cfg.num_heads
    if name == "tiny-qwen2":
        from transformers import LlamaConfig, Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig

        classes = {"qwen2": Qwen2Config, "qwen3": Qwen3Config, "llama": LlamaConfig, "qwen2_moe": Qwen2MoeConfig,
                   "qwen3_moe": Qwen3MoeConfig}
        if cfg.family not in classes:
            raise ValueError(
                f"tiny-qwen2 is a text model; model.family must be one of {sorted(classes)}, not {cfg.family!r}"
            )
        extra: dict[str, Any] = {"head_dim": head_dim} if cfg.family in ("qwen3", "qwen3_moe") else {}
        if cfg.family in MOE_TINY:
            extra.update(MOE_TINY[cfg.family], moe_intermediate_size=cfg.hidden_size)
            if cfg.family == "qwen2_moe":  # Qwen2-MoE has a gated shared expert beside the routed ones
                extra["shared_expert_intermediate_size"] = cfg.hidden_size * 2
        return classes[cfg.family](**text, **extra)
    if name == "tiny-qwen2-vl":
        from transformers import Qwen2_5_VLConfig

        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": _mrope_section(head_dim)}
        image_id = _token_id(tokenizer, IMAGE_TOKEN)
        config = Qwen2_5_VLConfig(
            text_config=text,
            vision_config={**VISION_TINY, "out_hidden_size": cfg.hidden_size},
            image_token_id=image_id,
            video_token_id=_token_id(tokenizer, VIDEO_TOKEN),  # unused: Relax has no video
            vision_start_token_id=_token_id(tokenizer, VISION_START),
            vision_end_token_id=_token_id(tokenizer, VISION_END),
            tie_word_embeddings=True,
        )
        config.relax_image_norm = dict(TINY_IMAGE_NORM)
        return config
    if name == "tiny-qwen2-audio":
        from transformers import Qwen2AudioConfig

        return Qwen2AudioConfig(
            audio_config=dict(AUDIO_TINY),
            text_config={"model_type": "qwen2", **text},
            audio_token_index=_token_id(tokenizer, AUDIO_TOKEN),
        )  # note: Qwen2-Audio keeps its LM head untied from the embedding in transformers 5.x
    if name == "tiny-omni":
        from transformers import Qwen2_5OmniThinkerConfig

        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": _mrope_section(head_dim)}
        image_id = _token_id(tokenizer, IMAGE_TOKEN)
        audio_id = _token_id(tokenizer, AUDIO_TOKEN)
        config = Qwen2_5OmniThinkerConfig(
            text_config=text,
            vision_config={**VISION_TINY, "out_hidden_size": cfg.hidden_size},
            audio_config={**AUDIO_TINY, "n_window": 50, "output_dim": cfg.hidden_size},
            audio_token_index=audio_id,
            image_token_index=image_id,
            video_token_index=_token_id(tokenizer, VIDEO_TOKEN),
            audio_start_token_id=_token_id(tokenizer, AUDIO_START),
            audio_end_token_id=_token_id(tokenizer, AUDIO_END),
            user_token_id=tokenizer.pad_token_id,
            tie_word_embeddings=True,
        )
        # get_rope_index reads these, but the thinker config does not declare them.
        config.vision_start_token_id = _token_id(tokenizer, VISION_START)
        config.vision_end_token_id = _token_id(tokenizer, VISION_END)
        config.relax_image_norm = dict(TINY_IMAGE_NORM)
        return config
    raise ValueError(f"unknown built-in model {name!r}; built-ins are {BUILTIN_MODELS}, or give a local folder")


def model_class_for(config: PretrainedConfig) -> type[PreTrainedModel]:
    """The generation-capable class for a config (multimodal ones are not AutoModelForCausalLM)."""
    from transformers import AutoModelForCausalLM

    kind = config.model_type
    if kind == "qwen2_5_vl":
        from transformers import Qwen2_5_VLForConditionalGeneration

        return Qwen2_5_VLForConditionalGeneration
    if kind == "qwen2_vl":
        from transformers import Qwen2VLForConditionalGeneration

        return Qwen2VLForConditionalGeneration
    if kind == "qwen2_audio":
        from transformers import Qwen2AudioForConditionalGeneration

        return Qwen2AudioForConditionalGeneration
    if kind == "qwen2_5_omni_thinker":
        from transformers import Qwen2_5OmniThinkerForConditionalGeneration

        return Qwen2_5OmniThinkerForConditionalGeneration
    if kind == "qwen2_5_omni":
        raise NotImplementedError(
            "a full Qwen2.5-Omni checkpoint (thinker + talker) is not supported; save and point at its thinker"
        )
    return AutoModelForCausalLM._model_mapping[type(config)]


def policy_config(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig:
    """The policy's Hugging Face config without its weights (a built-in's, or a local folder's)."""
    if cfg.name_or_path in BUILTIN_MODELS:
        return tiny_config(cfg, tokenizer)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(Path(cfg.name_or_path).expanduser()), local_files_only=True)


def build_policy(
    cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase, seed: int
) -> tuple[PreTrainedModel, MediaProcessor | None]:
    """``(model, processor)`` for ``cfg``; ``processor`` is None for text-only models.

    Built-ins are initialised under ``torch.manual_seed(seed)`` inside a forked RNG, so the
    caller's random state is untouched and the same seed gives an identical state_dict.
    A local folder is loaded as saved (``seed`` is unused) with ``local_files_only=True``.
    """
    dtype = _DTYPES[cfg.dtype]
    if cfg.name_or_path in BUILTIN_MODELS:
        config = tiny_config(cfg, tokenizer)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = model_class_for(config)._from_config(config, dtype=torch.float32)
            init_tiny_towers(model)  # relax.models.tiny_init: the colour stem, then the audio convs
    else:
        path = Path(cfg.name_or_path).expanduser()
        if not (path / "config.json").is_file():
            raise ValueError(
                f"model.name_or_path {cfg.name_or_path!r} is neither a built-in ({', '.join(BUILTIN_MODELS)}) "
                "nor a local folder with a config.json (hub names are never downloaded)"
            )
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        model = model_class_for(config).from_pretrained(str(path), local_files_only=True, dtype=torch.float32)
        if config.get_text_config().vocab_size < len(tokenizer):
            raise ValueError(
                f"the tokenizer has {len(tokenizer)} tokens but the checkpoint's vocab_size is "
                f"{config.get_text_config().vocab_size}; use the tokenizer the checkpoint was trained with"
            )
    model = model.to(dtype).eval()
    if model.generation_config is not None:
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, build_media_processor(model.config, tokenizer)


def build_processor(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> MediaProcessor | None:
    """The media processor of ``cfg``'s model from its config alone (no weights are built or read):
    what a process that sends prompts to remote engines needs to expand them."""
    if cfg.name_or_path in BUILTIN_MODELS:
        return build_media_processor(tiny_config(cfg, tokenizer), tokenizer)
    from transformers import AutoConfig

    path = Path(cfg.name_or_path).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(f"model.name_or_path {cfg.name_or_path!r} is neither a built-in ({', '.join(BUILTIN_MODELS)}) "
                         "nor a local folder with a config.json (hub names are never downloaded)")
    return build_media_processor(AutoConfig.from_pretrained(str(path), local_files_only=True), tokenizer)


def count_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
