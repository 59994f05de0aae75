"""HF <-> megatron-core weight conversion for Qwen2, Qwen3 and Llama, dense or mixture-of-experts.

Pure functions over ``{name: tensor}`` state dicts: no megatron import, so the rollout side
and CPU tests can use them. The megatron names are those of ``GPTModel`` built with
``get_gpt_layer_local_spec`` (see docs/megatron.md for the table). Two layouts differ from HF:

* ``linear_qkv`` interleaves q, k and v *per query group*: group i holds its r = h/g query
  heads, then k_i, then v_i. A flat cat(q, k, v) is wrong even for plain MHA, because
  megatron's attention views the fused output as [g, (r + 2) * d] when it splits it.
* ``linear_fc1`` is cat(gate, up): megatron's GLU applies silu to the first half.

The MLP part (dense, or Qwen2-/Qwen3-MoE experts, router and shared expert) is ``mlp.py``'s.

Tensor parallelism (``shard_for_tp`` / ``gather_tp``) follows megatron's parallel linears:
column-parallel weights are split on dim 0, row-parallel ones on dim 1, norms are
replicated, and fc1 is split as [gate_r; up_r] per rank, since each rank's GLU halves its
own shard. Every function checks names and shapes and raises ``ConversionError`` naming the
tensor and both shapes, so a config mismatch fails loudly instead of loading garbage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from relax.trainers.megatron import mlp

Tensor = torch.Tensor
StateDict = dict[str, Tensor]

_TE_ALIASES = {  # dist-checkpoint / TE-spec names -> local-spec names
    ".self_attention.linear_qkv.layer_norm_weight": ".input_layernorm.weight",
    ".mlp.linear_fc1.layer_norm_weight": ".pre_mlp_layernorm.weight",
}


class ConversionError(ValueError):
    """A state dict does not match the layout: lists every missing, unexpected or misshapen tensor."""


@dataclass(frozen=True)
class LayoutConfig:
    """The few numbers that fix the shapes and the layout of a GPT state dict (``num_experts`` > 0: MoE)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    ffn_hidden_size: int
    vocab_size: int
    qkv_bias: bool = False
    qk_layernorm: bool = False
    tie_word_embeddings: bool = False
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    shared_expert_size: int = 0  # Qwen2-MoE's gated shared expert
    norm_topk_prob: bool = False

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_query_groups={self.num_query_groups}"
            )

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups


def layout_from_hf_config(hf_config: Any) -> LayoutConfig:
    """Read a transformers Qwen2/Qwen3/Llama (or Qwen2-/Qwen3-MoE) config (``model_type`` picks the family).

    Qwen2 always has q/k/v biases (its config has no switch for it); Qwen3 and Llama follow
    ``attention_bias``. Qwen3 adds per-head q/k RMSNorm. ``head_dim`` may differ from H/h.
    """
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in ("qwen2", "qwen3", "llama", "qwen2_moe", "qwen3_moe"):
        raise ValueError(f"unsupported model_type {model_type!r}: expected qwen2, qwen3, llama, qwen2_moe or "
                         f"qwen3_moe")
    base = model_type.removesuffix("_moe")
    if getattr(hf_config, "mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported (the megatron layout here has no linear biases)")
    heads = hf_config.num_attention_heads
    groups = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    qkv_bias = True if base == "qwen2" else bool(getattr(hf_config, "attention_bias", False))
    return LayoutConfig(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim,
        ffn_hidden_size=hf_config.intermediate_size,
        vocab_size=hf_config.vocab_size,
        qkv_bias=qkv_bias,
        qk_layernorm=base == "qwen3",
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        **mlp.moe_layout_fields(hf_config),
    )


# ---------------------------------------------------------------- expected names and shapes


