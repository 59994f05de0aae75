"""Build a megatron-core ``GPTModel`` from a Hugging Face Qwen2/Qwen3/Llama (or Qwen2-/Qwen3-MoE) config.

Uses the *local* layer spec (plain torch modules, no Transformer Engine or Apex), so the
same model builds on a CUDA cluster and, for tests, on a CPU-only machine. The config
mapping follows docs/megatron.md; the fields that silently change the math when left at
megatron's defaults (add_bias_linear=True, dropout 0.1, learned absolute positions,
LayerNorm, gelu) are all set explicitly.

CPU support (``init_cpu_single_process``) needs three workarounds for megatron-core
0.16.1, which assumes CUDA in places that have nothing to do with the math:

1. ``tensor_parallel/random.py`` ``model_parallel_cuda_manual_seed`` calls
   ``torch.cuda.manual_seed`` and forks CUDA RNG states; we install the inference RNG
   tracker (``initialize_rng_tracker(inference_rng_tracker=True)``) whose ``fork`` is a no-op.
   Dropout is 0 here, so no RNG stream is lost.
2. ``utils.py`` ``GlobalMemoryBuffer.get_tensor`` allocates on ``torch.cuda.current_device()``
   (used by ``DotProductAttention`` for the ``baddbmm`` scores); we swap in a buffer that
   allocates on the CPU.
3. ``rotary_pos_embedding.py`` ``RotaryEmbedding.get_emb`` moves ``inv_freq`` to
   ``torch.cuda.current_device()`` on the first forward; we run it with that call
   answering "cpu".

Also: with ``attention_mask=None`` the torch softmax path builds its causal mask with
``device="cuda"`` (``transformer/utils.py`` ``get_default_causal_mask``), so CPU callers pass
an explicit mask (``causal_attention_mask``), which is what megatron training loops do anyway.

Pipeline parallelism: each stage's GPTModel numbers its layers from 0 (global offset
``decoder.layers[0].layer_number - 1``); load/export slice and merge stages with
``convert.stage_slice`` / ``stage_merge``. With tied embeddings megatron gives the last stage a
copy of the embedding as ``output_layer.weight`` and, while building, all-reduces it over the
embedding group after ``weight.data.cuda()`` (``language_module.py``
``setup_embeddings_and_output_layer``); on CPU that ``.cuda()`` is made a no-op (workaround 4).

MoE without Transformer Engine: ``moe_utils.py``'s router linear tests ``te_general_gemm is not
None``, a name it only defines when TE imports; it is defined as None (workaround 5).
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import random as mcore_random
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from megatron.core.utils import GlobalMemoryBuffer

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
from relax.trainers.megatron.mlp import moe_transformer_kwargs
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
    config = transformer_config_from_hf(
        hf_config, tp, pp, params_dtype, use_cpu_initialization, **config_overrides
    )
    layout = layout_from_hf_config(hf_config)
    if layout.num_experts and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # workaround 5
    spec = get_gpt_layer_local_spec(num_experts=layout.num_experts or None, normalization="RMSNorm",
                                    qk_layernorm=layout.qk_layernorm)
    # tied embeddings at pp > 1: megatron moves the last stage's embedding copy with .cuda() before
    # syncing it over the embedding group; on CPU that move is a no-op (workaround 4)
    cpu_tied = pp > 1 and layout.tie_word_embeddings and not torch.cuda.is_available()
    with mock.patch.object(torch.Tensor, "cuda", lambda t, *a, **k: t) if cpu_tied else contextlib.nullcontext():
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


# ---------------------------------------------------------------- CPU process setup


@contextlib.contextmanager
def cuda_device_as_cpu() -> Iterator[None]:
    """Within the block, ``torch.cuda.current_device()`` answers "cpu" (workarounds 2 and 3).

    Not thread-safe (it swaps a module attribute); meant for CPU-only test processes."""
    with mock.patch.object(torch.cuda, "current_device", lambda: "cpu"):
        yield


class CpuGlobalMemoryBuffer(GlobalMemoryBuffer):
    """megatron's scratch-buffer pool, allocating on the CPU (workaround 2)."""

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):  # type: ignore[override]
        with cuda_device_as_cpu():
            return super().get_tensor(tensor_shape, dtype, name, mem_alloc_context)


