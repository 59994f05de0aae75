"""Rollout routing replay (R3): record the experts an MoE forward chose, and replay them in another forward.

An MoE layer's router scores the E experts of each token and keeps the top k. The engine that
sampled a token and the trainer that scores it run different batches (and, on GPUs, different
kernels), so for a token near a routing tie they can pick different experts, and the
importance ratio then measures routing noise rather than a change of policy. R3 (Ma et al.
2025, "Stabilizing MoE Reinforcement Learning by Aligning Training and Inference Routers",
arXiv:2510.11370) records the engine's choices and makes the training forward use them; the
router still learns through the gate weights of the replayed experts.

Routes are int tensors shaped (tokens, layers, k): the ids of the k experts of every MoE layer
for each position fed through the model, in the order Hugging Face's routers see them (the
(R, T) input flattened row by row). A route of -1 means "none recorded": the router decides.
The hook points are Hugging Face's ``*TopKRouter`` modules (Qwen2-MoE, Qwen3-MoE), whose
forward returns ``(router_logits, top-k weights, top-k ids)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

NO_ROUTE = -1


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's top-k routers, first layer first (empty for a dense model)."""
    inner = getattr(model, "module", model)  # DDP
    return [m for m in inner.modules() if type(m).__name__.endswith("TopKRouter") and hasattr(m, "top_k")]


def route_shape(model: torch.nn.Module) -> tuple[int, int] | None:
    """(MoE layers, k) of ``model``; None for a dense model."""
    routers = moe_routers(model)
    return (len(routers), int(routers[0].top_k)) if routers else None


def replayed_scores(logits: torch.Tensor, routes: torch.Tensor, own: torch.Tensor, norm_topk_prob: bool
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's top-k weights for given experts: (scores (N, k) in ``logits``' dtype, ids (N, k)).

    ``logits`` (N, E) are the router's, ``routes`` (N, k) the replayed ids (-1: keep ``own``, the
    router's own (N, k) choice, for that token). Weights are softmax(logits) at the chosen ids,
    renormalised over the k when ``norm_topk_prob`` (Qwen3-MoE; Qwen2-MoE keeps them raw), as the
    router computes them for its own top k: so the gradient reaches the gate rows of the replayed
    experts. E.g. logits (0, ln 2, ln 3) give probs (1/6, 2/6, 3/6); replaying experts (0, 2) at
    k = 2 gives (1/6, 3/6), normalised (1/4, 3/4)."""
    ids = torch.where(routes >= 0, routes.to(own.dtype), own)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    scores = probs.gather(-1, ids)
    if norm_topk_prob:
        scores = scores / scores.sum(dim=-1, keepdim=True)
    return scores.to(logits.dtype), ids


class RouteRecorder:
    """Collects the top-k ids every router of ``model`` picks, while capturing (engine side)."""

    def __init__(self, model: torch.nn.Module):
        self.routers = moe_routers(model)
        self._seen: list[list[torch.Tensor]] | None = None
        for i, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(i))

    @classmethod
    def maybe(cls, model: torch.nn.Module) -> RouteRecorder | None:
        """A recorder for an MoE model; None for a dense one (nothing to record, no hooks)."""
        return cls(model) if moe_routers(model) else None

    def _hook(self, layer: int):
        def hook(_module: torch.nn.Module, _args: tuple, out: tuple) -> None:
            if self._seen is not None:
                self._seen[layer].append(out[2].to(torch.int16))
        return hook

    @contextmanager
    def capture(self) -> Iterator[list[torch.Tensor]]:
        """Within the block, every router call is recorded; the yielded list receives one (N, layers, k)
        int16 tensor when the block ends (N: the tokens of the block's forward, row-major)."""
        self._seen = [[] for _ in self.routers]
        result: list[torch.Tensor] = []
        try:
            yield result
            if self._seen and all(self._seen):
                result.append(torch.stack([torch.cat(calls) for calls in self._seen], dim=1))
        finally:
            self._seen = None


def check_routes(routes: torch.Tensor, shape: tuple[int, int] | None, where: str) -> None:
    """A routes tensor (..., layers, k) must match the model's MoE layers and k: else a ValueError naming both."""
    if shape is None:
        raise ValueError(f"{where}: routed_experts given for a model without MoE layers; turn "
                         f"algorithm.routing_replay off for dense models")
    if routes.dim() < 2 or tuple(routes.shape[-2:]) != shape:
        raise ValueError(f"{where}: routed_experts of shape {tuple(routes.shape)} do not match the model's "
                         f"{shape[0]} MoE layers x top-{shape[1]} (expected (..., {shape[0]}, {shape[1]}))")


@contextmanager
def replay_routes(model: torch.nn.Module, routes: torch.Tensor) -> Iterator[None]:
    """Within the block, forwards of ``model`` route position (r, t) of layer l to ``routes[r, t, l]``.

    ``routes`` is (R, T, layers, k) for an (R, T) input; positions of -1 keep the router's own choice.
    A model with its own ``replay_routes`` (the megatron policy) takes them as they are; for Hugging
    Face routers a forward of another token count fails naming both counts."""
    own = getattr(getattr(model, "module", model), "replay_routes", None)
    if own is not None:
        with own(routes):
            yield
        return
    routes = routes.flatten(0, 1)
    routers = moe_routers(model)
    check_routes(routes, (len(routers), int(routers[0].top_k)) if routers else None, "routing replay")
    handles = []
    for layer, router in enumerate(routers):
        def hook(module: torch.nn.Module, _args: tuple, out: tuple, layer: int = layer) -> tuple:
            logits, _, own = out
            if logits.shape[0] != routes.shape[0]:
                raise ValueError(f"routing replay: a forward of {logits.shape[0]} tokens was given routes for "
                                 f"{routes.shape[0]}")
            scores, ids = replayed_scores(logits, routes[:, layer].to(logits.device), own,
                                          bool(getattr(module, "norm_topk_prob", False)))
            return logits, scores, ids
        handles.append(router.register_forward_hook(hook))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def config_route_shape(config) -> tuple[int, int] | None:
    """(MoE layers, k) from a Hugging Face config, without building the model (what the queue column
    is declared with); None for a dense config. A layer is sparse as Qwen2/3-MoE decide it: not in
    ``mlp_only_layers`` and every ``decoder_sparse_step``-th."""
    experts, k = getattr(config, "num_experts", 0) or 0, getattr(config, "num_experts_per_tok", 0) or 0
    if not experts or not k:
        return None
    step, dense = getattr(config, "decoder_sparse_step", 1) or 1, set(getattr(config, "mlp_only_layers", []) or [])
    layers = sum(1 for i in range(config.num_hidden_layers) if i not in dense and (i + 1) % step == 0)
    return (layers, int(k)) if layers else None
