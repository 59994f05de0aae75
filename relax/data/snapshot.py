"""Immutable, content-hashed dataset snapshots under ``<root>/datasets/<id>/``.

Layout::

    <root>/datasets/<id>/
      manifest.json            written last: a snapshot exists iff its manifest does
      rows/<split>.jsonl       canonical rows; media refs point into media/
      media/<sha256>.<ext>     every image, audio clip and video, named by its content hash

The id is a hash of the canonical rows of every split, in which each media reference is
replaced by the hash of its bytes. So the same content always gives the same id (wherever
it was read from), and a change to any row or any media byte gives a new one.

Building a snapshot is two phases. ``plan_snapshot`` reads and validates everything and
computes the id without writing; only a plan that passed is written. So bad input (a
malformed row, a missing media file, bytes that are not an image, an image or clip over
the size limits) fails before anything reaches the root.
"""

from __future__ import annotations

import hashlib
import io
import json
import posixpath
import re
import warnings
import wave
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from PIL import Image
from tqdm import tqdm

from relax import objstore
from relax.config import ConfigError, DataConfig
from relax.config.preflight import ROOT_FIX
from relax.data.errors import DataError, Problems
from relax.data.readers import encode_jsonl
from relax.data.samples import NEEDS_VIDEO_AUDIO, MediaRef, Sample
from relax.data.video_snapshot import check_video, is_folder, read_folder

SCHEMA_VERSION = 1
MEDIA_SLOTS = ("images", "audios", "videos")
_MAGIC = ((b"\x89PNG", ".png"), (b"\xff\xd8\xff", ".jpg"), (b"GIF8", ".gif"), (b"RIFF", ".wav"),
          (b"fLaC", ".flac"), (b"OggS", ".ogg"), (b"ID3", ".mp3"), (b"\xff\xfb", ".mp3"),
          (b"\x1a\x45\xdf\xa3", ".mkv"))


@dataclass
class SnapshotInfo:
    """What a snapshot task returns and lineage records name."""

    id: str = ""
    url: str = ""
    rows: dict[str, int] = field(default_factory=dict)
    media_files: int = 0
    media_bytes: int = 0
    created: bool = False


@dataclass(frozen=True)
class MediaLimits:
    """What a snapshot accepts as media (``data.max_image_pixels``, ``data.max_audio_seconds``,
    ``data.max_video_frames``, ``data.max_video_seconds``).

    Checked from headers at planning time, so a small file that would decode to gigabytes is
    refused before a snapshot holds it and before a trainer or engine tries to decode it.
    """

    max_image_pixels: int = DataConfig.max_image_pixels
    max_audio_seconds: float = DataConfig.max_audio_seconds
    max_video_frames: int = DataConfig.max_video_frames
    max_video_seconds: float = DataConfig.max_video_seconds

    @staticmethod
    def from_config(data: DataConfig) -> MediaLimits:
        return MediaLimits(data.max_image_pixels, data.max_audio_seconds, data.max_video_frames,
                           data.max_video_seconds)


@dataclass
class SnapshotPlan:
    """A validated snapshot, ready to write: canonical rows and where each media blob comes from."""

    id: str
    rows: dict[str, bytes]
    stats: dict[str, Any]
    media: dict[str, tuple[str, MediaRef]]  # file name -> (where, source ref)
    source: dict[str, Any]


def plan_snapshot(splits: Mapping[str, Iterable[Sample]], source: Mapping[str, Any] | None = None,
                  progress: bool = False, limits: MediaLimits | None = None,
                  problems: Problems | None = None) -> SnapshotPlan:
    """Read, validate and hash every row and media item; write nothing.

    Every row is checked before anything is raised; one DataError then lists the problems met here
    and those already in ``problems`` (the readers')."""
    limits = limits or MediaLimits()
    problems = problems if problems is not None else Problems()
    media: dict[str, tuple[str, MediaRef]] = {}
    rows: dict[str, bytes] = {}
    stats: dict[str, Any] = {"tasks": {}, "modalities": {}}
    seen_ids: dict[str, str] = {}
    for split in sorted(splits):
        out: list[Sample] = []
        given = 0
        samples = tqdm(splits[split], desc=f"snapshot {split}", unit="row", disable=not progress, leave=False)
        for sample in samples:
            given += 1
            if sample.id in seen_ids:
                problems.add(f"{_origin(sample)}row id {sample.id!r} appears twice (splits {seen_ids[sample.id]} and "
                             f"{split}); ids must be unique across the dataset")
                continue
            seen_ids[sample.id] = split
            with problems.collect():
                refs = [tuple(_content_ref(ref, sample, kind, i, media, limits)
                              for i, ref in enumerate(getattr(sample, kind))) for kind in MEDIA_SLOTS]
                out.append(sample.with_media(*refs))
        if not given:
            problems.add(f"split {split!r} has no rows; a snapshot needs at least one row per split")
        rows[split] = encode_jsonl(out)
        stats["tasks"][split] = dict(sorted(Counter(s.task for s in out).items()))
        stats["modalities"][split] = dict(sorted(Counter(s.modality for s in out).items()))
    problems.raise_if_any()
    digest = hashlib.sha256(f"relax-dataset-v{SCHEMA_VERSION}\n".encode())
    for split in sorted(rows):
        digest.update(f"{split}\n{len(rows[split])}\n".encode())
        digest.update(rows[split])
    return SnapshotPlan(id="ds-" + digest.hexdigest()[:16], rows=rows, stats=stats, media=media,
                        source=dict(source or {}))


