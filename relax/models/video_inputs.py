"""Video prompts for Qwen2.5-VL and the Qwen2.5-Omni thinker: sampled frames as ``pixel_values_videos`` and, for
Omni, the clip's audio track interleaved with its frames in time.

What the model classes of transformers take, built the way HF's processors build it:

* frames are sampled by :func:`relax.data.video.decode_video` (``MediaProcessor.video_fps``
  per second, at most ``video_max_frames``), padded to a multiple of the temporal patch (2)
  by repeating the last frame, as ``Qwen2VLVideoProcessor`` does, and each frame is resized
  and normalised by the model's own image processor (an image's patch grid); a pair of
  frames is one temporal patch, laid out as the video processor's ``patchify`` lays it out
  (channel, time, row, column). HF's video processor itself needs torchvision, which Relax
  does not install.
* ``video_grid_thw`` per video, and the seconds each temporal patch spans
  (``second_per_grid_ts`` for Qwen2.5-VL, ``video_second_per_grid`` for Omni), which scale
  the temporal rotary positions.
* Omni with an audio track (``use_audio_in_video``): the placeholder becomes
  ``<|vision_start|><|audio_start|>`` + chunks of video tokens and audio tokens, each chunk
  ``seconds_per_chunk`` of the clip, + ``<|audio_end|><|vision_end|>``, exactly as
  ``Qwen2_5OmniProcessor.replace_video_with_audio_token``; the track's log-mel features join
  ``input_features`` in token order. A prompt's videos all carry a track or none do (the
  model takes one ``use_audio_in_video`` flag per forward).

The flag rides in the media dict as a tensor (``AUDIO_IN_VIDEO``), so media dicts still
concatenate per key; :func:`model_media_kwargs` turns it back into the bool the model takes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from relax.data.video import AUDIO_RATE, decode_video

AUDIO_IN_VIDEO = "use_audio_in_video"


def model_media_kwargs(media: dict[str, Any] | None) -> dict[str, Any]:
    """A media dict (one row's, or rows' concatenated) as model kwargs: the per-prompt
    ``use_audio_in_video`` flags become the one bool the model takes. Rows whose flags differ
    cannot share a forward; their callers batch them apart (a ValueError says so)."""
    out = dict(media or {})
    flag = out.pop(AUDIO_IN_VIDEO, None)
    if flag is not None:
        if bool(flag.any()) != bool(flag.all()):
            raise ValueError("rows with and without video audio tracks in one forward; batch them apart "
                             "(relax.models.video_inputs.audio_in_video)")
        out[AUDIO_IN_VIDEO] = bool(flag.all())
    return out


def audio_in_video(media: dict[str, Any] | None) -> bool:
    """Whether a media dict's videos carry their audio track (the key rows are batched by)."""
    flag = (media or {}).get(AUDIO_IN_VIDEO)
    return flag is not None and bool(flag.any())


def audio_token_count(n_frames: int) -> int:
    """Tokens a Qwen2-Audio / Omni encoder emits for ``n_frames`` mel frames (conv /2, pool /2)."""
    after_conv = (n_frames - 1) // 2 + 1
    return (after_conv - 2) // 2 + 1


def chunk_bounds(positions: np.ndarray, per_chunk: int) -> list[tuple[int, int]]:
    """[start, end) index ranges of ``positions`` (non-decreasing position ids) split where they
    pass each multiple of ``per_chunk``: ``Qwen2_5OmniProcessor.get_chunked_index``, step for
    step (one boundary per position, empty ranges kept), so token layout and rope agree."""
    out, start, chunk = [], 0, 1
    for i, value in enumerate(positions):
        if value >= chunk * per_chunk:
            out.append((start, i))
            start, chunk = i, chunk + 1
    out.append((start, len(positions)))
    return out


def _frame_patches(frames: np.ndarray, processor: Any) -> tuple[torch.Tensor, list[int]]:
    """(grid_t * grid_h * grid_w, C * T * p * p) patches of a clip and its [t, h, w] grid."""
    from PIL import Image

    proc = processor.image_processor
    temporal = int(proc.temporal_patch_size)
    if pad := -len(frames) % temporal:  # HF's video patchify repeats the last frame
        frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)])
    feats = proc(images=[Image.fromarray(f) for f in frames], return_tensors="pt")
    _, gh, gw = (int(v) for v in feats["image_grid_thw"][0])
    patch = int(proc.patch_size)
    # each frame alone: (gh*gw, C, T, p, p) with its pixels copied along T; keep one copy per frame
    single = feats["pixel_values"].view(len(frames), gh * gw, 3, temporal, patch, patch)[:, :, :, 0]
    grid_t = len(frames) // temporal
    pairs = single.view(grid_t, temporal, gh * gw, 3, patch, patch).permute(0, 2, 3, 1, 4, 5)
    return pairs.reshape(grid_t * gh * gw, 3 * temporal * patch * patch).to(torch.float32), [grid_t, gh, gw]


