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

Scope (docs/megatron.md): tensor, pipeline and data parallel over the process group the caller
set up (the actor role's ranks, relax.services.roles.actor_ranks; one process otherwise), gloo
on CPU and NCCL on CUDA; at pipeline parallel > 1 the trainer runs megatron's schedule
(relax.trainers.megatron.pipeline). The optimizer is the PyTorch trainer's AdamW; its state is
checkpointed by Hugging Face name (relax.trainers.checkpoint.optim_state), so a checkpoint resumes
at another layout. Qwen2-/Qwen3-MoE models convert too (relax.trainers.megatron.mlp), and replay the
engine's experts under ``replay_routes`` (replay.py); expert parallelism splits their experts over the
data-parallel ranks (``trainer.expert_parallel``), whose forwards then run in lockstep. Context
parallelism (``trainer.context_parallel``) gives each rank of a context group a zigzag share of every
row (relax.trainers.megatron.context_parallel); the logits are gathered whole for the loss.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import asdict
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch.nn.modules.module import _IncompatibleKeys

from relax.trainers.checkpoint.files import CheckpointError
from relax.trainers.checkpoint.optim_state import (
    load_by_name,
    local_optimizer_state,
    param_names,
    state_from_hf,
    state_to_hf,
)
from relax.trainers.checkpoint.sharded import (
    Place,
    every_rank,
    layout_of,
    places,
    read_shard,
    sizes_of,
    write_shard,
)
from relax.trainers.checkpoint.trainer_state import check_compatible
from relax.trainers.megatron.context_parallel import model_rows, whole_logits
from relax.trainers.megatron.convert import LayoutConfig, clean_mcore_state, layout_from_hf_config
from relax.trainers.megatron.cpu import forward_on_cpu, free_port, init_cpu_single_process
from relax.trainers.megatron.dist_optim import DistributedAdam
from relax.trainers.megatron.model import (
    build_gpt_model,
    export_hf_weights,
    gather_hf,
    load_hf_weights,
    pipeline_stage,
    shard_hf,
)
from relax.trainers.megatron.pipeline import attach_pipeline
from relax.trainers.megatron.replay import replaying, sample_routes
from relax.trainers.megatron.samples import rows_of, widened


def _padding_row_without_gradient(pad: int) -> Any:
    """A forward hook on megatron's word embedding that gives it ``nn.Embedding(padding_idx=pad)``'s
    gradient: a lookup of the pad token adds nothing to that row's gradient. Hugging Face's
    Qwen2/Qwen3/Llama embed with ``padding_idx=config.pad_token_id``, and a policy can sample the
    pad token mid-response (a tiny model often does), so without this the two backends' gradients
    differ in that row. The output layer's gradient to the row (tied embeddings) is untouched, as in HF."""

    def hook(module: torch.nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        is_pad = (args[0] == pad).unsqueeze(-1)  # input ids (b, s) -> (b, s, 1) over output (b, s, H)
        return torch.where(is_pad, output.detach(), output) if bool(is_pad.any()) else output

    return hook


def _is_expert(param: torch.nn.Parameter) -> bool:
    """An expert's weight split over expert-parallel ranks (megatron marks it ``allreduce=False``)."""
    return not getattr(param, "allreduce", True)


class MegatronPolicy(torch.nn.Module):
    """A ``GPTModel`` with a Hugging Face face (module docstring); ``hf_config`` is the config it
    was built from, ``layout`` the HF <-> megatron mapping."""

    def __init__(self, gpt: torch.nn.Module, hf_config: Any):
        super().__init__()
        self.gpt = gpt
        self.hf_config = hf_config
        self.layout: LayoutConfig = layout_from_hf_config(hf_config)
        self._routes: torch.Tensor | None = None  # set by replay_routes
        self.distributed_adam: DistributedAdam | None = None  # set when the trainer builds it
        pad = getattr(hf_config, "pad_token_id", None)
        embedding = getattr(getattr(gpt, "embedding", None), "word_embeddings", None)  # first pipeline stage only
        if pad is not None and embedding is not None:
            embedding.register_forward_hook(_padding_row_without_gradient(int(pad)))

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, use_cache: bool = False, **media: Any) -> SimpleNamespace:
        """(R, T) token ids -> ``.logits`` (R, T, V); positions default to 0..T-1 per row. The
        attention mask is implied by the samples (causal within each); media inputs are refused."""
        if media:
            raise ValueError(f"trainer.backend=megatron trains text models; got model inputs {sorted(media)}")
        if getattr(self, "pipeline_schedule", None) is not None:
            raise RuntimeError("a pipeline stage has no whole-model forward: run the model through its "
                               "pipeline_schedule (TorchTrainer.step and compute_logprobs do)")
        batch, positions, mask, spans, width = model_rows(input_ids, position_ids)  # a padded row per sample
        group = self._lockstep_group()
        if group is not None:  # expert parallel: every rank of the group runs the group's largest shape
            shape = torch.tensor(batch.shape)
            dist.all_reduce(shape, op=dist.ReduceOp.MAX, group=group)
            batch, positions, mask = widened(batch, *shape.tolist())
        replay = contextlib.nullcontext()
        if self._routes is not None:  # R3: the engine's experts, cut into the same rows (replay.py)
            shape = (self.layout.num_experts, self.layout.moe_topk)
            routes = sample_routes(self._routes, spans, batch.shape[1], rows=batch.shape[0])
            replay = replaying(self.gpt, routes, shape)
        # megatron's tensor-parallel gathers allocate on torch.cuda.current_device(): "cpu" on CPU
        with forward_on_cpu(), replay:
            logits = self.gpt(batch, positions, mask, runtime_gather_output=True)
        out = rows_of(whole_logits(logits, width), *input_ids.shape, spans)
        return SimpleNamespace(logits=out)

    def use_distributed_optimizer(self) -> None:
        """Have the trainer step this model with megatron's DistributedOptimizer (dist_optim.py): its
        ``build_optimizer`` then makes a :class:`DistributedAdam`, which wraps ``gpt`` in megatron's DDP."""
        self.adamw_class = self._distributed_adam

    def _distributed_adam(self, params: Any, **adamw: Any) -> DistributedAdam:
        self.distributed_adam = DistributedAdam(params, policy=self, **adamw)
        return self.distributed_adam

    def _lockstep_group(self) -> dist.ProcessGroup | None:
        """The ranks whose forwards exchange tokens (megatron's expert-parallel dispatch: the EP ranks
        hold different data), which must run forwards of one shape in step; None without EP."""
        if not self.layout.num_experts or parallel_state.get_expert_model_parallel_world_size() == 1:
            return None
        return parallel_state.get_expert_tensor_and_model_parallel_group()

    def lockstep_micro_batches(self, n: int) -> int:
        """How many forwards (micro-batches) this rank runs for its ``n``: the most of any rank of its
        expert-parallel group (collective there), n without EP. The trainer fills the difference with
        :meth:`idle_forward`, since each forward's token exchange needs every rank of the group."""
        group = self._lockstep_group()
        if group is None:
            return n
        most = torch.tensor(n)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group)
        return int(most)

    def idle_forward(self) -> torch.Tensor:
        """A forward that only keeps the expert-parallel group in step (one padding token, widened to the
        group's shape): a zero loss whose backward keeps the backward exchanges in step too."""
        param = next(self.parameters())
        return self(torch.zeros(1, 1, dtype=torch.long, device=param.device)).logits.sum() * 0.0

    @contextlib.contextmanager
    def replay_routes(self, routes: torch.Tensor) -> Iterator[None]:
        """Within the block, forwards route with the engine's experts: ``routes`` (R, T, L, k) aligned with
        the (R, T) input (relax.models.moe_routing.replay_routes hands them here)."""
        self._routes = routes
        try:
            yield
        finally:
            self._routes = None

    def data_parallel_group(self) -> dist.ProcessGroup:
        """The ranks that hold other data (not other shards of this model): what the trainer
        normalises the loss over and sums the batch's figures over."""
        return parallel_state.get_data_parallel_group()

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip the gradients to a global L2 norm of at most ``max_norm`` and return the norm
        before clipping, as ``torch.nn.utils.clip_grad_norm_`` on the unsharded model would:
        sum_p ||g_p||^2 over this rank's tensor-parallel shards plus, on tensor-parallel rank 0
        only, the parameters every rank holds whole (layer norms), summed over the model-parallel
        group. Under megatron's DistributedOptimizer its buffers hold the gradients, and it does all this
        (:meth:`DistributedAdam.clip_grad_norm_`)."""
        distributed = getattr(self, "distributed_adam", None)  # the critic calls this on its own module
        if distributed is not None:
            return distributed.clip_grad_norm_(max_norm)
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
        from megatron.core.transformer.module import param_is_not_shared

        tensor = parallel_state.get_tensor_model_parallel_group()
        if dist.get_world_size(tensor) > 1:  # as megatron's finalize_model_grads: a per-head q/k norm (Qwen3) is
            for name, p in self.named_parameters():  # whole on every TP rank but sees only that rank's heads
                if p.grad is not None and ("q_layernorm" in name or "k_layernorm" in name):
                    dist.all_reduce(p.grad, group=tensor)
        experts = [p for p in self.parameters() if _is_expert(p)]
        for p in experts:  # an expert no token reached: a zero gradient, as HF's fused expert tensors get
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        params = [p for p in self.parameters() if p.grad is not None]
        # context-parallel ranks hold the same data, each its tokens' part of the gradient (x cp, context_parallel.py)
        data = parallel_state.get_data_parallel_group(with_context_parallel=True)
        dp = dist.get_world_size(data)
        if dp > 1:  # what megatron's DDP does in finish_grad_sync, unbucketed
            expert_data = parallel_state.get_expert_data_parallel_group() if experts else None
            for p in params:  # each rank's gradient is world x its share's (TorchTrainer.step): the mean is the sum
                # an expert's gradient already holds the tokens of its whole EP group (the dispatch
                # gathered them): summed over the replicas of that expert only, still divided by dp
                group = expert_data if _is_expert(p) else data
                if dist.get_world_size(group) > 1:
                    dist.all_reduce(p.grad, group=group)
                p.grad.div_(dp)
        group = parallel_state.get_model_parallel_group()
        if dist.get_world_size(group) == 1 and not experts:  # exactly the PyTorch backend's arithmetic
            return float(torch.nn.utils.clip_grad_norm_(params, max_norm))

        def squares(chosen: list[torch.nn.Parameter], over: dist.ProcessGroup) -> torch.Tensor:
            total = sum((p.grad.double().pow(2).sum() for p in chosen), torch.zeros((), dtype=torch.float64))
            dist.all_reduce(total, group=over)
            return total

        # param_is_not_shared: the last pipeline stage's copy of tied embeddings counts once, on the first
        dense = [p for p in params if not _is_expert(p) and param_is_not_tensor_parallel_duplicate(p)
                 and param_is_not_shared(p)]
        total = squares(dense, group)
        if experts:  # each expert on one rank of its expert-model-parallel group (megatron's get_grad_norm_fp32)
            total += squares(experts, parallel_state.get_expert_tensor_model_pipeline_parallel_group())
        norm = float(total.sqrt())
        scale = min(1.0, max_norm / (norm + 1e-6))
        for p in params:
            p.grad.mul_(scale)
        return norm

    def optimizer_state_to_checkpoint(self, local: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """Per-parameter optimizer state under this module's names -> under Hugging Face names, moments
        gathered over the shards (relax.trainers.checkpoint.optim_state), so a checkpoint resumes at another
        parallel layout or backend (its ``optimizer_state``). Collective."""
        return state_to_hf(self, {n.removeprefix("gpt."): st for n, st in local.items()})

    def optimizer_state_from_checkpoint(self, saved: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """Inverse of :meth:`optimizer_state_to_checkpoint`: this rank's shards, under this module's names."""
        return {f"gpt.{n}": st for n, st in state_from_hf(self, saved).items()}

    def shard_place(self) -> tuple[Place, dict[str, int]]:
        """This rank's part of the model and the parallel sizes (relax.trainers.checkpoint.sharded)."""
        ps = parallel_state
        sizes = {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
                 "ep": ps.get_expert_model_parallel_world_size()}
        return Place(ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                     ps.get_expert_model_parallel_rank(), pipeline_stage(self.gpt)[0]), sizes

    def shard_head(self) -> dict[str, Any]:
        """What a sharded checkpoint's ``trainer.pt`` records of the model: its layout and parallel sizes."""
        return {"layout": asdict(self.layout), "parallel": self.shard_place()[1]}

    def save_shard(self, url: str, optimizer: torch.optim.Optimizer | None) -> dict[str, Any] | None:
        """Write this rank's part of a sharded checkpoint (its weights and optimizer state by megatron
        name) unless it is a data-parallel replica; returns its meta.json entry, or None. Every rank
        calls it: the DistributedOptimizer gathers a part's moments over its data-parallel group."""
        state = local_optimizer_state(self, optimizer)["state"] if optimizer is not None else None
        if parallel_state.get_expert_data_parallel_rank() != 0:
            return None
        weights = {k: v.detach() for k, v in clean_mcore_state(self.gpt.state_dict()).items()}
        moments = {n.removeprefix("gpt."): st for n, st in state.items()} if state is not None else None
        return write_shard(url, self.shard_place()[0], weights, moments)

    def load_own_shard(self, url: str, meta: dict[str, Any], head: dict[str, Any],
                       optimizer: torch.optim.Optimizer | None) -> bool:
        """Resume from a sharded checkpoint (``meta``, ``head``: its verified meta.json and trainer.pt)
        of this very layout by reading only this rank's part; False, having changed nothing, when the
        layout differs (the caller then loads the consolidated checkpoint)."""
        place, sizes = self.shard_place()
        if sizes_of(head, url) != sizes or layout_of(head, url) != self.layout:
            return False
        if optimizer is not None and head["optimizer"] is not None and len(head["optimizer"]["groups"]) != len(
                optimizer.param_groups):
            return False  # another optimizer layout: the consolidated load names the problem
        found = places(url, meta, sizes, self.layout.num_layers)
        mine = next(p for p in found if p.key == place.key)  # places() checked that every part is listed
        try:
            part = read_shard(url, mine, found[mine])
            check_compatible(part["model"], clean_mcore_state(self.gpt.state_dict()), f"{url}/{mine.file}")
            error = None
        except CheckpointError as e:
            error = str(e)
        # every rank reads another file: all fail alike (the run skips the checkpoint) or none applies it
        errors = [e for e in every_rank(error) if e]
        if errors:
            raise CheckpointError(errors[0])
        self.gpt.load_state_dict(part["model"], strict=False)
        if optimizer is not None and head["optimizer"] is not None:
            stepped = {f"gpt.{n}": st for n, st in (part["optimizer"] or {}).items()}
            load_by_name(optimizer, head["optimizer"], stepped, param_names(self, optimizer))
        return True

    def to_hf(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's megatron-named tensors of the weights' shapes -> the full HF-named dict (collective)."""
        return gather_hf(local, self.layout, pipeline_stage(self.gpt)[0])

    def from_hf(self, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A full HF-named dict of the weights' shapes -> this rank's megatron-named part."""
        return shard_hf(hf, self.layout, pipeline_stage(self.gpt))

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
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if parallel_state.model_parallel_is_initialized():
        return
    if not torch.cuda.is_available():
        init_cpu_single_process(seed=seed)
        return
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(seed)


def megatron_policy(hf_model: torch.nn.Module, seed: int = 0, routing_replay: bool = False,
                    distributed_optimizer: bool = False) -> MegatronPolicy:
    """The megatron twin of ``hf_model`` (a Qwen2/Qwen3/Llama causal LM, dense or MoE): same config, same
    weights (converted exactly), on the same device and dtype. ``routing_replay``: MoE routers that can
    replay the engine's experts (:meth:`MegatronPolicy.replay_routes`, algorithm.routing_replay);
    ``distributed_optimizer``: the trainer steps it with megatron's DistributedOptimizer."""
    param = next(hf_model.parameters())
    init_megatron(seed)  # or a process group the caller set up (tensor parallel over several ranks)
    gpt = build_gpt_model(hf_model.config, tp=parallel_state.get_tensor_model_parallel_world_size(),
                          pp=parallel_state.get_pipeline_model_parallel_world_size(), params_dtype=param.dtype,
                          **({"moe_enable_routing_replay": True} if routing_replay else {}))
    policy = MegatronPolicy(gpt, hf_model.config).to(param.device)
    policy.load_state_dict(hf_model.state_dict())

    attach_pipeline(policy)  # pp > 1: the trainer runs megatron's schedule instead of forward()
    if distributed_optimizer:
        policy.use_distributed_optimizer()
    return policy
