"""Read and write rows as jsonl or parquet on any fsspec URL.

Readers yield each record with a location string (``file.jsonl:12``, ``file.parquet#row3``)
so every later error can name the exact row at fault. Relative media paths in a row are
resolved against the folder of the file the row came from, so a dataset folder can be
moved or uploaded to S3 as a whole; media outside that folder is refused (remote URLs
need ``data.allow_remote_media``), since rows come from users.
"""

from __future__ import annotations

import io
import json
import os
import posixpath
from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from relax import objstore
from relax.data.errors import DataError, Problems
from relax.data.samples import MediaRef, Sample

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".ndjson", ".json")
PARQUET_SUFFIXES = (".parquet", ".pq")


def iter_records(url: str, problems: Problems | None = None) -> Iterator[tuple[dict[str, Any], str]]:
    """Yield ``(record, where)`` for every row of a jsonl or parquet file.

    A bad line raises a DataError; with ``problems``, it is added there and the line skipped, and so
    is a file that cannot be read at all, so that every problem of a dataset is found in one pass."""
    name = posixpath.basename(url)
    if not objstore.exists(url):
        _fail(problems, f"data file {url} does not exist; check data.train_url / data.eval_url")
    elif url.endswith(JSONL_SUFFIXES):
        yield from _iter_jsonl(url, name, problems)
    elif url.endswith(PARQUET_SUFFIXES):
        yield from _iter_parquet(url, problems)
    else:
        _fail(problems, f"{url}: unknown file type; use a .jsonl (or .jsonl.gz) or .parquet file")


def _fail(problems: Problems | None, message: str) -> None:
    if problems is None:
        raise DataError(message)
    problems.add(message)


def _iter_jsonl(url: str, name: str, problems: Problems | None) -> Iterator[tuple[dict[str, Any], str]]:
    # Bytes, decoded line by line: a text-mode reader decodes ahead in blocks, so a bad byte would
    # surface as a bare UnicodeDecodeError while an earlier line is being read, naming no line.
    with fsspec.open(url, "rb", compression="infer") as fh:
        for lineno, raw in enumerate(fh, start=1):
            where = f"{url}:{lineno}"
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                _fail(problems, f"{where}: not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1}); "
                                f"re-save {name} as UTF-8 or fix line {lineno}")
                continue
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                _fail(problems, f"{where}: malformed JSON ({e.msg} at column {e.colno}); fix or delete line "
                                f"{lineno} of {name}")
                continue
            if not isinstance(record, dict):
                _fail(problems, f"{where}: each line must be a JSON object, got {type(record).__name__}")
                continue
            yield record, where


def _iter_parquet(url: str, problems: Problems | None) -> Iterator[tuple[dict[str, Any], str]]:
    with fsspec.open(url, "rb") as fh:
        try:
            pf = pq.ParquetFile(io.BytesIO(fh.read()))
        except (pa.ArrowInvalid, OSError) as e:
            _fail(problems, f"{url}: not a readable parquet file ({e})")
            return
    index = 0
    for batch in pf.iter_batches(batch_size=1024):
        for record in batch.to_pylist():
            where, index = f"{url}#row{index}", index + 1
            if _parse_nested_columns(record, where, problems):
                yield record, where


def _parse_nested_columns(record: dict[str, Any], where: str, problems: Problems | None) -> bool:
    """Nested columns may be stored as JSON strings by tools that flatten them; False if one is not JSON."""
    for key in ("messages", "metadata", "images", "audios", "videos"):
        if isinstance(record.get(key), str) and record[key][:1] in "[{":
            try:
                record[key] = json.loads(record[key])
            except json.JSONDecodeError:
                _fail(problems, f"{where}: column {key!r} holds invalid JSON")
                return False
    return True


def read_samples(url: str, format: str = "relax", allow_remote_media: bool = False, split: str = "train",
                 problems: Problems | None = None) -> Iterator[Sample]:
    """Parse every row of ``url`` into a validated ``Sample`` (``format``: relax or gsm8k).

    Media paths are resolved and confined here, where the dataset's folder is known: see
    :func:`resolve_media_path`. ``allow_remote_media`` is ``data.allow_remote_media``. ``split``
    ("train" or "eval": which of the config's files this is) goes into the ids of GSM8K rows, which
    have none of their own. Every bad row is met before anything is raised: with ``problems`` they
    are added there and skipped; without, one error lists them once the file is read.
    """
    own = problems is None
    problems = Problems() if own else problems
    base = posixpath.dirname(objstore.absolute_url(url))
    for index, (record, where) in enumerate(iter_records(url, problems)):
        resolved = None
        with problems.collect():
            if format == "gsm8k":
                from relax.data.gsm8k import gsm8k_row_to_sample

                sample = gsm8k_row_to_sample(record, where, index, split)
            else:
                sample = Sample.from_json(record, where)
            resolved = _resolve_media(sample, base, where, allow_remote_media)
        if resolved is not None:
            yield resolved
    if own:
        problems.raise_if_any()


