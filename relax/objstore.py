"""Thin helpers over fsspec so every part of Relax addresses storage by URL alone.

Why a module of its own: the data layer, the TransferQueue and the WeightStore all need
the same two guarantees from very different stores (a local folder, S3, GCS, memory):

* a URL means the same object in every process (relative local paths are made absolute);
* a written object is either fully visible or not at all. Object stores give that for a
  single PUT; on a local filesystem we write a temporary sibling and rename it;
* a read sees what other processes wrote since this one last looked. Object-store
  filesystems (s3fs, gcsfs) keep a per-process listing cache, and they answer more than
  ``ls`` from it: s3fs's ``cat_file`` asks the object's size first, and a folder listed
  once (a queue's gap check lists each writer's log) then makes every record written into
  it afterwards "not found" for the life of the process. Every filesystem this module
  opens has that cache off (:func:`open_fs`), and a read is one GET (:func:`_one_get`).
  The only reads that may be cached are those of objects that never change once written
  (docs/transfer.md, "What a reader may cache").
"""

from __future__ import annotations

import os
import posixpath
import re
import uuid
from collections.abc import Iterator
from typing import Any

import fsspec
from fsspec import AbstractFileSystem

# Local writes go out in 1 MiB pieces: on our machines one 8 MiB write() into the page
# cache measured 10x slower than the same bytes in 1 MiB writes (benchmarks/transfer_queue.py).
WRITE_CHUNK = 1 << 20
# Suffix of write_bytes' temporary files: <name>.tmp-<8 hex digits>.
TMP_MARK = ".tmp-"
_TMP_NAME = re.compile(re.escape(TMP_MARK) + r"[0-9a-f]{8}$")


def open_fs(url: str) -> tuple[AbstractFileSystem, str]:
    """The filesystem and the protocol-less path of ``url`` (fsspec's own resolution), with no
    listing cache on an object store: another process may have written since any listing."""
    protocol, _ = fsspec.core.split_protocol(url)
    if protocol in (None, "file", "local", "memory") or "::" in url:
        return fsspec.core.url_to_fs(url)  # nothing cached (memory lists its dict), or a chain's own options
    return fsspec.core.url_to_fs(url, use_listings_cache=False)


def absolute_url(url: str) -> str:
    """``file://./.relax`` or ``./x`` -> ``file:///abs/.relax``; remote URLs unchanged."""
    fs, path = open_fs(url)
    if _is_local(fs):
        return "file://" + os.path.abspath(path)
    return fs.unstrip_protocol(path)


def local_path(url: str) -> str | None:
    """The local path of a ``file://`` (or plain path) URL; None for a remote one."""
    fs, path = open_fs(url)
    return os.path.abspath(path) if _is_local(fs) else None


def join(url: str, *parts: str) -> str:
    return posixpath.join(url.rstrip("/"), *parts)


def exists(url: str) -> bool:
    fs, path = open_fs(url)
    return fs.exists(path)


def read_bytes(url: str, *, large: bool = False) -> bytes:
    """The whole object at ``url``. ``large`` (weights, checkpoints): on S3, ask its size first and
    fetch a big one as concurrent ranged GETs; otherwise one GET (records, manifests, leases)."""
    fs, path = open_fs(url)
    return fs.cat_file(path) if large else fs.cat_file(path, **_one_get(fs))


def read_many(base: str, names: list[str]) -> list[bytes | None]:
    """The objects ``base/<name>`` for each name, None where one does not exist.

    On an object store fsspec issues the GETs concurrently (s3fs gathers them in one event
    loop), so N small objects cost about one round trip instead of N."""
    if not names:
        return []
    fs, path = open_fs(base)
    paths = [posixpath.join(path.rstrip("/"), n) for n in names]
    # cat_ranges fetches whole objects without cat()'s path expansion (a LIST or HEAD per path)
    got = fs.cat_ranges(paths, [None] * len(paths), [None] * len(paths), on_error="return", **_one_get(fs))
    out: list[bytes | None] = []
    for value in got:
        if isinstance(value, FileNotFoundError):
            out.append(None)
        elif isinstance(value, BaseException):
            raise value
        else:
            out.append(value)
    return out


def write_bytes(url: str, data: bytes | list, fsync: bool = True) -> None:
    """Write ``data`` so that readers see the whole object or nothing.

    ``fsync`` (local files only) also makes it survive a power loss; a process crash never
    needs it, and the queue's checksums catch what a power loss could still tear. ``data``
    may be a list of byte-like parts, written in order without joining them (locally)."""
    parts = data if isinstance(data, list) else [data]
    fs, path = open_fs(url)
    if _is_local(fs):
        fs.makedirs(posixpath.dirname(path), exist_ok=True)
        tmp = f"{path}{TMP_MARK}{uuid.uuid4().hex[:8]}"
        with open(tmp, "wb") as fh:
            for piece in _chunks(parts):
                fh.write(piece)
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    else:
        single = len(parts) == 1 and isinstance(parts[0], bytes)
        fs.pipe_file(path, parts[0] if single else b"".join(parts))  # object stores want bytes


def _chunks(parts: list) -> Iterator[bytes | memoryview]:
    """``parts`` re-cut into writes of about WRITE_CHUNK: large parts sliced, runs of small ones
    joined (a write() per 4 KB sample costs more than the copy that joins them)."""
    pending: list = []
    size = 0
    for part in parts:
        view = memoryview(part).cast("B")
        if len(view) >= WRITE_CHUNK:
            yield from _flush(pending)
            pending, size = [], 0
            for at in range(0, len(view), WRITE_CHUNK):
                yield view[at:at + WRITE_CHUNK]
            continue
        pending.append(view)
        size += len(view)
        if size >= WRITE_CHUNK:
            yield from _flush(pending)
            pending, size = [], 0
    yield from _flush(pending)


def _flush(pending: list) -> Iterator[bytes | memoryview]:
    if len(pending) == 1:
        yield pending[0]  # nothing to join: no copy
    elif pending:
        yield b"".join(pending)


def delete(url: str) -> None:
    """Remove one object (or an empty local folder); a missing object is not an error."""
    fs, path = open_fs(url)
    try:
        fs.rm(path, recursive=fs.isdir(path))
    except FileNotFoundError:
        pass


def list_dir(url: str) -> list[str]:
    """Names (not paths) of the entries directly under ``url``; empty if it does not exist.

    A local :func:`write_bytes` in flight, or killed before its rename, leaves a partial
    ``<name>.tmp-<hex>`` file; it is not an object, so it is not listed (a reader that opened
    it would see torn bytes)."""
    fs, path = open_fs(url)
    try:
        entries: list[Any] = fs.ls(path, detail=False)
    except FileNotFoundError:
        return []
    names = (posixpath.basename(e.rstrip("/")) for e in entries)
    return sorted(n for n in names if not _TMP_NAME.search(n))


def _is_local(fs: AbstractFileSystem) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol in ("file", "local")


def _one_get(fs: AbstractFileSystem) -> dict[str, Any]:
    """Keyword arguments that make ``cat_file`` one GET. s3fs first asks an object's size (a HEAD)
    to split a large one into concurrent ranged GETs; for a small record that request doubles the
    cost of every poll."""
    return {"max_concurrency": 1} if type(fs).__module__.startswith("s3fs") else {}
