"""Turn a chat prompt with ``<image>`` / ``<audio>`` / ``<video>`` placeholders plus media bytes into
model kwargs, offline.

The image processor and audio feature extractor are the families' own transformers
classes, constructed from a settings dict (never ``from_pretrained`` on a hub name):

* images: ``Qwen2VLImageProcessor`` (the PIL backend; torchvision is not needed), patch 14,
  temporal patch 2, with ``min_pixels = 56*56`` and ``max_pixels = 224*224``, and the model's
  own spatial merge: a 56x56 task image is 4x4 patches = 16 image tokens for the built-in tiny
  towers (merge 1) and 4 for Qwen's merge 2; an image is at most 256 tokens (merge 1) or 64 (merge 2).
* audio: ``WhisperFeatureExtractor`` with as many mel bins as the audio encoder
  (``num_mel_bins``), 16 kHz, hop 160, and a window of ``2 * max_source_positions`` frames
  (2 s for the tiny encoder, Whisper's 30 s for a real one). Longer clips are truncated.
* video: frames sampled at ``video_fps`` (at most ``video_max_frames``) through the image
  processor, and for Qwen2.5-Omni the audio track interleaved in time
  (``relax.models.video_inputs``).

:func:`prepare_inputs` expands the i-th placeholder into as many media tokens as the
encoder emits for the i-th item, the way the Qwen processors do, so the model's
"tokens == features" check holds.
"""

from __future__ import annotations

import io
import wave
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from relax.data.video import load_video
from relax.models.tokenizers import (
    AUDIO_END,
    AUDIO_START,
    AUDIO_TOKEN,
    IMAGE_TOKEN,
    VIDEO_TOKEN,
    VISION_END,
    VISION_START,
)
from relax.models.video_inputs import audio_token_count, video_features

SAMPLE_RATE = 16_000
HOP_LENGTH = 160
MIN_PIXELS = 56 * 56
MAX_PIXELS = 224 * 224
# Video frame sampling: 4 per second (a 2 s built-in clip keeps all 8 of its frames; Qwen's own
# default of 2 would drop every other frame and with it half the flashes), at most 16 frames.
VIDEO_FPS = 4.0
VIDEO_MAX_FRAMES = 16


@dataclass
class MediaProcessor:
    """The image processor and/or audio feature extractor of one multimodal model."""

    image_processor: Any | None
    feature_extractor: Any | None
    image_token_id: int | None
    audio_token_id: int | None
    # (start, end) ids wrapped around each expanded media span; None = no wrapper.
    vision_wrap: tuple[int, int] | None = None
    audio_wrap: tuple[int, int] | None = None
    # video: its placeholder id (None = no video), frame sampling, and for Qwen2.5-Omni the audio
    # track interleaved in chunks of seconds_per_chunk (position_id_per_seconds rope ids a second)
    video_token_id: int | None = None
    video_fps: float = VIDEO_FPS
    video_max_frames: int = VIDEO_MAX_FRAMES
    video_seconds_key: str = "second_per_grid_ts"
    audio_in_video: bool = False
    position_id_per_seconds: float = 25.0
    seconds_per_chunk: float = 2.0

    @property
    def merge_size(self) -> int:
        return int(self.image_processor.merge_size) if self.image_processor is not None else 1


def make_image_processor(patch_size: int = 14, merge_size: int = 2, temporal_patch_size: int = 2,
                         norm: dict[str, list[float]] | None = None) -> Any:
    """A Qwen2-VL image processor built from settings; PIL backend when torchvision is absent.

    ``norm`` ({"mean": [r, g, b], "std": [r, g, b]} on pixels scaled to [0, 1]) replaces the
    processor's CLIP constants; the built-in tiny models set it (relax_image_norm in config.json).
    """
    try:
        from transformers import Qwen2VLImageProcessorPil as cls
    except ImportError:  # older transformers: one class
        from transformers import Qwen2VLImageProcessor as cls
    return cls(
        patch_size=patch_size,
        merge_size=merge_size,
        temporal_patch_size=temporal_patch_size,
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        **({"image_mean": list(norm["mean"]), "image_std": list(norm["std"])} if norm else {}),
    )


