"""Rows of samples as megatron's GPTModel takes them.

megatron-core's local GPTModel derives RoPE positions from the sequence length, not from
``position_ids``, so a packed row (samples concatenated, positions restarting at 0) is cut into
its samples and run as a right-padded batch under one causal mask (right padding after a causal
sample never reaches it, so the plain mask is exact); outputs are put back in the row layout.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Span = tuple[int, int, int]  # (row, start, length) of a sample in a (R, T) micro-batch


def segments(position_ids: torch.Tensor) -> list[Span]:
    """``(row, start, length)`` of every sample in a (R, T) micro-batch: a new sample starts
    wherever the position restarts at 0 (packed rows) and at every row's first token."""
    out = []
    for row, pos in enumerate(position_ids.tolist()):
        starts = [0] + [t for t in range(1, len(pos)) if pos[t] == 0]
        ends = starts[1:] + [len(pos)]
        out += [(row, s, e - s) for s, e in zip(starts, ends, strict=True)]
    return out


def causal_attention_mask(seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """megatron's mask convention: [1, 1, s, s] bool, True where attention is *blocked*."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]


def sample_rows(input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[Span]]:
    """(R, T) ids (positions default to 0..T-1 per row) -> one right-padded row per sample: (n, S)
    ids, positions 0..S-1, the [1, 1, S, S] causal mask, and the spans to put outputs back."""
    rows, width = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(width, device=input_ids.device).expand(rows, -1)
    spans = segments(position_ids)
    longest = max(length for _, _, length in spans)
    batch = input_ids.new_zeros(len(spans), longest)
    for k, (row, start, length) in enumerate(spans):
        batch[k, :length] = input_ids[row, start:start + length]
    positions = torch.arange(longest, device=input_ids.device).expand(len(spans), -1)
    return batch, positions, causal_attention_mask(longest, input_ids.device), spans


def rows_of(per_sample: torch.Tensor, rows: int, width: int, spans: Sequence[Span]) -> torch.Tensor:
    """(n, S, ...) per-sample outputs -> the (R, T, ...) row layout (inverse of :func:`sample_rows`;
    zeros where no sample is)."""
    out = per_sample.new_zeros(rows, width, *per_sample.shape[2:])
    for k, (row, start, length) in enumerate(spans):
        out[row, start:start + length] = per_sample[k, :length]
    return out


def widened(batch: torch.Tensor, rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(n, S) sample rows -> (rows, width) >= (n, S), zero-padded below and to the right, with positions
    and causal mask as :func:`sample_rows` gives them. Expert-parallel ranks exchange their tokens in
    equal shares (megatron's allgather dispatcher), so each runs the group's largest shape; the
    added rows and columns are causal padding that no real position attends to."""
    out = batch.new_zeros(rows, width)
    out[:batch.shape[0], :batch.shape[1]] = batch
    positions = torch.arange(width, device=batch.device).expand(rows, -1)
    return out, positions, causal_attention_mask(width, batch.device)
