"""Immutable, content-hashed dataset snapshots under ``<root>/datasets/<id>/``.

Layout::

    <root>/datasets/<id>/
      manifest.json            written last: a snapshot exists iff its manifest does
      rows/<split>.jsonl       canonical rows; media refs point into media/
      media/<sha256>.<ext>     every image and audio clip, named by its content hash

The id is a hash of the canonical rows of every split, in which each media reference is
replaced by the hash of its bytes. So the same content always gives the same id (wherever
it was read from), and a change to any row or any media byte gives a new one.

Building a snapshot is two phases. ``plan_snapshot`` reads and validates everything and
computes the id without writing; only a plan that passed is written. So bad input (a
malformed row, a missing media file) fails before anything reaches the root.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from relax import objstore
from relax.data.errors import DataError
from relax.data.readers import encode_jsonl
from relax.data.schema import MediaRef, Sample

SCHEMA_VERSION = 1
_MAGIC = ((b"\x89PNG", ".png"), (b"\xff\xd8\xff", ".jpg"), (b"GIF8", ".gif"), (b"RIFF", ".wav"),
          (b"fLaC", ".flac"), (b"OggS", ".ogg"), (b"ID3", ".mp3"), (b"\xff\xfb", ".mp3"))


@dataclass
class SnapshotInfo:
    """What a snapshot task returns and lineage records name."""

    id: str = ""
    url: str = ""
    rows: dict[str, int] = field(default_factory=dict)
    media_files: int = 0
    media_bytes: int = 0
    created: bool = False


@dataclass
class SnapshotPlan:
    """A validated snapshot, ready to write: canonical rows and where each media blob comes from."""

    id: str
    rows: dict[str, bytes]
    stats: dict[str, Any]
    media: dict[str, tuple[str, MediaRef]]  # file name -> (where, source ref)
    source: dict[str, Any]


def plan_snapshot(splits: Mapping[str, Iterable[Sample]], source: Mapping[str, Any] | None = None,
                  progress: bool = False) -> SnapshotPlan:
    """Read, validate and hash every row and media item; write nothing."""
    media: dict[str, tuple[str, MediaRef]] = {}
    rows: dict[str, bytes] = {}
    stats: dict[str, Any] = {"tasks": {}, "modalities": {}}
    seen_ids: dict[str, str] = {}
    for split in sorted(splits):
        out: list[Sample] = []
        samples = tqdm(splits[split], desc=f"snapshot {split}", unit="row", disable=not progress, leave=False)
        for sample in samples:
            if sample.id in seen_ids:
                raise DataError(f"row id {sample.id!r} appears twice (splits {seen_ids[sample.id]} and {split}); "
                                f"ids must be unique across the dataset")
            seen_ids[sample.id] = split
            images = tuple(_content_ref(r, sample, "images", i, media) for i, r in enumerate(sample.images))
            audios = tuple(_content_ref(r, sample, "audios", i, media) for i, r in enumerate(sample.audios))
            out.append(sample.with_media(images, audios))
        if not out:
            raise DataError(f"split {split!r} has no rows; a snapshot needs at least one row per split")
        rows[split] = encode_jsonl(out)
        stats["tasks"][split] = dict(sorted(Counter(s.task for s in out).items()))
        stats["modalities"][split] = dict(sorted(Counter(s.modality for s in out).items()))
    digest = hashlib.sha256(f"relax-dataset-v{SCHEMA_VERSION}\n".encode())
    for split in sorted(rows):
        digest.update(f"{split}\n{len(rows[split])}\n".encode())
        digest.update(rows[split])
    return SnapshotPlan(id="ds-" + digest.hexdigest()[:16], rows=rows, stats=stats, media=media,
                        source=dict(source or {}))


def write_snapshot(plan: SnapshotPlan, root: str, progress: bool = False) -> SnapshotInfo:
    """Write ``plan`` under ``<root>/datasets/<id>``; a snapshot that already exists is reused."""
    url = objstore.join(objstore.absolute_url(root), "datasets", plan.id)
    manifest_url = objstore.join(url, "manifest.json")
    if objstore.exists(manifest_url):
        return _info(json.loads(objstore.read_bytes(manifest_url)), url, created=False)
    present = set(objstore.list_dir(objstore.join(url, "media")))
    total = 0
    for name, (where, ref) in tqdm(sorted(plan.media.items()), desc="snapshot media", unit="file",
                                    disable=not progress, leave=False):
        data = _load(ref, where)
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
            for ref in (*s.images, *s.audios):
                check_media_ref(ref, where)
            yield s.with_media(tuple(self._absolute(r) for r in s.images), tuple(self._absolute(r) for r in s.audios))

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


def _content_ref(ref: MediaRef, sample: Sample, kind: str, i: int, media: dict) -> MediaRef:
    where = f"row {sample.id!r} {kind}[{i}]"
    data = _load(ref, where)
    if not data:
        raise DataError(f"{where}: media {ref.path or '<bytes>'} is empty")
    sha = hashlib.sha256(data).hexdigest()
    if ref.sha256 and ref.sha256 != sha:
        raise DataError(f"{where}: media {ref.path or '<bytes>'} does not match its sha256 {ref.sha256}")
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


def _extension(data: bytes, path: str | None) -> str:
    for magic, ext in _MAGIC:
        if data.startswith(magic):
            return ext
    suffix = posixpath.splitext(path or "")[1].lower()
    return suffix if suffix and len(suffix) <= 6 else ".bin"


def _info(manifest: Mapping[str, Any], url: str, created: bool) -> SnapshotInfo:
    return SnapshotInfo(id=manifest["id"], url=url, rows={k: v["rows"] for k, v in manifest["splits"].items()},
                        media_files=manifest["media"]["files"], media_bytes=manifest["media"]["bytes"],
                        created=created)
