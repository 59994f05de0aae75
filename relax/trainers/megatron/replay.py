"""Rollout routing replay on megatron-core: the engine's experts handed to megatron's own RouterReplay.

With ``moe_enable_routing_replay`` every megatron ``TopKRouter`` owns a ``RouterReplay``; in its
``REPLAY_FORWARD`` action the router takes the given top-k ids instead of computing them and
gathers its own scores at them (softmax probabilities for Qwen2-MoE's pre-softmax routing, logits
then a softmax over the k for Qwen3-MoE), so its gate weights still get gradients: the same rule
as relax.models.moe_routing for Hugging Face routers (docs/algorithms.md, R3).

Two layout facts: megatron's router sees the tokens of its (S, B) input sequence-first, and the
policy runs each sample as its own padded row (relax.trainers.megatron.samples), so the routes
are cut into the same rows and transposed. Positions the engine never fed (the last token, the
padding: -1) get experts 0..k-1: their outputs reach no log-prob, so any valid id gives the same
loss and gradients, and megatron's replay gathers without a fallback to the router's own choice.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from megatron.core.transformer.moe.router_replay import RouterReplayAction

from relax.models.moe_routing import check_routes
from relax.trainers.megatron.samples import Span


def replay_instances(gpt: torch.nn.Module) -> list:
    """This stage's routers' ``RouterReplay`` objects, first layer first (empty without replay)."""
    return [m.router_replay for m in gpt.modules() if getattr(m, "router_replay", None) is not None]


def sample_routes(routes: torch.Tensor, spans: Sequence[Span], longest: int, rows: int = 0) -> torch.Tensor:
    """(R, T, L, k) routes in the trainer's rows -> (longest * n, L, k) in megatron's order: one padded
    row per sample (``spans``, as ``samples.sample_rows`` cut the tokens), sequence-first, -1 filled;
    ``rows`` > n pads with rows of padding (``samples.widened``)."""
    k = routes.shape[-1]
    out = torch.full((max(rows, len(spans)), longest, *routes.shape[-2:]), -1, dtype=torch.long)
    for i, (row, start, length) in enumerate(spans):
        out[i, :length] = routes[row, start:start + length]
    out = torch.where(out >= 0, out, torch.arange(k, dtype=torch.long))  # padding and never-fed positions
    return out.transpose(0, 1).reshape(longest * out.shape[0], *routes.shape[-2:])


@contextmanager
def replaying(gpt: torch.nn.Module, routes: torch.Tensor, shape: tuple[int, int]) -> Iterator[None]:
    """Within the block, forwards of ``gpt`` route with ``routes`` ((N, L, k) in megatron's token order,
    :func:`sample_routes`); L counts this stage's MoE layers."""
    instances = replay_instances(gpt)
    if not instances:
        raise ValueError("routing replay on megatron needs a model built with moe_enable_routing_replay "
                         "(megatron_policy(..., routing_replay=True))")
    check_routes(routes, (len(instances), shape[1]), "routing replay (megatron)")
    for layer, instance in enumerate(instances):
        instance.set_target_indices(routes[:, layer].contiguous())
        instance.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    try:
        yield
    finally:
        for instance in instances:
            instance.clear_router_replay_action()
            instance.clear_indices()
