"""The sample format every part of Relax speaks: OpenAI-style chat messages whose text
carries ``<image>`` / ``<audio>`` / ``<video>`` placeholders, the media they stand for, a
ground-truth answer and free-form metadata.

A row on disk (jsonl line, parquet row) looks like::

    {"id": "shapes-0007", "task": "shapes",
     "messages": [{"role": "user", "content": "<image>\\nHow many shapes are there?"}],
     "images": ["img/0007.png"],               # or {"path": ...} / {"bytes_b64": ...}
     "audios": [],
     "answer": "3",
     "metadata": {"difficulty": 1}}

The i-th ``<image>`` placeholder, counted across all messages in order, is ``images[i]``;
the same holds for ``<audio>`` and ``audios`` and for ``<video>`` and ``videos`` (an MP4 or
a folder of frames with an optional ``audio.wav``, see ``relax.data.video``). Media is referenced by a local path, an
fsspec URL (``s3://...``) or carried inline as bytes; a snapshot rewrites every reference
to a content-addressed file inside the snapshot.
"""

from __future__ import annotations

import base64
import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from relax.data.errors import DataError

IMAGE_PLACEHOLDER = "<image>"
AUDIO_PLACEHOLDER = "<audio>"
VIDEO_PLACEHOLDER = "<video>"
ROLES = ("system", "user", "assistant", "tool")
MEDIA_KINDS = ("image", "audio", "video")
_PLACEHOLDER_RE = re.compile(r"<(image|audio|video)>")
# Every field a row may have. Any other is refused, naming the closest of these: most are typos
# (``image`` for ``images``) that would otherwise drop the row's media or metadata without a word.
ROW_FIELDS = ("id", "task", "messages", "images", "audios", "videos", "answer", "metadata")
_PANDAS_INDEX = re.compile(r"__index_level_\d+__")  # the index column pandas adds to a parquet file
# metadata key of a row whose videos must carry an audio track (a snapshot refuses one without)
NEEDS_VIDEO_AUDIO = "needs_video_audio"


def check_row_fields(row: Mapping[str, Any], where: str) -> None:
    """Refuse a field the row format does not have, naming the one it probably meant."""
    unknown = [str(k) for k in row if k not in ROW_FIELDS and not _PANDAS_INDEX.fullmatch(str(k))]
    if not unknown:
        return
    named = []
    for key in unknown:
        close = difflib.get_close_matches(key, ROW_FIELDS, n=1)
        named.append(f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key))
    raise DataError(f"{where}: unknown field(s) {', '.join(named)}; a row's fields are {', '.join(ROW_FIELDS)}: "
                    f"rename a misspelled field, or move extra information under 'metadata'")


@dataclass(frozen=True)
class MediaRef:
    """One image, audio clip or video. Exactly one of ``path`` and ``data`` is set.

    ``path`` is a local path (relative paths resolve against the file the row came from)
    or any fsspec URL. ``sha256`` is filled in by snapshots and checked on load.
    """

    path: str | None = None
    data: bytes | None = None
    sha256: str | None = None

    def __post_init__(self) -> None:
        if (self.path is None) == (self.data is None):
            raise DataError("a media reference needs exactly one of 'path' or 'bytes'")

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.path is not None:
            out["path"] = self.path
        else:
            out["bytes_b64"] = base64.b64encode(self.data).decode("ascii")
        if self.sha256:
            out["sha256"] = self.sha256
        return out

    @staticmethod
    def from_json(value: Any, where: str) -> MediaRef:
        if isinstance(value, MediaRef):
            return value
        if isinstance(value, str):
            return MediaRef(path=value)
        if isinstance(value, (bytes, bytearray)):
            return MediaRef(data=bytes(value))
        if isinstance(value, Mapping):
            sha = value.get("sha256")
            if value.get("path") is not None:
                return MediaRef(path=str(value["path"]), sha256=sha)
            raw = value.get("bytes")
            if raw is not None:
                return MediaRef(data=bytes(raw), sha256=sha)
            if value.get("bytes_b64") is not None:
                try:
                    return MediaRef(data=base64.b64decode(value["bytes_b64"], validate=True), sha256=sha)
                except ValueError as e:
                    raise DataError(f"{where}: 'bytes_b64' is not valid base64 ({e})") from None
        raise DataError(
            f"{where}: a media reference must be a path string, bytes, or an object with "
            f"'path', 'bytes' or 'bytes_b64'; got {type(value).__name__}"
        )


