"""The Megatron actor's model: a megatron-core ``GPTModel`` behind the interface the PyTorch
trainer drives, so ``trainer.backend=megatron`` trains with megatron-core's layers and the same
loss, aggregation, optimizer and checkpoint code as the PyTorch backend (one place, not a copy).

What the trainer and the actor role see:

* ``forward(input_ids, position_ids, attention_mask)`` returns an object with ``.logits`` (R, T, V),
  like a Hugging Face causal LM. megatron's local ``GPTModel`` derives RoPE positions from the
  sequence length, not from ``position_ids``, so a packed row (samples concatenated, positions
  restarting at 0) is cut into its samples, run as a padded batch with a causal mask, and its
  logits are put back in place: every layout but ``prefix`` gives the same logits as unpacked.
* ``state_dict()`` / ``load_state_dict()`` speak the **Hugging Face layout** (converted exactly by
  ``relax.trainers.megatron.convert``): what the WeightStore publishes for native and SGLang
  engines, what checkpoints hold (so the PyTorch trainer's resume contract carries over bit for
  bit) and what an ``init_checkpoint`` from either backend loads.

Scope (docs/megatron.md): one process at tensor/pipeline/context/expert parallel 1, gloo on CPU
and NCCL on CUDA; the optimizer is the PyTorch trainer's AdamW. Larger layouts are refused by
the config before any work starts (``relax.config_checks``).
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.modules.module import _IncompatibleKeys

from relax.trainers.megatron.convert import LayoutConfig, layout_from_hf_config
from relax.trainers.megatron.model import (
    build_gpt_model,
    causal_attention_mask,
    cuda_device_as_cpu,
    export_hf_weights,
    init_cpu_single_process,
    load_hf_weights,
)


def segments(position_ids: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(row, start, length)`` of every sample in a (R, T) micro-batch: a new sample starts
    wherever the position restarts at 0 (packed rows) and at every row's first token."""
    out = []
    for row, pos in enumerate(position_ids.tolist()):
        starts = [0] + [t for t in range(1, len(pos)) if pos[t] == 0]
        ends = starts[1:] + [len(pos)]
        out += [(row, s, e - s) for s, e in zip(starts, ends, strict=True)]
    return out


class MegatronPolicy(torch.nn.Module):
    """A ``GPTModel`` with a Hugging Face face (module docstring); ``hf_config`` is the config it
    was built from, ``layout`` the HF <-> megatron mapping."""

    def __init__(self, gpt: torch.nn.Module, hf_config: Any):
        super().__init__()
        self.gpt = gpt
        self.hf_config = hf_config
        self.layout: LayoutConfig = layout_from_hf_config(hf_config)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, use_cache: bool = False, **media: Any) -> SimpleNamespace:
        """(R, T) token ids -> ``.logits`` (R, T, V); positions default to 0..T-1 per row. The
        attention mask is implied by the samples (causal within each); media inputs are refused."""
        if media:
            raise ValueError(f"trainer.backend=megatron trains text models; got model inputs {sorted(media)}")
        rows, width = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(width, device=input_ids.device).expand(rows, -1)
        spans = segments(position_ids)
        longest = max(length for _, _, length in spans)
        batch = input_ids.new_zeros(len(spans), longest)
        for k, (row, start, length) in enumerate(spans):
            batch[k, :length] = input_ids[row, start:start + length]
        positions = torch.arange(longest, device=input_ids.device).expand(len(spans), -1)
        # right padding after a causal sample never reaches it: the plain causal mask is exact
        # megatron's tensor-parallel gathers allocate on torch.cuda.current_device(): "cpu" on CPU
        with contextlib.nullcontext() if torch.cuda.is_available() else cuda_device_as_cpu():
            logits = self.gpt(batch, positions, causal_attention_mask(longest, input_ids.device),
                              runtime_gather_output=True)
        out = logits.new_zeros(rows, width, logits.shape[-1])
        for k, (row, start, length) in enumerate(spans):
            out[row, start:start + length] = logits[k, :length]
        return SimpleNamespace(logits=out)

    def data_parallel_group(self) -> dist.ProcessGroup:
        """The ranks that hold other data (not other shards of this model): what the trainer
        normalises the loss over and sums the batch's figures over."""
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_group()

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip the gradients to a global L2 norm of at most ``max_norm`` and return the norm
        before clipping, as ``torch.nn.utils.clip_grad_norm_`` on the unsharded model would:
        sum_p ||g_p||^2 over this rank's tensor-parallel shards plus, on tensor-parallel rank 0
        only, the parameters every rank holds whole (layer norms), summed over the model-parallel
        group. Megatron's own ``get_grad_norm_fp32`` allocates on CUDA, so it is not used."""
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        params = [p for p in self.parameters() if p.grad is not None]
        group = parallel_state.get_model_parallel_group()
        if dist.get_world_size(group) == 1:  # exactly the PyTorch backend's arithmetic
            return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        squares = sum((p.grad.double().pow(2).sum() for p in params if param_is_not_tensor_parallel_duplicate(p)),
                      torch.zeros((), dtype=torch.float64))
        dist.all_reduce(squares, group=group)
        norm = float(squares.sqrt())
        scale = min(1.0, max_norm / (norm + 1e-6))
        for p in params:
            p.grad.mul_(scale)
        return norm

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        """The weights in the Hugging Face layout (detached copies)."""
        if args or kwargs.get("prefix") or kwargs.get("destination") is not None:
            raise TypeError("MegatronPolicy.state_dict() takes no arguments: it is the top-level HF view")
        return export_hf_weights(self.gpt, self.layout)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> _IncompatibleKeys:
        """Load a Hugging Face-layout state dict (a PyTorch-backend checkpoint or published version);
        a tensor of the wrong name or shape is a ConversionError naming it."""
        load_hf_weights(self.gpt, dict(state_dict), self.layout)
        return _IncompatibleKeys([], [])


def init_megatron(seed: int) -> None:
    """megatron's process group and parallel state for one process, once per process: gloo and
    the CPU workarounds without CUDA, NCCL with it."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if parallel_state.model_parallel_is_initialized():
        return
    if not torch.cuda.is_available():
        init_cpu_single_process(seed=seed)
        return
    if not dist.is_initialized():
        import os

        from relax.trainers.megatron.model import free_port

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(seed)


def megatron_policy(hf_model: torch.nn.Module, seed: int = 0) -> MegatronPolicy:
    """The megatron twin of ``hf_model`` (a Qwen2/Qwen3/Llama causal LM): same config, same
    weights (converted exactly), on the same device and dtype."""
    from megatron.core import parallel_state

    param = next(hf_model.parameters())
    init_megatron(seed)  # or a process group the caller set up (tensor parallel over several ranks)
    gpt = build_gpt_model(hf_model.config, tp=parallel_state.get_tensor_model_parallel_world_size(),
                          pp=parallel_state.get_pipeline_model_parallel_world_size(), params_dtype=param.dtype)
    policy = MegatronPolicy(gpt, hf_model.config).to(param.device)
    policy.load_state_dict(hf_model.state_dict())
    return policy
