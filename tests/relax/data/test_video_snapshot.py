"""Video samples in snapshots: MP4 files and frame folders round trip with a stable content hash, and a
video that cannot be decoded, has no frames, runs past a limit or lacks the track its row needs is
refused at snapshot time, naming the row and the file."""

from __future__ import annotations

import io
import json
import os
import random

import numpy as np
import pytest
from PIL import Image

from relax import objstore
from relax.config import DataConfig
from relax.data.errors import DataError
from relax.data.samples import Sample
from relax.data.snapshot import Snapshot
from relax.data.sources import snapshot_from_config
from relax.data.suite import flash_beep
from relax.data.video import decode_video
from relax.services.trainable import check_trainable

CONFIG = flash_beep.CONFIGS[1]


def mp4(seed: int, audio: bool = True) -> bytes:
    clip = flash_beep.draw_clip(random.Random(seed), CONFIG)
    track = flash_beep.synthesize_audio(clip, CONFIG) if audio else None
    return flash_beep.encode_mp4(flash_beep.render_frames(clip, CONFIG), CONFIG.fps, track)


def png(value: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((28, 28, 3), value, dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def dataset(folder, videos, files, needs_audio=False, **limits) -> DataConfig:
    """``folder/train.jsonl`` with one row per entry of ``videos`` (line 1 on) and ``files`` written."""
    for name, data in files.items():
        objstore.write_bytes(objstore.join(folder, name), data)
    meta = {"needs_video_audio": True} if needs_audio else {}
    rows = [{"id": f"v{i}", "messages": "<video> how many flashes?", "answer": "1", "videos": [ref], "metadata": meta}
            for i, ref in enumerate(videos)]
    objstore.write_bytes(objstore.join(folder, "train.jsonl"), "".join(json.dumps(r) + "\n" for r in rows).encode())
    objstore.write_bytes(objstore.join(folder, "eval.jsonl"), b'{"id": "e0", "messages": "2+2?", "answer": "4"}\n')
    return DataConfig(train_url=objstore.join(folder, "train.jsonl"), eval_url=objstore.join(folder, "eval.jsonl"),
                      **limits)


def test_videos_round_trip_with_a_stable_content_hash(tmp_path):
    frames = {f"clip/{i:02d}.png": png(40 * i) for i in range(4)}
    files = {"a.mp4": mp4(1), **frames, "clip/audio.wav": _wav(), "clip/video.json": b'{"fps": 2}'}
    data = dataset(str(tmp_path / "src"), ["a.mp4", "clip"], files)
    first = snapshot_from_config(data, str(tmp_path / "root"))
    assert first.created and first.media_files == 2
    again = snapshot_from_config(dataset(str(tmp_path / "moved"), ["a.mp4", "clip/"], files), str(tmp_path / "root2"))
    assert again.id == first.id  # the same content read from elsewhere (a folder with a trailing slash too)
    snap = Snapshot(first.url)
    rows = list(snap.samples("train"))
    assert [r.modality for r in rows] == ["video", "video"]
    assert [r.videos[0].path.rsplit(".", 1)[1] for r in rows] == ["mp4", "tar"]
    assert snap.load_media(rows[0].videos[0]) == files["a.mp4"]
    clip = decode_video(snap.load_media(rows[1].videos[0]), 2.0, 16)
    assert clip.frames.shape == (4, 28, 28, 3) and clip.frames[3, 0, 0, 0] == 120 and clip.audio is not None
    # one frame changes: a new id
    changed = {**files, "clip/03.png": png(121)}
    assert snapshot_from_config(dataset(str(tmp_path / "c"), ["a.mp4", "clip"], changed), str(tmp_path / "r3")).id \
        != first.id


def test_suite_videos_snapshot_and_keep_their_bytes(tmp_path):
    from relax.data.snapshot import plan_snapshot, write_snapshot

    samples = flash_beep.generate(0, "train", 2, 1)
    info = write_snapshot(plan_snapshot({"train": samples, "eval": flash_beep.generate(0, "eval", 1, 1)}),
                          str(tmp_path))
    assert info.id == plan_snapshot({"train": samples, "eval": flash_beep.generate(0, "eval", 1, 1)}).id
    back = list(Snapshot(info.url).samples("train"))
    assert [Snapshot(info.url).load_media(s.videos[0]) for s in back] == [s.videos[0].data for s in samples]
    assert back[0].to_json()["videos"][0]["sha256"] and back[0].metadata["needs_video_audio"] is True


def _wav() -> bytes:
    from relax.data.suite.tones import encode_wav

    return encode_wav(np.zeros(32000))


@pytest.mark.parametrize("case,expected", [
    ("garbage", "not a video Relax can decode"),
    ("empty_folder", "holds no frames"),
    ("too_many_frames", "more than data.max_video_frames=5 frames"),
    ("too_long", "3.0 s long, over data.max_video_seconds=1.5"),
    ("no_track", "has no audio track, but its row needs one"),
    ("stray_file", "holds 'notes.txt'"),
])
def test_bad_videos_are_refused_naming_row_and_file(tmp_path, case, expected):
    files = {"good.mp4": mp4(2), "bad.mp4": b"\x00\x00\x00\x18ftypisom" + b"\x00" * 64,
             "silent.mp4": mp4(3, audio=False), "empty/video.json": b'{"fps": 2}',
             "mixed/0.png": png(1), "mixed/notes.txt": b"x"}
    ref, kw, needs = {"garbage": ("bad.mp4", {}, False), "empty_folder": ("empty", {}, False),
                      "too_many_frames": ("good.mp4", {"max_video_frames": 5}, False),
                      "too_long": ("good.mp4", {"max_video_seconds": 1.5}, False),
                      "no_track": ("silent.mp4", {}, True), "stray_file": ("mixed", {}, False)}[case]
    data = dataset(str(tmp_path / "src"), [ref], files, needs_audio=needs, **kw)
    root = tmp_path / "root"
    with pytest.raises(DataError) as err:
        snapshot_from_config(data, str(root))
    assert "train.jsonl:1: row 'v0' videos[0]" in str(err.value)
    assert expected in str(err.value)
    assert ref.split("/")[0] in str(err.value)
    assert not root.exists()


def test_a_link_out_of_a_video_folder_is_refused(tmp_path):
    secret = tmp_path / "secret.png"
    secret.write_bytes(png(9))
    data = dataset(str(tmp_path / "src"), ["clip"], {"clip/00.png": png(1)})
    os.symlink(secret, tmp_path / "src" / "clip" / "01.png")
    with pytest.raises(DataError, match="a link to .*secret.png outside the folder"):
        snapshot_from_config(data, str(tmp_path / "root"))


def test_sample_schema_counts_video_placeholders():
    row = {"id": "x", "messages": "<video> <video>", "answer": "1", "videos": ["a.mp4"]}
    with pytest.raises(DataError, match="2 <video> placeholder"):
        Sample.from_json(row, "t.jsonl:1")
    text = Sample.from_json({"id": "t", "messages": "hi", "answer": "1"}, "t.jsonl:2")
    assert "videos" not in text.to_json()  # rows without video keep their canonical bytes (and snapshot ids)


def test_video_tasks_are_refused_with_engines_that_would_not_see_the_videos(tmp_path):
    # HTTP engines are sent a prompt's images and audio only: a video prompt there would lose its clip
    from relax.config import ConfigError
    from relax.services.run_context import RunContext
    from tests.relax.services.runtime_helpers import tiny_config

    cfg = tiny_config(f"file://{tmp_path}", "v", "model.name_or_path=tiny-omni", "model.family=qwen2_5_omni",
                      "data.tasks=[flash_beep]", "data.train_per_task=4", "data.eval_per_task=2",
                      "rollout.engine_processes=1")
    with pytest.raises(ConfigError, match=r"tasks \['flash_beep'\] carry videos, which only the in-process"):
        check_trainable(RunContext(cfg))
