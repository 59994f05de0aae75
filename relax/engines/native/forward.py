"""The model's forward passes over the slot KV cache: one batched prefill, one decode step.

The scheduler (``engine.py``) decides which sequences run and samples from what these return;
this module only computes logits, writing keys and values into each sequence's cache slot.
Text rows take the lean fused path when the model has one (``fused_decode.py``), else the
model's own modules; media rows always run the model, which places its media and 3-D rope.
"""

from __future__ import annotations

from typing import Any

import torch

from relax.engines.native.fused_decode import FusedDecoder
from relax.engines.native.fused_decode import prefill as fused_prefill
from relax.engines.native.kv_cache import SlotCache
from relax.models.video_inputs import model_media_kwargs


def prefill_logits(model: torch.nn.Module, fused: FusedDecoder | None, cache: SlotCache, prompts: list[list[int]],
                   slots: list[int], mm_inputs: list[dict[str, Any]] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Prefill prompt rows together into ``slots`` (right-padded; pad positions are masked and
    later overwritten) -> (logits at each row's last prompt position, (rows, V); for media rows
    (``mm_inputs``, one dict per row) the rope offsets the model reports, flattened, else None)."""
    lengths = [len(p) for p in prompts]
    longest = max(lengths)
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : lengths[i]] = torch.tensor(p)
    causal = torch.ones(longest, longest, dtype=torch.bool).tril_()
    valid = torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]
    mask = (causal[None] & valid[:, None, :])[:, None]
    view = cache.view(slots, [0] * len(prompts), longest)
    if mm_inputs:
        # media prompts let the model place their media and positions itself (Qwen2.5-VL's
        # 3-D rope, audio feature merging take a plain 2-D padding mask); decode then
        # continues each row's text positions from the offset the model reports (rope_deltas)
        mm: dict[str, list[torch.Tensor]] = {}
        for inputs in mm_inputs:
            for key, value in inputs.items():
                mm.setdefault(key, []).append(value)
        # (a video's audio flag, one tensor per row, becomes the model's one bool; rows are grouped by it)
        logits = model(input_ids=ids, attention_mask=valid.long(), cache=view, use_cache=True,
                       **model_media_kwargs({key: torch.cat(values) for key, values in mm.items()})).logits
        last = logits[torch.arange(len(prompts)), torch.tensor(lengths) - 1]
        deltas = getattr(getattr(model, "model", None), "rope_deltas", None)
        return last, deltas.flatten() if isinstance(deltas, torch.Tensor) else None
    if fused is not None:
        return fused_prefill(fused, ids, lengths, cache, slots), None
    # only the last prompt position of each row needs logits: skip the LM head elsewhere
    keep = sorted(set(n - 1 for n in lengths))
    logits = model(input_ids=ids, position_ids=torch.arange(longest)[None].expand(len(prompts), -1),
                   attention_mask=mask, cache=view, use_cache=True, logits_to_keep=torch.tensor(keep)).logits
    if logits.shape[1] == len(keep):
        return logits[torch.arange(len(prompts)), torch.tensor([keep.index(n - 1) for n in lengths])], None
    # a model that ignores logits_to_keep (the Qwen2.5-Omni thinker) returns every position
    return logits[torch.arange(len(prompts)), torch.tensor(lengths) - 1], None


def decode_logits(model: torch.nn.Module, fused: FusedDecoder | None, cache: SlotCache, tokens: list[int],
                  pos: list[int], slots: list[int], rope_deltas: list[int]) -> torch.Tensor:
    """One decode step: feed each sequence's newest token (at cache position ``pos``, text rope
    position ``pos + rope_delta``) -> next-token logits, (rows, V)."""
    span = max(pos) + 1
    if fused is not None and not any(rope_deltas):
        return fused.step(torch.tensor(tokens), pos, cache, slots, span)
    mask = torch.arange(span)[None, :] <= torch.tensor(pos)[:, None]
    rope = torch.tensor([p + d for p, d in zip(pos, rope_deltas, strict=True)])[:, None]
    return model(
        input_ids=torch.tensor([[t] for t in tokens]),
        position_ids=rope,
        attention_mask=mask[:, None, None, :],
        cache=cache.view(slots, pos, span),
        use_cache=True,
    ).logits[:, -1]
