"""Exact weight deltas: the elements whose bits changed between two versions, per tensor.

Pure functions over CPU tensors. A delta is taken in the tensors' own dtype (the engines' dtype:
what the store holds is what the engines load), comparing bits rather than values, so applying it
reproduces the new version bit for bit (-0.0 vs 0.0 and NaN payloads included).

One changed tensor of ``n`` elements of ``s`` bytes, ``k`` of them changed, is stored as the
cheapest of (``TensorDelta.kind``):

* ``mask``: a packed bitmask of the changed elements (``ceil(n/8)`` bytes) and their new values
  (``k*s``): the cheapest above about 1 changed element in 16;
* ``gap16`` / ``gap32``: the distances between consecutive changed indices (the first is the
  index itself) as 16-bit (when every gap fits) or 32-bit integers, and the values: ``k*(2+s)``
  or ``k*(4+s)`` bytes, the cheapest when few elements change;
* ``full``: the whole new tensor (``n*s``), when that is smaller, or its dtype or shape changed.

Not compressed: zlib level 1 saves a further ~30% of gap16 bytes but runs at ~50 MB/s per core,
slower than the object store it would save time on (docs/weight_sync.md, "Encoding").

:func:`content_hash` names a version's content independent of how it is stored (files, shards,
deltas): a digest (xxh3_128 by default; the algorithm the version's manifest names,
``relax.transfer.weight_files``) of every tensor's name, dtype, shape and bytes, in name order.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from relax.transfer.weight_files import DIGEST, hasher

KINDS = ("mask", "gap16", "gap32", "full")
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # a dtype's bits, by element size


@dataclass
class TensorDelta:
    """``index``: the packed mask (uint8, ``ceil(n/8)``) or the gaps (int16 holding uint16 bits, or int32),
    empty for ``full``; ``values``: the changed elements' new values, ``[k]`` (``full``: the new tensor)."""

    kind: str
    index: torch.Tensor
    values: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.index.numel() * self.index.element_size() + self.values.numel() * self.values.element_size()


def _bits(t: torch.Tensor) -> np.ndarray:
    """``t`` (CPU) flattened and read as integers of its element size: equal bits, equal integers."""
    return t.contiguous().view(-1).view(_BITS[t.element_size()]).numpy()


