"""AdamW through megatron-core's ``DistributedOptimizer``: each data-parallel rank keeps the Adam moments
of only its slice of the weights (ZeRO-1), gradients are reduce-scattered into megatron's contiguous
buffers and the updated slices all-gathered back (``trainer.distributed_optimizer``).

:class:`DistributedAdam` is what the PyTorch trainer drives (relax.trainers.torch.trainer): a
``torch.optim.AdamW`` on the outside, so the learning-rate schedule (``LambdaLR`` over its groups), the
non-finite skip and the checkpoint code stay the backends' one copy, with megatron doing the work:

* construction wraps the policy's ``GPTModel`` in megatron's ``DistributedDataParallel`` (its weights
  move into the contiguous parameter buffer; the policy keeps calling the bare model, whose gradient
  hooks DDP installed) and builds megatron's optimizer over it with the same Adam hyper-parameters;
* ``clip_grad_norm_`` (called by the policy's) finishes the gradients as megatron's training loop does
  (``finalize_model_grads``: the data-parallel reduce-scatter scaled by 1/dp, Qwen3's q/k norms summed
  over tensor-parallel ranks, tied embeddings summed over pipeline stages), then takes megatron's global
  norm and clips by it; ``step`` copies the scheduled learning rate and weight decay into megatron's
  groups and steps them;
* ``state_dict`` / ``load_state_dict`` speak the ordinary AdamW layout (each parameter's moments whole
  over the data-parallel ranks), so the by-name checkpoint (relax.trainers.checkpoint.optim_state)
  resumes with or without this optimizer and at another layout.

Weights stay float32 (bf16 runs autocast, as on the PyTorch backend): megatron's "main" parameters are
then views of the model's, and a checkpoint's weights are the optimizer's. On a CPU megatron's calls run
under relax.trainers.megatron.cpu.megatron_calls_on_cpu (its workaround 9).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from relax.trainers.megatron.cpu import megatron_calls_on_cpu

MOMENTS = ("exp_avg", "exp_avg_sq")


class DistributedAdam(torch.optim.AdamW):
    """``torch.optim.AdamW``'s face over megatron's DistributedOptimizer for ``policy`` (a MegatronPolicy);
    ``params`` are the policy's parameters grouped as relax.trainers.torch.optim.build_optimizer does."""

    def __init__(self, params: Iterable[Any], lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, *, policy: torch.nn.Module):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        super().__init__(params, lr=lr, betas=betas, eps=eps)
        if len({g["lr"] for g in self.param_groups}) > 1:
            raise ValueError("trainer.distributed_optimizer steps every weight at one learning rate; per-module "
                             "lr scales (media encoders) need trainer.distributed_optimizer=false")
        if any(p.dtype != torch.float32 for g in self.param_groups for p in g["params"]):
            raise ValueError("trainer.distributed_optimizer steps float32 weights (bf16 runs autocast over them); "
                             "build the model in float32")
        self.weight_decay = max(g["weight_decay"] for g in self.param_groups)
        gpt = policy.gpt
        # the trainer's losses carry the global token weights (x world), so DDP's 1/dp mean is the sum it
        # wants; the pipeline schedule's per-token-loss flag (relax.trainers.megatron.pipeline) would turn
        # that mean off, and DDP reads it once, here
        per_token, gpt.config.calculate_per_token_loss = gpt.config.calculate_per_token_loss, False
        try:
            with megatron_calls_on_cpu():
                self.ddp = DistributedDataParallel(gpt.config, DistributedDataParallelConfig(
                    use_distributed_optimizer=True, grad_reduce_in_fp32=True), gpt)
        finally:
            gpt.config.calculate_per_token_loss = per_token
        with megatron_calls_on_cpu():
            self.megatron = get_megatron_optimizer(
                OptimizerConfig(optimizer="adam", lr=lr, weight_decay=self.weight_decay, adam_beta1=betas[0],
                                adam_beta2=betas[1], adam_eps=eps, clip_grad=0.0, use_distributed_optimizer=True),
                [self.ddp])
        self._parts = list(getattr(self.megatron, "chained_optimizers", [self.megatron]))
        self._check_decay_groups()

    def _check_decay_groups(self) -> None:
        """megatron decides which weights decay (``wd_mult``: not biases and norms), relax's groups too
        (2-D weights only); a weight they disagree on would step differently on the two backends."""
        if not self.weight_decay:
            return
        decayed = {id(p) for g in self.param_groups if g["weight_decay"] > 0 for p in g["params"]}
        for part in self._parts:
            for p, (index, _) in part.model_param_group_index_map.items():
                if (part.optimizer.param_groups[index]["wd_mult"] > 0) != (id(p) in decayed):
                    raise ValueError(f"megatron's weight-decay groups differ from relax's for a {tuple(p.shape)} "
                                     f"weight: set trainer.distributed_optimizer=false")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Empty megatron's gradient buffers (where DDP's hooks accumulate) and the optimizer's slices."""
        with megatron_calls_on_cpu():
            self.ddp.zero_grad_buffer()
            self.megatron.zero_grad(set_to_none=set_to_none)

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Finish the gradients (collective), clip them to a global L2 norm of at most ``max_norm`` and
        return the norm before clipping, as ``torch.nn.utils.clip_grad_norm_`` over the whole model."""
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        with megatron_calls_on_cpu():
            finalize_model_grads([self.ddp])
            self.megatron.prepare_grads()  # the buffers' slices -> each main parameter's .grad
            norm = float(self.megatron.get_grad_norm())
            if math.isfinite(norm) and math.isfinite(max_norm):
                for part in self._parts:
                    if part.get_parameters():
                        clip_grad_by_total_norm_fp32(part.get_parameters(), max_norm, norm)
        return norm

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """One AdamW update of this rank's slices at the scheduled learning rate, then the all-gather
        that gives every rank the whole updated weights."""
        if closure is not None:
            raise ValueError("DistributedAdam.step takes no closure")
        lr = self.param_groups[0]["lr"]
        for group in self.megatron.param_groups:  # what megatron's own scheduler would set
            group["lr"] = lr * group.get("lr_mult", 1.0)
            group["weight_decay"] = self.weight_decay * group.get("wd_mult", 1.0)
        with megatron_calls_on_cpu():
            self.megatron.step_with_ready_grads()

    def state_dict(self) -> dict[str, Any]:
        """AdamW's state dict with each parameter's moments whole (gathered over its data-parallel
        group: collective)."""
        self.state.update(self._gathered())
        try:
            return super().state_dict()
        finally:
            self.state.clear()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict`: the groups' hyper-parameters, and this rank's slice of every
        parameter's moments into megatron's optimizer."""
        super().load_state_dict(state_dict)
        try:
            for part in self._parts:
                for p, (index, order) in part.model_param_group_index_map.items():
                    saved = self.state.get(p)
                    main = part.optimizer.param_groups[index]["params"][order]
                    part.optimizer.state.pop(main, None)
                    if saved:  # a parameter never stepped keeps no state, as a fresh optimizer
                        r = part._get_model_param_range_map(p)["param"]
                        part.optimizer.state[main] = {
                            "step": saved["step"].detach().clone().float(),
                            **{k: saved[k].detach().reshape(-1)[r.start:r.end].clone().to(main) for k in MOMENTS}}
                        group = part.optimizer.param_groups[index]
                        if "step" in group:  # Apex's FusedAdam (a CUDA install) counts per group
                            group["step"] = int(saved["step"])
        finally:
            self.state.clear()

    def _gathered(self) -> dict[torch.nn.Parameter, dict[str, torch.Tensor]]:
        """Every parameter's whole state, from the slices the data-parallel ranks hold (each element of a
        parameter lives on exactly one rank of its buffer's group, so a sum rebuilds it)."""
        out: dict[torch.nn.Parameter, dict[str, torch.Tensor]] = {}
        order = {p: i for i, p in enumerate(self.ddp.module.parameters())}
        device = next(iter(order)).device  # NCCL reduces CUDA tensors only
        for part in self._parts:
            # every weight of the part's buffers (model_param_gbuf_map has only the ones this rank owns a
            # slice of), in one order on every rank
            params = sorted({p for buffer in part.buffers for p in buffer.params}, key=order.__getitem__)
            starts = [0]
            for p in params:
                starts.append(starts[-1] + p.numel())
            flat = {k: torch.zeros(starts[-1], dtype=torch.float32, device=device) for k in MOMENTS}
            steps = torch.zeros(len(params), dtype=torch.float64, device=device)  # 0: no state on this rank
            for i, p in enumerate(params):
                index, order_in_group = part.model_param_group_index_map.get(p, (None, None))
                if index is None:
                    continue
                group = part.optimizer.param_groups[index]
                state = part.optimizer.state.get(group["params"][order_in_group])
                if not state:
                    continue
                r = part._get_model_param_range_map(p)["param"]
                for k in MOMENTS:
                    flat[k][starts[i] + r.start:starts[i] + r.end] = state[k].detach().float()
                steps[i] = float(state["step"] if "step" in state else group["step"])
            group = part.data_parallel_group
            for k in MOMENTS:
                dist.all_reduce(flat[k], group=group)
            dist.all_reduce(steps, op=dist.ReduceOp.MAX, group=group)
            for i, p in enumerate(params):
                if steps[i] > 0:
                    out[p] = {"step": torch.tensor(float(steps[i])),
                              **{k: flat[k][starts[i]:starts[i + 1]].view_as(p).to(p.device) for k in MOMENTS}}
        return out
