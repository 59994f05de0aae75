"""The Megatron critic's model: a megatron-core ``GPTModel`` decoder plus a scalar value head,
behind the interface of :class:`relax.models.value_head.ValueHeadModel`, so ``trainer.backend=megatron``
trains the PPO critic with megatron-core's layers and the PyTorch critic's loss, optimizer and
checkpoints (``relax.trainers.torch.critic.Critic``, one place, not a copy).

What ``Critic`` / ``span_values`` and the critic role see:

* ``forward(input_ids, position_ids, attention_mask)`` returns (R, T) values ``head(h_t)``, with
  h_t the decoder's last hidden state *after* the final RMSNorm (HF's ``hidden_states[-1]``,
  megatron's ``decoder.final_layernorm``); the LM head is not run. As in
  ``MegatronPolicy.forward``, a packed row is cut into its samples (megatron's RoPE ignores
  ``position_ids``), run as a padded batch under a causal mask and put back in place;
  ``attention_mask`` is implied by the samples. ``return_logits=True`` gives ``(logits, values)``.
* ``backbone`` is a ``MegatronPolicy`` (what the role loads policy version 0 into, HF layout).
* ``state_dict()`` / ``load_state_dict()`` speak ValueHeadModel's layout, ``backbone.<HF name>``
  and ``value_head.{weight,bias}``, and so does the optimizer state of a checkpoint
  (``optimizer_state_to_checkpoint``, relax.trainers.checkpoint.optim_state): critic checkpoints of either
  backend resume on the other. The LM head is kept (the layout has it) but never run, so it gets
  no gradient and no optimizer state, as in ValueHeadModel.

Scope: one process at tensor/pipeline parallel 1 (a critic beside a multi-rank actor in its process
stays on the PyTorch backend: relax.services.roles.actor_ranks.megatron_beside_actor).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from relax.trainers.megatron.convert import ConversionError
from relax.trainers.megatron.cpu import forward_on_cpu
from relax.trainers.megatron.policy import MegatronPolicy, megatron_policy
from relax.trainers.megatron.samples import causal_attention_mask, rows_of, sample_rows


def final_hidden(gpt: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """(b, s) token ids, one sample per row from position 0 -> (b, s, H) hidden states after the
    final RMSNorm. The first half of ``GPTModel.forward`` in megatron-core 0.16.1 (``_preprocess``:
    embedding and RoPE tables; then the ``TransformerBlock``, which ends in ``final_layernorm``);
    the output layer of ``_postprocess`` is skipped."""
    b, s = input_ids.shape
    positions = torch.arange(s, device=input_ids.device).expand(b, -1)
    decoder_input, rotary_pos_emb = gpt._preprocess(input_ids=input_ids, position_ids=positions)[:2]
    hidden = gpt.decoder(hidden_states=decoder_input, attention_mask=causal_attention_mask(s, input_ids.device),
                         rotary_pos_emb=rotary_pos_emb)
    return hidden.transpose(0, 1)  # megatron is sequence-first: [s, b, H]


class MegatronValueModel(nn.Module):
    """``backbone`` (a ``MegatronPolicy``) + zero-initialised linear value head (module docstring)."""

    def __init__(self, backbone: MegatronPolicy) -> None:
        super().__init__()
        self.backbone = backbone
        param = next(backbone.parameters())
        self.value_head = nn.Linear(backbone.layout.hidden_size, 1, dtype=param.dtype, device=param.device)
        nn.init.zeros_(self.value_head.weight)  # a fresh critic predicts 0, as ValueHeadModel's
        nn.init.zeros_(self.value_head.bias)

    @property
    def hf_config(self) -> Any:
        return self.backbone.hf_config

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, use_cache: bool = False, return_logits: bool = False,
                **media: Any) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """(R, T) token ids -> (R, T) values (0 on padding), or ``(logits (R, T, V), values)``;
        positions default to 0..T-1 per row. Media inputs are refused (text models only)."""
        if media:
            raise ValueError(f"trainer.backend=megatron trains text models; got model inputs {sorted(media)}")
        batch, _, _, spans = sample_rows(input_ids, position_ids)  # one padded row per sample
        gpt = self.backbone.gpt
        # right padding after a causal sample never reaches it; megatron's tensor-parallel
        # collectives allocate on torch.cuda.current_device(): "cpu" on CPU
        with forward_on_cpu():
            hidden = final_hidden(gpt, batch)
            logits = None
            if return_logits:
                weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else None
                logits = gpt.output_layer(hidden.transpose(0, 1), weight=weight, runtime_gather_output=True)[0]
                logits = logits.transpose(0, 1)
        per_sample = self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1)  # (n, longest)
        values = rows_of(per_sample, *input_ids.shape, spans)
        out_logits = None if logits is None else rows_of(logits, *input_ids.shape, spans)
        return (out_logits, values) if return_logits else values

    def data_parallel_group(self) -> Any:
        """The ranks that hold other data (see ``MegatronPolicy.data_parallel_group``)."""
        return self.backbone.data_parallel_group()

    def clip_grad_norm_(self, max_norm: float) -> float:
        """``MegatronPolicy.clip_grad_norm_`` over this module's parameters, the value head included
        (replicated like the layer norms, so counted once, on tensor-parallel rank 0)."""
        return MegatronPolicy.clip_grad_norm_(self, max_norm)  # type: ignore[arg-type]

    def optimizer_state_to_checkpoint(self, local: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """Per-parameter optimizer state under ValueHeadModel's names: the backbone's moments in the HF
        layout (``MegatronPolicy.optimizer_state_to_checkpoint``), the head's as they are; the never-stepped
        LM head has an empty state. Collective under TP/PP."""
        backbone = self.backbone.optimizer_state_to_checkpoint(
            {n.removeprefix("backbone."): st for n, st in local.items() if n.startswith("backbone.")})
        return {**{f"backbone.{n}": st for n, st in backbone.items()},
                **{n: st for n, st in local.items() if n.startswith("value_head.")}}

    def optimizer_state_from_checkpoint(self, saved: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """Inverse of :meth:`optimizer_state_to_checkpoint`; also takes a PyTorch-backend critic's state
        (which lists only the parameters it stepped)."""
        backbone = self.backbone.optimizer_state_from_checkpoint(
            {n.removeprefix("backbone."): st for n, st in saved.items() if n.startswith("backbone.")})
        return {**{f"backbone.{n}": st for n, st in backbone.items()},
                **{n: st for n, st in saved.items() if n.startswith("value_head.") and st}}

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        """ValueHeadModel's layout: ``backbone.<HF name>`` and ``value_head.*`` (detached copies)."""
        if args or kwargs.get("prefix") or kwargs.get("destination") is not None:
            raise TypeError("MegatronValueModel.state_dict() takes no arguments: it is the top-level HF view")
        out = {f"backbone.{k}": v for k, v in self.backbone.state_dict().items()}
        out.update({f"value_head.{k}": v.detach().clone() for k, v in self.value_head.state_dict().items()})
        return out

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> _IncompatibleKeys:
        """Load a ValueHeadModel-layout state dict (a critic checkpoint of either backend); a tensor
        of another name or shape is a ConversionError naming it."""
        backbone, head, other = {}, {}, []
        for name, tensor in dict(state_dict).items():
            if name.startswith("backbone."):
                backbone[name[len("backbone."):]] = tensor
            elif name.startswith("value_head."):
                head[name[len("value_head."):]] = tensor
            else:
                other.append(name)
        if other:
            raise ConversionError(f"critic state dict has tensors outside backbone.* and value_head.*: {sorted(other)}")
        self.backbone.load_state_dict(backbone)
        try:
            self.value_head.load_state_dict(head)
        except RuntimeError as e:
            raise ConversionError(f"critic value head does not match nn.Linear({self.value_head.in_features}, 1): "
                                  f"{e}") from e
        return _IncompatibleKeys([], [])


def megatron_value_model(hf_policy: nn.Module, seed: int = 0) -> MegatronValueModel:
    """The megatron twin of ``ValueHeadModel(hf_policy)``: the policy's weights converted exactly
    (``megatron_policy``), a zero value head, same device and dtype. Torch's RNG is left as it was
    (building draws initial weights that the load overwrites): the critic draws no random numbers."""
    devices = list(range(torch.cuda.device_count()))
    with torch.random.fork_rng(devices=devices):
        return MegatronValueModel(megatron_policy(hf_policy, seed=seed))
