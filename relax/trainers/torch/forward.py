"""Per-token log-probabilities (and entropies) of the tokens a sequence actually contains.

For a sample with tokens x_0..x_{L-1}, position t holds log pi(x_t | x_<t) for t >= 1 and 0
at t = 0, so the result aligns with ``input_ids`` like every other token field.

A ``PositionReader`` reads more off each scored position's full distribution than the
sampled token's log-probability: the reference's top-k tokens, or the policy's KL to the
reference over them (the exact top-k KL, ``relax.algorithms.kl.topk_forward_kl``). It is called as
``read(indices, starts, logp)`` with ``logp`` the (n, R, V) log-softmax of n samples, row k
holding positions starts[k].. of sample indices[k] (rows shorter than R run on into padding),
and returns a tensor or tuple of tensors shaped (n, R, ...); the forward cuts each sample's
rows out and pads them with zero rows in front to (L_i, ...), like the log-probs. One call
per micro-batch in the prefix layout: a read per sample would make the backward pass
materialise a zero (n, R, V) gradient for every sample's slice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from relax.models.moe_routing import replay_routes
from relax.trainers.model_parallel import hook, unwrap
from relax.trainers.packing import MicroBatch
from relax.trainers.torch.attention import NAME as PACKED
from relax.trainers.torch.prefix import PrefixMicroBatch, first_row, pad_front, prefix_logprobs

PositionReader = Callable[[list[int], list[int], torch.Tensor], torch.Tensor | tuple[torch.Tensor, ...]]


class TokenOutputs(NamedTuple):
    """Per-sample outputs of a forward, in ``mb.spans`` order: (L_i,) logprobs, (L_i,) entropies
    (None unless asked) and what a ``PositionReader`` read ((L_i, ...) each; None without one)."""

    logprobs: list[torch.Tensor]
    entropies: list[torch.Tensor] | None = None
    reads: list | None = None


def model_inputs(model: torch.nn.Module, mb: MicroBatch) -> dict[str, object]:
    """Forward kwargs for ``mb``: packed rows pass their segments when the model (unwrapped from
    DDP) was switched to per-sample attention (``attention.enable_packed_attention``), else a
    dense block mask."""
    inner = getattr(model, "module", model)
    return mb.model_inputs(getattr(getattr(inner, "config", None), "_attn_implementation", None) == PACKED)


def logits_of(model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
    """(R, T, V) logits for a micro-batch (routed through ``mb.routes`` when it carries the engine's)."""
    if mb.routes is None:
        return model(**model_inputs(model, mb), use_cache=False).logits
    with replay_routes(model, mb.routes):
        return model(**model_inputs(model, mb), use_cache=False).logits


def span_logprobs(logits: torch.Tensor, mb: MicroBatch, temperature: float = 1.0,
                  with_entropy: bool = False, read: PositionReader | None = None) -> TokenOutputs:
    """Per-sample (L_i,) logprobs of its own tokens (and entropies, and ``read``'s), in ``mb.spans`` order.

    ``temperature`` divides the logits first, so the trainer scores tokens with the same
    distribution the engine sampled from.
    """
    out, ent, reads = [], [] if with_entropy else None, [] if read is not None else None
    for s in mb.spans:
        lg = logits[s.row, s.start:s.start + s.length - 1].float() / temperature  # predicts tokens 1..L-1
        logp = torch.log_softmax(lg, dim=-1)
        target = mb.input_ids[s.row, s.start + 1:s.start + s.length]
        lp = logp.gather(-1, target[:, None]).squeeze(-1)
        out.append(torch.cat([lp.new_zeros(1), lp]))
        if ent is not None:
            h = -(logp.exp() * logp).sum(-1)
            ent.append(torch.cat([h.new_zeros(1), h]))
        if reads is not None:
            reads.append(pad_front(first_row(read([s.index], [1], logp[None])), 1))
    return TokenOutputs(out, ent, reads)


def token_logprobs(model: torch.nn.Module, mb: MicroBatch | PrefixMicroBatch, temperature: float = 1.0,
                   with_entropy: bool = False, read: PositionReader | None = None) -> TokenOutputs:
    """Per-sample logprobs (and entropies, and ``read``'s) of a micro-batch of either kind: full rows,
    or shared prompts with their responses (``prefix.PrefixMicroBatch``, whose prompt positions are 0)."""
    if isinstance(mb, PrefixMicroBatch):
        return TokenOutputs(*prefix_logprobs(model, mb, temperature, with_entropy, read))
    return span_logprobs(logits_of(model, mb), mb, temperature, with_entropy, read)


def lockstep_fillers(model: torch.nn.Module, n: int) -> int:
    """Idle forwards to run after this rank's ``n`` micro-batches so that ranks exchanging tokens inside
    every forward (a ``model_parallel.LockstepModel``: megatron expert parallelism) run as many
    as the busiest of them; 0 for any other model (collective where it is not 0)."""
    count = hook(model, "lockstep_micro_batches")
    return 0 if count is None else count(n) - n


@torch.no_grad()
def compute_logprobs(model: torch.nn.Module, batches: Sequence[MicroBatch | PrefixMicroBatch], n: int,
                     temperature: float = 1.0) -> list[torch.Tensor]:
    """Logprobs of every sample under ``model`` without gradients (reference, proximal policy)."""
    result: list[torch.Tensor | None] = [None] * n
    pipeline = hook(model, "pipeline_schedule")
    if pipeline is not None:  # stages of a model split into a pipeline: the last one scores
        outs = pipeline.forward_only(batches, lambda mb, logits: span_logprobs(logits, mb, temperature).logprobs)
    else:
        fillers = lockstep_fillers(model, len(batches))  # before the first forward: counted collectively
        outs = [token_logprobs(model, mb, temperature).logprobs for mb in batches]
        for _ in range(fillers):
            unwrap(model).idle_forward()
    for mb, logprobs in zip(batches, outs, strict=True):
        for s, lp in zip(mb.spans, logprobs, strict=True):
            result[s.index] = lp.detach()
    return result  # type: ignore[return-value]