def _origin(sample: Sample) -> str:
    return f"{sample.origin}: " if sample.origin else ""


def write_snapshot(plan: SnapshotPlan, root: str, progress: bool = False) -> SnapshotInfo:
    """Write ``plan`` under ``<root>/datasets/<id>``; a snapshot that already exists is reused."""
    url = objstore.join(objstore.absolute_url(root), "datasets", plan.id)
    manifest_url = objstore.join(url, "manifest.json")
    if objstore.exists(manifest_url):
        return _info(json.loads(objstore.read_bytes(manifest_url)), url, created=False)
    try:
        return _write(plan, url, manifest_url, progress)
    except OSError as e:  # what relax.config.preflight.check_root_writable cannot see: a full disk, a store's refusal
        raise ConfigError(f"cannot write the snapshot under root {root} ({type(e).__name__}: {e}); "
                          f"{ROOT_FIX}") from None


def _write(plan: SnapshotPlan, url: str, manifest_url: str, progress: bool) -> SnapshotInfo:
    present = set(objstore.list_dir(objstore.join(url, "media")))
    total = 0
    for name, (where, ref) in tqdm(sorted(plan.media.items()), desc="snapshot media", unit="file",
                                    disable=not progress, leave=False):
        data = _fetch(ref, where, folder=name.endswith(".tar"))
        if hashlib.sha256(data).hexdigest() != name.split(".")[0]:
            raise DataError(f"{where}: media {ref.path} changed while the snapshot was being written; rerun")
        total += len(data)
        if name not in present:  # content-addressed: an existing file already holds these bytes
            objstore.write_bytes(objstore.join(url, "media", name), data)
    splits = {}
    for split, blob in plan.rows.items():
        objstore.write_bytes(objstore.join(url, "rows", f"{split}.jsonl"), blob)
        splits[split] = {"file": f"rows/{split}.jsonl", "rows": blob.count(b"\n"),
                         "sha256": hashlib.sha256(blob).hexdigest()}
    manifest = {"id": plan.id, "schema_version": SCHEMA_VERSION, "splits": splits,
                "media": {"files": len(plan.media), "bytes": total}, **plan.stats, "source": plan.source}
    objstore.write_bytes(manifest_url, json.dumps(manifest, indent=2, sort_keys=True).encode())
    return _info(manifest, url, created=True)


