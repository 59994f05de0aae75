"""Build a megatron-core ``GPTModel`` from a Hugging Face Qwen2/Qwen3/Llama (or Qwen2-/Qwen3-MoE) config.

Uses the *local* layer spec (plain torch modules, no Transformer Engine or Apex), so the
same model builds on a CUDA cluster and, for tests, on a CPU-only machine. The config
mapping follows docs/megatron.md; the fields that silently change the math when left at
megatron's defaults (add_bias_linear=True, dropout 0.1, learned absolute positions,
LayerNorm, gelu) are all set explicitly.

CPU support (the process group, and every workaround for what megatron-core 0.16.1 puts on CUDA
or Transformer Engine outside the math, the build-time 7 and 8 included) is relax.trainers.megatron.cpu.

Also: with ``attention_mask=None`` the torch softmax path builds its causal mask with
``device="cuda"`` (``transformer/utils.py`` ``get_default_causal_mask``), so CPU callers pass
an explicit mask (``causal_attention_mask``), which is what megatron training loops do anyway
(cpu.py's workaround 4).

Pipeline parallelism: each stage's GPTModel numbers its layers from 0 (global offset
``decoder.layers[0].layer_number - 1``); load/export slice and merge stages with
``convert.stage_slice`` / ``stage_merge``. With tied embeddings megatron gives the last stage a
copy of the embedding as ``output_layer.weight`` and, while building, all-reduces it over the
embedding group after ``weight.data.cuda()``; on CPU that ``.cuda()`` is made a no-op (cpu.py's
workaround 7).

Context parallelism without Transformer Engine: the local spec's core attention becomes
``ContextParallelAttention`` (relax.trainers.megatron.context_parallel; megatron's own refuses cp > 1).

MoE without Transformer Engine needs a name megatron defines only when TE imports (cpu.py's
workaround 8).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from relax.trainers.megatron.context_parallel import ContextParallelAttention
from relax.trainers.megatron.convert import (
    LayoutConfig,
    clean_mcore_state,
    gather_tp,
    hf_to_megatron,
    layout_from_hf_config,
    megatron_to_hf,
    shard_for_tp,
    stage_merge,
    stage_slice,
)
from relax.trainers.megatron.cpu import building_gpt_model, forward_on_cpu
from relax.trainers.megatron.mlp import expert_merge, expert_slice, local_expert, moe_transformer_kwargs
from relax.trainers.megatron.samples import causal_attention_mask

_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def rope_settings(hf_config: Any) -> dict[str, Any]:
    """GPTModel rotary kwargs from an HF config (transformers 5 ``rope_parameters`` or 4.x fields).

    megatron 0.16 knows plain RoPE and Llama-3 scaling with fixed low/high/original factors;
    anything else (yarn, dynamic, other llama3 factors) would silently differ, so it raises.
    """
    params = dict(
        getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    )
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    out: dict[str, Any] = {
        "position_embedding_type": "rope",
        "rotary_base": int(theta),
        "rotary_percent": float(getattr(hf_config, "partial_rotary_factor", None) or 1.0),
    }
    if rope_type == "llama3":
        if any(float(params.get(k, v)) != v for k, v in _LLAMA3_FIXED.items()):
            raise NotImplementedError(
                f"megatron-core hard-codes llama3 RoPE factors {_LLAMA3_FIXED}; got {params}"
            )
        out.update(rope_scaling=True, rope_scaling_factor=float(params["factor"]))
    elif rope_type != "default":
        raise NotImplementedError(f"RoPE type {rope_type!r} is not supported by this mapping")
    return out


def transformer_config_from_hf(
    hf_config: Any,
    tp: int = 1,
    pp: int = 1,
    params_dtype: torch.dtype = torch.float32,
    use_cpu_initialization: bool | None = None,
    **overrides: Any,
) -> TransformerConfig:
    """The TransformerConfig for an HF Qwen2/Qwen3/Llama config (fusions off, dropout 0)."""
    if getattr(hf_config, "use_sliding_window", False):
        raise NotImplementedError("sliding-window attention is not mapped to megatron")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise NotImplementedError(f"hidden_act={hf_config.hidden_act!r}: only silu (SwiGLU) is mapped")
    layout = layout_from_hf_config(hf_config)
    if use_cpu_initialization is None:
        use_cpu_initialization = not torch.cuda.is_available()
    kwargs: dict[str, Any] = dict(
        num_layers=layout.num_layers,
        hidden_size=layout.hidden_size,
        num_attention_heads=layout.num_attention_heads,
        num_query_groups=layout.num_query_groups,
        kv_channels=layout.kv_channels,
        ffn_hidden_size=layout.ffn_hidden_size,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=layout.qkv_bias,
        qk_layernorm=layout.qk_layernorm,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        rotary_interleaved=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=use_cpu_initialization,
    )
    kwargs.update(moe_transformer_kwargs(layout, "alltoall" if torch.cuda.is_available() else "allgather"))
    if pp > 1:  # micro-batches differ in samples and length: stages exchange shapes before tensors
        # (megatron refuses variable lengths with the allgather MoE dispatcher, unused by dense models)
        if layout.num_experts and not torch.cuda.is_available():
            raise NotImplementedError("an MoE model at pipeline_parallel > 1 needs megatron's alltoall dispatcher, "
                                      "which needs CUDA: use pipeline_parallel=1 on a CPU")
        kwargs.update(pipeline_dtype=params_dtype, variable_seq_lengths=True, moe_token_dispatcher_type="alltoall")
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def parallel_sizes(trainer_cfg: Any) -> dict[str, int]:
    """TP/PP/CP/EP sizes from ``relax.config.TrainerConfig`` (the ``*_parallel`` fields), as the
    keyword arguments ``init_cpu_distributed`` and megatron's ``initialize_model_parallel`` take."""
    return {"tp": trainer_cfg.tensor_parallel, "pp": trainer_cfg.pipeline_parallel,
            "cp": trainer_cfg.context_parallel, "ep": trainer_cfg.expert_parallel}


