"""Pipeline parallelism (pp > 1) for the Megatron actor: megatron-core's 1F1B schedule
(``get_forward_backward_func``) over the PyTorch trainer's micro-batches.

Every rank of a pipeline group plans the same micro-batches from the same batch. The first stage
embeds each micro-batch, every stage runs its layers and sends the hidden states
[s, b, H] on, and the last stage turns its logits back into the micro-batch's (R, T, V) layout and
calls the trainer's loss callback, which returns the micro-batch's loss sum_i sum_t w_it * l_it
exactly as ``TorchTrainer.step`` computes it per micro-batch; the schedule back-propagates it
unscaled (``calculate_per_token_loss=True`` turns off megatron's division by the number of
micro-batches and tokens). The per-micro-batch losses and metrics are then broadcast from the
last stage, so every rank reports the same step.

Shapes: megatron's GPTModel takes RoPE positions from the sequence length, so packed rows are cut
into samples and right-padded (``samples.sample_rows``), as ``MegatronPolicy.forward`` does; at
context parallel > 1 each stage runs its rank's share of those rows and the last stage gathers the
logits whole (``context_parallel.model_rows`` / ``whole_logits``). The
number of samples and their longest length differ between micro-batches, so the model is built
with ``variable_seq_lengths=True`` (``model.transformer_config_from_hf`` at pp > 1): stages send
each tensor's shape before the tensor. Padding every micro-batch to one shape would save that
exchange but run pad tokens through every layer, and the budgeted micro-batches of a batch can
differ in length by the whole response range.

CPU (gloo, megatron-core 0.16.1): gloo runs ``batch_isend_irecv`` (torch 2.13 coalesces
``isend``/``irecv`` for it), so megatron's batched p2p is kept. What needs CUDA is worked around
for the duration of the schedule (``cpu.megatron_calls_on_cpu``, workaround 6): ``p2p_communication.py``
``_communicate_shapes`` / ``_communicate`` allocate on ``torch.cuda.current_device()`` and call
``torch.cuda.synchronize()``; ``schedules.py`` ``forward_backward_pipelining_without_interleaving``
creates ``total_num_tokens`` with ``device="cuda"``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from relax.trainers.megatron.context_parallel import model_rows, whole_logits
from relax.trainers.megatron.cpu import megatron_calls_on_cpu
from relax.trainers.megatron.samples import rows_of
from relax.trainers.packing import MicroBatch

# (micro-batch, its (R, T, V) logits) -> (micro-batch loss, a 0-dim tensor; its metrics)
MicroLoss = Callable[[MicroBatch, torch.Tensor], tuple[torch.Tensor, dict[str, float]]]


class PipelineSchedule:
    """Forward/backward of a ``MegatronPolicy`` at pp > 1 (module docstring). ``TorchTrainer.step``
    runs it instead of its per-micro-batch loop when the model carries one as ``pipeline_schedule``."""

    def __init__(self, policy: torch.nn.Module):
        self.policy = policy
        self.gpt = policy.gpt
        config = self.gpt.config
        if not config.variable_seq_lengths or config.pipeline_dtype is None:
            raise ValueError("the GPTModel needs variable_seq_lengths=True and a pipeline_dtype for the "
                             "trainer's micro-batches; build it with model.build_gpt_model(..., pp=pp)")
        config.calculate_per_token_loss = True  # the callback's loss already carries the global weights

    def forward_backward(self, mbs: Sequence[MicroBatch], loss: MicroLoss,
                         scale: float = 1.0) -> list[tuple[float, dict[str, float]]]:
        """Run every micro-batch through the pipeline and back-propagate ``scale`` x its loss (the
        trainer's data-parallel factor); returns each micro-batch's (loss, metrics) on every rank."""
        if any(not isinstance(mb, MicroBatch) or mb.media for mb in mbs):
            raise ValueError("pipeline parallelism takes text micro-batches of the pack/bucket/pad layouts, "
                             "not the prefix layout or media inputs")
        results: list[tuple[float, dict[str, float]]] = []

        def forward_step(data: Iterator[MicroBatch], model: torch.nn.Module):
            mb = next(data)
            batch, positions, mask, spans, width = model_rows(mb.input_ids, mb.position_ids)
            output = model(batch, positions, mask, runtime_gather_output=True)

            def on_last_stage(logits: torch.Tensor):  # (n, S, V), gathered over TP (and CP: whole_logits)
                value, metrics = loss(mb, rows_of(whole_logits(logits, width), *mb.input_ids.shape, spans))
                results.append((float(value.detach()), metrics))
                # (loss to back-propagate, token count, reported): megatron sums the counts only
                return (value * scale).float(), torch.ones((), dtype=torch.int), {}

            return output, on_last_stage

        longest = max(int(mb.input_ids.shape[1]) for mb in mbs)
        with megatron_calls_on_cpu():
            get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(mbs), model=[self.gpt],
                num_microbatches=len(mbs), seq_length=longest, micro_batch_size=1, forward_only=False)
        self._sync_tied_embedding_grads()
        box: list[Any] = [results]
        dist.broadcast_object_list(box, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                                   group=parallel_state.get_pipeline_model_parallel_group())
        return box[0]

    def forward_only(self, mbs: Sequence[MicroBatch], read: Callable[[MicroBatch, torch.Tensor], Any]) -> list[Any]:
        """``read(mb, logits (R, T, V))`` of every micro-batch without gradients (the reference's or
        the proximal policy's log-probs), computed on the last stage and returned on every rank."""
        results: list[Any] = []

        def forward_step(data: Iterator[MicroBatch], model: torch.nn.Module):
            mb = next(data)
            batch, positions, mask, spans, width = model_rows(mb.input_ids, mb.position_ids)
            output = model(batch, positions, mask, runtime_gather_output=True)

            def on_last_stage(logits: torch.Tensor):
                results.append(read(mb, rows_of(whole_logits(logits, width), *mb.input_ids.shape, spans)))
                return torch.zeros(()), torch.ones((), dtype=torch.int), {}

            return output, on_last_stage

        longest = max(int(mb.input_ids.shape[1]) for mb in mbs)
        with megatron_calls_on_cpu(), torch.no_grad():
            get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(mbs), model=[self.gpt],
                num_microbatches=len(mbs), seq_length=longest, micro_batch_size=1, forward_only=True)
        box: list[Any] = [results]
        dist.broadcast_object_list(box, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                                   group=parallel_state.get_pipeline_model_parallel_group())
        return box[0]

    def _sync_tied_embedding_grads(self) -> None:
        """Tied embeddings: the first stage's embedding and the last stage's ``output_layer`` copy each
        got half of the gradient; both need the sum (megatron's ``finalize_model_grads`` does this
        through its DDP buffers, which this trainer does not use)."""
        if getattr(self.policy, "distributed_adam", None) is not None:
            return  # megatron's DistributedOptimizer: finalize_model_grads sums them in its buffers
        gpt = self.gpt
        if not gpt.share_embeddings_and_output_weights or not parallel_state.is_rank_in_embedding_group():
            return
        weight = gpt.shared_embedding_or_output_weight()
        grad = weight.grad if weight.grad is not None else torch.zeros_like(weight)
        dist.all_reduce(grad, group=parallel_state.get_embedding_group())
        weight.grad = grad


def attach_pipeline(policy: torch.nn.Module) -> PipelineSchedule | None:
    """Give a ``MegatronPolicy`` its schedule when pipeline parallelism is on (None at pp = 1)."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return None
    policy.pipeline_schedule = PipelineSchedule(policy)
    return policy.pipeline_schedule