class Snapshot:
    """Read access to a written snapshot; rows come back with media URLs inside the snapshot."""

    def __init__(self, url: str):
        self.url = objstore.absolute_url(url).rstrip("/")
        manifest_url = objstore.join(self.url, "manifest.json")
        if not objstore.exists(manifest_url):
            raise DataError(f"no dataset snapshot at {self.url} (missing manifest.json); create one with "
                            f"`relax data snapshot`")
        self.manifest: dict[str, Any] = json.loads(objstore.read_bytes(manifest_url))

    @classmethod
    def open(cls, root: str, snapshot_id: str) -> Snapshot:
        return cls(objstore.join(objstore.absolute_url(root), "datasets", snapshot_id))

    @property
    def id(self) -> str:
        return self.manifest["id"]

    @property
    def splits(self) -> list[str]:
        return sorted(self.manifest["splits"])

    def info(self) -> SnapshotInfo:
        return _info(self.manifest, self.url, created=False)

    def samples(self, split: str) -> Iterator[Sample]:
        if split not in self.manifest["splits"]:
            raise DataError(f"snapshot {self.id} has no split {split!r}; it has {self.splits}")
        entry = self.manifest["splits"][split]
        if not SPLIT_NAME.fullmatch(split) or entry.get("file") != f"rows/{split}.jsonl":
            raise DataError(f"snapshot {self.id}: split {split!r} names rows file {entry.get('file')!r}, not "
                            f"rows/<split>.jsonl; the snapshot was altered, nothing was read")
        blob = objstore.read_bytes(objstore.join(self.url, entry["file"]))
        if hashlib.sha256(blob).hexdigest() != entry["sha256"]:
            raise DataError(f"snapshot {self.id}: {entry['file']} fails its checksum; the snapshot is corrupt")
        for lineno, line in enumerate(blob.decode("utf-8").splitlines(), start=1):
            where = f"{self.id}/{entry['file']}:{lineno}"
            s = Sample.from_json(json.loads(line), where)
            for ref in (*s.images, *s.audios, *s.videos):
                check_media_ref(ref, where)
            yield s.with_media(tuple(self._absolute(r) for r in s.images), tuple(self._absolute(r) for r in s.audios),
                               tuple(self._absolute(r) for r in s.videos))

    def load_media(self, ref: MediaRef) -> bytes:
        """Bytes of one media item, checked against its content hash."""
        data = _load(ref, f"snapshot {self.id}")
        if ref.sha256 and hashlib.sha256(data).hexdigest() != ref.sha256:
            raise DataError(f"snapshot {self.id}: media {ref.path} fails its checksum; the snapshot is corrupt")
        return data

    def _absolute(self, ref: MediaRef) -> MediaRef:
        return MediaRef(path=objstore.join(self.url, ref.path), sha256=ref.sha256)


SPLIT_NAME = re.compile(r"[A-Za-z0-9_-]+")
MEDIA_NAME = re.compile(r"media/([0-9a-f]{64})\.[a-z0-9]{1,8}")  # content-addressed, as _content_ref names it


def check_media_ref(ref: MediaRef, where: str) -> None:
    """A snapshot row's media is ``media/<its sha256>.<ext>`` with that sha256: nothing outside the
    snapshot, and nothing unchecked."""
    m = MEDIA_NAME.fullmatch(ref.path or "")
    if m is None or ref.sha256 != m.group(1):
        raise DataError(f"{where}: media {ref.path!r} (sha256 {ref.sha256!r}) is not a file of this snapshot "
                        f"(media/<sha256>.<ext> with its sha256); the snapshot was altered, nothing was read")


def list_snapshots(root: str) -> list[str]:
    base = objstore.join(objstore.absolute_url(root), "datasets")
    return [d for d in objstore.list_dir(base) if objstore.exists(objstore.join(base, d, "manifest.json"))]


def _content_ref(ref: MediaRef, sample: Sample, kind: str, i: int, media: dict, limits: MediaLimits) -> MediaRef:
    where = f"{_origin(sample)}row {sample.id!r} {kind}[{i}]"
    data = _fetch(ref, where, folder=kind == "videos")
    if not data:
        raise DataError(f"{where}: media {ref.path or '<bytes>'} is empty")
    sha = hashlib.sha256(data).hexdigest()
    if ref.sha256 and ref.sha256 != sha:
        raise DataError(f"{where}: media {ref.path or '<bytes>'} does not match its sha256 {ref.sha256}")
    what = f"{where} ({ref.path or '<bytes>'})"
    if kind == "videos":
        check_video(data, what, limits.max_video_frames, limits.max_video_seconds,
                    bool(sample.metadata.get(NEEDS_VIDEO_AUDIO)))
    else:
        (_check_image if kind == "images" else _check_audio)(data, what, limits)
    name = sha + _extension(data, ref.path)
    media.setdefault(name, (where, ref))
    return MediaRef(path=f"media/{name}", sha256=sha)


def _load(ref: MediaRef, where: str) -> bytes:
    if ref.data is not None:
        return ref.data
    try:
        return objstore.read_bytes(ref.path)
    except (FileNotFoundError, IsADirectoryError):
        raise DataError(f"{where}: media file {ref.path} not found; fix the path in the row or add the file") from None


def _fetch(ref: MediaRef, where: str, folder: bool = False) -> bytes:
    """``_load`` while a snapshot is built: any failure to read a row's media, whatever the store's
    client raises (aiohttp, botocore, ssl, OSError), is a DataError naming the row. Reads of a
    written snapshot keep their own errors, so a run's roles can tell a flaky store from bad data.
    ``folder``: a video slot, where a folder of frames is read and packed into one file."""
    try:
        if folder and ref.path is not None and is_folder(ref.path):
            return read_folder(ref.path, where)
        return _load(ref, where)
    except DataError:
        raise
    except Exception as e:
        raise DataError(f"{where}: cannot read media {ref.path} ({type(e).__name__}: {e}); check the URL, the "
                        f"network and credentials, or copy the file into the dataset folder") from None


