"""The MLP part of the HF <-> megatron layouts: a dense SwiGLU, or a mixture of experts (Qwen2-/Qwen3-MoE).

Per layer, with ``s`` the HF prefix (``model.layers.i.``) and ``m`` the megatron one
(``decoder.layers.i.``), in megatron's local spec (``SequentialMLP`` experts, no grouped GEMM):

| HF | megatron |
|---|---|
| ``mlp.gate_proj``, ``mlp.up_proj``, ``mlp.down_proj`` (dense) | ``mlp.linear_fc1`` = cat(gate, up), ``mlp.linear_fc2``
|
| ``mlp.gate.weight`` (E, H): the router | ``mlp.router.weight`` |
| ``mlp.experts.gate_up_proj`` (E, 2I, H): gate rows, then up | ``mlp.experts.local_experts.e.linear_fc1.weight`` (2I,
H), one per expert |
| ``mlp.experts.down_proj`` (E, H, I) | ``mlp.experts.local_experts.e.linear_fc2.weight`` (H, I) |
| ``mlp.shared_expert.{gate,up,down}_proj`` (Qwen2-MoE) | ``mlp.shared_experts.linear_fc1`` = cat(gate, up),
``linear_fc2`` |
| ``mlp.shared_expert_gate.weight`` (1, H) | ``mlp.shared_experts.gate_weight`` (sigmoid gate, as HF) |

HF fuses gate and up per expert in the order megatron's GLU expects, so ``gate_up_proj[e]`` is
``linear_fc1`` as it stands. Routing maps onto megatron's softmax router: Qwen2-MoE (raw top-k
probabilities) is ``moe_router_pre_softmax``; Qwen3-MoE (``norm_topk_prob``: the top k
renormalised) equals a softmax over the top-k logits, megatron's default.

Expert parallelism (EP) splits each layer's experts over the EP ranks in blocks: rank r holds global
experts r*E/EP .. (r+1)*E/EP - 1 as its ``local_experts.0 ..`` (megatron's numbering); the router and
the shared expert stay whole on every rank (``expert_slice`` / ``expert_merge``).
"""

from __future__ import annotations

import re
from typing import Any

import torch

Tensor = torch.Tensor
_LOCAL_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")


def _experts(cfg: Any) -> range:
    return range(cfg.num_experts)


def hf_mlp_shapes(cfg: Any, s: str) -> dict[str, tuple[int, ...]]:
    """HF MLP tensor name -> shape for the layer with prefix ``s``."""
    H = cfg.hidden_size
    if not cfg.num_experts:
        F = cfg.ffn_hidden_size
        return {
            s + "mlp.gate_proj.weight": (F, H),
            s + "mlp.up_proj.weight": (F, H),
            s + "mlp.down_proj.weight": (H, F),
        }
    E, W = cfg.num_experts, cfg.moe_ffn_hidden_size
    out = {s + "mlp.gate.weight": (E, H), s + "mlp.experts.gate_up_proj": (E, 2 * W, H),
           s + "mlp.experts.down_proj": (E, H, W)}
    if cfg.shared_expert_size:
        S = cfg.shared_expert_size
        out.update({s + "mlp.shared_expert.gate_proj.weight": (S, H), s + "mlp.shared_expert.up_proj.weight": (S, H),
                    s + "mlp.shared_expert.down_proj.weight": (H, S), s + "mlp.shared_expert_gate.weight": (1, H)})
    return out


