"""Optimizer state in a checkpoint: by parameter name, in the Hugging Face layout.

A checkpoint keeps AdamW's state keyed by the name of the parameter it belongs to, not by its
position in the optimizer (:func:`optimizer_state`), so it resumes on either backend and at any
parallel layout. A model that is a view of another layout (a ``model_parallel.ShardedModel``: the
Megatron policy, Hugging Face names over tensor-parallel shards) renames and gathers its states
through ``optimizer_state_to_checkpoint`` / ``optimizer_state_from_checkpoint``, which use
:func:`state_to_hf` / :func:`state_from_hf` below. Moments are elementwise, so converting them like
the weights (a permutation and concatenation, ``relax.trainers.megatron.convert``) is exact.

A parameter that was never stepped (a critic's LM head: it gets no gradient) has no state; its
Hugging Face entry is ``{}``, what a fresh optimizer has. ``policy`` below is a
``MegatronPolicy`` (its ``gpt``, ``layout``, ``to_hf`` and ``from_hf``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from relax.trainers.checkpoint.files import CheckpointError
from relax.trainers.megatron.convert import hf_shapes
from relax.trainers.model_parallel import hook, unwrap


def local_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer``'s state keyed by the name of each parameter in ``model`` (as this rank holds it):
    ``{"format": "by-name", "groups": [hyper-parameters], "state": {name: {"step", "exp_avg", ...}}}``."""
    sd = optimizer.state_dict()
    order = param_names(unwrap(model), optimizer)
    return {"format": "by-name", "groups": [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]],
            "state": {order[i]: st for i, st in sd["state"].items()}}


def optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """:func:`local_optimizer_state`, not by position, so a checkpoint resumes on either backend and any
    parallel layout: a model that is a view of another layout (the Megatron policy: Hugging Face names,
    tensor-parallel shards gathered) renames and gathers its parameters' states
    (``optimizer_state_to_checkpoint``)."""
    out = local_optimizer_state(model, optimizer)
    convert = hook(model, "optimizer_state_to_checkpoint")
    return {**out, "state": convert(out["state"])} if convert is not None else out


def load_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """Inverse of :func:`optimizer_state` (``optimizer_state_from_checkpoint`` maps a view's names
    back); a positional state dict (checkpoints before by-name) loads as it is."""
    if saved.get("format") != "by-name":
        optimizer.load_state_dict(saved)
        return
    convert = hook(model, "optimizer_state_from_checkpoint")
    by_name = convert(saved["state"]) if convert is not None else saved["state"]
    load_by_name(optimizer, saved, by_name, param_names(unwrap(model), optimizer))


def param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name in ``model`` of each parameter of ``optimizer``, in its groups' order."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for g in optimizer.param_groups for p in g["params"]]


def load_by_name(optimizer: torch.optim.Optimizer, saved: dict[str, Any], by_name: dict[str, dict[str, Any]],
                 order: list[str]) -> None:
    """Load per-name optimizer state into ``optimizer`` whose parameters are named ``order`` (its
    groups' order), through ``Optimizer.load_state_dict`` (which casts to each parameter's dtype and
    device). Names the checkpoint has and this model lacks (a tied head's alias) are skipped."""
    if len(saved["groups"]) != len(optimizer.param_groups):
        raise CheckpointError(f"checkpoint optimizer has {len(saved['groups'])} parameter groups, this one "
                              f"{len(optimizer.param_groups)}: another optimizer layout")
    groups, start = [], 0
    for g, hyper in zip(optimizer.param_groups, saved["groups"], strict=True):
        groups.append({**hyper, "params": list(range(start, start + len(g["params"])))})
        start += len(g["params"])
    # a parameter never stepped (a head without gradient) has no state, as in a fresh optimizer; each
    # gets its own copy of a shared scalar (AdamW's step), which the optimizer increments in place
    state = {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in by_name[n].items()}
             for i, n in enumerate(order) if n in by_name}
    optimizer.load_state_dict({"state": state,
                               "param_groups": groups})


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


def moments_to_hf(
    parts: list[tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]],
    to_hf: Callable[[list[dict[str, torch.Tensor]]], dict[str, torch.Tensor]],
) -> dict[str, dict[str, Any]]:
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