def make_feature_extractor(n_mels: int, max_source_positions: int) -> Any:
    """A Whisper log-mel extractor whose window matches an encoder of ``max_source_positions``."""
    from transformers import WhisperFeatureExtractor

    frames = 2 * max_source_positions  # the encoder's two convs halve the frames once
    return WhisperFeatureExtractor(
        feature_size=n_mels,
        sampling_rate=SAMPLE_RATE,
        hop_length=HOP_LENGTH,
        chunk_length=max(1, frames * HOP_LENGTH // SAMPLE_RATE),
        n_fft=400,
        padding_value=0.0,
    )


def build_media_processor(config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase) -> MediaProcessor | None:
    """The processor for a model config, or None for a text-only model."""
    vision = getattr(config, "vision_config", None)
    audio = getattr(config, "audio_config", None)
    if vision is None and audio is None:
        return None
    image_proc = None
    if vision is not None:
        image_proc = make_image_processor(vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size,
                                          getattr(config, "relax_image_norm", None))
    feat = None
    if audio is not None:
        feat = make_feature_extractor(audio.num_mel_bins, audio.max_source_positions)
    image_id = getattr(config, "image_token_id", None) or getattr(config, "image_token_index", None)
    audio_id = getattr(config, "audio_token_index", None) or getattr(config, "audio_token_id", None)
    vocab = tokenizer.get_vocab()
    vision_wrap = (vocab[VISION_START], vocab[VISION_END]) if vision is not None else None
    audio_wrap = None
    if audio is not None and config.model_type != "qwen2_audio":  # Qwen2-Audio uses bare audio tokens
        audio_wrap = (vocab[AUDIO_START], vocab[AUDIO_END])
    video_id = getattr(config, "video_token_id", None) or getattr(config, "video_token_index", None)
    omni = config.model_type == "qwen2_5_omni_thinker"
    return MediaProcessor(image_proc, feat, image_id if vision else None, audio_id if audio else None,
                          vision_wrap, audio_wrap, video_token_id=video_id if vision is not None else None,
                          video_seconds_key="video_second_per_grid" if omni else "second_per_grid_ts",
                          audio_in_video=omni and audio is not None,
                          position_id_per_seconds=float(getattr(config, "position_id_per_seconds", 25)),
                          seconds_per_chunk=float(getattr(config, "seconds_per_chunk", 2)))


def decode_image(data: bytes, index: int) -> Any:
    """PNG/JPEG bytes -> RGB PIL image; a ValueError names the item ``index`` when unreadable."""
    from PIL import Image

    try:
        img = Image.open(io.BytesIO(data))
        img.load()
        return img.convert("RGB")
    except Exception as e:  # PIL raises several unrelated types for bad bytes
        raise ValueError(f"image {index}: cannot decode the bytes as an image ({type(e).__name__}: {e})") from None


def decode_wav(data: bytes, index: int) -> np.ndarray:
    """WAV bytes -> mono float32 in [-1, 1] at 16 kHz; a ValueError names the item ``index``."""
    try:
        with wave.open(io.BytesIO(data)) as w:
            rate, width, channels = w.getframerate(), w.getsampwidth(), w.getnchannels()
            raw = w.readframes(w.getnframes())
    except Exception as e:
        raise ValueError(f"audio {index}: cannot decode the bytes as a WAV file ({type(e).__name__}: {e})") from None
    dtypes = {1: np.uint8, 2: np.int16, 4: np.int32}
    if width not in dtypes:
        raise ValueError(f"audio {index}: unsupported WAV sample width {width * 8} bits (use 8, 16 or 32-bit PCM)")
    x = np.frombuffer(raw, dtype=dtypes[width]).astype(np.float32)
    x = (x - 128.0) / 128.0 if width == 1 else x / float(2 ** (8 * width - 1))
    if len(x) == 0:
        raise ValueError(f"audio {index}: the WAV file holds no samples")
    x = x.reshape(-1, channels).mean(axis=1)
    if rate != SAMPLE_RATE:  # linear resampling is enough for the synthetic tasks
        n_out = max(1, round(len(x) * SAMPLE_RATE / rate))
        x = np.interp(np.linspace(0, len(x) - 1, n_out), np.arange(len(x)), x).astype(np.float32)
    return x


def _wrap(ids: list[int], wrap: tuple[int, int] | None) -> list[int]:
    return ids if wrap is None else [wrap[0], *ids, wrap[1]]


def _to_text(prompt: Any, tokenizer: PreTrainedTokenizerBase, add_generation_prompt: bool) -> str:
    if isinstance(prompt, str):
        return prompt
    messages = getattr(prompt, "messages", prompt)  # a relax Sample, or a list of messages
    if not isinstance(messages, Sequence):
        raise TypeError(f"prepare_inputs takes text, a message list or a Sample, not {type(prompt).__name__}")
    msgs = [
        {"role": m["role"], "content": m["content"]}
        if isinstance(m, Mapping)
        else {"role": m.role, "content": m.content}
        for m in messages
    ]
    return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt)


