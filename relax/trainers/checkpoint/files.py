"""The files of a checkpoint, read without trusting them: ``meta.json``, sha256 and safe unpickling.

A checkpoint is a folder on any fsspec URL whose ``meta.json`` is written last, naming the sha256 of
every file it holds, so a checkpoint exists iff its meta does and a torn one is never loaded.
Whoever can write the run root can write a matching sha256 too, so the hash guards against
corruption only: every file is read with ``torch.load(weights_only=True)``, which builds tensors
and plain containers and never runs code. Checkpoints written before RNG states were stored as
tensors (numpy's state as an ndarray) load through an allow-list of numpy's array constructors,
nothing wider. ``checkpoint.trainer_state`` gives these files their meaning (one gathered
``trainer.pt``); ``checkpoint.sharded`` writes and reads a file per model-parallel rank.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
from typing import Any

import numpy as np
import torch

from relax import objstore

_SHA256 = re.compile(r"[0-9a-f]{64}")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, torn, corrupt, unsafe or of another model; the
    message names the object and why."""


def _numpy_globals() -> list[Any]:
    # what an ndarray pickles to (pre-tensor RNG states): array reconstruction, no callables of ours
    try:
        from numpy._core import multiarray  # numpy 2
    except ImportError:  # numpy 1
        from numpy.core import multiarray

    return [multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def safe_load(blob: bytes, where: str) -> dict[str, Any]:
    """``torch.load`` with ``weights_only=True``; anything else in the file is a CheckpointError."""
    try:
        with torch.serialization.safe_globals(_numpy_globals()):
            state = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    except Exception as e:  # UnpicklingError and whatever a malformed file raises
        raise CheckpointError(f"checkpoint {where} holds more than tensors and plain values, or is not a "
                              f"checkpoint ({type(e).__name__}: {str(e)[:200]}); it was not loaded") from None
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"checkpoint {where} is not a trainer checkpoint (no 'model' state)")
    return state


def tensor_file(state: dict[str, Any]) -> bytes:
    """``state`` as ``torch.save`` writes it (what :func:`safe_load` reads back)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def write_file(url: str, name: str, blob: bytes) -> dict[str, Any]:
    """Write ``<url>/<name>``; returns what meta.json records of it (``sha256``, ``bytes``)."""
    objstore.write_bytes(objstore.join(url, name), blob)
    return {"sha256": hashlib.sha256(blob).hexdigest(), "bytes": len(blob)}


def write_meta(url: str, body: dict[str, Any]) -> None:
    """``<url>/meta.json``, the checkpoint's last write: before it, the checkpoint does not exist."""
    objstore.write_bytes(objstore.join(url, "meta.json"), json.dumps(body, indent=1, sort_keys=True).encode())


def read_meta(url: str) -> dict[str, Any]:
    """``<url>/meta.json``; FileNotFoundError when it is missing, CheckpointError when unreadable."""
    where = objstore.join(url, "meta.json")
    try:
        meta = json.loads(objstore.read_bytes(where))
    except FileNotFoundError:
        raise FileNotFoundError(f"no checkpoint at {url} (meta.json missing: never written or not finished)") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{where} is not valid JSON ({e}): a torn or foreign file") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("sha256"), str):
        raise CheckpointError(f"{where} has no 'sha256' string: not a checkpoint this code wrote")
    return meta


def read_verified(url: str, name: str, sha256: Any) -> dict[str, Any]:
    """``<url>/<name>`` after its sha256 matches ``sha256`` (from meta.json), safely loaded.
    ``name`` is the caller's, never a string read from storage."""
    where = objstore.join(url, name)
    if not isinstance(sha256, str) or not _SHA256.fullmatch(sha256):
        raise CheckpointError(f"meta.json of {url} records no sha256 for {name}: not a checkpoint this code wrote")
    try:
        blob = objstore.read_bytes(where, large=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {where} is missing; the checkpoint is incomplete") from None
    if hashlib.sha256(blob).hexdigest() != sha256:
        raise CheckpointError(f"checkpoint {where} fails its sha256 check; it is corrupt")
    return safe_load(blob, where)