@dataclass(frozen=True)
class Message:
    """One chat turn. ``content`` is text with media placeholders."""

    role: str
    content: str

    def to_json(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


@dataclass(frozen=True)
class Sample:
    """One prompt with its ground truth. Immutable; ``metadata`` holds JSON values only."""

    id: str
    messages: tuple[Message, ...]
    answer: str
    task: str = "custom"
    images: tuple[MediaRef, ...] = ()
    audios: tuple[MediaRef, ...] = ()
    metadata: Mapping[str, Any] = field(default_factory=dict)
    videos: tuple[MediaRef, ...] = ()
    # Where the row was read from (``train.jsonl:12``), so errors raised later, when its media is
    # fetched and checked for a snapshot, can still name the file and line. Not part of the row.
    origin: str = field(default="", compare=False, repr=False)

    @property
    def modality(self) -> str:
        """``text``, ``image``, ``audio``, ``video`` or ``omni`` (more than one kind of media)."""
        if sum(map(bool, (self.images, self.audios, self.videos))) > 1:
            return "omni"
        if self.images:
            return "image"
        if self.audios:
            return "audio"
        if self.videos:
            return "video"
        return "text"

    @property
    def prompt_text(self) -> str:
        """The last user message, the question as a person would read it."""
        for m in reversed(self.messages):
            if m.role == "user":
                return m.content
        return self.messages[-1].content

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "task": self.task,
            "messages": [m.to_json() for m in self.messages],
            "images": [r.to_json() for r in self.images],
            "audios": [r.to_json() for r in self.audios],
            **({"videos": [r.to_json() for r in self.videos]} if self.videos else {}),
            "answer": self.answer,
            "metadata": dict(self.metadata),
        }

    @staticmethod
    def from_json(row: Any, where: str) -> Sample:
        """Parse and validate one row; ``where`` (e.g. ``data.jsonl:12``) prefixes errors."""
        if not isinstance(row, Mapping):
            raise DataError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
        check_row_fields(row, where)
        missing = [k for k in ("id", "messages", "answer") if row.get(k) is None]
        if missing:
            raise DataError(f"{where}: missing required field(s) {missing}; every row needs id, messages, answer")
        msgs_raw = row["messages"]
        if isinstance(msgs_raw, str):  # a plain prompt is shorthand for one user turn
            msgs_raw = [{"role": "user", "content": msgs_raw}]
        if not isinstance(msgs_raw, (list, tuple)) or not msgs_raw:
            raise DataError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
        messages = []
        for i, m in enumerate(msgs_raw):
            if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
                raise DataError(f"{where}: messages[{i}] must be an object with 'role' and 'content'")
            if m["role"] not in ROLES:
                raise DataError(f"{where}: messages[{i}].role is {m['role']!r}; expected one of {ROLES}")
            if not isinstance(m["content"], str):
                raise DataError(
                    f"{where}: messages[{i}].content must be a string with <image>/<audio>/<video> placeholders"
                )
            messages.append(Message(role=m["role"], content=m["content"]))
        images = tuple(MediaRef.from_json(v, f"{where}: images[{i}]") for i, v in enumerate(row.get("images") or ()))
        audios = tuple(MediaRef.from_json(v, f"{where}: audios[{i}]") for i, v in enumerate(row.get("audios") or ()))
        videos = tuple(MediaRef.from_json(v, f"{where}: videos[{i}]") for i, v in enumerate(row.get("videos") or ()))
        metadata = row.get("metadata") or {}
        if not isinstance(metadata, Mapping):
            raise DataError(f"{where}: 'metadata' must be an object")
        sample = Sample(
            id=str(row["id"]),
            task=str(row.get("task") or "custom"),
            messages=tuple(messages),
            images=images,
            audios=audios,
            answer=str(row["answer"]),
            metadata=dict(metadata),
            videos=videos,
        )
        sample.check_placeholders(where)
        return sample

    def check_placeholders(self, where: str) -> None:
        """Every media item has exactly one placeholder and vice versa."""
        found = {"image": 0, "audio": 0, "video": 0}
        for m in self.messages:
            for kind in _PLACEHOLDER_RE.findall(m.content):
                found[kind] += 1
        for kind, refs in (("image", self.images), ("audio", self.audios), ("video", self.videos)):
            if found[kind] != len(refs):
                raise DataError(
                    f"{where}: row {self.id!r} has {found[kind]} <{kind}> placeholder(s) but "
                    f"{len(refs)} {kind}(s); put one <{kind}> in the text for each entry of '{kind}s'"
                )

    def with_media(self, images: tuple[MediaRef, ...], audios: tuple[MediaRef, ...],
                   videos: tuple[MediaRef, ...] | None = None) -> Sample:
        return Sample(self.id, self.messages, self.answer, self.task, images, audios, self.metadata,
                      videos=self.videos if videos is None else videos, origin=self.origin)