def build_gpt_model(
    hf_config: Any,
    tp: int = 1,
    pp: int = 1,
    *,
    params_dtype: torch.dtype = torch.float32,
    use_cpu_initialization: bool | None = None,
    parallel_output: bool = True,
    **config_overrides: Any,
) -> GPTModel:
    """A GPTModel (local spec) for this process's TP/PP rank; parallel state must be initialised."""
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError(
            "megatron parallel state is not initialised (call init_cpu_single_process "
            "or parallel_state.initialize_model_parallel first)"
        )
    have = (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
    )
    if have != (tp, pp):
        raise ValueError(
            f"build_gpt_model(tp={tp}, pp={pp}) but parallel state has tp={have[0]}, pp={have[1]}"
        )
    ep = parallel_state.get_expert_model_parallel_world_size()  # experts split over data-parallel ranks
    cp = parallel_state.get_context_parallel_world_size()  # RoPE and the attention read it from the config
    sizes = {k: v for k, v in (("expert_model_parallel_size", ep), ("context_parallel_size", cp)) if v > 1}
    config = transformer_config_from_hf(hf_config, tp, pp, params_dtype, use_cpu_initialization,
                                        **sizes, **config_overrides)
    layout = layout_from_hf_config(hf_config)
    spec = get_gpt_layer_local_spec(num_experts=layout.num_experts or None, normalization="RMSNorm",
                                    qk_layernorm=layout.qk_layernorm)
    if cp > 1:  # megatron's local attention refuses cp > 1 (relax.trainers.megatron.context_parallel)
        spec.submodules.self_attention.submodules.core_attention = ContextParallelAttention
    # tied embeddings at pp > 1: megatron moves the last stage's embedding copy with .cuda() before
    # syncing it over the embedding group (cpu.py's workaround 7)
    with building_gpt_model(moe=bool(layout.num_experts), tied_stages=pp > 1 and layout.tie_word_embeddings):
        return GPTModel(
            config,
            spec,
            vocab_size=layout.vocab_size,
            max_sequence_length=getattr(hf_config, "max_position_embeddings", 4096),
            pre_process=parallel_state.is_pipeline_first_stage(),
            post_process=parallel_state.is_pipeline_last_stage(),
            parallel_output=parallel_output,
            share_embeddings_and_output_weights=layout.tie_word_embeddings,
            **rope_settings(hf_config),
        )


# ---------------------------------------------------------------- forward and weights


def forward_logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """[b, s] token ids -> [b, s, V] logits (gathered over TP), positions 0..s-1, causal mask."""
    b, s = input_ids.shape
    position_ids = torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, -1)
    mask = causal_attention_mask(s, input_ids.device)
    # TP>1 on CPU: megatron's tensor_parallel/mappings.py allocates gather outputs on
    # torch.cuda.current_device(); answer "cpu" for the duration of this forward.
    with forward_on_cpu():
        return model(input_ids, position_ids, mask, runtime_gather_output=True)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module"):  # DDP, Float16Module
        model = model.module
    return model


