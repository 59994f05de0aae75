"""Video clips: decode an MP4 (or a packed folder of frames plus a WAV) into sampled RGB frames and its audio track.

Decoding is PyAV's (FFmpeg bundled in its wheel, so no system codecs are needed); Relax never
parses a container itself. A video is one of:

* a file FFmpeg can demux (MP4, MKV, WEBM, ...) with one video stream and at most one audio
  stream used (the first);
* a folder of frames (``*.png`` / ``*.jpg`` in name order) with an optional ``audio.wav`` and
  an optional ``video.json`` (``{"fps": 4}``; 2 fps without it). A snapshot stores the folder
  as one uncompressed, byte-reproducible tar (:func:`pack_folder`), hashed like any file.

:func:`probe` checks what a snapshot needs to know (it decodes every frame, so an
undecodable stream is found there, not in a trainer); :func:`decode_video` samples the
frames a model sees (``fps``, ``max_frames``) and the track resampled to 16 kHz mono.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import wave
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

FRAME_SUFFIXES = (".png", ".jpg", ".jpeg")
FOLDER_AUDIO = "audio.wav"
FOLDER_META = "video.json"
FOLDER_FPS = 2.0  # a folder without video.json: Qwen's default sampling rate
AUDIO_RATE = 16_000


@dataclass(frozen=True)
class VideoInfo:
    """What a snapshot checks: frame count, duration, size and whether there is an audio track."""

    frames: int
    seconds: float
    width: int
    height: int
    has_audio: bool
    format: str


@dataclass
class Clip:
    """Sampled frames ((T, H, W, 3) uint8), the seconds each sampled frame spans, and the audio
    track (16 kHz mono float32 in [-1, 1]) or None."""

    frames: np.ndarray
    seconds_per_frame: float
    audio: np.ndarray | None


def load_video(ref: Any) -> bytes:
    """A sample's video (a ``MediaRef``) as bytes: inline, or read from its path (a snapshot's
    media file) and checked against its sha256, as ``Snapshot.load_media`` checks other media."""
    if ref.data is not None:
        return ref.data
    from relax import objstore

    data = objstore.read_bytes(ref.path)
    if ref.sha256 and hashlib.sha256(data).hexdigest() != ref.sha256:
        raise ValueError(f"video {ref.path} fails its checksum; the snapshot is corrupt")
    return data


def is_folder_pack(data: bytes) -> bool:
    """A tar written by :func:`pack_folder` (``ustar`` magic at offset 257)."""
    return data[257:262] == b"ustar"


def pack_folder(files: Mapping[str, bytes]) -> bytes:
    """Frames (``*.png``/``*.jpg``), an optional ``audio.wav`` and ``video.json`` as one tar whose
    bytes depend only on the names and contents (sorted, zero mtimes, no owners). Other names raise."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name in sorted(files):
            if not (name.lower().endswith(FRAME_SUFFIXES) or name in (FOLDER_AUDIO, FOLDER_META)):
                raise ValueError(f"video folder holds {name!r}; a folder video holds only frames "
                                 f"({', '.join(FRAME_SUFFIXES)}), {FOLDER_AUDIO} and {FOLDER_META}")
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(files[name]), 0, 0o644
            tar.addfile(info, io.BytesIO(files[name]))
    return out.getvalue()


def _unpack(data: bytes) -> tuple[list[bytes], bytes | None, float]:
    """(frame bytes in name order, audio.wav bytes or None, fps) of a packed folder."""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        members = {m.name: m for m in tar.getmembers() if m.isfile()}
        read = {name: tar.extractfile(m).read() for name, m in members.items()}
    frames = [read[n] for n in sorted(read) if n.lower().endswith(FRAME_SUFFIXES)]
    fps = FOLDER_FPS
    if FOLDER_META in read:
        fps = float(json.loads(read[FOLDER_META]).get("fps", FOLDER_FPS))
        if not fps > 0:
            raise ValueError(f"{FOLDER_META} gives fps {fps}; it must be positive")
    return frames, read.get(FOLDER_AUDIO), fps


def _wav_mono(data: bytes) -> np.ndarray:
    with wave.open(io.BytesIO(data)) as w:
        rate, width, channels = w.getframerate(), w.getsampwidth(), w.getnchannels()
        raw = w.readframes(w.getnframes())
    dtypes = {1: np.uint8, 2: np.int16, 4: np.int32}
    if width not in dtypes:
        raise ValueError(f"{FOLDER_AUDIO} has {width * 8}-bit samples; use 8, 16 or 32-bit PCM")
    x = np.frombuffer(raw, dtype=dtypes[width]).astype(np.float32)
    x = (x - 128.0) / 128.0 if width == 1 else x / float(2 ** (8 * width - 1))
    x = x.reshape(-1, channels).mean(axis=1)
    if rate != AUDIO_RATE and len(x):
        n_out = max(1, round(len(x) * AUDIO_RATE / rate))
        x = np.interp(np.linspace(0, len(x) - 1, n_out), np.arange(len(x)), x).astype(np.float32)
    return x