def _resolve_media(sample: Sample, base: str, where: str, allow_remote: bool) -> Sample:
    def fix(ref: MediaRef, slot: str) -> MediaRef:
        if ref.path is None:
            return ref
        path = resolve_media_path(ref.path, base, f"{where}: row {sample.id!r} {slot}", allow_remote)
        return MediaRef(path=path, sha256=ref.sha256)

    images = tuple(fix(r, f"images[{i}]") for i, r in enumerate(sample.images))
    audios = tuple(fix(r, f"audios[{i}]") for i, r in enumerate(sample.audios))
    videos = tuple(fix(r, f"videos[{i}]") for i, r in enumerate(sample.videos))
    return replace(sample, images=images, audios=audios, videos=videos, origin=where)


def resolve_media_path(path: str, base: str, where: str, allow_remote: bool = False) -> str:
    """The URL to read a row's media from, or a ``DataError`` if the row may not read it.

    Datasets come from users, so a row must not be able to copy any file the snapshotting
    machine can read into a snapshot. A local path (relative, absolute or ``file://``) must
    resolve, links followed, inside ``base``, the folder of the data file; so must a relative
    path or a URL on the dataset's own object store. Any other URL is remote and is read only
    with ``allow_remote``.
    """
    if "::" in path:
        raise DataError(f"{where}: media {path!r} is a chained fsspec URL; give a path relative to the data file's "
                        f"folder or a plain URL")
    protocol, rest = fsspec.core.split_protocol(path)
    base_protocol, base_path = fsspec.core.split_protocol(base)
    local = protocol is None or protocol in _LOCAL_PROTOCOLS
    if local and base_protocol in _LOCAL_PROTOCOLS:
        candidate = os.path.join(base_path, rest) if protocol is None else os.path.abspath(rest)
        return "file://" + _confine_local(candidate, base_path, path, where)
    if protocol is None and not path.startswith("/"):  # relative, in a dataset on an object store
        return _confine_store(posixpath.join(base_path, path), base_protocol, base_path, path, where, relative=True)
    if local:
        raise DataError(f"{where}: media {path!r} is a path on this machine's disk, but the dataset lives at {base}; "
                        f"give a path relative to the data file's folder")
    if protocol in _protocols(base_protocol):
        inside = _confine_store(rest, base_protocol, base_path, path, where, relative=False)
        if inside:
            return inside
    if not allow_remote:
        raise DataError(f"{where}: media {path!r} is a URL outside the dataset folder {base}; Relax fetches remote "
                        f"media only with data.allow_remote_media=true (set it if you trust the URL), or copy the "
                        f"file into the dataset folder")
    return path


_LOCAL_PROTOCOLS = ("file", "local")


def _confine_local(candidate: str, base_dir: str, given: str, where: str) -> str:
    real, root = os.path.realpath(candidate), os.path.realpath(base_dir)
    if not real.startswith(root.rstrip(os.sep) + os.sep):
        raise DataError(f"{where}: media path {given!r} resolves to {real} (links followed), outside the dataset "
                        f"folder {root}; move the file into that folder and give its path relative to the data file")
    return real


def _confine_store(path: str, protocol: str, base_path: str, given: str, where: str, relative: bool) -> str:
    """``protocol://path`` normalised, if it lies under the dataset's prefix; else an error for a
    relative path (it was meant to be inside) and ``""`` for a URL (it is remote media)."""
    norm = posixpath.normpath(path)
    if norm.startswith(base_path.rstrip("/") + "/"):
        return f"{protocol}://{norm}"
    if relative:
        raise DataError(f"{where}: media path {given!r} leaves the dataset folder {protocol}://{base_path}; move the "
                        f"file into that folder and give its path relative to the data file")
    return ""


def _protocols(protocol: str) -> tuple[str, ...]:
    """Every alias of ``protocol`` (s3 and s3a, http and https): the same store either way."""
    try:
        names = fsspec.get_filesystem_class(protocol).protocol
    except (ValueError, ImportError):
        return (protocol,)
    return (names,) if isinstance(names, str) else tuple(names)


def encode_jsonl(samples: Iterable[Sample]) -> bytes:
    """Canonical jsonl: sorted keys, no spaces, one sample per line (stable bytes for hashing)."""
    lines = (json.dumps(s.to_json(), sort_keys=True, separators=(",", ":"), ensure_ascii=False) for s in samples)
    return "".join(line + "\n" for line in lines).encode("utf-8")


def write_jsonl(url: str, samples: Iterable[Sample]) -> None:
    objstore.write_bytes(url, encode_jsonl(samples))


def write_parquet(url: str, samples: Iterable[Sample]) -> None:
    """Parquet with nested columns (messages as list<struct>, metadata as a JSON string)."""
    rows = []
    for s in samples:
        row = s.to_json()
        row["metadata"] = json.dumps(row["metadata"], sort_keys=True)
        row.setdefault("videos", [])  # one schema for every row: pyarrow takes the columns of the first
        rows.append(row)
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    objstore.write_bytes(url, buf.getvalue())
