"""Video model inputs: frames laid out as Qwen's video patches, Omni's audio interleaved exactly as
HF's Qwen2.5-Omni processor interleaves it, frame sampling, and folder videos."""

from __future__ import annotations

import io
import json
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import Qwen2_5OmniProcessor

from relax.config import load_config
from relax.data.suite import flash_beep, tones
from relax.data.video import decode_video, pack_folder, probe, sample_indices
from relax.models import build_tokenizer, prepare_inputs
from relax.models.builders import build_processor
from relax.models.tokenizers import AUDIO_END, AUDIO_START, AUDIO_TOKEN, VIDEO_TOKEN
from relax.models.video_inputs import video_features


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer("bpe-tiny")


def processor(tokenizer, name):
    return build_processor(load_config(None, [f"model.name_or_path={name}"]).model, tokenizer)


def png(rgb: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "PNG")
    return buf.getvalue()


def test_a_still_video_is_its_image(tokenizer):
    # Qwen's image path copies a picture over the temporal patch; a video of that picture twice is
    # the same patch, so the two paths must give the same pixels
    proc = processor(tokenizer, "tiny-qwen2-vl")
    frame = (np.random.default_rng(0).random((56, 56, 3)) * 255).astype(np.uint8)
    video = pack_folder({"0.png": png(frame), "1.png": png(frame), "video.json": b'{"fps": 4}'})
    out, spans, _ = video_features([video], proc)
    image = proc.image_processor(images=[Image.fromarray(frame)], return_tensors="pt")
    torch.testing.assert_close(out["pixel_values_videos"], image["pixel_values"].float())
    assert out["video_grid_thw"].tolist() == image["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert out["second_per_grid_ts"].tolist() == [0.5]  # 2 frames at 4 fps
    assert len(spans[0]) == 16 + 2  # 16 video tokens inside <|vision_start|> ... <|vision_end|>


@pytest.mark.parametrize("frames,fps", [(8, 4), (16, 2)])
def test_omni_interleaves_audio_like_hf_processor(tokenizer, frames, fps):
    # 16 frames at 2 fps = 8 s: video positions 0, 25, 50, ... span several 2 s chunks
    proc = processor(tokenizer, "tiny-omni")
    config = flash_beep.FlashBeepConfig(frames=frames, fps=fps, max_flashes=2)
    sample = flash_beep.generate_with_config(0, "train", 1, config)[0]
    out, spans, counts = video_features([sample.videos[0].data], proc)
    hf = SimpleNamespace(audio_bos_token=AUDIO_START, audio_eos_token=AUDIO_END, video_token=VIDEO_TOKEN,
                         audio_token=AUDIO_TOKEN, video_processor=SimpleNamespace(merge_size=proc.merge_size))
    hf.get_chunked_index = lambda indices, n: Qwen2_5OmniProcessor.get_chunked_index(hf, indices, n)
    text = Qwen2_5OmniProcessor.replace_video_with_audio_token(
        hf,
        {
            "video_grid_thw": out["video_grid_thw"].numpy(),
            "video_second_per_grid": out["video_second_per_grid"].tolist(),
        },
        0,
        {"num_audio_tokens": counts},
        0,
        position_id_per_seconds=25,
        seconds_per_chunk=2.0,
    )
    assert spans[0][1:-1] == tokenizer(text, add_special_tokens=False)["input_ids"]
    if frames == 16:  # the video tokens come in more than one run: the layout really is chunked
        video_id = proc.video_token_id
        runs = sum(1 for a, b in zip(spans[0], spans[0][1:], strict=False) if a != video_id and b == video_id)
        assert runs > 1


def test_audio_features_follow_token_order(tokenizer):
    # an <audio> clip before a <video> with its track: input_features rows in that order
    proc = processor(tokenizer, "tiny-omni")
    clip = tones.generate(0, "train", 1, 1)[0].audios[0].data
    video = flash_beep.generate(0, "train", 1, 1)[0].videos[0].data
    both = prepare_inputs("<audio> then <video>", [], [clip], tokenizer, proc, videos=[video])
    alone = prepare_inputs("<audio>", [], [clip], tokenizer, proc)
    track, _, _ = video_features([video], proc)
    assert both["input_features"].shape[0] == 2
    torch.testing.assert_close(both["input_features"][0], alone["input_features"][0])
    torch.testing.assert_close(both["input_features"][1], track["input_features"][0])


def test_frame_sampling_keeps_fps_within_max_frames():
    assert sample_indices(8, 2.0, 4.0, 16) == list(range(8))
    assert sample_indices(8, 2.0, 2.0, 16) == [0, 2, 5, 7]  # every other frame, first and last kept
    assert sample_indices(300, 10.0, 4.0, 16) == [round(x) for x in np.linspace(0, 299, 16)]
    assert sample_indices(3, 0.1, 2.0, 16) == [0]


def test_a_folder_video_decodes_to_its_frames_and_track():
    rng = np.random.default_rng(1)
    frames = [(rng.random((28, 42, 3)) * 255).astype(np.uint8) for _ in range(6)]
    wav = tones.encode_wav(np.zeros(16000 * 3 // 2))
    files = {f"{i:03d}.png": png(f) for i, f in enumerate(frames)}
    packed = pack_folder({**files, "audio.wav": wav, "video.json": json.dumps({"fps": 4}).encode()})
    assert packed == pack_folder(dict(reversed(list({**files, "audio.wav": wav,
                                                     "video.json": b'{"fps": 4}'}.items()))))  # order-free bytes
    info = probe(packed, 100)
    assert (info.frames, info.seconds, info.width, info.height, info.has_audio) == (6, 1.5, 42, 28, True)
    clip = decode_video(packed, 4.0, 16)
    assert np.array_equal(clip.frames, np.stack(frames)) and clip.seconds_per_frame == 0.25
    assert clip.audio is not None and len(clip.audio) == 24000
    with pytest.raises(ValueError, match="holds 'notes.txt'"):
        pack_folder({"notes.txt": b"x"})


def test_mp4_decodes_to_the_frames_and_track_it_was_made_from():
    config = flash_beep.CONFIGS[1]
    clip = flash_beep.draw_clip(random.Random(2), config)
    data = flash_beep.encode_mp4(flash_beep.render_frames(clip, config), config.fps, flash_beep.synthesize_audio(clip,
                                                                                                                  config))
    decoded = decode_video(data, 4.0, 16)
    assert decoded.frames.shape == (12, 56, 56, 3) and decoded.seconds_per_frame == 0.25
    for frame, colour in clip.flashes:  # the square's centre keeps its colour through H.264, in both frames
        for f in (frame, frame + 1):
            centre = decoded.frames[f, clip.y + config.square // 2, clip.x + config.square // 2].astype(int)
            assert np.abs(centre - np.array(flash_beep.COLOURS[colour])).max() < 40
    # the beep sits in its flash's two frames (8000 samples): AAC's priming is hidden by the edit list
    energy = [float(np.abs(decoded.audio[i * 8000:(i + 1) * 8000]).max()) for i in range(6)]
    assert 2 * int(np.argmax(energy)) == clip.flashes[clip.beep_flash][0]
