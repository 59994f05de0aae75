"""Shared-prefix forward: a prompt group's prompt (and its image or audio) runs once, and its
samples' responses attend to it through a key/value cache.

GRPO draws n responses per prompt. A row-per-sample forward recomputes the same prompt, and
the same vision or audio tower, n times; with short answers the prompt is nearly all of the
work (tiny-omni, 8 samples of ~50 prompt and ~4 response tokens: 93% of the tokens). Here a
micro-batch holds whole prompt groups: their G distinct prompts run as one (G, P) batch with
``use_cache``, the cache is gathered to one row per sample (differentiable, so gradients from
every response flow back into the shared prompt and the encoders), and the N responses run as
one (N, R) batch after it. Logprobs equal the full-row forward to float rounding.

The prompt of a sample is its tokens before the first trained one (``loss_mask``); samples
share a prefix when those tokens and their media are equal. Response positions continue the
prompt's: p_g + t, shifted by the model's multimodal rotary offset (``rope_deltas`` of
Qwen2-VL / Qwen2.5-Omni, whose image and audio tokens advance positions by less than one each).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from relax.models.video_inputs import audio_in_video, model_media_kwargs
from relax.trainers.model_parallel import unwrap
from relax.trainers.packing import Span, concat_media, right_pad

Media = dict[str, torch.Tensor] | None


@dataclass
class PrefixMicroBatch:
    """Whole prompt groups: ``prompts[g]`` (P_g,) with ``media[g]``; sample k of the micro-batch is
    ``spans[k]`` (its batch index and full length P_g + R_k) with response ``responses[k]`` in
    group ``group_of[k]``."""

    prompts: list[torch.Tensor]
    media: list[Media]
    responses: list[torch.Tensor]
    group_of: list[int]
    spans: list[Span]
    pad_id: int = 0

    @property
    def real_tokens(self) -> int:
        return sum(int(p.shape[0]) for p in self.prompts) + sum(int(r.shape[0]) for r in self.responses)

    @property
    def total_tokens(self) -> int:
        return len(self.prompts) * max(int(p.shape[0]) for p in self.prompts) + \
            len(self.responses) * max(int(r.shape[0]) for r in self.responses)


def prompt_length(input_ids: torch.Tensor, loss_mask: torch.Tensor) -> int:
    """Tokens before the first trained one; at least 1 and leaving at least one response token."""
    trained = torch.nonzero(loss_mask).flatten()
    first = int(trained[0]) if len(trained) else int(input_ids.shape[0]) - 1
    return min(max(first, 1), int(input_ids.shape[0]) - 1)


def _same_media(a: Media, b: Media) -> bool:
    if not a or not b:
        return not a and not b
    return a.keys() == b.keys() and all(a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a)


def prefix_groups(input_ids: Sequence[torch.Tensor], loss_mask: Sequence[torch.Tensor],
                  media: Sequence[Media]) -> list[tuple[int, list[int]]]:
    """[(prompt length, sample indices)] of samples sharing prompt tokens and media, in first-seen order."""
    groups: list[tuple[int, list[int]]] = []
    by_prompt: dict[bytes, list[int]] = {}  # prompt tokens -> positions in ``groups``
    for i, (ids, mask) in enumerate(zip(input_ids, loss_mask, strict=True)):
        p = prompt_length(ids, mask)
        key = ids[:p].numpy().tobytes()
        for g in by_prompt.get(key, []):
            if _same_media(media[groups[g][1][0]], media[i]):
                groups[g][1].append(i)
                break
        else:
            by_prompt.setdefault(key, []).append(len(groups))
            groups.append((p, [i]))
    return groups


def plan_prefix(input_ids: Sequence[torch.Tensor], loss_mask: Sequence[torch.Tensor],
                media: Sequence[Media] | None, token_budget: int, pad_id: int = 0) -> list[PrefixMicroBatch]:
    """Micro-batches of whole prompt groups, each within ``token_budget`` computed positions
    (prompts padded to the longest prompt, responses to the longest response). A group too large
    for the budget alone is split; each part then runs the prompt once."""
    media = media or [None] * len(input_ids)
    lengths = [int(t.shape[0]) for t in input_ids]
    parts: list[tuple[int, list[int]]] = []
    for p, members in prefix_groups(input_ids, loss_mask, media):
        chunk: list[int] = []
        for i in members:
            if chunk and p + (len(chunk) + 1) * max(lengths[j] - p for j in chunk + [i]) > token_budget:
                parts.append((p, chunk))
                chunk = []
            chunk.append(i)
        parts.append((p, chunk))
    # Qwen2.5-Omni takes one use_audio_in_video flag per forward: prompts whose videos carry
    # their audio track run in micro-batches of their own (a stable sort keeps the order otherwise)
    parts.sort(key=lambda part: audio_in_video(media[part[1][0]]))
    out: list[PrefixMicroBatch] = []
    current: list[tuple[int, list[int]]] = []

    def cost(groups: list[tuple[int, list[int]]]) -> int:
        n = sum(len(m) for _, m in groups)
        return len(groups) * max(p for p, _ in groups) + n * max(lengths[i] - p for p, m in groups for i in m)

    for part in parts:
        flag_changes = bool(current) and audio_in_video(media[part[1][0]]) != audio_in_video(media[current[0][1][0]])
        if current and (cost(current + [part]) > token_budget or flag_changes):
            out.append(_collect(current, input_ids, media, pad_id))
            current = []
        current.append(part)
    if current:
        out.append(_collect(current, input_ids, media, pad_id))
    return out


def _collect(groups: list[tuple[int, list[int]]], input_ids: Sequence[torch.Tensor], media: Sequence[Media],
             pad_id: int) -> PrefixMicroBatch:
    prompts, group_media, responses, group_of, spans = [], [], [], [], []
    for g, (p, members) in enumerate(groups):
        prompts.append(input_ids[members[0]][:p])
        group_media.append(media[members[0]])
        for i in members:
            spans.append(Span(i, len(spans), 0, int(input_ids[i].shape[0])))
            responses.append(input_ids[i][p:])
            group_of.append(g)
    return PrefixMicroBatch(prompts, group_media, responses, group_of, spans, pad_id)


def pad_front(x, n: int):
    """``x`` (a tensor or tuple of tensors, (m, ...)) with ``n`` zero rows in front: (n + m, ...)."""
    if isinstance(x, tuple):
        return tuple(pad_front(v, n) for v in x)
    return torch.cat([x.new_zeros((n, *x.shape[1:])), x])


def first_row(x, k: int = 0, n: int | None = None):
    """Row ``k`` of ``x`` (a tensor or tuple of tensors), its first ``n`` entries."""
    if isinstance(x, tuple):
        return tuple(first_row(v, k, n) for v in x)
    return x[k, :n]


def prefix_logprobs(
    model: torch.nn.Module, mb: PrefixMicroBatch, temperature: float = 1.0, with_entropy: bool = False, read=None
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None, list | None]:
    """Per-sample (L_i,) logprobs of the response tokens (0 over the prompt, which is not scored),
    entropies and what ``read`` (a ``forward.PositionReader``) reads, in ``mb.spans`` order. Two
    forward passes: prompts (G, P_max), responses (N, R_max)."""
    core = getattr(unwrap(model), "model", None)
    if hasattr(core, "rope_deltas"):
        core.rope_deltas = None  # recomputed for these prompts, never a previous batch's
    prompt_ids, prompt_mask = right_pad(mb.prompts, mb.pad_id)
    first = model(input_ids=prompt_ids, attention_mask=prompt_mask, use_cache=True,
                  **model_media_kwargs(concat_media(mb.media)))
    # transformers 5 names the cache `cache`, 4.x `past_key_values` (output field and argument alike)
    cache_arg = "cache" if hasattr(first, "cache") else "past_key_values"
    cache = getattr(first, cache_arg)
    device = prompt_ids.device
    p = prompt_mask.sum(1)  # (G,)
    last = first.logits[torch.arange(len(mb.prompts), device=device), p - 1]  # (G, V): predicts response token 0
    deltas = getattr(core, "rope_deltas", None)
    shift = deltas.reshape(-1).to(device) if deltas is not None else torch.zeros_like(p)
    sel = torch.tensor(mb.group_of, device=device)
    cache.batch_select_indices(sel)  # (G, ...) -> (N, ...): one prompt copy per sample, gradients flow back
    ids, mask = right_pad(mb.responses, mb.pad_id)
    steps = torch.arange(ids.shape[1], device=device)
    width = prompt_ids.shape[1]
    second = model(input_ids=ids, attention_mask=torch.cat([prompt_mask[sel], mask], 1),
                   position_ids=(p + shift)[sel][:, None] + steps, use_cache=True,
                   cache_position=steps + width, **{cache_arg: cache})
    logits = torch.cat([last[sel][:, None], second.logits[:, :-1]], 1).float() / temperature  # (N, R, V)
    logp = torch.log_softmax(logits, -1)
    token_lp = logp.gather(-1, ids[..., None]).squeeze(-1)  # (N, R)
    ent = -(logp.exp() * logp).sum(-1) if with_entropy else None
    starts = [s.length - int(r.shape[0]) for s, r in zip(mb.spans, mb.responses, strict=True)]
    read_all = read([s.index for s in mb.spans], starts, logp) if read is not None else None
    out, ents, reads = [], [] if with_entropy else None, [] if read is not None else None
    for k, (r, start) in enumerate(zip(mb.responses, starts, strict=True)):
        n_r = int(r.shape[0])
        out.append(pad_front(token_lp[k, :n_r], start))
        if ents is not None:
            ents.append(pad_front(ent[k, :n_r], start))
        if reads is not None:
            reads.append(pad_front(first_row(read_all, k, n_r), start))
    return out, ents, reads
