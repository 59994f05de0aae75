"""Per-token log-probabilities (and entropies) of the tokens a sequence actually contains.

For a sample with tokens x_0..x_{L-1}, position t holds log pi(x_t | x_<t) for t >= 1 and 0
at t = 0, so the result aligns with ``input_ids`` like every other token field.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from relax.trainers.torch.attention import NAME as PACKED
from relax.trainers.torch.packing import MicroBatch
from relax.trainers.torch.prefix import PrefixMicroBatch, prefix_logprobs


def model_inputs(model: torch.nn.Module, mb: MicroBatch) -> dict[str, object]:
    """Forward kwargs for ``mb``: packed rows pass their segments when the model (unwrapped from
    DDP) was switched to per-sample attention (``attention.enable_packed_attention``), else a
    dense block mask."""
    inner = getattr(model, "module", model)
    return mb.model_inputs(getattr(getattr(inner, "config", None), "_attn_implementation", None) == PACKED)


def logits_of(model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
    """(R, T, V) logits for a micro-batch."""
    return model(**model_inputs(model, mb), use_cache=False).logits


def span_logprobs(logits: torch.Tensor, mb: MicroBatch, temperature: float = 1.0,
                  with_entropy: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """Per-sample (L_i,) logprobs of its own tokens (and entropies), in ``mb.spans`` order.

    ``temperature`` divides the logits first, so the trainer scores tokens with the same
    distribution the engine sampled from.
    """
    out, ent = [], [] if with_entropy else None
    for s in mb.spans:
        lg = logits[s.row, s.start:s.start + s.length - 1].float() / temperature  # predicts tokens 1..L-1
        logp = torch.log_softmax(lg, dim=-1)
        target = mb.input_ids[s.row, s.start + 1:s.start + s.length]
        lp = logp.gather(-1, target[:, None]).squeeze(-1)
        out.append(torch.cat([lp.new_zeros(1), lp]))
        if ent is not None:
            h = -(logp.exp() * logp).sum(-1)
            ent.append(torch.cat([h.new_zeros(1), h]))
    return out, ent


def token_logprobs(model: torch.nn.Module, mb: MicroBatch | PrefixMicroBatch, temperature: float = 1.0,
                   with_entropy: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """Per-sample logprobs (and entropies) of a micro-batch of either kind: full rows, or shared
    prompts with their responses (``prefix.PrefixMicroBatch``, whose prompt positions are 0)."""
    if isinstance(mb, PrefixMicroBatch):
        return prefix_logprobs(model, mb, temperature, with_entropy)
    return span_logprobs(logits_of(model, mb), mb, temperature, with_entropy)


@torch.no_grad()
def compute_logprobs(model: torch.nn.Module, batches: Sequence[MicroBatch | PrefixMicroBatch], n: int,
                     temperature: float = 1.0) -> list[torch.Tensor]:
    """Logprobs of every sample under ``model`` without gradients (reference, proximal policy)."""
    result: list[torch.Tensor | None] = [None] * n
    for mb in batches:
        lps, _ = token_logprobs(model, mb, temperature)
        for s, lp in zip(mb.spans, lps, strict=True):
            result[s.index] = lp
    return result  # type: ignore[return-value]