def diff(old: torch.Tensor, new: torch.Tensor) -> TensorDelta | None:
    """The delta that turns ``old`` into ``new`` (both ``[*shape]``, CPU); None when their bits are equal."""
    new = new.detach().contiguous()
    if old.dtype != new.dtype or old.shape != new.shape or new.element_size() not in _BITS:
        return TensorDelta("full", torch.empty(0, dtype=torch.uint8), new.clone())
    a, b = _bits(old), _bits(new)
    changed = a != b  # numpy: several times faster than torch's nonzero on the CPU, and it frees the GIL
    idx = np.flatnonzero(changed)
    k, n, s = idx.size, new.numel(), new.element_size()
    if k == 0:
        return None
    values = torch.from_numpy(b[idx]).view(new.dtype)
    gaps = np.diff(idx, prepend=0)
    wide = bool(gaps.max() > 0xFFFF)
    sizes = {"mask": (n + 7) // 8 + k * s, "gap32" if wide else "gap16": k * ((4 if wide else 2) + s), "full": n * s}
    kind = min(sizes, key=sizes.__getitem__)
    if kind == "full":
        return TensorDelta("full", torch.empty(0, dtype=torch.uint8), new.clone())
    if kind == "mask":
        return TensorDelta("mask", torch.from_numpy(np.packbits(changed)), values)
    if kind == "gap16":  # uint16 bits in an int16 tensor: safetensors and torch both know int16
        return TensorDelta("gap16", torch.from_numpy(gaps.astype(np.uint16).view(np.int16)), values)
    return TensorDelta("gap32", torch.from_numpy(gaps.astype(np.int32)), values)


def indices(d: TensorDelta, numel: int) -> torch.Tensor:
    """The flat indices ``[k]`` (int64) of the elements ``d`` changes in a tensor of ``numel`` elements."""
    if d.kind == "mask":
        bits = np.unpackbits(d.index.numpy(), count=numel)
        return torch.from_numpy(np.flatnonzero(bits))
    if d.kind == "gap16":
        gaps = d.index.numpy().view(np.uint16).astype(np.int64)
    elif d.kind == "gap32":
        gaps = d.index.numpy().astype(np.int64)
    else:
        raise ValueError(f"a {d.kind!r} delta has no indices")
    return torch.from_numpy(np.cumsum(gaps))


def check(d: TensorDelta, target: torch.Tensor) -> str | None:
    """Why ``d`` cannot apply to ``target`` (a problem to report), or None."""
    if d.kind not in KINDS:
        return f"unknown delta kind {d.kind!r} (one of {', '.join(KINDS)})"
    if d.kind == "full":
        if d.values.shape != target.shape:
            return f"full tensor of shape {list(d.values.shape)} for a tensor of shape {list(target.shape)}"
        return None
    if d.values.dtype != target.dtype or d.values.dim() != 1:
        return f"values of dtype {d.values.dtype} for a tensor of dtype {target.dtype}"
    want = {"mask": torch.uint8, "gap16": torch.int16, "gap32": torch.int32}[d.kind]
    if d.index.dtype != want:
        return f"{d.kind} index of dtype {d.index.dtype}, not {want}"
    if d.kind == "mask" and d.index.numel() != (target.numel() + 7) // 8:
        return f"mask of {d.index.numel()} bytes for {target.numel()} elements"
    if d.kind != "mask" and d.index.numel() != d.values.numel():
        return f"{d.index.numel()} indices for {d.values.numel()} values"
    return None


def apply_(target: torch.Tensor, d: TensorDelta) -> torch.Tensor | None:
    """Write ``d`` into ``target`` in place; returns what it overwrote (``[k]`` values, or the whole
    old tensor for ``full``) so :func:`undo_` can put it back. ``target`` must be contiguous."""
    problem = check(d, target)
    if problem is not None:
        raise ValueError(problem)
    if d.kind == "full":
        old = target.detach().clone()
        target.data.copy_(d.values)  # .data: a parameter that requires grad is written all the same
        return old
    idx = indices(d, target.numel())
    if idx.numel() != d.values.numel() or (idx.numel() and int(idx[-1]) >= target.numel()):
        raise ValueError(f"the delta's indices ({idx.numel()}, last {int(idx[-1]) if idx.numel() else None}) do not "
                         f"fit its {d.values.numel()} values and a tensor of {target.numel()} elements")
    flat = target.data.view(-1)
    idx = idx.to(flat.device)
    old = flat[idx]
    flat[idx] = d.values.to(flat.device)
    return old


def undo_(target: torch.Tensor, d: TensorDelta, old: torch.Tensor) -> None:
    """Reverse :func:`apply_` with what it returned."""
    if d.kind == "full":
        target.data.copy_(old)
    else:
        target.data.view(-1)[indices(d, target.numel()).to(target.device)] = old


def tensor_digest(name: str, t: torch.Tensor, algorithm: str = DIGEST) -> str:
    """The ``algorithm`` digest of one tensor's name, dtype, shape and bytes."""
    h = hasher(algorithm)
    h.update(f"{name}\0{str(t.dtype).removeprefix('torch.')}\0{list(t.shape)}\0".encode())
    t = t.detach().cpu().contiguous()  # an engine's tensors may live on a GPU
    if t.numel():
        h.update(t.view(-1).view(torch.uint8).numpy())  # both hashes release the GIL: threads hash in parallel
    return h.hexdigest()


def digests(state: Mapping[str, torch.Tensor], threads: int = 8, algorithm: str = DIGEST) -> dict[str, str]:
    """:func:`tensor_digest` of every tensor, hashed concurrently."""
    names = sorted(state)
    hasher(algorithm)  # an unknown algorithm fails here, not in a worker thread
    with ThreadPoolExecutor(max(1, threads)) as pool:
        return dict(zip(names, pool.map(lambda n: tensor_digest(n, state[n], algorithm), names), strict=True))


def combine(per_tensor: Mapping[str, str], algorithm: str = DIGEST) -> str:
    """The content hash from every tensor's digest (:func:`content_hash` without re-hashing)."""
    h = hasher(algorithm)
    h.update("".join(f"{n}\0{per_tensor[n]}\n" for n in sorted(per_tensor)).encode())
    return h.hexdigest()


def content_hash(state: Mapping[str, torch.Tensor], threads: int = 8, algorithm: str = DIGEST) -> str:
    """The ``algorithm`` digest naming ``state``'s content (names, dtypes, shapes, bytes), however it is stored."""
    return combine(digests(state, threads, algorithm), algorithm)