def mcore_mlp_shapes(cfg: Any, m: str) -> dict[str, tuple[int, ...]]:
    """Megatron (local spec, unsharded) MLP tensor name -> shape for the layer with prefix ``m``."""
    H = cfg.hidden_size
    if not cfg.num_experts:
        return {m + "mlp.linear_fc1.weight": (2 * cfg.ffn_hidden_size, H),
                m + "mlp.linear_fc2.weight": (H, cfg.ffn_hidden_size)}
    W = cfg.moe_ffn_hidden_size
    out: dict[str, tuple[int, ...]] = {m + "mlp.router.weight": (cfg.num_experts, H)}
    for e in _experts(cfg):
        out[f"{m}mlp.experts.local_experts.{e}.linear_fc1.weight"] = (2 * W, H)
        out[f"{m}mlp.experts.local_experts.{e}.linear_fc2.weight"] = (H, W)
    if cfg.shared_expert_size:
        S = cfg.shared_expert_size
        out.update({m + "mlp.shared_experts.linear_fc1.weight": (2 * S, H),
                    m + "mlp.shared_experts.linear_fc2.weight": (H, S), m + "mlp.shared_experts.gate_weight": (1, H)})
    return out


def mlp_to_megatron(hf: dict[str, Tensor], s: str, m: str, cfg: Any) -> dict[str, Tensor]:
    """One layer's HF MLP tensors -> megatron names (shapes already checked)."""
    if not cfg.num_experts:
        return {m + "mlp.linear_fc1.weight": torch.cat([hf[s + "mlp.gate_proj.weight"], hf[s + "mlp.up_proj.weight"]]),
                m + "mlp.linear_fc2.weight": hf[s + "mlp.down_proj.weight"]}
    out = {m + "mlp.router.weight": hf[s + "mlp.gate.weight"]}
    for e in _experts(cfg):
        out[f"{m}mlp.experts.local_experts.{e}.linear_fc1.weight"] = hf[s + "mlp.experts.gate_up_proj"][e]
        out[f"{m}mlp.experts.local_experts.{e}.linear_fc2.weight"] = hf[s + "mlp.experts.down_proj"][e]
    if cfg.shared_expert_size:
        shared = s + "mlp.shared_expert."
        out[m + "mlp.shared_experts.linear_fc1.weight"] = torch.cat([hf[shared + "gate_proj.weight"],
                                                                     hf[shared + "up_proj.weight"]])
        out[m + "mlp.shared_experts.linear_fc2.weight"] = hf[shared + "down_proj.weight"]
        out[m + "mlp.shared_experts.gate_weight"] = hf[s + "mlp.shared_expert_gate.weight"]
    return out


def mlp_to_hf(state: dict[str, Tensor], s: str, m: str, cfg: Any) -> dict[str, Tensor]:
    """Inverse of :func:`mlp_to_megatron` for one layer."""
    if not cfg.num_experts:
        gate, up = state[m + "mlp.linear_fc1.weight"].chunk(2, dim=0)
        return {s + "mlp.gate_proj.weight": gate.contiguous(), s + "mlp.up_proj.weight": up.contiguous(),
                s + "mlp.down_proj.weight": state[m + "mlp.linear_fc2.weight"]}
    expert = f"{m}mlp.experts.local_experts."
    out = {
        s + "mlp.gate.weight": state[m + "mlp.router.weight"],
        s + "mlp.experts.gate_up_proj": torch.stack([state[f"{expert}{e}.linear_fc1.weight"] for e in _experts(cfg)]),
        s + "mlp.experts.down_proj": torch.stack([state[f"{expert}{e}.linear_fc2.weight"] for e in _experts(cfg)]),
    }
    if cfg.shared_expert_size:
        gate, up = state[m + "mlp.shared_experts.linear_fc1.weight"].chunk(2, dim=0)
        out.update({s + "mlp.shared_expert.gate_proj.weight": gate.contiguous(),
                    s + "mlp.shared_expert.up_proj.weight": up.contiguous(),
                    s + "mlp.shared_expert.down_proj.weight": state[m + "mlp.shared_experts.linear_fc2.weight"],
                    s + "mlp.shared_expert_gate.weight": state[m + "mlp.shared_experts.gate_weight"]})
    return out


