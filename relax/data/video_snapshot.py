"""How a snapshot takes a video: a folder of frames packed into one file, and the checks against the limits.

A snapshot holds each video as one content-addressed file: an MP4 (or any container FFmpeg
demuxes) as it is, a folder of frames as the tar :func:`relax.data.video.pack_folder`
writes. Every video is decoded once while the snapshot is planned, so a file that cannot be
decoded, holds no frames, runs past ``data.max_video_frames`` / ``data.max_video_seconds``
or lacks the audio track its row needs (``metadata.needs_video_audio``) is refused there,
naming the row and the file, before anything is written.
"""

from __future__ import annotations

import os
import posixpath

from relax import objstore
from relax.data.errors import DataError
from relax.data.video import pack_folder, probe


def read_folder(url: str, where: str) -> bytes:
    """The folder video at ``url`` packed into one file. On a local disk, a member that is a
    link leading out of the folder is refused, as a row's own media path would be."""
    fs, path = objstore.open_fs(url)
    local = objstore.local_path(url)
    files: dict[str, bytes] = {}
    for name in objstore.list_dir(url):
        member = objstore.join(url, name)
        if local is not None:
            real, root = os.path.realpath(os.path.join(local, name)), os.path.realpath(local)
            if not real.startswith(root.rstrip(os.sep) + os.sep):
                raise DataError(f"{where}: video folder {url} holds {name!r}, a link to {real} outside the folder; "
                                f"copy the file into the folder")
        if fs.isdir(posixpath.join(path, name)):
            raise DataError(f"{where}: video folder {url} holds a subfolder {name!r}; a folder video holds only "
                            f"frames, audio.wav and video.json")
        files[name] = objstore.read_bytes(member)
    try:
        return pack_folder(files)
    except ValueError as e:
        raise DataError(f"{where}: video folder {url}: {e}; move other files out of the folder") from None


def is_folder(url: str) -> bool:
    fs, path = objstore.open_fs(url)
    try:
        return bool(fs.isdir(path))
    except OSError:
        return False


def check_video(data: bytes, where: str, max_frames: int, max_seconds: float, needs_audio: bool) -> None:
    """Decode the video and hold it to the limits; a DataError names what is wrong and the fix."""
    try:
        info = probe(data, max_frames)
    except ValueError as e:
        raise DataError(f"{where}: not a video Relax can decode ({e}); re-encode it, e.g. ffmpeg -i in -c:v libx264 "
                        f"-c:a aac out.mp4, or give a folder of PNG/JPEG frames") from None
    except Exception as e:  # FFmpeg and PIL raise many types for bytes they cannot read
        raise DataError(f"{where}: not a video Relax can decode ({type(e).__name__}: {e}); re-encode it, e.g. "
                        f"ffmpeg -i in -c:v libx264 -c:a aac out.mp4") from None
    if info.frames > max_frames:
        raise DataError(f"{where}: video has more than data.max_video_frames={max_frames} frames; cut it, lower its "
                        f"frame rate or raise data.max_video_frames")
    if info.seconds > max_seconds:
        raise DataError(f"{where}: video is {info.seconds:.1f} s long, over data.max_video_seconds={max_seconds}; cut "
                        f"it or raise data.max_video_seconds")
    if needs_audio and not info.has_audio:
        raise DataError(f"{where}: video has no audio track, but its row needs one (metadata.needs_video_audio); "
                        f"use a file with its audio stream (or audio.wav in a frame folder) or drop the flag")
