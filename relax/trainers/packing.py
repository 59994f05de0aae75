"""Micro-batch layouts: padding-free packing, length buckets, or plain padding.

RL batches mix short and long responses (4:1 is common). Padding every micro-batch to its
longest sample spends compute on pad tokens; packing concatenates samples into rows up to
a token budget and gives attention a block-diagonal causal mask (and per-sample position
ids), so each token attends only within its own sample and the output is identical to
running samples one by one. Models whose attention cannot take a 4-D mask fall back to
length buckets: samples sorted by length, so pads stay few.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from relax.models.video_inputs import audio_in_video, model_media_kwargs

LAYOUTS = ("pack", "bucket", "pad")


@dataclass
class Span:
    """Where sample ``index`` sits in a micro-batch: row ``row``, tokens ``start:start+length``."""

    index: int
    row: int
    start: int
    length: int


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # (R, T) int64
    position_ids: torch.Tensor  # (R, T) int64
    attention_mask: torch.Tensor | None  # (R, T) padding mask; None for a packed row
    spans: list[Span]
    cu_seqlens: torch.Tensor | None = None  # packed row: sample boundaries (n+1,) int32
    # media inputs of the rows' images/audio (pixel_values, image_grid_thw, input_features, ...)
    media: dict[str, torch.Tensor] | None = None
    # algorithm.routing_replay: (R, T, layers, k) experts per position, -1 on padding (moe_routing)
    routes: torch.Tensor | None = None

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    def dense_mask(self) -> torch.Tensor:
        """(1, 1, T, T) block-diagonal causal mask of a packed row, for models that need one."""
        total = int(self.cu_seqlens[-1])
        lengths = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long()
        device = self.input_ids.device
        segment = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)
        causal = torch.ones(total, total, dtype=torch.bool, device=device).tril_()
        return (causal & (segment[:, None] == segment[None, :]))[None, None]

    @property
    def real_tokens(self) -> int:
        return sum(s.length for s in self.spans)

    @property
    def total_tokens(self) -> int:
        return int(self.input_ids.numel())

    def model_inputs(self, segment_kernel: bool = True) -> dict[str, object]:
        """Keyword arguments for a Hugging Face model. A packed row passes its segments the way
        HF forwards them to varlen attention (``attention.enable_packed_attention``), or, with
        ``segment_kernel=False``, as a dense block-diagonal mask."""
        inputs: dict[str, object] = {"input_ids": self.input_ids, "position_ids": self.position_ids}
        if self.media:
            # multimodal models derive their (3-D rotary) positions from the media token spans
            inputs.update(model_media_kwargs(self.media), position_ids=None)
        if not self.packed:
            inputs["attention_mask"] = self.attention_mask
        elif segment_kernel:
            longest = int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max())
            inputs.update(cu_seq_lens_q=self.cu_seqlens, cu_seq_lens_k=self.cu_seqlens, max_length_q=longest,
                          max_length_k=longest)
        else:
            inputs["attention_mask"] = self.dense_mask()
        return inputs


def plan(
    lengths: Sequence[int], token_budget: int, layout: str = "pack", max_samples: int | None = None
) -> list[list[int]]:
    """Group sample indices into micro-batches of at most ``token_budget`` tokens (counting pads).

    ``pack``: first-fit decreasing into bins of ``token_budget`` real tokens.
    ``bucket``: sorted by length, each micro-batch as many as fit when padded to its longest.
    ``pad``: input order, as many as fit when padded to the longest (the naive baseline).
    A sample longer than the budget gets a micro-batch of its own.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown micro-batch layout {layout!r}; choose one of {LAYOUTS}")
    order = list(range(len(lengths)))
    if layout == "pack":
        bins: list[list[int]] = []
        room: list[int] = []
        for i in sorted(order, key=lambda i: (-lengths[i], i)):
            for b, free in enumerate(room):
                if lengths[i] <= free and (max_samples is None or len(bins[b]) < max_samples):
                    bins[b].append(i)
                    room[b] -= lengths[i]
                    break
            else:
                bins.append([i])
                room.append(token_budget - lengths[i])
        return bins
    if layout == "bucket":
        order.sort(key=lambda i: (lengths[i], i))
    groups: list[list[int]] = []
    for i in order:
        if groups:
            cur = groups[-1]
            longest = max(lengths[j] for j in cur + [i])
            if longest * (len(cur) + 1) <= token_budget and (max_samples is None or len(cur) < max_samples):
                cur.append(i)
                continue
        groups.append([i])
    return groups


