"""A critic for PPO with GAE: a decoder plus a scalar value head on its last hidden state.

The head is a single ``nn.Linear(hidden, 1)`` initialised to zero, so every value starts
at exactly 0 and the first advantages equal the returns; a random head would inject noise
into the first policy updates. The backbone is any Relax policy (text, VL, audio, omni),
so the critic sees the same media the policy does.

On disk the format is Hugging Face's: the backbone via ``save_pretrained`` (config.json +
model.safetensors) and the head beside it as ``value_head.safetensors``, so the folder
also loads as a plain policy.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PreTrainedModel

VALUE_HEAD_FILE = "value_head.safetensors"


class ValueHeadModel(nn.Module):
    """``backbone`` + zero-initialised linear value head; ``forward`` gives one value per token."""

    def __init__(self, backbone: PreTrainedModel) -> None:
        super().__init__()
        self.backbone = backbone
        hidden = backbone.config.get_text_config().hidden_size
        param = next(backbone.parameters())
        self.value_head = nn.Linear(hidden, 1, dtype=param.dtype, device=param.device)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)
        # values need the hidden states only; where the family allows, the LM head then runs on
        # one position instead of (T, vocab) - for a 150k vocabulary that is most of a forward's memory
        self._logits_to_keep = "logits_to_keep" in inspect.signature(backbone.forward).parameters

    @property
    def config(self) -> Any:
        return self.backbone.config

    def set_attn_implementation(self, name: str) -> None:
        """Switch the backbone's attention (the trainer's padding-free packed kernel goes through here)."""
        self.backbone.set_attn_implementation(name)

    def forward(
        self, return_logits: bool = False, **model_kwargs: Any
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Values ``(batch, seq)`` for the kwargs of the backbone (input_ids, pixel_values, ...).

        With ``return_logits=True`` returns ``(logits, values)`` from one backbone pass, for
        a policy and critic that share weights.
        """
        model_kwargs.setdefault("use_cache", False)  # a training/scoring forward never decodes on
        if not return_logits and self._logits_to_keep:
            model_kwargs.setdefault("logits_to_keep", 1)
        out = self.backbone(**model_kwargs, output_hidden_states=True, return_dict=True)
        hidden = out.hidden_states[-1]
        values = self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1)
        return (out.logits, values) if return_logits else values

    def save_pretrained(self, directory: str | Path) -> None:
        """Backbone in HF format plus ``value_head.safetensors`` in ``directory``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.backbone.save_pretrained(str(directory))
        head = {k: v.detach().contiguous().cpu() for k, v in self.value_head.state_dict().items()}
        save_file(head, str(directory / VALUE_HEAD_FILE), metadata={"format": "pt"})

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> ValueHeadModel:
        """Load what :meth:`save_pretrained` wrote, from a local folder only."""
        from transformers import AutoConfig

        from relax.models.builders import model_class_for

        directory = Path(directory)
        head_file = directory / VALUE_HEAD_FILE
        if not head_file.is_file():
            raise FileNotFoundError(f"{head_file} is missing; is {directory} a ValueHeadModel.save_pretrained folder?")
        config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
        backbone = model_class_for(config).from_pretrained(str(directory), local_files_only=True, dtype=config.dtype)
        model = cls(backbone.eval())
        model.value_head.load_state_dict(load_file(str(head_file)))
        return model
