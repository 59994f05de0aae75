"""Trainer checkpoints on any fsspec URL, restored bit-exactly; export to Hugging Face format.

``<url>/trainer.pt`` holds model, optimizer and LR-schedule state plus every RNG the step
touches (torch, Python, numpy); ``<url>/meta.json`` is written last with the file's sha256
and whatever the caller records (step, manifest versions consumed up to, weight version).
The files are read as ``relax.trainers.checkpoint.files`` says: sha256 first, then a
weights-only unpickling, so nothing read back runs code. The RNG states are stored as
tensors and ints for that reason. The optimizer's state is kept by parameter name
(``relax.trainers.checkpoint.optim_state``). A LoRA model's checkpoint holds its adapter alone
(``relax.models.lora.checkpoint_tensors``): the frozen base is rebuilt from the config.

A Megatron actor may write its checkpoint sharded instead (``trainer.checkpoint_format=sharded``,
``relax.trainers.checkpoint.sharded``): :func:`read_state` consolidates one into this same state, so
every reader (another layout, the other backend, an ``init_checkpoint``) loads either format.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from relax.objstore import absolute_url
from relax.trainers.checkpoint.files import (
    CheckpointError,
    read_meta,
    read_verified,
    tensor_file,
    write_file,
    write_meta,
)
from relax.trainers.checkpoint.optim_state import load_optimizer_state, optimizer_state
from relax.trainers.checkpoint.sharded import SHARDED, consolidate, every_rank, write_sharded
from relax.trainers.model_parallel import hook, unwrap

log = logging.getLogger(__name__)


def rng_state() -> dict[str, Any]:
    """Every RNG a step touches, as tensors and ints (loadable with ``weights_only=True``)."""
    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {"torch": torch.get_rng_state(),
            "python": {"version": version, "state": torch.tensor(mt, dtype=torch.int64), "gauss": gauss},
            "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached": float(cached)}}


def set_rng_state(rng: dict[str, Any]) -> None:
    """Restore :func:`rng_state`'s output (or the tuples of checkpoints written before it)."""
    torch.set_rng_state(rng["torch"])
    py, npy = rng["python"], rng["numpy"]
    if isinstance(py, dict):
        py = (py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"])
    random.setstate(py)
    if isinstance(npy, dict):
        npy = (npy["kind"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"], npy["cached"])
    np.random.set_state(npy)


def trainer_head(optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None) -> dict[str, Any]:
    """What a checkpoint holds beside the weights and the optimizer's per-parameter state: the
    optimizer's hyper-parameters, the LR schedule, every RNG (a sharded checkpoint's ``trainer.pt``)."""
    groups = optimizer.param_groups if optimizer is not None else None  # state_dict() would gather moments
    return {"optimizer": {"format": "by-name", "groups": [{k: v for k, v in g.items() if k != "params"}
                                                          for g in groups]} if groups is not None else None,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "rng": rng_state()}


def trainer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                  scheduler: Any = None) -> dict[str, Any]:
    """What a checkpoint's ``trainer.pt`` holds (collective for a sharded model: every rank calls it)."""
    from relax.models.lora import checkpoint_tensors  # relax.models loads transformers: only where a model is

    return {**trainer_head(optimizer, scheduler), "model": checkpoint_tensors(unwrap(model)),
            "optimizer": optimizer_state(model, optimizer) if optimizer is not None else None}


def save_checkpoint(url: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    scheduler: Any = None, meta: dict[str, Any] | None = None) -> str:
    return write_checkpoint(url, trainer_state(model, optimizer, scheduler), meta)


def write_checkpoint(url: str, state: dict[str, Any], meta: dict[str, Any] | None = None) -> str:
    """Write :func:`trainer_state`'s ``state``: ``trainer.pt``, then ``meta.json`` with its sha256."""
    url = absolute_url(url)
    written = write_file(url, "trainer.pt", tensor_file(state))
    write_meta(url, {**written, **(meta or {})})
    return url


def save_sharded_checkpoint(url: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                            scheduler: Any = None, meta: dict[str, Any] | None = None) -> str:
    """A sharded checkpoint (relax.trainers.checkpoint.sharded) of a model that writes its own part (a
    ``model_parallel.ShardWriter``: the Megatron policy). Collective: every rank writes its part, then rank 0 writes
    ``trainer.pt`` and, last, ``meta.json`` listing every part."""
    m, url = unwrap(model), absolute_url(url)
    entries = every_rank(m.save_shard(url, optimizer))  # after every rank has written its part
    if not dist.is_initialized() or dist.get_rank() == 0:
        write_sharded(url, {**trainer_head(optimizer, scheduler), **m.shard_head()}, [e for e in entries if e],
                      meta or {})
    return url


def _read_head(url: str) -> tuple[dict[str, Any], dict[str, Any]]:
    meta = read_meta(url)
    return meta, read_verified(url, "trainer.pt", meta["sha256"])


def _whole(url: str, meta: dict[str, Any], head: dict[str, Any]) -> dict[str, Any]:
    return consolidate(url, meta, head) if meta.get("format") == SHARDED else head


def read_state(url: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(meta, state) of a checkpoint, verified (meta readable, sha256, safe load) before anything is
    applied; a sharded one consolidated into the gathered state (Hugging Face names, whole tensors)."""
    meta, head = _read_head(url)
    return meta, _whole(url, meta, head)


def load_checkpoint(url: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    scheduler: Any = None, restore_rng: bool = True) -> dict[str, Any]:
    """Restore everything ``save_checkpoint`` wrote; returns the recorded meta.

    Every check runs before any state is applied, so a failed load changes nothing. A checkpoint
    of a differently shaped model fails naming the first mismatched tensor.
    """
    meta, head = _read_head(url)
    own = hook(model, "load_own_shard")  # the same parallel layout: read only this rank's
    if meta.get("format") == SHARDED and own is not None and own(url, meta, head, optimizer):
        return _restore_rest(head, meta, scheduler, restore_rng)
    from relax.models.lora import checkpoint_tensors, load_checkpoint_tensors

    state = _whole(url, meta, head)
    check_compatible(state["model"], checkpoint_tensors(unwrap(model)), url)
    load_checkpoint_tensors(unwrap(model), state["model"], url)
    if optimizer is not None and state["optimizer"] is not None:
        load_optimizer_state(model, optimizer, state["optimizer"])
    return _restore_rest(state, meta, scheduler, restore_rng)


def _restore_rest(state: dict[str, Any], meta: dict[str, Any], scheduler: Any, restore_rng: bool) -> dict[str, Any]:
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
    if restore_rng:
        set_rng_state(state["rng"])
    return meta


def load_newest_good(urls: Sequence[str], load: Callable[[str], dict[str, Any]]) -> tuple[int, dict[str, Any]] | None:
    """Resume from the newest checkpoint that verifies: ``load`` (which checks before it applies
    anything) is tried on ``urls`` newest first (they are given oldest first); one that fails
    with a CheckpointError is skipped with a warning naming it and why, and the run replays the
    steps after the one loaded. Returns (index in ``urls``, meta), None for no checkpoints; when
    every one fails, a CheckpointError lists them all (starting over would discard the run)."""
    failures = []
    for i in range(len(urls) - 1, -1, -1):
        try:
            return i, load(urls[i])
        except CheckpointError as e:
            log.warning("skipping checkpoint %s: %s", urls[i], e)
            failures.append(str(e))
    if failures:
        raise CheckpointError(f"none of the run's {len(urls)} checkpoints loads: " + "; ".join(failures))
    return None


def check_compatible(saved: dict[str, torch.Tensor], current: dict[str, torch.Tensor], where: str) -> None:
    missing = sorted(set(current) - set(saved))
    unexpected = sorted(set(saved) - set(current))
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {where} does not fit this model: missing tensors {missing[:5]}, "
                         f"unexpected tensors {unexpected[:5]}")
    for name, tensor in saved.items():
        if tuple(tensor.shape) != tuple(current[name].shape):
            raise CheckpointError(f"checkpoint {where} does not fit this model: tensor {name!r} has shape "
                             f"{tuple(tensor.shape)} in the checkpoint but {tuple(current[name].shape)} in the model")


def export_hf(model: torch.nn.Module, local_dir: str, tokenizer: Any = None) -> str:
    """Write a Hugging Face folder (config + safetensors) that ``from_pretrained`` loads."""
    unwrap(model).save_pretrained(local_dir, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(local_dir)
    return local_dir