def pipeline_stage(model: torch.nn.Module) -> tuple[int, int, bool, bool]:
    """(global index of this stage's first layer, its number of layers, holds the embedding,
    holds the final norm and output layer) of a GPTModel; (0, L, True, True) at pp = 1."""
    gpt = _unwrap(model)
    layers = gpt.decoder.layers
    first = layers[0].layer_number - 1 if len(layers) else get_transformer_layer_offset(gpt.config)
    return first, len(layers), gpt.pre_process, gpt.post_process


def shard_hf(hf_state: dict[str, torch.Tensor], cfg: LayoutConfig,
             stage: tuple[int, int, bool, bool]) -> dict[str, torch.Tensor]:
    """A full HF-named dict (weights, or anything of their shapes: optimizer moments) -> this rank's
    megatron-named part: its TP shard of its PP ``stage`` (``pipeline_stage``), its EP rank's experts."""
    mcore = hf_to_megatron(hf_state, cfg)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp > 1:
        mcore = shard_for_tp(mcore, cfg, tp, parallel_state.get_tensor_model_parallel_rank())
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        mcore = stage_slice(mcore, cfg, *stage)
    return expert_slice(mcore, cfg, parallel_state.get_expert_model_parallel_world_size(),
                        parallel_state.get_expert_model_parallel_rank())


def _gather_by_name(local: dict[str, torch.Tensor], names: list[str], group: Any) -> list[dict[str, torch.Tensor]]:
    """Every rank's ``local[name]`` for ``names`` (same names and shapes on each rank of ``group``),
    one dict per rank in rank order (collective)."""
    parts: list[dict[str, torch.Tensor]] = [{} for _ in range(dist.get_world_size(group))]
    for name in names:
        gathered = [torch.empty_like(local[name]) for _ in parts]
        dist.all_gather(gathered, local[name].contiguous(), group=group)
        for rank, tensor in enumerate(gathered):
            parts[rank][name] = tensor
    return parts


def gather_hf(local: dict[str, torch.Tensor], cfg: LayoutConfig, first_layer: int) -> dict[str, torch.Tensor]:
    """Inverse of :func:`shard_hf`, on every rank (collective): the EP ranks' experts are gathered
    first (within a stage), then stages are merged over the pipeline group (each rank then holds its
    TP rank's shard of every layer), then TP shards are gathered as at pp = 1.
    ``first_layer``: the global index of this stage's first layer."""
    if parallel_state.get_expert_model_parallel_world_size() > 1:
        experts = sorted(n for n in local if local_expert(n) is not None)
        gathered = _gather_by_name(local, experts, parallel_state.get_expert_model_parallel_group())
        local = expert_merge([{**local, **part} for part in gathered], cfg)  # the rest is whole on every EP rank
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if pp > 1:
        device = next(iter(local.values())).device
        stages: list[Any] = [None] * pp
        # CPU copies: a pickled CUDA tensor would unpickle onto the sender's device index
        mine = (first_layer, {k: v.cpu() for k, v in local.items()})
        dist.all_gather_object(stages, mine, group=parallel_state.get_pipeline_model_parallel_group())
        local = {k: v.to(device) for k, v in stage_merge(stages, cfg).items()}
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        local = gather_tp(_gather_by_name(local, sorted(local), parallel_state.get_tensor_model_parallel_group()),
                          cfg)
    return megatron_to_hf(local, cfg)


def load_hf_weights(model: torch.nn.Module, hf_state: dict[str, torch.Tensor], cfg: LayoutConfig) -> None:
    """Copy a full HF state dict into this rank's part of the model: its TP shard of its PP stage."""
    mcore = shard_hf(hf_state, cfg, pipeline_stage(model))
    result = _unwrap(model).load_state_dict(mcore, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("._extra_state")]
    if missing or result.unexpected_keys:
        raise RuntimeError(
            f"megatron model rejected converted weights: missing {missing}, "
            f"unexpected {result.unexpected_keys}"
        )


def export_hf_weights(model: torch.nn.Module, cfg: LayoutConfig) -> dict[str, torch.Tensor]:
    """The full HF state dict of a (TP-sharded, PP-staged) megatron model, as detached copies on every rank."""
    local = {k: v.detach().clone() for k, v in clean_mcore_state(_unwrap(model).state_dict()).items()}
    return gather_hf(local, cfg, pipeline_stage(model)[0])