def video_features(videos: Sequence[bytes], processor: Any
                   ) -> tuple[dict[str, torch.Tensor], list[list[int]], list[int]]:
    """``(media kwargs, token ids each <video> expands to, audio feature rows in token order)``.

    The kwargs hold ``pixel_values_videos``, ``video_grid_thw``, the seconds per temporal
    patch and, for Omni with audio tracks, ``input_features``/``feature_attention_mask`` (one
    row per video, to be placed among the prompt's other audio rows) and ``AUDIO_IN_VIDEO``."""
    if processor is None or processor.image_processor is None or processor.video_token_id is None:
        raise ValueError("this model takes no video, but the prompt has a <video> placeholder")
    clips = []
    for i, data in enumerate(videos):
        try:
            clips.append(decode_video(data, processor.video_fps, processor.video_max_frames))
        except Exception as e:  # PyAV, PIL and tarfile raise many types for bytes they cannot read
            raise ValueError(f"video {i}: cannot decode it ({type(e).__name__}: {e})") from None
    with_audio = processor.audio_in_video and [c.audio is not None and len(c.audio) > 0 for c in clips]
    if with_audio and any(with_audio) and not all(with_audio):
        raise ValueError("a prompt's videos must all have an audio track or none (the model takes one "
                         "use_audio_in_video flag per prompt); add a track or strip them all")
    use_audio = bool(with_audio) and all(with_audio)
    pixels, grids, seconds, spans = [], [], [], []
    temporal = int(processor.image_processor.temporal_patch_size)
    merge = processor.merge_size
    audio_out: dict[str, torch.Tensor] = {}
    audio_counts: list[int] = []
    if use_audio:
        fe = processor.feature_extractor
        feats = fe([c.audio for c in clips], sampling_rate=AUDIO_RATE, return_attention_mask=True,
                   padding="max_length", truncation=True, return_tensors="pt")
        audio_out = {"input_features": feats["input_features"].to(torch.float32),
                     "feature_attention_mask": feats["attention_mask"]}
        audio_counts = [audio_token_count(int(n)) for n in feats["attention_mask"].sum(-1)]
    start, end = processor.vision_wrap
    for i, clip in enumerate(clips):
        patches, grid = _frame_patches(clip.frames, processor)
        pixels.append(patches)
        grids.append(grid)
        seconds.append(temporal * clip.seconds_per_frame)
        n_video = grid[0] * grid[1] * grid[2] // merge**2
        if not use_audio:
            spans.append([start, *[processor.video_token_id] * n_video, end])
            continue
        # HF's layout: every merged video token at its frame's time in position ids, chunked
        per_frame = grid[1] * grid[2] // merge**2
        video_pos = np.repeat(np.arange(grid[0]), per_frame) * seconds[-1] * processor.position_id_per_seconds
        per_chunk = int(processor.position_id_per_seconds * processor.seconds_per_chunk)
        v_chunks = chunk_bounds(video_pos, per_chunk)
        a_chunks = chunk_bounds(np.arange(audio_counts[i]), per_chunk)
        ids = [start, processor.audio_wrap[0]]
        for j in range(max(len(v_chunks), len(a_chunks))):
            if j < len(v_chunks):
                ids += [processor.video_token_id] * (v_chunks[j][1] - v_chunks[j][0])
            if j < len(a_chunks):
                ids += [processor.audio_token_id] * (a_chunks[j][1] - a_chunks[j][0])
        spans.append([*ids, processor.audio_wrap[1], end])
    out = {"pixel_values_videos": torch.cat(pixels), "video_grid_thw": torch.tensor(grids, dtype=torch.long),
           processor.video_seconds_key: torch.tensor(seconds, dtype=torch.float32), **audio_out}
    if use_audio:
        out[AUDIO_IN_VIDEO] = torch.tensor([True])
    return out, spans, audio_counts
