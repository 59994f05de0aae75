"""Turn-level rewards in the advantage: each policy turn's own reward credited to that turn's tokens.

An external agent may post one reward per policy turn beside the episode's reward (docs/agents.md).
With ``algorithm.turn_reward_coef`` = c > 0 a token of turn k gets ``A_t + c * r_k``: the episode's
advantage (whatever estimator made it) plus its turn's reward, so a good lookup in turn 1 is credited
to turn 1's tokens even when the episode's answer fails. Tokens outside every policy turn (the prompt,
tool results) gain nothing; they are outside the loss anyway.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def turn_reward_tokens(length: int, spans: Sequence[tuple[int, int]], rewards: Sequence[float]) -> np.ndarray:
    """Per-token turn rewards, shape (length,): ``rewards[k]`` on the tokens ``spans[k] = (start, end)``
    of policy turn k, 0 elsewhere. A turn without a reward (fewer rewards than spans) gets 0."""
    out = np.zeros(length, np.float32)
    for (start, end), r in zip(spans, rewards, strict=False):
        out[start:end] = r
    return out


def turn_advantages(advantages: np.ndarray, token_rewards: np.ndarray, mask: np.ndarray, coef: float) -> np.ndarray:
    """``advantages`` (T,) plus ``coef`` * ``token_rewards`` (T,) on the trained tokens (``mask`` (T,) == 1)."""
    mask = np.asarray(mask, np.float32)
    return (np.asarray(advantages, np.float32) + coef * np.asarray(token_rewards, np.float32) * mask).astype(np.float32)
