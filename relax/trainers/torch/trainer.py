"""One optimizer step over a rollout batch: micro-batches, accumulation, data parallel, safety.

Every loss in Relax is a weighted sum of per-token terms, sum_i sum_t w_it * l_it, where the
weights encode the aggregation (token-mean, seq-mean-token-mean, seq-mean-token-sum(-norm))
over the *global* batch: all ranks and all micro-batches. So splitting a batch into
micro-batches or across data-parallel ranks never changes the gradient, only the memory
it takes: 2 gloo processes give the same weights as 1 process on the whole batch.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from relax.trainers.checkpoint.trainer_state import load_checkpoint, save_checkpoint
from relax.trainers.model_parallel import hook, unwrap
from relax.trainers.packing import MicroBatch, lay_out_routes, micro_batches
from relax.trainers.torch.attention import enable_packed_attention
from relax.trainers.torch.batch import RolloutBatch
from relax.trainers.torch.forward import (
    PositionReader,
    TokenOutputs,
    lockstep_fillers,
    span_logprobs,
    token_logprobs,
)
from relax.trainers.torch.optim import build_optimizer
from relax.trainers.torch.prefix import PrefixMicroBatch, plan_prefix

log = logging.getLogger(__name__)
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")

# (micro-batch, per-sample logprobs, per-sample entropies or None, batch) -> per-sample token losses;
# a step given a PositionReader also passes what it read as the keyword ``reads``
TokenLoss = Callable[..., tuple[list[torch.Tensor], dict[str, float]]]


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    skipped: bool
    lr: float
    micro_batches: int
    tokens: int
    metrics: dict[str, float]


def token_weights(masks: Sequence[torch.Tensor], agg: str, norm: float | None = None,
                  group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
    """Per-token weights w_it such that sum w_it * l_it is the ``agg`` mean over the global batch.

    token-mean: m_it / sum m; seq-mean-token-mean: m_it / (|m_i| * N);
    seq-mean-token-sum: m_it / N (verl's, no length divisor); seq-mean-token-sum-norm:
    m_it / (norm * N) with N sequences (Dr.GRPO's constant normalizer). N counts every row over
    the data-parallel ranks, an empty one (a failed or filtered sample) too, as in
    relax.algorithms.aggregation and verl's trainer (its global batch size).
    """
    if agg not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {agg!r}; choose one of {AGGREGATIONS}")
    local = torch.tensor([float(sum(float(m.sum()) for m in masks)), float(len(masks))], dtype=torch.float64)
    if group is not None or (dist.is_available() and dist.is_initialized()):
        dist.all_reduce(local, group=group)
    tokens, seqs = local.tolist()
    if agg == "token-mean":
        return [m.double() / max(tokens, 1.0) for m in masks]  # stays on the masks' device
    if agg == "seq-mean-token-mean":
        return [m.double() / (max(float(m.sum()), 1.0) * max(seqs, 1.0)) for m in masks]
    if agg == "seq-mean-token-sum":
        return [m.double() / max(seqs, 1.0) for m in masks]
    if norm is None:
        raise ValueError("seq-mean-token-sum-norm needs a constant normalizer (e.g. max response length)")
    return [m.double() / (norm * max(seqs, 1.0)) for m in masks]


def plan_micro_batches(batch: RolloutBatch, token_budget: int, layout: str,
                       pad_id: int = 0) -> list[MicroBatch] | list[PrefixMicroBatch]:
    """``batch`` in micro-batches of ``layout``: one of ``packing.LAYOUTS``, or ``prefix`` (prompt
    groups whose shared prompt runs once, ``prefix.plan_prefix``)."""
    if layout == "prefix":
        if batch.routed_experts is not None:
            raise ValueError("routing replay needs full rows: use trainer.micro_batch_layout=pack, bucket or pad")
        return plan_prefix(batch.input_ids, batch.loss_mask, batch.media, token_budget, pad_id)
    mbs = micro_batches(batch.input_ids, token_budget, layout, pad_id, batch.media)
    if batch.routed_experts is not None:
        for mb in mbs:
            mb.routes = lay_out_routes(mb, batch.routed_experts)
    return mbs


def has_media_encoder(model: torch.nn.Module) -> bool:
    """Whether the model has a vision or audio encoder (their attention is bidirectional, so the
    causal per-sample packed kernel must not replace it; such models train on padded rows)."""
    inner = getattr(model, "module", model)
    cfg = getattr(inner, "config", None)
    return any(getattr(cfg, name, None) is not None for name in ("vision_config", "audio_config"))


def wrap_ddp(model: torch.nn.Module) -> torch.nn.parallel.DistributedDataParallel:
    """DistributedDataParallel as TorchTrainer needs it.

    Ranks plan their own micro-batches, so they run different numbers of forward passes;
    DDP's default buffer broadcast is a collective on every forward and would deadlock
    them. Buffers here (rotary frequencies) are deterministic, so nothing is lost.
    """
    ddp = torch.nn.parallel.DistributedDataParallel
    if "forward_sync_buffers" in inspect.signature(ddp.__init__).parameters:  # torch >= 2.13 name
        return ddp(model, forward_sync_buffers=False)
    return ddp(model, broadcast_buffers=False)



def combine_metrics(parts: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """One step's metrics from its parts (micro-batches, or a batch's optimizer steps): the mean
    (a part without the key counts 0), but the max for keys ending in ``_max``: a spike in one
    micro-batch must show at its size, not divided by the number of micro-batches."""
    keys = {k for part in parts for k in part}
    return {k: max(p[k] for p in parts if k in p) if k.endswith("_max") else
            sum(p.get(k, 0.0) for p in parts) / len(parts) for k in keys}

class TorchTrainer:
    """Owns a model, its optimizer and schedule; ``step`` applies one update from a batch."""

    def __init__(self, model: torch.nn.Module, *, lr: float, weight_decay: float = 0.0, warmup_steps: int = 0,
                 total_steps: int = 1, schedule: str = "constant", grad_clip: float = 1.0,
                 micro_batch_tokens: int = 4096, layout: str = "pack", pad_id: int = 0,
                 aggregation: str = "token-mean", agg_norm: float | None = None, nan_policy: str = "skip",
                 temperature: float = 1.0, autocast: str | None = None, lr_scales: dict[str, float] | None = None,
                 ramps: dict[str, tuple[int, int]] | None = None):
        syncs = model.forward_sync_buffers if hasattr(model, "forward_sync_buffers") else \
            getattr(model, "broadcast_buffers", False)
        if syncs:
            raise ValueError("wrap the model with relax.trainers.torch.trainer.wrap_ddp (broadcast_buffers=False): "
                             "ranks run different numbers of micro-batches and would deadlock on buffer broadcasts")
        self.model = model
        self.optimizer, self.scheduler = build_optimizer(unwrap(model), lr, weight_decay, warmup_steps,
                                                         total_steps, schedule, lr_scales, ramps)
        self.grad_clip = grad_clip
        self.micro_batch_tokens = micro_batch_tokens
        # a model with a vision/audio encoder keeps its stock attention, where packed rows would
        # need a dense (T, T) mask: length buckets are the cheaper layout for it
        self.layout = "bucket" if layout == "pack" and has_media_encoder(model) else layout
        self.pad_id = pad_id
        self.aggregation = aggregation
        self.agg_norm = agg_norm
        if nan_policy not in ("skip", "fail"):
            raise ValueError(f"nan_policy must be 'skip' or 'fail', got {nan_policy!r}")
        self.nan_policy = nan_policy
        self.temperature = temperature
        # mixed precision for the forward/backward (bf16 on GPU); master weights and the optimizer stay fp32
        self.autocast = getattr(torch, autocast) if autocast else None
        self.steps_done = 0
        if self.layout == "pack":
            enable_packed_attention(model)

    @property
    def data_group(self) -> dist.ProcessGroup | None:
        """The data-parallel ranks when the model is sharded over others (Megatron's tensor
        parallelism: those ranks hold the same data); None = every rank of the process group."""
        group = hook(self.model, "data_parallel_group")
        return group() if group is not None else None

    @property
    def world(self) -> tuple[int, int]:
        if dist.is_available() and dist.is_initialized():
            group = self.data_group
            return dist.get_rank(group), dist.get_world_size(group)
        return 0, 1

    def micro_batches(self, batch: RolloutBatch) -> list[MicroBatch] | list[PrefixMicroBatch]:
        return plan_micro_batches(batch, self.micro_batch_tokens, self.layout, self.pad_id)

    def step(self, batch: RolloutBatch, token_loss: TokenLoss, with_entropy: bool = False,
             forward: Callable[[torch.nn.Module, MicroBatch], list[torch.Tensor]] | None = None,
             read: PositionReader | None = None) -> StepResult:
        """Forward/backward every micro-batch of this rank's ``batch``, then one optimizer step.

        ``forward`` maps (model, micro-batch) to per-sample outputs (default: token logprobs);
        the critic passes its values. ``read`` (batch indices of ``batch``) reads more off each
        position's distribution; ``token_loss`` then gets it as ``reads=``. A model split into
        pipeline stages (a ``pipeline_schedule``, ``relax.trainers.megatron.pipeline``) runs its
        schedule over the micro-batches instead, with the same per-micro-batch loss."""
        self.model.train()
        _, world = self.world
        weights = token_weights(batch.loss_mask, self.aggregation, self.agg_norm, group=self.data_group)
        mbs = self.micro_batches(batch)
        total = torch.zeros((), dtype=torch.float64)
        parts: list[dict[str, float]] = []
        self.optimizer.zero_grad(set_to_none=True)

        def micro_loss(mb: MicroBatch, out: TokenOutputs) -> tuple[torch.Tensor, dict[str, float]]:
            extra = {"reads": out.reads} if read is not None else {}
            losses, m = token_loss(mb, out.logprobs, out.entropies, batch, **extra)
            return sum((loss.double() * weights[s.index]).sum() for s, loss in zip(mb.spans, losses, strict=True)), m

        pipeline = hook(self.model, "pipeline_schedule")
        if pipeline is not None:
            if forward is not None:
                raise ValueError("a pipelined model trains on token log-probs only; the critic's custom forward "
                                 "needs pipeline_parallel=1")
            with self._precision():  # losses and metrics of the last stage, on every rank
                done = pipeline.forward_backward(mbs, lambda mb, logits: micro_loss(
                    mb, span_logprobs(logits, mb, self.temperature, with_entropy, read)), scale=world)
            for mb_loss, m in done:
                total += mb_loss
                parts.append(m)
        else:
            fillers = lockstep_fillers(self.model, len(mbs))  # before the first forward: counted collectively
            for k, mb in enumerate(mbs):
                sync = k == len(mbs) - 1
                ctx = (
                    self.model.no_sync() if (not sync and hasattr(self.model, "no_sync")) else contextlib.nullcontext()
                )
                with ctx, self._precision():
                    if forward is None:
                        out = token_logprobs(self.model, mb, self.temperature, with_entropy, read)
                    else:
                        out = TokenOutputs(forward(self.model, mb))
                    mb_loss, m = micro_loss(mb, out)
                    # DDP averages gradients over ranks; the weights already normalise globally
                    (mb_loss * world).float().backward()
                total += mb_loss.detach()
                parts.append(m)
            for _ in range(fillers):  # their backward exchanges tokens too
                with self._precision():
                    unwrap(self.model).idle_forward().float().backward()
        metrics = combine_metrics(parts)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(total, group=self.data_group)
        finite = math.isfinite(total.item())
        grad_norm = float("nan")
        if finite:
            limit = self.grad_clip if self.grad_clip > 0 else float("inf")
            clip = hook(self.model, "clip_grad_norm_")  # a sharded model knows its global norm
            if clip is not None:
                grad_norm = clip(limit)
            else:
                params = [p for p in self.model.parameters() if p.grad is not None]
                grad_norm = float(torch.nn.utils.clip_grad_norm_(params, limit))
            finite = math.isfinite(grad_norm)
        if not finite:
            msg = f"non-finite loss/gradient at step {self.steps_done}; samples {batch.ids[:8]}"
            if self.nan_policy == "fail":
                raise FloatingPointError(msg)
            log.warning("%s: step skipped", msg)
            self.optimizer.zero_grad(set_to_none=True)
        lr = self.scheduler.get_last_lr()[0]
        if finite:  # the schedule follows applied updates; a skipped step does not advance it
            self.optimizer.step()
            self.scheduler.step()
        self.steps_done += 1
        return StepResult(float(total), grad_norm, not finite, lr, len(mbs), sum(batch.lengths), metrics)

    def _precision(self):
        if self.autocast is None:
            return contextlib.nullcontext()
        device = next(self.model.parameters()).device.type
        return torch.autocast(device_type=device, dtype=self.autocast)

    def save(self, url: str, meta: dict | None = None) -> str:
        return save_checkpoint(url, self.model, self.optimizer, self.scheduler,
                               {"steps_done": self.steps_done, **(meta or {})})

    def load(self, url: str) -> dict:
        meta = load_checkpoint(url, self.model, self.optimizer, self.scheduler)
        self.steps_done = int(meta.get("steps_done", 0))
        return meta


def sft_loss(mb: MicroBatch, logprobs: list[torch.Tensor], entropies, batch: RolloutBatch):
    """Cross-entropy on demonstration tokens (``loss_mask``): the format warm-start."""
    return [-lp for lp in logprobs], {}
