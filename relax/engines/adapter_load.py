"""Loading a weight version into the native engine, adapter versions merged onto a kept base.

An adapter version (``relax.transfer.adapter_versions``) changes only the adapted projections:
W = W_base + scaling * B @ A. The engine merges it into its weights rather than running the adapter
beside them (docs/lora.md, "Engines": decoding then costs what the base does, and a reload costs one
(out, r) x (r, in) product per adapted module). To keep the merge exact version after version, the
base weights of the adapted modules are kept aside (:class:`KeptBase`) and each adapter is merged onto
that copy: unmerging by subtraction would leave rounding residue that grows with every reload.

The first adapter version an engine sees (or one on another base version) goes the full way: its base
is read (version 0 holds it), merged and loaded through ``engine.update_weights``. After that a reload
reads only the adapter's bytes and rewrites only the adapted weights, in place, between scheduler steps
(``engine.exclusive``), exactly as ``update_weights`` swaps a whole version.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from relax.engines.types import EngineError
from relax.engines.weight_source import complete_tied
from relax.transfer.adapter_versions import AdapterVersion, merge, split


@dataclass
class KeptBase:
    """The base version an engine's adapters apply to, and its adapted weights' base values."""

    version: int
    weights: dict[str, torch.Tensor]


def load_into(engine: Any, state: dict[str, Any], version: str) -> None:
    """Load ``state`` (a full version, or an :class:`AdapterVersion`) into ``engine`` as ``version``."""
    if not isinstance(state, AdapterVersion):
        engine.update_weights(complete_tied(state, getattr(engine, "model", None)), version)
        engine.lora_base = None  # a full version: a later adapter reads its base again
        return
    kept: KeptBase | None = getattr(engine, "lora_base", None)
    adapter = split(state)[1]
    if kept is None or kept.version != state.base_version or len(state) > len(adapter):
        base = state.load_base()
        merged = merge(base, adapter, state.scaling)
        engine.update_weights(complete_tied({**base, **merged}, getattr(engine, "model", None)), version)
        engine.lora_base = KeptBase(state.base_version, {k: base[k].clone() for k in merged})
        return
    merged = merge(kept.weights, adapter, state.scaling)
    params = dict(engine.model.named_parameters())
    odd = [k for k, v in merged.items() if k not in params or params[k].shape != v.shape]
    if odd or set(merged) != set(kept.weights):
        differ = sorted(set(merged) ^ set(kept.weights))[:3] or odd[:3]
        raise EngineError(f"adapter version {version} adapts {differ}, unlike the adapter loaded before on base "
                          f"{kept.version}; still serving version {engine.weight_version}")
    with torch.no_grad(), engine.exclusive():
        for k, v in merged.items():
            params[k].copy_(v)
        if engine.fused is not None:
            engine.fused.refresh()  # the fused weights are copies (concatenations) of the old ones
        engine.weight_version = str(version)
