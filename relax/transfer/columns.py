"""Topic schemas and the columnar shard codec.

A topic's samples are rows; their fields are columns. A shard holds one batch of rows
for some fields as a safetensors file: fixed-shape fields are stacked into one array,
variable-length fields (token ids, logprobs, image patches) are concatenated along their
first axis with an ``<name>.offsets`` array, bytes and strings likewise as uint8. Arrays
stay numpy so producers and consumers that never touch torch (reward workers, the crash
tests) start fast; ``to_torch`` converts at the edge, bfloat16 included.

Per-sample bookkeeping (id, prompt group, policy version, token count) is not in shards:
it travels in the commit record so that consumers plan batches without reading data.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from relax.transfer.errors import SchemaError, StoreError

KINDS = ("tensor", "bytes", "str")
# bfloat16 has no numpy dtype: it is carried as its raw 16 bits and restored by to_torch.
_STORAGE_DTYPE = {"bfloat16": "int16"}


@dataclass(frozen=True)
class Field:
    """One column. ``shape`` is per sample: ``()`` a scalar, ``(None,)`` a variable-length
    vector, ``(None, 1176)`` variable rows of fixed width, ``(3,)`` a fixed vector. Only the
    first dimension may be ``None``."""

    name: str
    dtype: str = "float32"
    shape: tuple[int | None, ...] = ()
    kind: str = "tensor"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise SchemaError(f"field {self.name!r}: kind must be one of {KINDS}, got {self.kind!r}")
        if any(d is None for d in self.shape[1:]):
            raise SchemaError(f"field {self.name!r}: only the first dimension may be variable (None)")
        if self.kind == "tensor":
            np.dtype(_STORAGE_DTYPE.get(self.dtype, self.dtype))  # raises on unknown dtypes

    @property
    def ragged(self) -> bool:
        return self.kind != "tensor" or (len(self.shape) > 0 and self.shape[0] is None)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "kind": self.kind}

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> Field:
        return Field(d["name"], d.get("dtype", "float32"), tuple(d.get("shape", ())), d.get("kind", "tensor"))

    def check(self, value: Any, sample_id: str) -> np.ndarray:
        """Normalise one sample's value to a contiguous numpy array, or raise naming the mismatch."""
        where = f"sample {sample_id!r} field {self.name!r}"
        if self.kind == "bytes":
            if not isinstance(value, (bytes, bytearray, memoryview)):
                raise SchemaError(f"{where}: expected bytes, got {type(value).__name__}")
            return np.frombuffer(bytes(value), dtype=np.uint8)
        if self.kind == "str":
            if not isinstance(value, str):
                raise SchemaError(f"{where}: expected str, got {type(value).__name__}")
            return np.frombuffer(value.encode("utf-8"), dtype=np.uint8)
        arr = _as_numpy(value, self.dtype)
        if arr.dtype != np.dtype(_STORAGE_DTYPE.get(self.dtype, self.dtype)):
            raise SchemaError(f"{where}: dtype {arr.dtype} contradicts the topic schema ({self.dtype}); "
                              f"cast it before putting")
        if arr.ndim != len(self.shape) or any(
            w is not None and w != g for w, g in zip(self.shape, arr.shape, strict=False)
        ):
            want = "(" + ", ".join("*" if d is None else str(d) for d in self.shape) + ")"
            raise SchemaError(f"{where}: shape {tuple(arr.shape)} contradicts the topic schema {want}")
        return arr if arr.flags.c_contiguous else arr.copy(order="C")  # ascontiguousarray makes 0-d 1-d


def _as_numpy(value: Any, dtype: str) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor; imported lazily, never required
        t = value.detach().cpu()
        if str(t.dtype) == "torch.bfloat16":
            if dtype != "bfloat16":
                raise SchemaError(f"got a bfloat16 tensor for a {dtype} field")
            import torch

            return t.view(torch.int16).numpy()
        return t.numpy()
    if isinstance(value, np.ndarray):
        return value
    arr = np.asarray(value)
    if arr.dtype.kind in "iuf" and dtype != "bfloat16" and np.can_cast(arr.dtype, dtype, "same_kind"):
        return arr.astype(dtype)  # Python scalars and lists take the schema's dtype
    return arr


@dataclass(frozen=True)
class TopicSchema:
    """The fields a topic's samples may carry. Stages add fields by declaring them too."""

    fields: tuple[Field, ...]

    def __post_init__(self) -> None:
        names = [f.name for f in self.fields]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise SchemaError(f"fields declared twice: {dupes}")
        reserved = set(names) & RESERVED
        if reserved:
            raise SchemaError(f"{sorted(reserved)} are per-sample bookkeeping, not fields; pass them as "
                              f"keyword columns of put()")

    def field(self, name: str) -> Field:
        for f in self.fields:
            if f.name == name:
                return f
        raise SchemaError(f"field {name!r} is not in the topic schema; declared: {[f.name for f in self.fields]}")

    def to_json(self) -> list[dict[str, Any]]:
        return [f.to_json() for f in self.fields]

    @staticmethod
    def from_json(items: Sequence[Mapping[str, Any]]) -> TopicSchema:
        return TopicSchema(tuple(Field.from_json(d) for d in items))

    def merge(self, other: TopicSchema) -> TopicSchema:
        """Union of two schemas; a field declared differently in each is an error."""
        mine = {f.name: f for f in self.fields}
        for f in other.fields:
            if f.name in mine and mine[f.name] != f:
                raise SchemaError(f"field {f.name!r} is declared as {mine[f.name].to_json()} in the topic but "
                                  f"{f.to_json()} here")
        return TopicSchema(self.fields + tuple(f for f in other.fields if f.name not in mine))