def hf_shapes(cfg: LayoutConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name -> shape (``lm_head.weight`` only when untied)."""
    H, d, h, g = cfg.hidden_size, cfg.kv_channels, cfg.num_attention_heads, cfg.num_query_groups
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, H)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (H,)
        for name, rows in (("q", h * d), ("k", g * d), ("v", g * d)):
            out[f"{p}self_attn.{name}_proj.weight"] = (rows, H)
            if cfg.qkv_bias:
                out[f"{p}self_attn.{name}_proj.bias"] = (rows,)
        if cfg.qk_layernorm:
            out[p + "self_attn.q_norm.weight"] = (d,)
            out[p + "self_attn.k_norm.weight"] = (d,)
        out[p + "self_attn.o_proj.weight"] = (H, h * d)
        out[p + "post_attention_layernorm.weight"] = (H,)
        out.update(mlp.hf_mlp_shapes(cfg, p))
    out["model.norm.weight"] = (H,)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, H)
    return out


def mcore_shapes(cfg: LayoutConfig) -> dict[str, tuple[int, ...]]:
    """Every megatron (local spec, unsharded) tensor name -> shape, ``_extra_state`` excluded."""
    H, d, h, g = cfg.hidden_size, cfg.kv_channels, cfg.num_attention_heads, cfg.num_query_groups
    out: dict[str, tuple[int, ...]] = {"embedding.word_embeddings.weight": (cfg.vocab_size, H)}
    for i in range(cfg.num_layers):
        p = f"decoder.layers.{i}."
        out[p + "input_layernorm.weight"] = (H,)
        out[p + "self_attention.linear_qkv.weight"] = ((h + 2 * g) * d, H)
        if cfg.qkv_bias:
            out[p + "self_attention.linear_qkv.bias"] = ((h + 2 * g) * d,)
        if cfg.qk_layernorm:
            out[p + "self_attention.q_layernorm.weight"] = (d,)
            out[p + "self_attention.k_layernorm.weight"] = (d,)
        out[p + "self_attention.linear_proj.weight"] = (H, h * d)
        out[p + "pre_mlp_layernorm.weight"] = (H,)
        out.update(mlp.mcore_mlp_shapes(cfg, p))
    out["decoder.final_layernorm.weight"] = (H,)
    if not cfg.tie_word_embeddings:
        out["output_layer.weight"] = (cfg.vocab_size, H)
    return out


def check_state(
    state: StateDict, expected: dict[str, tuple[int, ...]], what: str, optional: tuple[str, ...] = ()
) -> None:
    """Raise ``ConversionError`` listing every missing, unexpected or misshapen tensor."""
    problems = []
    for name, shape in expected.items():
        if name not in state:
            problems.append(f"missing tensor {name!r} (expected shape {list(shape)})")
        elif tuple(state[name].shape) != shape:
            problems.append(f"tensor {name!r} has shape {list(state[name].shape)}, expected {list(shape)}")
    for name in state.keys() - expected.keys() - set(optional):
        problems.append(f"unexpected tensor {name!r} (shape {list(state[name].shape)})")
    if problems:
        raise ConversionError(f"{what} state dict does not match the layout:\n  " + "\n  ".join(problems))


def clean_mcore_state(state: dict[str, Any]) -> StateDict:
    """Strip ``module.`` wrapper prefixes (DDP, Float16Module), drop ``_extra_state`` entries
    (TE-compatibility placeholders of local linears) and map TE-spec norm names to local ones."""
    out: StateDict = {}
    for name, value in state.items():
        while name.startswith("module."):
            name = name[len("module.") :]
        if name.endswith("._extra_state"):
            continue
        for te, local in _TE_ALIASES.items():
            if name.endswith(te):
                name = name[: -len(te)] + local
        out[name] = value
    return out


# ---------------------------------------------------------------- QKV and fc1 layouts


def merge_qkv(q: Tensor, k: Tensor, v: Tensor, cfg: LayoutConfig) -> Tensor:
    """HF q/k/v (weights [n*d, H] or biases [n*d]) -> megatron rows grouped per query group."""
    g, r, d = cfg.num_query_groups, cfg.heads_per_group, cfg.kv_channels
    tail = q.shape[1:]
    fused = torch.cat([q.reshape(g, r * d, *tail), k.reshape(g, d, *tail), v.reshape(g, d, *tail)], dim=1)
    return fused.reshape((r + 2) * g * d, *tail)


def split_qkv(qkv: Tensor, cfg: LayoutConfig) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of ``merge_qkv``: megatron ``linear_qkv`` weight or bias -> HF q, k, v."""
    g, r, d = cfg.num_query_groups, cfg.heads_per_group, cfg.kv_channels
    tail = qkv.shape[1:]
    q, k, v = qkv.reshape(g, (r + 2) * d, *tail).split([r * d, d, d], dim=1)
    return (
        q.reshape(g * r * d, *tail).contiguous(),
        k.reshape(g * d, *tail).contiguous(),
        v.reshape(g * d, *tail).contiguous(),
    )


# ---------------------------------------------------------------- whole state dicts


def hf_to_megatron(hf_state: StateDict, cfg: LayoutConfig) -> StateDict:
    """HF ``model.state_dict()`` -> unsharded megatron local-spec state dict (no ``_extra_state``).

    With tied embeddings a present ``lm_head.weight`` is accepted and ignored (HF lists the
    shared tensor under both names). Stale ``rotary_emb.inv_freq`` buffers are ignored.
    """
    hf_state = {k: v for k, v in hf_state.items() if not k.endswith("rotary_emb.inv_freq")}
    optional = ("lm_head.weight",) if cfg.tie_word_embeddings else ()
    check_state(hf_state, hf_shapes(cfg), "HF", optional)
    out: StateDict = {"embedding.word_embeddings.weight": hf_state["model.embed_tokens.weight"]}
    for i in range(cfg.num_layers):
        s, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        a = s + "self_attn."
        out[m + "input_layernorm.weight"] = hf_state[s + "input_layernorm.weight"]
        for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
            out[m + f"self_attention.linear_qkv.{kind}"] = merge_qkv(
                *(hf_state[f"{a}{x}_proj.{kind}"] for x in "qkv"), cfg)
        if cfg.qk_layernorm:
            out[m + "self_attention.q_layernorm.weight"] = hf_state[a + "q_norm.weight"]
            out[m + "self_attention.k_layernorm.weight"] = hf_state[a + "k_norm.weight"]
        out[m + "self_attention.linear_proj.weight"] = hf_state[a + "o_proj.weight"]
        out[m + "pre_mlp_layernorm.weight"] = hf_state[s + "post_attention_layernorm.weight"]
        out.update(mlp.mlp_to_megatron(hf_state, s, m, cfg))
    out["decoder.final_layernorm.weight"] = hf_state["model.norm.weight"]
    if not cfg.tie_word_embeddings:
        out["output_layer.weight"] = hf_state["lm_head.weight"]
    return out


def megatron_to_hf(mcore_state: dict[str, Any], cfg: LayoutConfig) -> StateDict:
    """Unsharded megatron state dict (``module.`` prefixes, ``_extra_state`` and TE norm names
    allowed) -> HF state dict. Tied models also get ``lm_head.weight`` (the embedding tensor),
    so a strict ``load_state_dict`` on the HF model succeeds."""
    state = clean_mcore_state(mcore_state)
    optional = ("output_layer.weight",) if cfg.tie_word_embeddings else ()  # PP last-stage copy
    check_state(state, mcore_shapes(cfg), "megatron", optional)
    out: StateDict = {"model.embed_tokens.weight": state["embedding.word_embeddings.weight"]}
    for i in range(cfg.num_layers):
        s, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        a = s + "self_attn."
        out[s + "input_layernorm.weight"] = state[m + "input_layernorm.weight"]
        q, k, v = split_qkv(state[m + "self_attention.linear_qkv.weight"], cfg)
        out.update({a + "q_proj.weight": q, a + "k_proj.weight": k, a + "v_proj.weight": v})
        if cfg.qkv_bias:
            q, k, v = split_qkv(state[m + "self_attention.linear_qkv.bias"], cfg)
            out.update({a + "q_proj.bias": q, a + "k_proj.bias": k, a + "v_proj.bias": v})
        if cfg.qk_layernorm:
            out[a + "q_norm.weight"] = state[m + "self_attention.q_layernorm.weight"]
            out[a + "k_norm.weight"] = state[m + "self_attention.k_layernorm.weight"]
        out[a + "o_proj.weight"] = state[m + "self_attention.linear_proj.weight"]
        out[s + "post_attention_layernorm.weight"] = state[m + "pre_mlp_layernorm.weight"]
        out.update(mlp.mlp_to_hf(state, s, m, cfg))
    out["model.norm.weight"] = state["decoder.final_layernorm.weight"]
    out["lm_head.weight"] = state["embedding.word_embeddings.weight" if cfg.tie_word_embeddings
                                  else "output_layer.weight"]
    return out


# ---------------------------------------------------------------- tensor parallelism


def _tp_rule(name: str) -> str:
    """How megatron shards a parameter: 'vocab', 'col', 'fc1', 'row' or 'replicated'."""
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return "vocab"
    if ".linear_qkv." in name:
        return "col"
    if name.endswith("linear_fc1.weight"):
        return "fc1"
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return "row"
    return "replicated"  # norms; row-parallel biases too, if a layout ever had them


def check_tp(cfg: LayoutConfig, tp: int) -> None:
    """The divisibility megatron asserts for this tp, with the fix in each message."""
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    if cfg.vocab_size % tp:
        raise ValueError(
            f"vocab_size={cfg.vocab_size} is not divisible by tp={tp}: megatron splits the embedding "
            f"and output layer by vocab rows; pad the vocabulary to a multiple of tp "
            f"(megatron's make_vocab_size_divisible_by) before converting"
        )
    g, h = cfg.num_query_groups, cfg.num_attention_heads
    if h % tp or (g % tp and tp % g):
        raise ValueError(
            f"tp={tp} must divide num_attention_heads={h} and divide or be a multiple of num_query_groups={g}"
        )
    for name in ("ffn_hidden_size", "moe_ffn_hidden_size", "shared_expert_size"):
        if getattr(cfg, name) % tp:
            raise ValueError(f"{name}={getattr(cfg, name)} is not divisible by tp={tp}")


def shard_for_tp(mcore_state: dict[str, Any], cfg: LayoutConfig, tp: int, rank: int) -> StateDict:
    """The slice of an unsharded megatron state dict that tensor-parallel ``rank`` of ``tp`` holds."""
    check_tp(cfg, tp)
    if not 0 <= rank < tp:
        raise ValueError(f"rank={rank} is out of range for tp={tp}")
    state = clean_mcore_state(mcore_state)
    optional = ("output_layer.weight",) if cfg.tie_word_embeddings else ()
    check_state(state, mcore_shapes(cfg), "megatron", optional)
    out: StateDict = {}
    for name, t in state.items():
        rule = _tp_rule(name)
        if rule in ("vocab", "col"):
            out[name] = t.chunk(tp, dim=0)[rank].contiguous()
        elif rule == "fc1":
            gate, up = t.chunk(2, dim=0)
            out[name] = torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]], dim=0)
        elif rule == "row":
            out[name] = t.chunk(tp, dim=1)[rank].contiguous()
        else:
            out[name] = t
    return out


