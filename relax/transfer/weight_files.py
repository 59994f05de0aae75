"""The bytes of a weight version's files and their digests: what publish writes and a load checks.

Serialising: :func:`serialize` lays tensors out in the safetensors format (an 8-byte little-endian
header length, a JSON header of dtypes, shapes and byte offsets, then the tensors' bytes) as a list
of parts in which every tensor is a view of its own memory. ``objstore.write_bytes`` writes such a
list without joining it, so a shard goes from the tensors to the file (or, on an object store, into
one joined buffer) with no intermediate copy; ``safetensors.torch.save`` builds the file twice in
memory, at about 0.8 GB/s on one core, which was half the cost of a publish on a local folder
(docs/weight_sync.md, "Integrity and speed"). Any safetensors reader loads the result.

Digests: a version's manifest names the algorithm of its file digests and content hash
(``"digest"``); each file's digest is stored under that name. New versions use xxh3_128 (about
22 GB/s per core, against sha256's 1.7): the digest guards against torn or corrupted files, not
against someone who can rewrite the manifest beside them in the same store, so a fast
non-cryptographic 128-bit hash is enough, and 128 bits still name versions without collisions in
practice. A manifest without ``"digest"`` was written with sha256 and is verified with it.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import xxhash

from relax.transfer.errors import StoreError

DIGEST = "xxh3_128"  # what new versions are hashed with
LEGACY = "sha256"  # what a manifest that names no algorithm was hashed with (stores written before xxh3)
ALGORITHMS = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}

_DTYPES = {name: code for name, code in (
    ("float64", "F64"), ("float32", "F32"), ("float16", "F16"), ("bfloat16", "BF16"), ("int64", "I64"),
    ("int32", "I32"), ("int16", "I16"), ("int8", "I8"), ("uint8", "U8"), ("bool", "BOOL"),
    ("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64"),
    ("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")) if hasattr(torch, name)}
_CODES = {getattr(torch, name): code for name, code in _DTYPES.items()}


def hasher(algorithm: str) -> Any:
    """A fresh incremental hash object of ``algorithm`` (``update(bytes-like)``, ``hexdigest()``)."""
    make = ALGORITHMS.get(algorithm)
    if make is None:
        raise StoreError(f"unknown digest algorithm {algorithm!r} (this version of relax knows "
                         f"{', '.join(sorted(ALGORITHMS))}): the version was written by a newer relax or altered; "
                         f"load it with the relax that wrote it, or publish it again")
    return make()


def digest(parts: Iterable[Any], algorithm: str = DIGEST) -> str:
    """The hex digest of the bytes-like ``parts`` in order (one file's bytes, however they are cut)."""
    h = hasher(algorithm)
    for part in parts:
        h.update(part)
    return h.hexdigest()


def algorithm(manifest: Mapping[str, Any], where: str) -> str:
    """The digest algorithm ``manifest`` (at ``where``) names: ``"digest"``, or sha256 for one that names none."""
    name = manifest.get("digest", LEGACY)
    if not isinstance(name, str):
        raise StoreError(f"{where} names digest algorithm {name!r}, not a string; the store was altered")
    hasher(name)  # an unknown one is refused here, before any file is read
    return name


def serialize(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> list[Any]:
    """``tensors`` (CPU, contiguous) as one safetensors file: ``[header, *views of the tensors' bytes]``.

    The parts alias the tensors: write them before the tensors change. Tensors are laid out largest
    element first (then by name), so each starts at a multiple of its element size, as safetensors'
    own writer does, and readers may map them in place."""
    if any(t.dtype not in _CODES for t in tensors.values()):  # a dtype this writer does not name: the library's
        from safetensors.torch import save as st_save

        return [st_save({k: t.clone() for k, t in tensors.items()}, metadata=dict(metadata or {}))]
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    views, offset = [], 0
    for name in sorted(tensors, key=lambda n: (-tensors[n].element_size(), n)):
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
        if nbytes:
            views.append(memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()))
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the tensors' bytes start 8-aligned
    return [struct.pack("<Q", len(head)) + head, *views]