RESERVED = {"id", "group", "group_size", "policy_version", "num_tokens"}


# safetensors dtype codes; shards are written and read without the library so that no
# sample is copied on the way (the format stays standard: safetensors.numpy.load reads it).
_ST_CODES = {"float64": "F64", "float32": "F32", "float16": "F16", "int64": "I64", "int32": "I32", "int16": "I16",
             "int8": "I8", "uint8": "U8", "uint16": "U16", "uint32": "U32", "uint64": "U64", "bool": "BOOL"}
_ST_DTYPES = {v: k for k, v in _ST_CODES.items()}


def encode_shard(columns: Mapping[str, list[np.ndarray]], fields: Mapping[str, Field],
                 ids: Sequence[str]) -> list[bytes | memoryview]:
    """A safetensors file as a list of parts (header, then each sample's buffer in place).

    Fixed-shape fields are one stacked tensor; ragged fields, bytes and strings are the
    samples' buffers back to back plus an ``<name>.offsets`` tensor.
    """
    header: dict[str, Any] = {}
    parts: list[bytes | memoryview] = []
    pos = 0

    def add(name: str, dtype: np.dtype, shape: list[int], buffers: list[np.ndarray]) -> None:
        nonlocal pos
        size = sum(b.nbytes for b in buffers)
        header[name] = {"dtype": _ST_CODES[dtype.name], "shape": shape, "data_offsets": [pos, pos + size]}
        parts.extend(memoryview(b).cast("B") for b in buffers if b.nbytes)
        pos += size

    for name, values in columns.items():
        if fields[name].ragged:
            lengths = np.fromiter((v.shape[0] for v in values), dtype=np.int64, count=len(values))
            offsets = np.zeros(len(values) + 1, dtype=np.int64)
            np.cumsum(lengths, out=offsets[1:])
            dtype = values[0].dtype if values else np.dtype(np.uint8)
            add(name, dtype, [int(offsets[-1]), *(values[0].shape[1:] if values else ())], list(values))
            add(name + ".offsets", offsets.dtype, [len(offsets)], [offsets])
        else:
            stacked = np.stack(values)
            add(name, stacked.dtype, list(stacked.shape), [stacked])
    kinds = {name: fields[name].kind for name in columns}
    header["__metadata__"] = {"relax_shard": "1", "ids": json.dumps(list(ids)), "kinds": json.dumps(kinds)}
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the format aligns data to 8 bytes
    return [len(head).to_bytes(8, "little") + head, *parts]


def decode_shard(blob: bytes, name: str) -> tuple[list[str], dict[str, list[Any]]]:
    """Per-sample values of every field in the shard, as views into ``blob`` (no copies):
    numpy arrays for tensors, memoryviews for bytes, str for strings."""
    try:
        n = int.from_bytes(blob[:8], "little")
        header = json.loads(blob[8:8 + n])
        meta = header.pop("__metadata__")
        ids, kinds = json.loads(meta["ids"]), json.loads(meta["kinds"])
        base = 8 + n
        tensors = {}
        for tname, spec in header.items():
            start, stop = spec["data_offsets"]
            dtype = np.dtype(_ST_DTYPES[spec["dtype"]])
            tensors[tname] = np.frombuffer(blob, dtype=dtype, count=(stop - start) // dtype.itemsize,
                                           offset=base + start).reshape(spec["shape"])
    except Exception as e:  # a checksum passed but the blob is not ours: report, don't crash
        raise StoreError(f"shard {name} cannot be decoded: {e}") from None
    view = memoryview(blob)
    out: dict[str, list[Any]] = {}
    for fname, kind in kinds.items():
        arr = tensors[fname]
        if fname + ".offsets" not in tensors:
            out[fname] = list(arr)
            continue
        off = tensors[fname + ".offsets"].tolist()
        if kind == "tensor":
            out[fname] = [arr[off[i]:off[i + 1]] for i in range(len(ids))]
        else:
            start = base + header[fname]["data_offsets"][0]
            raw = [view[start + off[i]:start + off[i + 1]] for i in range(len(ids))]
            out[fname] = raw if kind == "bytes" else [bytes(r).decode("utf-8") for r in raw]
    return ids, out


def to_torch(value: Any, field: Field) -> Any:
    """A numpy value as a torch tensor (a writable copy: read values are read-only views into
    the cached shard), restoring bfloat16 from its raw bits."""
    import torch

    t = torch.from_numpy(np.array(value, copy=True, order="C"))
    return t.view(torch.bfloat16) if field.dtype == "bfloat16" else t
