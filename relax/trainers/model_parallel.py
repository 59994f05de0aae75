"""The seam between the one training loop and the backend that splits the model over ranks.

The loop is written once: ``relax.trainers.torch.trainer.TorchTrainer`` (micro-batches, loss
weights, accumulation, clipping, the optimizer step, NaN policy), the actor, critic and reference
around it (``relax.trainers.torch``) and the checkpoint formats (``relax.trainers.checkpoint``).
A backend plugs in by handing the loop its *model*; how that model is split over ranks is told
to the loop through the optional hooks below, looked up by name on the model inside any DDP
wrapper (:func:`hook`). A model that has none of them is plain data parallel:

* **PyTorch** (``trainer.backend=torch``): a Hugging Face model, wrapped in DDP over the data-parallel
  ranks (``relax.trainers.torch.trainer.wrap_ddp``). No hook: every rank of the process group holds
  other data, ``torch.nn.utils.clip_grad_norm_`` gives the global norm, one forward runs per
  micro-batch, ``torch.optim.AdamW`` steps it and ``trainer.pt`` holds its state dict.
* **megatron-core** (``trainer.backend=megatron``): ``relax.trainers.megatron.policy.MegatronPolicy``
  (actor) and ``relax.trainers.megatron.value.MegatronValueModel`` (critic) speak the Hugging Face
  layout through ``forward``/``state_dict`` and implement :class:`ShardedModel`; the policy also
  :class:`LockstepModel` under expert parallelism, :class:`PipelinedModel` at pipeline parallel > 1,
  :class:`ShardWriter` (``trainer.checkpoint_format=sharded``) and ``adamw_class`` under
  ``trainer.distributed_optimizer``.

The two backend packages import nothing of each other (tests/test_layers.py); what both use lives
beside this module (``packing``, ``checkpoint``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from relax.trainers.packing import MicroBatch


class ShardedModel(Protocol):
    """A model whose parameters are split over ranks that hold the same data."""

    def data_parallel_group(self) -> dist.ProcessGroup:
        """The ranks that hold other data: what the loss weights normalise over and the step's
        figures sum over (default: every rank of the process group)."""

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Reduce the gradients over the data-parallel ranks, clip them to a global L2 norm of at most
        ``max_norm`` and return the norm before clipping, as torch's would on the unsharded model."""

    def optimizer_state_to_checkpoint(self, local: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """Per-parameter optimizer state under this module's names -> under the checkpoint's (the
        Hugging Face layout, shards gathered), so a checkpoint resumes at any layout. Collective."""

    def optimizer_state_from_checkpoint(self, saved: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """Inverse of :meth:`optimizer_state_to_checkpoint`: this rank's shards, under this module's names."""


class LockstepModel(Protocol):
    """A model whose forwards exchange tokens between ranks holding other data (expert parallelism):
    those ranks must run as many forwards as each other."""

    def lockstep_micro_batches(self, n: int) -> int:
        """How many forwards this rank runs for its ``n`` micro-batches (collective)."""

    def idle_forward(self) -> torch.Tensor:
        """A zero loss from a forward that only keeps the group in step; its backward does too."""


class PipelineSchedule(Protocol):
    """Forward (and backward) of a model split into pipeline stages over the trainer's micro-batches;
    the callbacks get (micro-batch, its (R, T, V) logits) on the last stage."""

    def forward_backward(self, mbs: Sequence[MicroBatch],
                         loss: Callable[[MicroBatch, torch.Tensor], tuple[torch.Tensor, dict[str, float]]],
                         scale: float = 1.0) -> list[tuple[float, dict[str, float]]]:
        """Every micro-batch's (loss, metrics), on every rank, after back-propagating loss x ``scale``."""

    def forward_only(self, mbs: Sequence[MicroBatch], read: Callable[[MicroBatch, torch.Tensor], Any]) -> list[Any]:
        """``read``'s answer for every micro-batch, on every rank, without gradients."""


class PipelinedModel(Protocol):
    """A pipeline stage: it has no whole-model forward, the loop runs its schedule instead."""

    pipeline_schedule: PipelineSchedule


class ShardWriter(Protocol):
    """A model that writes and reads its own part of a sharded checkpoint (relax.trainers.checkpoint.sharded)."""

    def save_shard(self, url: str, optimizer: torch.optim.Optimizer | None) -> dict[str, Any] | None:
        """Write this rank's part; its meta.json entry, or None for a replica that writes nothing."""

    def shard_head(self) -> dict[str, Any]:
        """What rank 0's ``trainer.pt`` records of the model (layout, parallel sizes)."""

    def load_own_shard(self, url: str, meta: dict[str, Any], head: dict[str, Any],
                       optimizer: torch.optim.Optimizer | None) -> bool:
        """Load this rank's part when the checkpoint has this very layout; False, changing nothing, if not."""


# every hook the loop asks for, by the Protocol that documents it; ``adamw_class`` is the AdamW
# (called as ``torch.optim.AdamW`` is) that should step the model
HOOKS = frozenset(
    {"adamw_class", "pipeline_schedule"}
    | {name for proto in (ShardedModel, LockstepModel, ShardWriter) for name in vars(proto)
       if not name.startswith("_")})


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside DDP/FSDP/compile wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def hook(model: torch.nn.Module, name: str) -> Any:
    """The model's ``name`` hook (one of :data:`HOOKS`), None where it is plain data parallel."""
    if name not in HOOKS:
        raise AttributeError(f"{name!r} is no model-parallel hook; known: {sorted(HOOKS)}")
    return getattr(unwrap(model), name, None)
