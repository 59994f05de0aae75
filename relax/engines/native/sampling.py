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


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
           ) -> tuple[list[int], list[float]]:
    """logits (b, V) float -> (token ids, logprobs) for each row."""
    logits = logits.float()
    temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], dtype=logits.dtype)
    scaled = logits / temps[:, None]
    logp = torch.log_softmax(scaled, dim=-1)
    tokens: list[int] = []
    for i, p in enumerate(params):
        if p.greedy:
            tokens.append(int(torch.argmax(logits[i])))
            continue
        probs = _truncate(logp[i].exp(), p.top_k, p.top_p)
        tokens.append(int(torch.multinomial(probs, 1, generator=generators[i])))
    chosen = torch.tensor(tokens)
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