def collate(input_ids: Sequence[torch.Tensor], indices: Sequence[int], packed: bool, pad_id: int = 0) -> MicroBatch:
    """One micro-batch: a single packed row, or one right-padded row per sample."""
    if packed:
        seqs = [input_ids[i] for i in indices]
        spans, start = [], 0
        for i, s in zip(indices, seqs, strict=True):
            spans.append(Span(i, 0, start, int(s.shape[0])))
            start += int(s.shape[0])
        device = seqs[0].device
        positions = torch.cat([torch.arange(int(s.shape[0]), device=device) for s in seqs])
        cu = torch.tensor([0] + [sp.start + sp.length for sp in spans], dtype=torch.int32, device=device)
        return MicroBatch(torch.cat(seqs)[None], positions[None], None, spans, cu)
    ids, pad_mask = right_pad([input_ids[i] for i in indices], pad_id)
    spans = [Span(i, row, 0, int(input_ids[i].shape[0])) for row, i in enumerate(indices)]
    positions = torch.arange(ids.shape[1], device=ids.device).expand(*ids.shape).clone()
    return MicroBatch(ids, positions, pad_mask, spans)


def right_pad(seqs: Sequence[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(L_i,) token tensors -> (n, max L) ids right-padded with ``pad_id`` and the (n, max L) 0/1 mask."""
    longest = max(int(s.shape[0]) for s in seqs)
    ids = torch.full((len(seqs), longest), pad_id, dtype=torch.long, device=seqs[0].device)
    mask = torch.zeros(len(seqs), longest, dtype=torch.long, device=seqs[0].device)
    for row, s in enumerate(seqs):
        ids[row, : s.shape[0]] = s
        mask[row, : s.shape[0]] = 1
    return ids, mask


def concat_media(media: Sequence[dict[str, torch.Tensor] | None]) -> dict[str, torch.Tensor]:
    """Rows' media tensors concatenated per key in row order, the way a multimodal model takes a
    batch (images and clips in token order); rows without media contribute nothing."""
    parts: dict[str, list[torch.Tensor]] = {}
    for m in media:
        for key, value in (m or {}).items():
            parts.setdefault(key, []).append(value)
    return {key: torch.cat(values) for key, values in parts.items()}


def collate_media(input_ids: Sequence[torch.Tensor], indices: Sequence[int],
                  media: Sequence[dict[str, torch.Tensor] | None], pad_id: int = 0) -> MicroBatch:
    """Right-padded rows whose samples carry images or audio: their media tensors are concatenated
    in row order, the way a multimodal model takes a batch (images and clips in token order)."""
    mb = collate(input_ids, indices, packed=False, pad_id=pad_id)
    mb.media = concat_media([media[i] for i in indices])
    return mb


def micro_batches(input_ids: Sequence[torch.Tensor], token_budget: int, layout: str = "pack",
                  pad_id: int = 0, media: Sequence[dict[str, torch.Tensor] | None] | None = None) -> list[MicroBatch]:
    """Text samples in ``layout``; samples with ``media`` in padded length buckets (their
    vision/audio encoders attend bidirectionally, so they are never packed), those whose videos
    carry an audio track apart from the others (the model takes one ``use_audio_in_video``)."""
    media = media or [None] * len(input_ids)
    lengths = [int(t.shape[0]) for t in input_ids]
    text = [i for i, m in enumerate(media) if not m]
    rich = [i for i, m in enumerate(media) if m]
    out = []
    if text:
        out += [collate(input_ids, [text[j] for j in g], packed=layout == "pack", pad_id=pad_id)
                for g in plan([lengths[i] for i in text], token_budget, layout)]
    for flag in (False, True):
        kind = [i for i in rich if audio_in_video(media[i]) == flag]
        out += [collate_media(input_ids, [kind[j] for j in g], media, pad_id)
                for g in plan([lengths[i] for i in kind], token_budget, "bucket")] if kind else []
    return out


def waste(batches: Sequence[MicroBatch]) -> float:
    """Share of computed token positions that are padding (0 for packed rows)."""
    total = sum(b.total_tokens for b in batches)
    return 1.0 - sum(b.real_tokens for b in batches) / total if total else 0.0


def lay_out_routes(mb: MicroBatch, routes: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-sample (L_i, layers, k) routes placed like ``mb``'s tokens: (R, T, layers, k), -1 on padding.

    E.g. samples of lengths 2 and 1 packed in one row of 3 take positions 0-1 and 2 of row 0."""
    first = routes[mb.spans[0].index]
    out = torch.full((*mb.input_ids.shape, *first.shape[1:]), -1, dtype=torch.long)
    for s in mb.spans:
        out[s.row, s.start:s.start + s.length] = routes[s.index]
    return out
