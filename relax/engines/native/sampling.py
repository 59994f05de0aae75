"""Token sampling with per-sequence parameters and generators.

Each sequence owns a ``torch.Generator`` seeded from its request, so what it samples does
not depend on which other requests share the batch (continuous batching stays
deterministic). The returned logprob is log softmax(logits / T) of the sampled token: the
behaviour policy's probability before top-k/top-p truncation, which a trainer can
recompute exactly from the same weights and temperature.
"""

from __future__ import annotations

import torch

from relax.engines.types import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator],
           banned: torch.Tensor | None = None) -> tuple[list[int], list[float]]:
    """logits (b, V) float -> (token ids, logprobs) for each row. ``banned`` ids (media
    placeholders: input-only tokens a tiny or early policy could otherwise emit) are never
    chosen; like top-k/top-p this truncates the sampling distribution, not the logprob."""
    logits = logits.float()
    temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], dtype=logits.dtype)
    scaled = logits / temps[:, None]
    logp = torch.log_softmax(scaled, dim=-1)
    probs = logp.exp()
    if banned is not None:
        probs[:, banned] = 0.0
        logits = logits.index_fill(-1, banned, float("-inf"))
    for i, p in enumerate(params):  # truncation only for the rows that ask for it
        if not p.greedy and (p.top_k > 0 or p.top_p < 1.0):
            probs[i] = _truncate(probs[i], p.top_k, p.top_p)
    # inverse-CDF sampling: one uniform per row from the row's own generator, then one
    # vectorised search (a torch.multinomial call per row cost more than the model's step)
    u = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators]).to(probs.dtype)
    cdf = torch.cumsum(probs, dim=-1)
    chosen = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).squeeze(-1).clamp_(max=probs.shape[-1] - 1)
    greedy = torch.tensor([p.greedy for p in params])
    if greedy.any():
        chosen = torch.where(greedy, logits.argmax(-1), chosen)
    tokens = chosen.tolist()
    lps = logp.gather(-1, chosen[:, None]).squeeze(-1)
    return tokens, lps.tolist()


def _truncate(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k > 0 and top_k < probs.shape[-1]:
        kth = torch.topk(probs, top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < top_p  # keep the smallest prefix reaching top_p
        mask = torch.zeros_like(probs, dtype=torch.bool)
        mask[order[keep]] = True
        probs = torch.where(mask, probs, torch.zeros_like(probs))
    return probs / probs.sum()


def generator_for(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF)
