"""Trainer checkpoints on any fsspec URL, restored bit-exactly; export to Hugging Face format.

``<url>/trainer.pt`` holds model, optimizer and LR-schedule state plus every RNG the step
touches (torch, Python, numpy); ``<url>/meta.json`` is written last with the file's sha256
and whatever the caller records (step, manifest versions consumed up to, weight version),
so a checkpoint exists iff its meta does and a torn one is never loaded.
"""

from __future__ import annotations

import hashlib
import io
import json
import random
from typing import Any

import numpy as np
import torch

from relax import objstore


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside DDP/FSDP/compile wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def save_checkpoint(url: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    scheduler: Any = None, meta: dict[str, Any] | None = None) -> str:
    state = {
        "model": unwrap(model).state_dict(),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
    }
    buf = io.BytesIO()
    torch.save(state, buf)
    blob = buf.getvalue()
    url = objstore.absolute_url(url)
    objstore.write_bytes(objstore.join(url, "trainer.pt"), blob)
    body = {"sha256": hashlib.sha256(blob).hexdigest(), "bytes": len(blob), **(meta or {})}
    objstore.write_bytes(objstore.join(url, "meta.json"), json.dumps(body, indent=1, sort_keys=True).encode())
    return url


def read_meta(url: str) -> dict[str, Any]:
    try:
        return json.loads(objstore.read_bytes(objstore.join(url, "meta.json")))
    except FileNotFoundError:
        raise FileNotFoundError(f"no checkpoint at {url} (meta.json missing: never written or not finished)") from None


def load_checkpoint(url: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    scheduler: Any = None, restore_rng: bool = True) -> dict[str, Any]:
    """Restore everything ``save_checkpoint`` wrote; returns the recorded meta.

    A checkpoint of a differently shaped model fails naming the first mismatched tensor.
    """
    meta = read_meta(url)
    blob = objstore.read_bytes(objstore.join(url, "trainer.pt"))
    if hashlib.sha256(blob).hexdigest() != meta["sha256"]:
        raise ValueError(f"checkpoint {url}/trainer.pt fails its sha256 check; it is corrupt")
    state = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=False)
    check_compatible(state["model"], unwrap(model).state_dict(), url)
    unwrap(model).load_state_dict(state["model"])
    if optimizer is not None and state["optimizer"] is not None:
        optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
    if restore_rng:
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])
    return meta


def check_compatible(saved: dict[str, torch.Tensor], current: dict[str, torch.Tensor], where: str) -> None:
    missing = sorted(set(current) - set(saved))
    unexpected = sorted(set(saved) - set(current))
    if missing or unexpected:
        raise ValueError(f"checkpoint {where} does not fit this model: missing tensors {missing[:5]}, "
                         f"unexpected tensors {unexpected[:5]}")
    for name, tensor in saved.items():
        if tuple(tensor.shape) != tuple(current[name].shape):
            raise ValueError(f"checkpoint {where} does not fit this model: tensor {name!r} has shape "
                             f"{tuple(tensor.shape)} in the checkpoint but {tuple(current[name].shape)} in the model")


def export_hf(model: torch.nn.Module, local_dir: str, tokenizer: Any = None) -> str:
    """Write a Hugging Face folder (config + safetensors) that ``from_pretrained`` loads."""
    unwrap(model).save_pretrained(local_dir, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(local_dir)
    return local_dir
