"""Optimizer state of a megatron model in the Hugging Face layout, by parameter name.

A checkpoint keeps AdamW's moments under the Hugging Face names of the weights they belong to
(relax.trainers.torch.checkpoint ``optimizer_state``), so it resumes at another tensor/pipeline
layout or on the other backend. Moments are elementwise, so converting them like the weights
(a permutation and concatenation, ``relax.trainers.megatron.convert``) is exact.

A parameter that was never stepped (a critic's LM head: it gets no gradient) has no state; its
Hugging Face entry is ``{}``, what a fresh optimizer has. ``policy`` below is a
``MegatronPolicy`` (its ``gpt``, ``layout``, ``to_hf`` and ``from_hf``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from relax.trainers.checkpoint_files import CheckpointError
from relax.trainers.megatron.convert import hf_shapes


def is_moment(value: Any) -> bool:
    """An optimizer state entry shaped like its parameter (AdamW's exp_avg), not a count (its step)."""
    return torch.is_tensor(value) and value.dim() > 0


def own_counts(scalars: dict[str, Any]) -> dict[str, Any]:
    """A parameter's own copy of the shared counts: AdamW increments ``step`` in place, so one
    tensor shared by every parameter would advance once per parameter per update."""
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in scalars.items()}


def all_or_none(mask: torch.Tensor, name: str) -> bool:
    """Whether converted tensor ``name`` came from stepped parameters; a mix would put moments of
    stepped and never-stepped parameters into one tensor, which the layout cannot express."""
    if bool(mask.all()):
        return True
    if mask.any():
        raise CheckpointError(f"optimizer state of {name!r} mixes stepped and never-stepped parameters")
    return False


def _counts_of(states: Iterable[dict[str, Any]]) -> dict[str, Any]:
    scalars: dict[str, list[Any]] = {}
    for st in states:
        for key, value in st.items():
            if not is_moment(value):
                scalars.setdefault(key, []).append(value)
    for key, values in scalars.items():  # AdamW's step: one count for every stepped parameter
        if any(not torch.equal(torch.as_tensor(v), torch.as_tensor(values[0])) for v in values):
            raise ValueError(f"optimizer state {key!r} differs between parameters; it has no by-name form")
    return {key: values[0] for key, values in scalars.items()}


def moments_to_hf(parts: list[tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]],
                  to_hf: Callable[[list[dict[str, torch.Tensor]]], dict[str, torch.Tensor]]) -> dict[str, dict[str, Any]]:
    """Optimizer state by megatron name -> by Hugging Face name, whole tensors. ``parts``: per part
    of the model, (its weights or tensors of their shapes, its stepped parameters' state), both by
    megatron name; ``to_hf`` turns one such dict per part into the full HF-named dict (a gather over
    the process groups for this rank's part, or a merge of a sharded checkpoint's files)."""
    keys = sorted({k for _, local in parts for st in local.values() for k, v in st.items() if is_moment(v)})
    has = to_hf([{n: torch.full_like(p, float(n in local)) for n, p in params.items()} for params, local in parts])
    hf = {key: to_hf([{n: local[n][key] if n in local else torch.zeros_like(p) for n, p in params.items()}
                      for params, local in parts]) for key in keys}
    counts = _counts_of(st for _, local in parts for st in local.values())
    return {name: {**own_counts(counts), **{k: hf[k][name] for k in keys}} if all_or_none(mask, name) else {}
            for name, mask in has.items()}


def state_to_hf(policy: Any, local: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """This rank's state per megatron parameter name (stepped ones) -> per Hugging Face name, full
    tensors, on every rank (collective over the tensor and pipeline groups)."""
    params = {n: p.detach() for n, p in policy.gpt.named_parameters()}
    return moments_to_hf([(params, local)], lambda parts: policy.to_hf(parts[0]))


def state_from_hf(policy: Any, by_hf: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Inverse of :func:`state_to_hf`: this rank's shard of each stepped parameter's state, per
    megatron name (never-stepped ones and names this layout lacks, a tied head's alias, left out)."""
    shapes = hf_shapes(policy.layout)
    stepped = {n for n, st in by_hf.items() if st and n in shapes}
    keys = sorted({k for n in stepped for k, v in by_hf[n].items() if is_moment(v)})
    has = policy.from_hf({n: torch.full(shape, float(n in stepped)) for n, shape in shapes.items()})
    local = {key: policy.from_hf({n: by_hf[n][key] if n in stepped else torch.zeros(shape)
                                  for n, shape in shapes.items()}) for key in keys}
    counts = _counts_of(by_hf[n] for n in stepped)
    return {n: {**own_counts(counts), **{k: local[k][n] for k in keys}}
            for n, mask in has.items() if all_or_none(mask, n)}