def _patch_rope_for_cpu() -> None:
    """Keep RoPE's ``inv_freq`` on the CPU (workaround 3); idempotent, a no-op when CUDA exists."""
    original = RotaryEmbedding.get_emb
    if torch.cuda.is_available() or getattr(original, "_relax_cpu", False):
        return

    @functools.wraps(original)
    def get_emb(self: RotaryEmbedding, *args: Any, **kwargs: Any) -> torch.Tensor:
        with cuda_device_as_cpu():
            return original(self, *args, **kwargs)

    get_emb._relax_cpu = True  # type: ignore[attr-defined]
    RotaryEmbedding.get_emb = get_emb  # type: ignore[method-assign]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_cpu_distributed(
    rank: int = 0,
    world_size: int = 1,
    port: int | None = None,
    *,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    ep: int = 1,
    seed: int = 1234,
) -> None:
    """gloo process group + megatron parallel state + the CPU workarounds, for one rank.

    With world_size > 1 every rank must pass the same ``port``.
    """
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port if port is not None else free_port())
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
    )
    mcore_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)  # workaround 1
    parallel_state._GLOBAL_MEMORY_BUFFER = CpuGlobalMemoryBuffer()  # workaround 2
    _patch_rope_for_cpu()  # workaround 3
    torch.manual_seed(seed)


def init_cpu_single_process(tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, seed: int = 1234) -> None:
    """World size 1 on gloo (127.0.0.1, a free port); megatron then accepts only sizes of 1."""
    init_cpu_distributed(0, 1, None, tp=tp, pp=pp, cp=cp, ep=ep, seed=seed)


def shutdown_distributed() -> None:
    """Undo ``init_cpu_*``: megatron's global parallel state and the process group."""
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------- forward and weights


def forward_logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """[b, s] token ids -> [b, s, V] logits (gathered over TP), positions 0..s-1, causal mask."""
    b, s = input_ids.shape
    position_ids = torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, -1)
    mask = causal_attention_mask(s, input_ids.device)
    # TP>1 on CPU: megatron's tensor_parallel/mappings.py allocates gather outputs on
    # torch.cuda.current_device(); answer "cpu" for the duration of this forward.
    on_cpu = not torch.cuda.is_available()
    with cuda_device_as_cpu() if on_cpu else contextlib.nullcontext():
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
    megatron-named part: its TP shard of its PP ``stage`` (``pipeline_stage``)."""
    mcore = hf_to_megatron(hf_state, cfg)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp > 1:
        mcore = shard_for_tp(mcore, cfg, tp, parallel_state.get_tensor_model_parallel_rank())
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        mcore = stage_slice(mcore, cfg, *stage)
    return mcore


def gather_hf(local: dict[str, torch.Tensor], cfg: LayoutConfig, first_layer: int) -> dict[str, torch.Tensor]:
    """Inverse of :func:`shard_hf`, on every rank (collective): stages are merged over the pipeline
    group first (each rank then holds its TP rank's shard of every layer), then TP shards are
    gathered as at pp = 1. ``first_layer``: the global index of this stage's first layer."""
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if pp > 1:
        device = next(iter(local.values())).device
        stages: list[Any] = [None] * pp
        # CPU copies: a pickled CUDA tensor would unpickle onto the sender's device index
        mine = (first_layer, {k: v.cpu() for k, v in local.items()})
        dist.all_gather_object(stages, mine, group=parallel_state.get_pipeline_model_parallel_group())
        local = {k: v.to(device) for k, v in stage_merge(stages, cfg).items()}
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp > 1:
        group = parallel_state.get_tensor_model_parallel_group()
        shards: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
        for name in sorted(local):
            parts = [torch.empty_like(local[name]) for _ in range(tp)]
            dist.all_gather(parts, local[name].contiguous(), group=group)
            for rank, part in enumerate(parts):
                shards[rank][name] = part
        local = gather_tp(shards, cfg)
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