def _rgb(frame_bytes: bytes) -> np.ndarray:
    from PIL import Image

    with Image.open(io.BytesIO(frame_bytes)) as img:
        return np.asarray(img.convert("RGB"))


def probe(data: bytes, max_frames: int) -> VideoInfo:
    """Decode every frame (stopping past ``max_frames``) and read the audio track's presence and
    duration; a ValueError says why the bytes are not a usable video."""
    if is_folder_pack(data):
        frames, audio, fps = _unpack(data)
        if not frames:
            raise ValueError("the video folder holds no frames")
        sizes = {_rgb(f).shape[:2] for f in frames[: max_frames + 1]}
        if len(sizes) > 1:
            raise ValueError(f"the video folder's frames differ in size ({sorted(sizes)}); make them all one size")
        (height, width), = sizes
        if audio is not None:
            _wav_mono(audio)
        return VideoInfo(len(frames), len(frames) / fps, width, height, audio is not None, "frames")
    import av

    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise ValueError("the file has no video stream")
            stream = container.streams.video[0]
            count, last_time, rate = 0, 0.0, float(stream.average_rate or 0) or None
            for frame in container.decode(stream):
                count += 1
                last_time = float(frame.time or 0.0)
                if count > max_frames:
                    break
            fmt = container.format.name
        with av.open(io.BytesIO(data), mode="r") as container:
            has_audio = bool(container.streams.audio)
    except av.FFmpegError as e:
        raise ValueError(f"FFmpeg cannot decode it ({type(e).__name__}: {e})") from None
    if count == 0:
        raise ValueError("the video stream holds no frames")
    seconds = last_time + (1.0 / rate if rate else 0.0)
    return VideoInfo(count, seconds, stream.width, stream.height, has_audio, fmt)


def sample_indices(total: int, seconds: float, fps: float, max_frames: int) -> list[int]:
    """Which of ``total`` decoded frames to keep: ``fps`` per second of video, at most
    ``max_frames`` and at least 1, spread evenly from the first frame to the last."""
    n = max(1, min(total, max_frames, round(seconds * fps) or 1))
    return [int(round(i)) for i in np.linspace(0, total - 1, n)]


def decode_video(data: bytes, fps: float, max_frames: int) -> Clip:
    """The frames a model sees (sampled at ``fps``, at most ``max_frames``) and the audio track.

    ``seconds_per_frame`` is the video's duration over the frames kept, the time step that
    Qwen's temporal rotary positions are scaled by."""
    if is_folder_pack(data):
        frame_bytes, audio_bytes, native = _unpack(data)
        if not frame_bytes:
            raise ValueError("the video folder holds no frames")
        seconds = len(frame_bytes) / native
        keep = sample_indices(len(frame_bytes), seconds, fps, max_frames)
        frames = np.stack([_rgb(frame_bytes[i]) for i in keep])
        audio = _wav_mono(audio_bytes) if audio_bytes is not None else None
        return Clip(frames, seconds / len(keep), audio)
    import av

    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise ValueError("the file has no video stream")
            stream = container.streams.video[0]
            rate = float(stream.average_rate or 0) or None
            decoded = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
        audio = _decode_audio(data)
    except av.FFmpegError as e:
        raise ValueError(f"FFmpeg cannot decode it ({type(e).__name__}: {e})") from None
    if not decoded:
        raise ValueError("the video stream holds no frames")
    seconds = len(decoded) / (rate or FOLDER_FPS)  # no declared rate: the folder default
    keep = sample_indices(len(decoded), seconds, fps, max_frames)
    if audio is not None:  # the encoder's tail padding is past the last frame: not part of the clip
        audio = audio[: round(seconds * AUDIO_RATE)]
    return Clip(np.stack([decoded[i] for i in keep]), seconds / len(keep), audio)


def _decode_audio(data: bytes) -> np.ndarray | None:
    """The first audio stream resampled to 16 kHz mono float32, or None without one."""
    import av

    with av.open(io.BytesIO(data), mode="r") as container:
        if not container.streams.audio:
            return None
        resampler = av.AudioResampler(format="flt", layout="mono", rate=AUDIO_RATE)
        parts = []
        for frame in container.decode(container.streams.audio[0]):
            parts += [f.to_ndarray().reshape(-1) for f in resampler.resample(frame)]
        parts += [f.to_ndarray().reshape(-1) for f in resampler.resample(None)]
    return np.concatenate(parts).astype(np.float32) if parts else np.zeros(0, np.float32)

