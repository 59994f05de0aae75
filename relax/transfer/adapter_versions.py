"""Adapter weight versions: a LoRA run publishes its adapter alone, with the base version it applies to.

An adapter version is an ordinary WeightStore version (safetensors files, their digests, the manifest
written last: ``relax.transfer.weights``), so it is verified exactly as a full one is; its manifest's
``meta.adapter`` says what it is::

    {"base_version": 0, "rank": 16, "alpha": 32.0, "scaling": 2.0, "target_modules": [...],
     "base_model": "tiny-qwen2", "base_checkpoint": ""}

and its files hold only the PEFT-named adapter tensors (``<p>.lora_A.weight``, (r, in), and
``<p>.lora_B.weight``, (out, r), with ``p = base_model.model.<module>``). The base version holds
the base under Hugging Face names; a LoRA run's version 0 holds both, its base and its starting
adapter, and is its own base. Retention always keeps version 0 (``ActorRole.checkpoint``).

Whoever needs the weights of an adapter version adds ``scaling * B @ A`` to each adapted
module's base weight (:func:`merge`); an engine keeps the base beside it and merges each new
adapter onto that copy, so a version applied after another is exact (``relax.engines.adapter_load``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from relax.transfer.errors import StoreError
from relax.transfer.weights import WeightStore

if TYPE_CHECKING:
    import torch

PEFT_PREFIX = "base_model.model."
LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"


def is_adapter_tensor(name: str) -> bool:
    return name.endswith((LORA_A, LORA_B))


def split(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``state`` as (base tensors, adapter tensors)."""
    base, adapter = {}, {}
    for k, v in state.items():
        (adapter if is_adapter_tensor(k) else base)[k] = v
    return base, adapter


def adapted_weight(a_name: str) -> str:
    """``base_model.model.<module>.lora_A.weight`` -> ``<module>.weight``, the base weight it changes."""
    return a_name.removeprefix(PEFT_PREFIX).removesuffix(LORA_A) + ".weight"


def merge(base: Mapping[str, Any], adapter: Mapping[str, Any], scaling: float) -> dict[str, Any]:
    """The adapted weights: ``W + scaling * B @ A`` for every module of ``adapter``, W from ``base``
    ((out, in) each), computed in W's dtype. A base without the module fails naming it."""
    out = {}
    for name in adapter:
        if not name.endswith(LORA_A):
            continue
        weight = adapted_weight(name)
        if weight not in base:
            raise StoreError(f"adapter tensor {name} adapts {weight}, which the base does not hold: the adapter "
                             f"was trained on another model")
        w = base[weight]
        out[weight] = merge_into(w.new_empty(w.shape), w, adapter[name.removesuffix(LORA_A) + LORA_B], adapter[name],
                                 scaling)
    return out


def merge_into(out: torch.Tensor, w: torch.Tensor, b: torch.Tensor, a: torch.Tensor, scaling: float) -> torch.Tensor:
    """``out = w + scaling * (b @ a)`` written into ``out`` ((out, in), W's dtype), bit-equal to the
    out-of-place expression: the same matmul, scale and add, without the two temporaries that a
    reload would otherwise allocate (and page-fault in) per adapted module."""
    import torch  # transfer/ reads tensors through safetensors and imports torch only where it computes

    torch.matmul(b.to(w.dtype), a.to(w.dtype), out=out)
    return out.mul_(scaling).add_(w)


class AdapterVersion(dict):
    """An adapter version's tensors (and, in a base version, the base's), with its manifest's
    ``adapter`` record as ``info`` and ``load_base()`` reading its base version's base tensors."""

    def __init__(self, tensors: Mapping[str, Any], info: dict[str, Any], load_base: Callable[[], dict[str, Any]]):
        super().__init__(tensors)
        self.info = info
        self.load_base = load_base

    @property
    def base_version(self) -> int:
        return int(self.info["base_version"])

    @property
    def scaling(self) -> float:
        return float(self.info["scaling"])


def publish_adapter(store: WeightStore, version: int, state: Mapping[str, Any], info: dict[str, Any],
                    meta: Mapping[str, Any] | None = None) -> str:
    """Publish ``state`` (adapter tensors; base tensors too when ``version`` is its own base) as an
    adapter version applying to ``info['base_version']``."""
    base, adapter = split(state)
    if not adapter:
        raise ValueError(f"weight version {version} is published as an adapter but holds no lora_A/lora_B tensors")
    if base and info["base_version"] != version:
        raise ValueError(f"adapter version {version} applies to version {info['base_version']}, so it holds the "
                         f"adapter alone; {len(base)} base tensors were given (e.g. {next(iter(base))})")
    return store.publish(version, state, {**(meta or {}), "adapter": dict(info)})


def adapter_record(meta: Mapping[str, Any]) -> dict[str, Any] | None:
    info = meta.get("adapter")
    return info if isinstance(info, dict) else None


def is_adapter_chain(chain: list[dict[str, Any]]) -> bool:
    """Whether the version :meth:`WeightStore.chain` rebuilt in ``chain`` is an adapter version."""
    return adapter_record(chain[-1].get("meta", {})) is not None


def load_version(store: WeightStore, version: int, chain: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Version ``version``'s tensors, verified; an :class:`AdapterVersion` for an adapter version, whose
    base version must be published (else a StoreError naming both). ``chain``: as in ``WeightStore.load``."""
    state, meta = store.load(version, chain=chain)
    info = adapter_record(meta)
    if info is None:
        return state
    base_version = info.get("base_version")
    if not isinstance(base_version, int) or not isinstance(info.get("scaling"), (int, float)):
        raise StoreError(f"weight version {version}'s manifest has a malformed adapter record {info}; the store was "
                         f"altered")
    if base_version != version and base_version not in store.versions():
        raise StoreError(f"adapter version {version} applies to base version {base_version}, which is not "
                         f"published at {store.url} (retention keeps version 0: was the store pruned by hand?)")
    stray = [k for k in state if not is_adapter_tensor(k)] if base_version != version else []
    if stray:
        raise StoreError(f"adapter version {version} holds non-adapter tensors {stray[:3]}; the store was altered")

    def load_base() -> dict[str, Any]:
        return split(state if base_version == version else store.load(base_version)[0])[0]

    return AdapterVersion(state, info, load_base)


def resolve(store: WeightStore, version: int) -> dict[str, Any]:
    """The whole weights of ``version`` under Hugging Face names: a full version as stored, an adapter
    version merged onto its base (what export --merge and weight comparisons read)."""
    state = load_version(store, version)
    if not isinstance(state, AdapterVersion):
        return state
    base = state.load_base()
    return {**base, **merge(base, split(state)[1], state.scaling)}
