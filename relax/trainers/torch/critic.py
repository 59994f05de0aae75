"""The critic for PPO with GAE: a value head on the policy architecture, trained on returns.

V is read from the decoder's last hidden state through a linear head (zero-initialised, so
a fresh critic predicts 0 and its first updates are well scaled). Token fields align with
``input_ids`` and position t of a logprob scores token t given tokens < t; values align the
same way: ``values[t]`` is the head on hidden state t-1, the value of the state *before*
token t was chosen (0 at t = 0, a prompt token). Read at t itself, V would already have seen
the action: the last answer token's V could predict its reward exactly and GAE would credit
it with nothing. The loss is PPO's clipped value loss (:func:`relax.algorithms.value_loss`).

Any module whose ``forward(**inputs)`` gives (R, T) values works: the runtime's critic is
:class:`relax.models.value_head.ValueHeadModel` (every model family, media included);
:class:`ValueModel` is the lighter text-decoder-only form (no LM head computed).
"""

from __future__ import annotations

import torch
from torch import nn

from relax.algorithms import clipped_value_loss, value_loss
from relax.config import RelaxConfig
from relax.trainers.packing import MicroBatch
from relax.trainers.torch.actor import pad
from relax.trainers.torch.batch import RolloutBatch
from relax.trainers.torch.forward import model_inputs
from relax.trainers.torch.trainer import StepResult, TorchTrainer

__all__ = ["Critic", "ValueModel", "clipped_value_loss", "span_values"]


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
    """Per-sample (L_i,) values in ``mb.spans`` order, shifted to align with the tokens they
    precede: out[0] = 0, out[t] = head(hidden[t - 1]) (see the module docstring)."""
    values = model(**model_inputs(model, mb))
    out = []
    for s in mb.spans:
        v = values[s.row, s.start:s.start + s.length - 1].float()
        out.append(torch.cat([v.new_zeros(1), v]))
    return out


def critic_layout(layout: str) -> str:
    """The critic's micro-batch layout for the run's: values are read at every position of full
    rows, so the actor's shared-prefix layout becomes length buckets."""
    return "bucket" if layout == "prefix" else layout


class Critic:
    """Value model + optimizer: ``values`` reads V for a batch, ``train_step`` fits it to returns."""

    def __init__(self, model: nn.Module, *, lr: float, value_clip: float = 0.2, micro_batch_tokens: int = 4096,
                 **trainer_kwargs):
        self.trainer = TorchTrainer(model, lr=lr, micro_batch_tokens=micro_batch_tokens, **trainer_kwargs)
        self.value_clip = value_clip

    @classmethod
    def for_run(cls, model: nn.Module, cfg: RelaxConfig, pad_id: int = 0) -> Critic:
        """The critic of a run: the actor's optimisation settings with the critic's own lr and
        clip; one update per RL step, token-mean over the response tokens."""
        t = cfg.trainer
        return cls(
            model,
            lr=t.critic_lr or t.lr,
            value_clip=cfg.algorithm.value_clip,
            micro_batch_tokens=t.micro_batch_tokens,
            weight_decay=t.weight_decay,
            warmup_steps=t.warmup_steps,
            total_steps=t.total_steps,
            schedule=t.lr_schedule,
            grad_clip=t.grad_clip,
            layout=critic_layout(t.micro_batch_layout),
            pad_id=pad_id,
            aggregation="token-mean",
            nan_policy=t.nan_policy,
            autocast=cfg.model.dtype if cfg.model.dtype != "float32" else None,
        )

    @property
    def model(self) -> nn.Module:
        return self.trainer.model

    @torch.no_grad()
    def values(self, batch: RolloutBatch) -> list[torch.Tensor]:
        """(L_i,) values of every sample, without gradients (what GAE consumes)."""
        self.trainer.model.eval()
        out: list[torch.Tensor | None] = [None] * len(batch)
        for mb in self.trainer.micro_batches(batch):
            for s, v in zip(mb.spans, span_values(self.trainer.model, mb), strict=True):
                out[s.index] = v
        return out  # type: ignore[return-value]

    def train_step(self, batch: RolloutBatch) -> StepResult:
        """One update on ``batch.values`` (V_old, what GAE used) and ``batch.returns`` (targets)."""
        batch.require(["values", "returns"], "the clipped value loss (critic)")

        def loss(mb, values, _entropies, b):
            idx = [s.index for s in mb.spans]
            v = pad(values)
            per_token, metrics = value_loss(v, pad([b.values[i] for i in idx]).to(v.dtype),
                                            pad([b.returns[i] for i in idx]).to(v.dtype),
                                            pad([b.loss_mask[i] for i in idx]).to(v.dtype), clip=self.value_clip)
            return [per_token[k, : s.length] for k, s in enumerate(mb.spans)], {k: float(x) for k, x in metrics.items()}

        return self.trainer.step(batch, loss, forward=span_values)
