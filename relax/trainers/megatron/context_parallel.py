"""Context parallelism for the Megatron actor without Transformer Engine: each rank of a context-parallel
group holds a share of every sequence, so a layer's activations (and attention's scores) split over the
group while the weights are replicated on it.

Megatron's zigzag split (the load-balanced causal layout its ``get_batch_on_this_cp_rank`` uses): a
sequence of S tokens (padded to a multiple of 2*cp) is cut into 2*cp chunks and rank r holds chunks
r and 2*cp-1-r, so every rank has as many early (cheap) as late (expensive) causal queries. megatron's
RoPE already selects those positions' rotations when ``context_parallel_size > 1``
(``RotaryEmbedding.forward``); what megatron-core 0.16.1 lacks without TE is the attention:
``DotProductAttention`` asserts ``context_parallel_size == 1``. :class:`ContextParallelAttention` is
that attention with the keys and values all-gathered over the group (the "all-gather KV" form of
context parallelism; its backward sums every rank's key/value gradients and keeps this rank's share)
and the causal mask written in global positions.

The losses stay in one place (relax.algorithms, called by the trainer on whole rows): the output
logits are all-gathered over the group (:func:`gather_sequence`) so every context-parallel rank
computes the same loss; the backward keeps this rank's share of the logits' gradient, times cp:
megatron's data-parallel reduction averages over data x context ranks, and each context rank's
gradient is only its tokens' part of the sum (megatron's loss functions multiply by cp for the same
reason). The cost of this choice: the (S, V) logits of a micro-batch are whole on each rank.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.dot_product_attention import DotProductAttention

from relax.trainers.megatron.samples import Span, causal_attention_mask, sample_rows


def padded_length(seq: int, cp: int) -> int:
    """The smallest multiple of 2*cp that holds ``seq`` tokens (each rank holds two equal chunks)."""
    return -(-seq // (2 * cp)) * 2 * cp


def zigzag_positions(seq: int, cp: int, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(seq / cp,) the global positions context rank ``rank`` holds of a ``seq``-token sequence
    (``seq`` a multiple of 2*cp): chunks ``rank`` and ``2*cp - 1 - rank`` of 2*cp.
    E.g. seq=8, cp=2: rank 0 holds [0, 1, 6, 7], rank 1 holds [2, 3, 4, 5]."""
    chunk = seq // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    return torch.cat([first, torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)])


def rank_order(seq: int, cp: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(seq,) for each global position, where it lies in the ranks' shares concatenated in rank order
    (what an all-gather returns): ``gathered.index_select(dim, rank_order(...))`` is in global order."""
    held = torch.cat([zigzag_positions(seq, cp, r, device) for r in range(cp)])
    return torch.argsort(held)


class _Gather(torch.autograd.Function):
    """All-gather along ``dim`` over ``group`` in rank order. Backward: this rank's share of the
    gradient, first summed over the group when every rank's output used every share (``reduce``) or
    else scaled by ``scale`` (every rank computed the same loss from the gathered whole)."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, dim: int, group: dist.ProcessGroup, reduce: bool,
                scale: float) -> torch.Tensor:
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        ctx.args = (dim, group, reduce, scale, dist.get_rank(group), local.shape[dim])
        return torch.cat(parts, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        dim, group, reduce, scale, rank, size = ctx.args
        if reduce:
            grad = grad.contiguous().clone()
            dist.all_reduce(grad, group=group)
        mine = grad.narrow(dim, rank * size, size)
        return (mine if scale == 1.0 else mine * scale), None, None, None, None


def gather_sequence(local: torch.Tensor, dim: int, *, reduce: bool, scale: float = 1.0) -> torch.Tensor:
    """This rank's zigzag share along ``dim`` -> the whole sequence in global order, over the context-parallel
    group (collective; autograd as :class:`_Gather`)."""
    group = parallel_state.get_context_parallel_group()
    cp = dist.get_world_size(group)
    whole = _Gather.apply(local, dim, group, reduce, scale)
    return whole.index_select(dim, rank_order(whole.shape[dim], cp, whole.device))


def split_rows(batch: torch.Tensor) -> torch.Tensor:
    """(n, S) token rows -> (n, S' / cp) this rank's share, S' = :func:`padded_length` (right-padded with
    zeros, which causal attention keeps from every real token)."""
    cp = parallel_state.get_context_parallel_world_size()
    rank = parallel_state.get_context_parallel_rank()
    seq = padded_length(batch.shape[1], cp)
    padded = torch.nn.functional.pad(batch, (0, seq - batch.shape[1]))
    return padded.index_select(1, zigzag_positions(seq, cp, rank, batch.device))


def model_rows(input_ids: torch.Tensor, position_ids: torch.Tensor | None,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[Span], int]:
    """What this rank's GPTModel runs for a (R, T) micro-batch: ``samples.sample_rows`` (one padded
    row per sample, positions, causal mask, spans), cut to this rank's share at cp > 1; and the rows'
    whole width, which :func:`whole_logits` restores."""
    batch, positions, mask, spans = sample_rows(input_ids, position_ids)
    width = batch.shape[1]
    if parallel_state.get_context_parallel_world_size() > 1:
        batch = split_rows(batch)
        positions, mask = positions[:, :batch.shape[1]], causal_attention_mask(batch.shape[1], batch.device)
    return batch, positions, mask, spans, width


def whole_logits(logits: torch.Tensor, width: int) -> torch.Tensor:
    """The GPTModel's (n, S' / cp, V) logits for :func:`model_rows`' rows -> (n, width, V) whole rows in
    global order, on every context rank; the backward keeps this rank's share of the gradient, times cp
    (module docstring). As they are at cp = 1."""
    cp = parallel_state.get_context_parallel_world_size()
    return gather_sequence(logits, 1, reduce=False, scale=float(cp))[:, :width] if cp > 1 else logits


class ContextParallelAttention(DotProductAttention):
    """megatron's local ``DotProductAttention`` over a zigzag share of the queries and the whole sequence's
    keys and values (module docstring). Shapes as megatron's: query (sq, b, np, hn) with sq = S / cp,
    key and value (sq, b, ng, hn) this rank's share, gathered to (S, b, ng, hn); output (sq, b, np * hn).
    The mask argument is replaced by the causal mask in global positions."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any):
        single = copy.copy(config)  # the parent refuses cp > 1: it would attend within this rank's share only
        single.context_parallel_size = 1
        super().__init__(single, *args, **kwargs)
        self.config = config

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None) -> torch.Tensor:
        cp = parallel_state.get_context_parallel_world_size()
        seq = key.shape[0] * cp
        key = gather_sequence(key, 0, reduce=True)
        value = gather_sequence(value, 0, reduce=True)
        mine = zigzag_positions(seq, cp, parallel_state.get_context_parallel_rank(), query.device)
        blocked = torch.arange(seq, device=query.device)[None, :] > mine[:, None]  # (sq, S): a later key
        return super().forward(query, key, value, blocked[None, None], attn_mask_type, attention_bias,
                               packed_seq_params)