def gather_tp(shards: list[dict[str, Any]], cfg: LayoutConfig) -> StateDict:
    """Inverse of ``shard_for_tp``: per-rank state dicts (rank order) -> unsharded state dict.

    fc1 is not a plain cat: each rank holds [gate_r; up_r], so the gates and the ups are
    gathered separately. Replicated tensors (norms) are taken from rank 0.
    """
    tp = len(shards)
    check_tp(cfg, tp)
    shards = [clean_mcore_state(s) for s in shards]
    full = mcore_shapes(cfg)
    for rank, shard in enumerate(shards):
        if shard.keys() != shards[0].keys():
            diff = sorted(shard.keys() ^ shards[0].keys())
            raise ConversionError(f"rank {rank} and rank 0 hold different tensors: {diff}")
    out: StateDict = {}
    for name in shards[0]:
        rule, parts = _tp_rule(name), [s[name] for s in shards]
        if rule in ("vocab", "col"):
            out[name] = torch.cat(parts, dim=0)
        elif rule == "fc1":
            halves = [p.chunk(2, dim=0) for p in parts]
            out[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        elif rule == "row":
            out[name] = torch.cat(parts, dim=1)
        else:
            out[name] = parts[0]
    optional = ("output_layer.weight",) if cfg.tie_word_embeddings else ()
    check_state(out, full, f"gathered (tp={tp})", optional)
    return out


# ---------------------------------------------------------------- pipeline stages


def _renumber(name: str, shift: int) -> tuple[str, int | None]:
    """``decoder.layers.N.rest`` -> (``decoder.layers.{N+shift}.rest``, N); other names: (name, None)."""
    if not name.startswith("decoder.layers."):
        return name, None
    _, _, n, rest = name.split(".", 3)
    return f"decoder.layers.{int(n) + shift}.{rest}", int(n)


def stage_slice(mcore_state: dict[str, Any], cfg: LayoutConfig, first_layer: int, num_layers: int,
                first: bool, last: bool) -> StateDict:
    """A stage's part of a megatron state dict (global layer numbers, TP-sharded or not): its layers
    renumbered from 0, the embedding on the first stage, final norm and output layer on the last (tied:
    a last stage that is not also the first holds megatron's embedding copy as ``output_layer.weight``)."""
    out: StateDict = {}
    for name, t in clean_mcore_state(mcore_state).items():
        local, n = _renumber(name, -first_layer)
        if n is not None and first_layer <= n < first_layer + num_layers:
            out[local] = t
        elif name == "embedding.word_embeddings.weight":
            out.update({name: t} if first else {"output_layer.weight": t} if last and cfg.tie_word_embeddings else {})
        elif n is None and last:  # decoder.final_layernorm.weight, output_layer.weight
            out[name] = t
    return out


def stage_merge(stages: list[tuple[int, dict[str, Any]]], cfg: LayoutConfig) -> StateDict:
    """Inverse of ``stage_slice`` over ``(first_layer, state)`` per stage; drops the tied copy."""
    out: StateDict = {}
    for first_layer, state in stages:
        for name, t in clean_mcore_state(state).items():
            name, _ = _renumber(name, first_layer)
            if name in out:
                raise ConversionError(f"tensor {name!r} is held by two pipeline stages")
            if not (name == "output_layer.weight" and cfg.tie_word_embeddings):
                out[name] = t
    return out