def media_features(images: Sequence[bytes], audios: Sequence[bytes],
                   processor: MediaProcessor | None) -> tuple[dict[str, torch.Tensor], list[int], list[int]]:
    """The model's media kwargs for ``images`` and ``audios`` (``pixel_values`` + ``image_grid_thw``,
    ``input_features`` + ``feature_attention_mask``), and how many placeholder tokens each item
    expands to. A ValueError names the item that cannot be decoded or a model without that tower."""
    out: dict[str, torch.Tensor] = {}
    image_counts: list[int] = []
    audio_counts: list[int] = []
    if images:
        if processor is None or processor.image_processor is None:
            raise ValueError("this model takes no images, but the prompt has an <image> placeholder")
        pil = [decode_image(b, i) for i, b in enumerate(images)]
        feats = processor.image_processor(images=pil, return_tensors="pt")
        out["pixel_values"] = feats["pixel_values"].to(torch.float32)
        out["image_grid_thw"] = feats["image_grid_thw"]
        image_counts = [int(g.prod()) // processor.merge_size**2 for g in feats["image_grid_thw"]]
    if audios:
        if processor is None or processor.feature_extractor is None:
            raise ValueError("this model takes no audio, but the prompt has an <audio> placeholder")
        waves = [decode_wav(b, i) for i, b in enumerate(audios)]
        fe = processor.feature_extractor
        feats = fe(waves, sampling_rate=SAMPLE_RATE, return_attention_mask=True, padding="max_length",
                   truncation=True, return_tensors="pt")
        out["input_features"] = feats["input_features"].to(torch.float32)
        out["feature_attention_mask"] = feats["attention_mask"]
        audio_counts = [audio_token_count(int(n)) for n in feats["attention_mask"].sum(-1)]
    return out, image_counts, audio_counts


def merge_media(first: dict[str, torch.Tensor] | None,
                then: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
    """Media kwargs of ``first`` followed by ``then`` (items concatenated, in token order)."""
    if not first or not then:
        return dict(first or then) if (first or then) else None
    out = dict(first)
    for k, v in then.items():
        out[k] = torch.cat([first[k], v], dim=0) if k in first else v
    return out


def check_expanded(ids: Sequence[int], image_counts: Sequence[int], audio_counts: Sequence[int],
                   processor: MediaProcessor | None) -> None:
    """Raise ValueError unless pre-expanded ``ids`` hold exactly the media tokens the items need
    (a prompt expanded by another processor, or media sent with the wrong prompt)."""
    for kind, token_id, counts in (("image", processor and processor.image_token_id, image_counts),
                                   ("audio", processor and processor.audio_token_id, audio_counts)):
        have = sum(1 for t in ids if token_id is not None and t == token_id)
        if have != sum(counts):
            raise ValueError(f"input_ids hold {have} {kind} token(s) but the {len(counts)} {kind} item(s) sent "
                             f"expand to {sum(counts)}; send input_ids expanded by this model's processor "
                             f"(relax.models.prepare_inputs) or send 'text' with placeholders")


def prepare_inputs(
    prompt: Any,
    images: Sequence[bytes],
    audios: Sequence[bytes],
    tokenizer: PreTrainedTokenizerBase,
    processor: MediaProcessor | None,
    add_generation_prompt: bool = True,
    videos: Sequence[bytes] | None = None,
) -> dict[str, torch.Tensor]:
    """Model kwargs (batch of one) for a prompt with media placeholders.

    ``prompt`` is raw text (used as is), a list of chat messages, or a relax ``Sample``
    (rendered with the chat template). The i-th ``<image>`` is ``images[i]``, the i-th
    ``<audio>`` is ``audios[i]``, the i-th ``<video>`` is ``videos[i]``. Returns ``input_ids``,
    ``attention_mask`` and, when media is present, ``pixel_values`` + ``image_grid_thw``,
    ``input_features`` + ``feature_attention_mask`` and/or ``pixel_values_videos`` +
    ``video_grid_thw`` (``relax.models.video_inputs``). ``videos`` default to a Sample's own
    (read with ``relax.data.video.load_video``), so callers written for images and audio take
    video samples too.
    """
    if videos is None:
        videos = [load_video(r) for r in getattr(prompt, "videos", ())]
    text = _to_text(prompt, tokenizer, add_generation_prompt)
    n_img, n_aud, n_vid = text.count(IMAGE_TOKEN), text.count(AUDIO_TOKEN), text.count(VIDEO_TOKEN)
    if n_img != len(images) or n_aud != len(audios) or n_vid != len(videos):
        raise ValueError(
            f"the prompt has {n_img} {IMAGE_TOKEN}, {n_aud} {AUDIO_TOKEN} and {n_vid} {VIDEO_TOKEN} placeholders but "
            f"{len(images)} image(s), {len(audios)} audio clip(s) and {len(videos)} video(s) were given"
        )
    out, image_counts, audio_counts = media_features(images, audios, processor)
    video_spans: list[list[int]] = []
    video_audio = None
    if videos:
        video_out, video_spans, _ = video_features(videos, processor)
        video_audio = {k: video_out.pop(k) for k in ("input_features", "feature_attention_mask") if k in video_out}
        out.update(video_out)

    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    expanded: list[int] = []
    audio_rows: list[tuple[str, int]] = []  # ("audio" | "video", item): whose features each audio span is
    img_i = aud_i = vid_i = 0
    for tid in ids:
        if processor is not None and tid == processor.image_token_id and images:
            expanded += _wrap([tid] * image_counts[img_i], processor.vision_wrap)
            img_i += 1
        elif processor is not None and tid == processor.audio_token_id and audios:
            expanded += _wrap([tid] * audio_counts[aud_i], processor.audio_wrap)
            audio_rows.append(("audio", aud_i))
            aud_i += 1
        elif processor is not None and tid == processor.video_token_id and videos:
            expanded += video_spans[vid_i]
            if video_audio:
                audio_rows.append(("video", vid_i))
            vid_i += 1
        else:
            expanded.append(tid)
    if img_i != len(images) or aud_i != len(audios) or vid_i != len(videos):
        raise ValueError(
            "a media placeholder did not tokenize to the model's media token id; build the tokenizer "
            "with relax.models.build_tokenizer so <image>/<audio>/<video> are single special tokens"
        )
    if video_audio:  # the model fills audio tokens with feature rows in token order
        rows = {"audio": {k: out.get(k) for k in video_audio}, "video": video_audio}
        for k in video_audio:
            out[k] = torch.cat([rows[kind][k][i:i + 1] for kind, i in audio_rows])
    out["input_ids"] = torch.tensor([expanded], dtype=torch.long)
    out["attention_mask"] = torch.ones_like(out["input_ids"])
    return out
