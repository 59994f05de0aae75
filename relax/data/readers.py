"""Read and write rows as jsonl or parquet on any fsspec URL.

Readers yield each record with a location string (``file.jsonl:12``, ``file.parquet#row3``)
so every later error can name the exact row at fault. Relative media paths in a row are
resolved against the folder of the file the row came from, so a dataset folder can be
moved or uploaded to S3 as a whole.
"""

from __future__ import annotations

import io
import json
import posixpath
from collections.abc import Iterable, Iterator
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from relax import objstore
from relax.data.errors import DataError
from relax.data.schema import MediaRef, Sample

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".ndjson", ".json")
PARQUET_SUFFIXES = (".parquet", ".pq")


def iter_records(url: str) -> Iterator[tuple[dict[str, Any], str]]:
    """Yield ``(record, where)`` for every row of a jsonl or parquet file."""
    name = posixpath.basename(url)
    if not objstore.exists(url):
        raise DataError(f"data file {url} does not exist; check data.train_url / data.eval_url")
    if url.endswith(JSONL_SUFFIXES):
        yield from _iter_jsonl(url, name)
    elif url.endswith(PARQUET_SUFFIXES):
        yield from _iter_parquet(url, name)
    else:
        raise DataError(f"{url}: unknown file type; use a .jsonl (or .jsonl.gz) or .parquet file")


def _iter_jsonl(url: str, name: str) -> Iterator[tuple[dict[str, Any], str]]:
    with fsspec.open(url, "rt", encoding="utf-8", compression="infer") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"{url}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: malformed JSON ({e.msg} at column {e.colno}); fix or delete line "
                                f"{lineno} of {name}") from None
            if not isinstance(record, dict):
                raise DataError(f"{where}: each line must be a JSON object, got {type(record).__name__}")
            yield record, where


def _iter_parquet(url: str, name: str) -> Iterator[tuple[dict[str, Any], str]]:
    with fsspec.open(url, "rb") as fh:
        try:
            pf = pq.ParquetFile(io.BytesIO(fh.read()))
        except (pa.ArrowInvalid, OSError) as e:
            raise DataError(f"{url}: not a readable parquet file ({e})") from None
    index = 0
    for batch in pf.iter_batches(batch_size=1024):
        for record in batch.to_pylist():
            # Nested columns may be stored as JSON strings by tools that flatten them.
            for key in ("messages", "metadata", "images", "audios"):
                if isinstance(record.get(key), str) and record[key][:1] in "[{":
                    try:
                        record[key] = json.loads(record[key])
                    except json.JSONDecodeError:
                        raise DataError(f"{url}#row{index}: column {key!r} holds invalid JSON") from None
            yield record, f"{url}#row{index}"
            index += 1


def read_samples(url: str, format: str = "relax") -> Iterator[Sample]:
    """Parse every row of ``url`` into a validated ``Sample`` (``format``: relax or gsm8k)."""
    base = posixpath.dirname(objstore.absolute_url(url))
    for index, (record, where) in enumerate(iter_records(url)):
        if format == "gsm8k":
            from relax.data.gsm8k import gsm8k_row_to_sample

            sample = gsm8k_row_to_sample(record, where, index)
        else:
            sample = Sample.from_json(record, where)
        yield _resolve_media(sample, base)


def _resolve_media(sample: Sample, base: str) -> Sample:
    def fix(ref: MediaRef) -> MediaRef:
        if ref.path is None or "://" in ref.path or ref.path.startswith("/"):
            return ref
        return MediaRef(path=objstore.join(base, ref.path), sha256=ref.sha256)

    if not any(r.path for r in sample.images + sample.audios):
        return sample
    return sample.with_media(tuple(map(fix, sample.images)), tuple(map(fix, sample.audios)))


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
        rows.append(row)
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    objstore.write_bytes(url, buf.getvalue())
