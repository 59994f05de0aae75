"""The critic for PPO with GAE: a value head on the policy architecture, trained on returns.

V(s_t) is read at every token from the decoder's last hidden state through a linear head
(zero-initialised, so a fresh critic predicts 0 and its first updates are well scaled).
The loss is PPO's clipped value loss (Schulman et al., arXiv:1707.06347; as in OpenAI's
baselines): 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -eps, eps) - R)^2), per token.
"""

from __future__ import annotations

import torch
from torch import nn

from relax.trainers.torch.actor import pad
from relax.trainers.torch.batch import RolloutBatch
from relax.trainers.torch.forward import model_inputs
from relax.trainers.torch.packing import MicroBatch, micro_batches
from relax.trainers.torch.trainer import StepResult, TorchTrainer


class ValueModel(nn.Module):
    """``backbone`` is a Hugging Face decoder (e.g. ``Qwen2ForCausalLM(...).model``)."""

    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    @property
    def config(self):
        return self.backbone.config

    def set_attn_implementation(self, name: str) -> None:
        self.backbone.set_attn_implementation(name)

    def forward(self, **inputs) -> torch.Tensor:
        inputs.pop("use_cache", None)
        hidden = self.backbone(**inputs, use_cache=False).last_hidden_state
        return self.head(hidden).squeeze(-1)  # (R, T)


def span_values(model: nn.Module, mb: MicroBatch) -> list[torch.Tensor]:
    """Per-sample (L_i,) values in ``mb.spans`` order."""
    values = model(**model_inputs(model, mb))
    return [values[s.row, s.start:s.start + s.length].float() for s in mb.spans]


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       clip: float) -> torch.Tensor:
    """(B, T) -> (B, T): 0.5 * max((V-R)^2, (V_old + clip(V-V_old, -c, c) - R)^2)."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)


class Critic:
    def __init__(self, model: ValueModel, *, lr: float, value_clip: float = 0.2, micro_batch_tokens: int = 4096,
                 **trainer_kwargs):
        self.trainer = TorchTrainer(model, lr=lr, micro_batch_tokens=micro_batch_tokens, **trainer_kwargs)
        self.value_clip = value_clip

    @torch.no_grad()
    def values(self, batch: RolloutBatch) -> list[torch.Tensor]:
        out: list[torch.Tensor | None] = [None] * len(batch)
        for mb in micro_batches(batch.input_ids, self.trainer.micro_batch_tokens, self.trainer.layout):
            for s, v in zip(mb.spans, span_values(self.trainer.model, mb), strict=True):
                out[s.index] = v
        return out  # type: ignore[return-value]

    def train_step(self, batch: RolloutBatch) -> StepResult:
        batch.require(["values", "returns"], "the clipped value loss (critic)")

        def loss(mb, values, _entropies, b):
            idx = [s.index for s in mb.spans]
            v = pad(values)
            per_token = clipped_value_loss(v, pad([b.values[i] for i in idx]).to(v.dtype),
                                           pad([b.returns[i] for i in idx]).to(v.dtype), self.value_clip)
            return [per_token[k, : s.length] for k, s in enumerate(mb.spans)], {}

        return self.trainer.step(batch, loss, forward=span_values)
