"""The digests of a weight version's files and content: what publish records and a load checks.

Digests: a version's manifest names the algorithm of its file digests and content hash
(``"digest"``); each file's digest is stored under that name. New versions use xxh3_128 (about
22 GB/s per core, against sha256's 1.7): the digest guards against torn or corrupted files, not
against someone who can rewrite the manifest beside them in the same store, so a fast
non-cryptographic 128-bit hash is enough, and 128 bits still name versions without collisions in
practice. A manifest without ``"digest"`` was written with sha256 and is verified with it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

import xxhash

from relax.transfer.errors import StoreError

DIGEST = "xxh3_128"  # what new versions are hashed with
LEGACY = "sha256"  # what a manifest that names no algorithm was hashed with (stores written before xxh3)
ALGORITHMS = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}


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

