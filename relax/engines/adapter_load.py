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
(``engine.exclusive``), exactly as ``update_weights`` swaps a whole version: each merge is written
straight into the engine's parameter, and the fused decoder's concatenated copies are rewritten only in
the adapted rows (``FusedDecoder.rewrite``), so a reload costs the adapter's products and one pass over
the adapted weights, not a copy of the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from relax.engines.types import EngineError
from relax.engines.weight_source import complete_tied
from relax.transfer.adapter_versions import LORA_A, LORA_B, AdapterVersion, adapted_weight, merge, merge_into, split


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
    params = dict(engine.model.named_parameters())
    # every check before the first write: a refused reload leaves the version served before intact
    pairs = {adapted_weight(k): (adapter[k.removesuffix(LORA_A) + LORA_B], v)
             for k, v in adapter.items() if k.endswith(LORA_A)}
    odd = [k for k, (b, a) in pairs.items()
           if k not in params or tuple(params[k].shape) != (b.shape[0], a.shape[-1]) or b.shape[-1] != a.shape[0]]
    if odd or set(pairs) != set(kept.weights):
        differ = sorted(set(pairs) ^ set(kept.weights))[:3] or odd[:3]
        raise EngineError(f"adapter version {version} adapts {differ}, unlike the adapter loaded before on base "
                          f"{kept.version}; still serving version {engine.weight_version}")
    with torch.no_grad(), engine.exclusive():
        # written in place, only the adapted weights: a reload allocates nothing the size of a weight
        for k, (b, a) in pairs.items():
            merge_into(params[k], kept.weights[k], b, a, state.scaling)
        if engine.fused is not None:
            engine.fused.rewrite(set(pairs))  # its QKV and gate/up are concatenated copies
        engine.weight_version = str(version)