# Formats every image path of Relax decodes with PIL; others (EPS runs Ghostscript) are refused.
IMAGE_FORMATS = ("PNG", "JPEG", "MPO", "GIF", "WEBP", "BMP", "TIFF")


def _check_image(data: bytes, where: str, limits: MediaLimits) -> None:
    """Identify the image and read its size from the header alone; no pixel is decoded."""
    try:
        with warnings.catch_warnings():  # PIL warns above its own limit; ours is checked below
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as img:
                (width, height), fmt = img.size, img.format
    except Image.DecompressionBombError as e:
        raise DataError(f"{where}: image is too large to decode ({e}); downscale it") from None
    except Exception:  # PIL raises many unrelated types for bytes it cannot read
        raise DataError(f"{where}: not an image in a format Relax reads ({', '.join(IMAGE_FORMATS)}); found "
                        f"{_describe(data)}; fix the file or the row") from None
    if width * height > limits.max_image_pixels:
        raise DataError(f"{where}: {fmt} image is {width}x{height} = {width * height} pixels, over "
                        f"data.max_image_pixels={limits.max_image_pixels}; downscale it or raise data.max_image_pixels")
    try:  # chunk structure and checksums (PNG), still without decoding pixels
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as img:
            img.verify()
    except Exception as e:
        raise DataError(f"{where}: {fmt} image is corrupt ({type(e).__name__}: {e}); re-export it") from None


def _check_audio(data: bytes, where: str, limits: MediaLimits) -> None:
    """A PCM WAV that ``relax.models.processors.decode_wav`` can read, within the duration limit."""
    if not (data.startswith(b"RIFF") and data[8:12] == b"WAVE"):
        raise DataError(f"{where}: audio must be a PCM WAV file (the only container Relax's processors decode); "
                        f"found {_describe(data)}; convert it, e.g. ffmpeg -i in.mp3 -c:a pcm_s16le out.wav")
    try:  # the same stdlib reader as the processors; reads the header chunks only
        with wave.open(io.BytesIO(data)) as w:
            rate, width, frames = w.getframerate(), w.getsampwidth(), w.getnframes()
    except Exception as e:
        raise DataError(f"{where}: unreadable WAV header ({type(e).__name__}: {e}); re-export it as PCM WAV "
                        f"(ffmpeg -c:a pcm_s16le)") from None
    if width not in (1, 2, 4) or rate <= 0 or frames == 0:
        raise DataError(f"{where}: WAV with {width * 8}-bit samples at {rate} Hz and {frames} frames; Relax needs "
                        f"8, 16 or 32-bit PCM with at least one frame: re-export it")
    if frames / rate > limits.max_audio_seconds:
        raise DataError(f"{where}: audio is {frames / rate:.1f} s long, over data.max_audio_seconds="
                        f"{limits.max_audio_seconds}; cut it or raise data.max_audio_seconds")


def _describe(data: bytes) -> str:
    """What the bytes look like, for an error: their start, and the signature they carry if any."""
    ext = _sniff(data)
    return f"{len(data)} bytes starting {data[:16]!r}" + (f" (a {ext[1:].upper()} signature)" if ext else "")


def _extension(data: bytes, path: str | None) -> str:
    ext = _sniff(data)
    if ext:
        return ext
    suffix = posixpath.splitext(path or "")[1].lower()
    return suffix if suffix and len(suffix) <= 6 else ".bin"


def _sniff(data: bytes) -> str:
    """The extension the leading bytes announce, or ``""``. RIFF holds both WAV and WEBP."""
    if data.startswith(b"RIFF") and data[8:12] == b"WEBP":
        return ".webp"
    if data[4:8] == b"ftyp":  # ISO media: MP4, MOV, M4A
        return ".mp4"
    if data[257:262] == b"ustar":  # a folder video, packed (relax.data.video.pack_folder)
        return ".tar"
    return next((ext for magic, ext in _MAGIC if data.startswith(magic)), "")


def _info(manifest: Mapping[str, Any], url: str, created: bool) -> SnapshotInfo:
    return SnapshotInfo(id=manifest["id"], url=url, rows={k: v["rows"] for k, v in manifest["splits"].items()},
                        media_files=manifest["media"]["files"], media_bytes=manifest["media"]["bytes"],
                        created=created)