def moe_layout_fields(hf_config: Any) -> dict[str, Any]:
    """The LayoutConfig fields of an HF Qwen2-/Qwen3-MoE config ({} for a dense one). Only configs whose
    every layer is sparse map (``decoder_sparse_step`` 1, no ``mlp_only_layers``)."""
    if not getattr(hf_config, "num_experts", 0):
        return {}
    if (getattr(hf_config, "decoder_sparse_step", 1) or 1) != 1 or getattr(hf_config, "mlp_only_layers", None):
        raise ValueError("an MoE config with dense layers (decoder_sparse_step > 1 or mlp_only_layers) is not "
                         "mapped to megatron: every layer must be sparse")
    return {"num_experts": int(hf_config.num_experts), "moe_topk": int(hf_config.num_experts_per_tok),
            "moe_ffn_hidden_size": int(hf_config.moe_intermediate_size),
            "shared_expert_size": int(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0),
            "norm_topk_prob": bool(getattr(hf_config, "norm_topk_prob", False))}


def moe_transformer_kwargs(cfg: Any, dispatcher: str, routing_replay: bool = False) -> dict[str, Any]:
    """TransformerConfig fields of an MoE layout: HF's router (no load-balancing loss: HF trains without
    one unless ``output_router_logits``), the shared expert and its gate, the token ``dispatcher``
    (megatron's alltoall creates CUDA streams: allgather on a CPU); ``routing_replay``: megatron's
    RouterReplay hooks."""
    if not cfg.num_experts:
        return {}
    out: dict[str, Any] = {
        "num_moe_experts": cfg.num_experts, "moe_router_topk": cfg.moe_topk,
        "moe_ffn_hidden_size": cfg.moe_ffn_hidden_size, "moe_router_pre_softmax": not cfg.norm_topk_prob,
        "moe_router_load_balancing_type": "none", "moe_aux_loss_coeff": 0.0, "moe_grouped_gemm": False,
        "moe_token_dispatcher_type": dispatcher, "moe_enable_routing_replay": routing_replay}
    if cfg.shared_expert_size:
        out.update(moe_shared_expert_intermediate_size=cfg.shared_expert_size, moe_shared_expert_gate=True)
    return out


def local_expert(name: str) -> int | None:
    """The expert index in a megatron ``...mlp.experts.local_experts.<e>....`` name; None for any other tensor."""
    match = _LOCAL_EXPERT.match(name)
    return int(match.group(2)) if match else None


def _renamed(name: str, expert: int) -> str:
    head, _, tail = _LOCAL_EXPERT.match(name).groups()  # type: ignore[union-attr]
    return f"{head}{expert}{tail}"


def experts_per_rank(cfg: Any, ep: int) -> int:
    """E / EP; a ValueError naming both when EP does not divide the experts."""
    if cfg.num_experts % ep:
        raise ValueError(f"expert_parallel={ep} does not divide the model's {cfg.num_experts} experts per layer")
    return cfg.num_experts // ep


def expert_slice(state: dict[str, Tensor], cfg: Any, ep: int, rank: int) -> dict[str, Tensor]:
    """A megatron state dict holding every expert -> EP rank ``rank``'s part: its block of experts,
    renumbered from 0, and every other tensor as it is (the identity at ep = 1 or for a dense model)."""
    if ep == 1 or not cfg.num_experts:
        return state
    per = experts_per_rank(cfg, ep)
    out = {}
    for name, tensor in state.items():
        e = local_expert(name)
        if e is None:
            out[name] = tensor
        elif rank * per <= e < (rank + 1) * per:
            out[_renamed(name, e - rank * per)] = tensor
    return out


def expert_merge(parts: list[dict[str, Tensor]], cfg: Any) -> dict[str, Tensor]:
    """Inverse of :func:`expert_slice`: the EP ranks' parts (rank order) -> every expert under its global
    number; the tensors every rank holds whole are taken from rank 0's part."""
    if len(parts) == 1 or not cfg.num_experts:
        return parts[0]
    per = experts_per_rank(cfg, len(parts))
    out = {name: t for name, t in parts[0].items() if local_expert(name) is None}
    for rank, part in enumerate(parts):
        for name, tensor in part.items():
            e = local_expert(name)
            if e is not None:
                out[_renamed(name, rank * per + e)] = tensor
    return out
