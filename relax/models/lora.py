"""LoRA adapters on a policy (``model.lora``), through PEFT: wrap, read and write the adapter, its base.

:func:`apply_lora` wraps a built policy in a ``peft.PeftModel`` whose only trainable tensors are the
adapters of the language decoder's projections (``relax.config.model.lora_targets``; encoder towers
are left alone). Everything else reads the wrapped model through the functions here, in two naming
schemes: the *adapter* tensors as PEFT saves them (``base_model.model.<module>.lora_A.weight``, (r, in),
and ``...lora_B.weight``, (out, r)), which is also what an adapter weight version and a PEFT adapter
folder hold, and the *base* tensors under the plain Hugging Face names the engines load.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from relax.config.model import lora_targets

ENCODER_TOWERS = ("visual", "audio_tower")  # their projections stay un-adapted (and frozen)


def is_lora(model: torch.nn.Module) -> bool:
    import peft

    return isinstance(model, peft.PeftModel)


def target_module_names(model: torch.nn.Module, targets: list[str]) -> list[str]:
    """Full names of the decoder's ``nn.Linear`` modules whose last name component is in ``targets``."""
    names = []
    for name, module in model.named_modules():
        parts = name.split(".")
        if isinstance(module, torch.nn.Linear) and parts[-1] in targets and not set(parts) & set(ENCODER_TOWERS):
            names.append(name)
    return names


def apply_lora(model: torch.nn.Module, model_cfg: Any, seed: int | None = None) -> torch.nn.Module:
    """``model`` wrapped in PEFT LoRA as ``model_cfg.lora`` says: base frozen, adapters trainable (B = 0,
    so the wrapped model computes exactly what the base does until the first update). ``seed`` draws
    the A matrices from a generator of their own (None: from torch's global one, as PEFT does)."""
    import peft

    lora = model_cfg.lora
    names = target_module_names(model, lora_targets(model_cfg))
    if not names:
        raise ValueError(f"model.lora.target_modules {lora_targets(model_cfg)} match no nn.Linear of the "
                         f"{type(model).__name__} decoder: name projections it has (docs/lora.md)")
    short = sorted({n.rsplit(".", 1)[-1] for n in names})
    # the short names where they pick the same modules: what SGLang's --lora-target-modules and other tools read
    every = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in short}
    same = set(names) == every
    config = peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                             target_modules=short if same else names, bias="none")
    if seed is None:
        return peft.get_peft_model(model, config)
    # PEFT draws A from the global RNG, whose state depends on what the process did before (a
    # data-parallel rank 0 differs from a one-process actor): seeded, every incarnation starts alike
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return peft.get_peft_model(model, config)


def scaling(model_cfg: Any) -> float:
    """The factor of B @ A in every adapted weight: alpha / rank (PEFT's, without rsLoRA)."""
    return model_cfg.lora.alpha / model_cfg.lora.rank


def adapter_info(model_cfg: Any, base_version: int = 0) -> dict[str, Any]:
    """What an adapter weight version's manifest records beside its tensors."""
    lora = model_cfg.lora
    return {"base_version": base_version, "rank": lora.rank, "alpha": lora.alpha, "scaling": scaling(model_cfg),
            "target_modules": lora_targets(model_cfg), "base_model": model_cfg.name_or_path,
            "base_checkpoint": model_cfg.init_checkpoint}


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors, PEFT-named (the adapter name dropped), detached."""
    from peft import get_peft_model_state_dict

    return {k: v.detach() for k, v in get_peft_model_state_dict(model).items()}


def load_adapter_state(model: torch.nn.Module, state: dict[str, torch.Tensor], where: str) -> None:
    """Set the adapter from :func:`adapter_state`'s tensors; a mismatch fails naming it before any change."""
    from peft import set_peft_model_state_dict

    current = adapter_state(model)
    missing, unexpected = sorted(set(current) - set(state)), sorted(set(state) - set(current))
    shapes = [k for k in current if k in state and tuple(state[k].shape) != tuple(current[k].shape)]
    if missing or unexpected or shapes:
        raise ValueError(f"the adapter at {where} does not fit model.lora (rank, target_modules): missing "
                         f"{missing[:3]}, unexpected {unexpected[:3]}, other shapes {shapes[:3]}")
    set_peft_model_state_dict(model, state)


def base_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The frozen base's tensors under the Hugging Face names (``...q_proj.weight``, no adapter)."""
    out = {}
    for k, v in model.get_base_model().state_dict().items():
        if ".lora_" not in k:
            out[k.replace(".base_layer.", ".")] = v.detach()
    return out


def checkpoint_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a trainer checkpoint holds of ``model``: the adapter alone for a LoRA model (its base is
    rebuilt from the config), else the whole state dict."""
    return adapter_state(model) if is_lora(model) else model.state_dict()


def load_checkpoint_tensors(model: torch.nn.Module, state: dict[str, torch.Tensor], where: str) -> None:
    if is_lora(model):
        load_adapter_state(model, state, where)
    else:
        model.load_state_dict(state)


@contextlib.contextmanager
def adapter_disabled(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``model`` computing its base alone (eval mode, adapters bypassed), restored on exit: the KL
    reference of a LoRA run without a second model in memory."""
    training = model.training
    model.eval()
    try:
        with model.disable_adapter():
            yield model
    finally:
        model.train(training)
