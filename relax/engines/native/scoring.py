"""Prompt scoring: the log-probability of every prompt token from ``logprob_start_len`` on.

SGLang answers ``/generate`` with ``return_logprob``, ``logprob_start_len = s`` and
``max_new_tokens = 0`` by prefilling the prompt and returning ``meta_info.input_token_logprobs``:
one ``[logprob, token_id, text]`` per position from ``s`` on, the logprob of token j given
tokens ``< j`` (null at position 0, which nothing predicts), and with ``top_logprobs_num = k``
``input_top_logprobs``, the k likeliest tokens of the same distributions. SGLang computes them
from the raw logits, at temperature 1, whatever the request's sampling temperature (0.5.23's
``InputLogprobProcessor``); so does this. A teacher behind an engine URL scores a student's
samples this way (relax.services.roles.teacher).
"""

from __future__ import annotations

from typing import Any

import torch

from relax.models.video_inputs import model_media_kwargs


class PromptScores:
    """One prompt's scores from ``start`` on: ``logprobs[i]`` is position ``start + i``'s (None at
    position 0); ``top[i]`` its k likeliest tokens as (logprob, id), likeliest first, or None."""

    def __init__(self, logprobs: list[float | None], top: list[list[tuple[float, int]] | None] | None):
        self.logprobs, self.top = logprobs, top


@torch.no_grad()
def score_prompt(model: torch.nn.Module, ids: list[int], start: int, top_k: int = 0,
                 media: dict[str, Any] | None = None) -> PromptScores:
    """One forward over ``ids`` (and its ``media``, already expanded in ``ids``) -> the log-softmax of
    each position's predecessor logits at its token, positions ``start .. len(ids) - 1``."""
    if not 0 <= start < len(ids):
        raise ValueError(f"logprob_start_len={start} is outside the {len(ids)}-token prompt")
    x = torch.tensor([ids], dtype=torch.long)
    if media:
        logits = model(input_ids=x, attention_mask=torch.ones_like(x), **model_media_kwargs(media)).logits[0]
    else:
        logits = model(input_ids=x, position_ids=torch.arange(len(ids))[None]).logits[0]
    first = max(start, 1)  # position 0 has no predecessor
    logp = torch.log_softmax(logits[first - 1:len(ids) - 1].float(), dim=-1)  # (L - first, V): predicts first..L-1
    targets = torch.tensor(ids[first:], dtype=torch.long)
    values = logp.gather(-1, targets[:, None]).squeeze(-1).tolist()
    logprobs: list[float | None] = [None] * (first - start) + values
    if top_k <= 0:
        return PromptScores(logprobs, None)
    top_lp, top_ids = torch.topk(logp, min(top_k, logp.shape[-1]), dim=-1)
    rows = [list(zip(lp, t, strict=True)) for lp, t in zip(top_lp.tolist(), top_ids.tolist(), strict=True)]
    return PromptScores(logprobs, [None] * (first - start) + rows)
