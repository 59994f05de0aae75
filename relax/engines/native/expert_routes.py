"""The experts each sequence's tokens were routed to, recorded as the engine runs (rollout routing replay).

The engine captures its MoE routers (``relax.models.moe_routing.RouteRecorder``) around every
prefill and decode forward and keeps, per sequence, the (tokens, layers, k) ids of every
position it fed through the model: the prompt's from the prefill (shared by a prompt's n
samples), then one per decode step. The last sampled token is never fed, so a completion's
routes cover ``prompt_tokens + len(output_ids) - 1`` positions, as SGLang's ``routed_experts``.
Dense models have no recorder and pay nothing.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from relax.models.moe_routing import RouteRecorder


@contextmanager
def capture(recorder: RouteRecorder | None) -> Iterator[list[torch.Tensor]]:
    """Records the block's forward when there is a recorder; the list gets its (N, layers, k) routes."""
    if recorder is None:
        yield []
        return
    with recorder.capture() as routes:
        yield routes


def prompt_rows(captured: list[torch.Tensor], lengths: Sequence[int]) -> list[torch.Tensor | None]:
    """A right-padded prefill's routes cut into each row's prompt positions ((L_i, layers, k) each)."""
    if not captured:
        return [None] * len(lengths)
    routes = captured[0].reshape(len(lengths), -1, *captured[0].shape[1:])
    return [routes[i, :n] for i, n in enumerate(lengths)]


def add_step(seqs: Sequence[Any], captured: list[torch.Tensor]) -> None:
    """One decode step's routes (rows in ``seqs`` order) appended to each sequence's."""
    if captured:
        for k, s in enumerate(seqs):
            s.routes.append(captured[0][k:k + 1])


def joined(parts: list[torch.Tensor]) -> np.ndarray | None:
    """A sequence's recorded routes as one (positions, layers, k) int16 array; None if none were recorded."""
    return torch.cat(parts).numpy() if parts else None
