"""The actor: RL policy updates on a Hugging Face model, with the algorithm chosen by config.

Per micro-batch the samples' token fields are padded into (n, T) tensors and handed to
``relax.algorithms`` (policy loss, off-policy correction, KL, entropy); the per-token loss
comes back per sample and ``TorchTrainer`` weights it by the configured aggregation over
the whole (all-rank) batch. The proximal policy of decoupled PPO / TIS / icepop is this
model's own logprobs before the update, recomputed here when the batch does not carry them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple

import torch

from relax.algorithms import (
    compute_policy_loss,
    kl_estimate,
    masked_max,
    off_policy_correction,
    topk_forward_kl,
)
from relax.config import AlgorithmConfig, RelaxConfig
from relax.models.lora import adapter_disabled
from relax.trainers.model_parallel import unwrap
from relax.trainers.packing import MicroBatch
from relax.trainers.torch.batch import TEACHER_TOPK_FIELDS, TOPK_FIELDS, RolloutBatch, data_parallel_share
from relax.trainers.torch.encoders import EncoderSchedule
from relax.trainers.torch.forward import PositionReader, compute_logprobs, token_logprobs
from relax.trainers.torch.trainer import StepResult, TorchTrainer, combine_metrics, plan_micro_batches

log = logging.getLogger(__name__)


def pad(values: Sequence[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """(L_i, ...) tensors -> (n, max L, ...) right-padded with zeros."""
    out = torch.zeros(len(values), max(int(v.shape[0]) for v in values), *values[0].shape[1:],
                      dtype=dtype or values[0].dtype)
    for i, v in enumerate(values):
        out[i, : v.shape[0]] = v
    return out


def kl_loss_term(alg: AlgorithmConfig) -> bool:
    """Whether the actor's loss has a KL term (else none, or the KL is in the rewards)."""
    return alg.kl_coef > 0 and not alg.kl_in_reward


def sampled_kl_weight(alg: AlgorithmConfig) -> float:
    """The share of ``kl_coef`` on ``kl_estimator`` over the sampled tokens; the rest is on the top-k KL."""
    return 1.0 - alg.kl_topk_weight if alg.kl_topk else 1.0


def reference_fields(alg: AlgorithmConfig) -> list[str]:
    """The batch fields the KL loss term reads: the top-k pair with ``kl_topk``, ``ref_logprobs``
    for the sampled-token estimator, both when ``kl_topk_weight`` splits the term."""
    return (list(TOPK_FIELDS) if alg.kl_topk else []) + (["ref_logprobs"] if sampled_kl_weight(alg) > 0 else [])


def teacher_fields(alg: AlgorithmConfig) -> list[str]:
    """The batch fields the exact top-k KL to the teacher reads (``algorithm.distill_topk``)."""
    return list(TEACHER_TOPK_FIELDS) if alg.distill_topk else []


def topk_terms(alg: AlgorithmConfig) -> list[tuple[str, float, str]]:
    """Each exact top-k KL term of the loss as (scorer, weight, metric): the reference's (``kl_topk``,
    weight kl_coef * kl_topk_weight) and the teacher's (``distill_topk``, weight distill_coef); the
    batch holds a scorer's pair as ``<scorer>_topk_ids`` / ``<scorer>_topk_logprobs``."""
    return ([("ref", alg.kl_coef * alg.kl_topk_weight, "kl_topk")] if alg.kl_topk and kl_loss_term(alg) else []) + (
        [("teacher", alg.distill_coef, "distill_topk_kl")] if alg.distill_topk else [])


def required_fields(alg: AlgorithmConfig) -> list[str]:
    return (["loss_mask", "old_logprobs", "advantages"] + (reference_fields(alg) if kl_loss_term(alg) else [])
            + teacher_fields(alg))


class PolicyLoss:
    """Per-token policy loss of one micro-batch (the ``TokenLoss`` a TorchTrainer step takes)."""

    def __init__(self, alg: AlgorithmConfig):
        self.alg = alg

    def reader(self, batch: RolloutBatch) -> PositionReader | None:
        """With ``kl_topk`` or ``distill_topk``: the forward reads each position's exact top-k KL to the
        reference and/or the teacher (``topk_terms`` order), (n, R, terms).

        The KL is summed over k inside one batched op, so only a scalar per term and position leaves the
        forward: per-sample (L_i, k) tensors would cost k times the backward copies of the padding."""
        scorers = [scorer for scorer, _, _ in topk_terms(self.alg)]
        if not scorers:
            return None

        def kl_to(scorer: str, indices: list[int], starts: list[int], logp: torch.Tensor) -> torch.Tensor:
            ids, lps = getattr(batch, f"{scorer}_topk_ids"), getattr(batch, f"{scorer}_topk_logprobs")
            rows, k = logp.shape[1], ids[indices[0]].shape[-1]
            at = torch.zeros(*logp.shape[:2], k, dtype=torch.long)
            ref = torch.zeros(*logp.shape[:2], k, dtype=logp.dtype)
            for n, (i, start) in enumerate(zip(indices, starts, strict=True)):
                part = ids[i][start:start + rows]
                at[n, :part.shape[0]] = part
                ref[n, :part.shape[0]] = lps[i][start:start + rows]
            # rows past a sample's end gather token 0 against a scorer log-prob of 0; the mask drops them
            return topk_forward_kl(
                logp.gather(-1, at.to(logp.device)), ref.to(logp.device), torch.ones_like(ref[..., 0])
            )

        def read(indices: list[int], starts: list[int], logp: torch.Tensor) -> torch.Tensor:
            return torch.stack([kl_to(s, indices, starts, logp) for s in scorers], dim=-1)
        return read

    def __call__(
        self,
        mb: MicroBatch,
        logprobs: list[torch.Tensor],
        entropies: list[torch.Tensor] | None,
        batch: RolloutBatch,
        reads: list[torch.Tensor] | None = None,
    ) -> tuple[list[torch.Tensor], dict[str, float]]:
        a = self.alg
        idx = [s.index for s in mb.spans]
        lengths = [s.length for s in mb.spans]
        lp = pad(logprobs)
        mask = pad([batch.loss_mask[i] for i in idx]).to(lp.dtype)
        behav = pad([batch.old_logprobs[i] for i in idx]).to(lp.dtype)
        adv = pad([batch.advantages[i] for i in idx]).to(lp.dtype)
        weights = None
        old = behav
        correction = {}
        if a.off_policy != "none":  # ratio against the proximal policy, behaviour enters as a weight
            old = pad([batch.prox_logprobs[i] for i in idx]).to(lp.dtype)
            corr = off_policy_correction(a.off_policy, old, behav, mask, cap=a.is_cap, level=a.is_level)
            weights, mask, correction = corr.weights, corr.mask, corr.metrics
        loss, metrics = compute_policy_loss(a.policy_loss, lp, old, adv, mask, clip_low=a.clip_low,
                                            clip_high=a.clip_high, dual_clip_c=a.dual_clip_c, is_weights=weights,
                                            seq_clamp=a.gspo_clamp)
        metrics = {**correction, **metrics}  # is_weight_max / kept_frac show what the correction did
        # each term's largest per-token loss: a gradient spike names the term (and so the cause) that made it
        metrics["pg_token_max"] = masked_max(loss.detach().abs(), mask)
        terms = topk_terms(a)
        if terms and reads is None:
            raise ValueError("algorithm.kl_topk / distill_topk read their KL off the forward: pass "
                             "read=PolicyLoss.reader(batch) to TorchTrainer.step (Actor.train_step does)")
        kls = pad(reads) if terms else None  # (n, T, terms): topk_forward_kl per position, from the reader
        for j, (_, weight, name) in enumerate(terms):
            kl = kls[..., j] * mask
            term = weight * kl
            loss = loss + term
            metrics[name] = kl.detach().sum() / mask.sum().clamp(min=1)
            metrics[f"{name}_token_max"] = masked_max(term.detach().abs(), mask)
        if kl_loss_term(a) and sampled_kl_weight(a) > 0:
            ref = pad([batch.ref_logprobs[i] for i in idx]).to(lp.dtype)
            sampled = a.kl_coef * sampled_kl_weight(a) * kl_estimate(lp, ref, a.kl_estimator, a.kl_clamp) * mask
            loss = loss + sampled
            metrics["kl_sampled_token_max"] = masked_max(sampled.detach().abs(), mask)
        if a.entropy_coef > 0 and entropies is not None:
            loss = loss - a.entropy_coef * pad(entropies) * mask
        out = {k: float(v) for k, v in metrics.items()}
        return [loss[k, :n] for k, n in enumerate(lengths)], out


class Actor:
    """Policy model + optimizer; ``train_step`` is one RL update from a rollout batch."""

    def __init__(self, model: torch.nn.Module, cfg: RelaxConfig, pad_id: int = 0):
        t = cfg.trainer
        self.cfg = cfg
        updates = t.mini_batches * t.ppo_epochs  # optimizer steps per RL step: the schedule counts those
        # encoders that thaw later join the optimizer now, frozen (relax.trainers.torch.encoders)
        self.encoders = EncoderSchedule(unwrap(model), t, updates)
        self.trainer = TorchTrainer(
            model,
            lr=t.lr,
            weight_decay=t.weight_decay,
            warmup_steps=t.warmup_steps * updates,
            total_steps=t.total_steps * updates,
            schedule=t.lr_schedule,
            grad_clip=t.grad_clip,
            micro_batch_tokens=t.micro_batch_tokens,
            layout=t.micro_batch_layout,
            pad_id=pad_id,
            aggregation=cfg.algorithm.loss_agg,
            agg_norm=float(cfg.algorithm.loss_agg_norm or cfg.rollout.max_new_tokens),
            nan_policy=t.nan_policy,
            temperature=cfg.rollout.temperature,
            autocast=cfg.model.dtype if cfg.model.dtype != "float32" else None,
            lr_scales=self.encoders.lr_scales,
            ramps=self.encoders.ramps,
        )
        self.encoders.hold(unwrap(model))
        self.loss = PolicyLoss(cfg.algorithm)

    @property
    def model(self) -> torch.nn.Module:
        return self.trainer.model

    def logprobs(self, batch: RolloutBatch) -> list[torch.Tensor]:
        """This policy's logprobs of every token, without gradients (proximal policy, checks)."""
        return compute_logprobs(self.model, self.trainer.micro_batches(batch), len(batch), self.trainer.temperature)

    def _thaw_if_due(self) -> None:
        """Let gradients into the frozen encoders once ``trainer.thaw_encoders_at`` RL steps are done.

        Counted from the scheduler's update count, which checkpoints restore, so a run resumed
        after the thaw point thaws on its first step."""
        thawed = self.encoders.thaw_if_due(unwrap(self.model), self.trainer.scheduler.last_epoch)
        if thawed:
            log.info("thawed encoders %s at RL step %d", thawed, self.encoders.thaw_step)

    def share(self, batch: RolloutBatch) -> RolloutBatch:
        """This data-parallel rank's samples of ``batch`` (all of it on one rank); the loss weights
        still normalise over the whole batch (``token_weights`` sums over the ranks)."""
        rank, world = self.trainer.world
        return batch if world == 1 else batch.select(data_parallel_share(batch.lengths, rank, world))

    def train_step(self, batch: RolloutBatch) -> StepResult:
        """One RL update from ``batch``, the whole step's batch on every rank: each data-parallel
        rank trains on its share of every mini-batch."""
        self._thaw_if_due()
        batch.require(
            required_fields(self.cfg.algorithm),
            f"policy loss {self.cfg.algorithm.policy_loss!r} with off_policy {self.cfg.algorithm.off_policy!r}",
        )
        if self.cfg.algorithm.off_policy != "none" and batch.prox_logprobs is None:
            batch.prox_logprobs = self.logprobs(batch)
        t = self.cfg.trainer
        entropy = self.cfg.algorithm.entropy_coef > 0
        # rows arrive prompt group by prompt group, so contiguous parts keep most groups whole
        n, k = len(batch), min(t.mini_batches, len(batch))
        parts = [self.share(batch.select(list(range(i * n // k, (i + 1) * n // k)))) for i in range(k)]
        if len(parts) == 1 and t.ppo_epochs == 1:
            return self.trainer.step(parts[0], self.loss, with_entropy=entropy, read=self.loss.reader(parts[0]))
        results = [self.trainer.step(part, self.loss, with_entropy=entropy, read=self.loss.reader(part))
                   for _ in range(t.ppo_epochs) for part in parts]
        return merge_results(results)


def merge_results(results: Sequence[StepResult]) -> StepResult:
    """One batch's several optimizer steps reported as one: means of loss, grad norm and metrics
    (maxima of the ``*_max`` metrics)."""
    m = len(results)
    return StepResult(loss=sum(r.loss for r in results) / m, grad_norm=sum(r.grad_norm for r in results) / m,
                      skipped=any(r.skipped for r in results), lr=results[-1].lr,
                      micro_batches=sum(r.micro_batches for r in results), tokens=sum(r.tokens for r in results),
                      metrics=combine_metrics([r.metrics for r in results]))


class ReferenceTopK(NamedTuple):
    """``Reference.topk``'s answer, one entry per sample."""

    ids: list[torch.Tensor]  # (L_i, k) int64: the reference's k likeliest tokens at each position
    logprobs: list[torch.Tensor]  # (L_i, k): their log-probs, descending
    sampled: list[torch.Tensor]  # (L_i,): the log-probs of the tokens the sample holds


class Reference:
    """A frozen copy of the initial policy: reference logprobs for the KL term."""

    def __init__(self, model: torch.nn.Module, micro_batch_tokens: int = 4096, temperature: float = 1.0,
                 layout: str = "bucket"):
        self.model = model.eval().requires_grad_(False)
        self.micro_batch_tokens = micro_batch_tokens
        self.temperature = temperature
        # 'prefix' scores each shared prompt once; the row layouts stay in buckets (no packed kernel here)
        self.layout = layout if layout == "prefix" else "bucket"

    def logprobs(self, batch: RolloutBatch) -> list[torch.Tensor]:
        mbs = plan_micro_batches(batch, self.micro_batch_tokens, self.layout)
        return compute_logprobs(self.model, mbs, len(batch), self.temperature)

    def topk_width(self, k: int) -> int:
        """How many tokens ``topk(batch, k)`` returns per position: k, capped at the vocabulary."""
        return min(k, self.model.get_output_embeddings().out_features)

    @torch.no_grad()
    def topk(self, batch: RolloutBatch, k: int) -> ReferenceTopK:
        """The reference's k most likely tokens at every position of every sample: (L_i, k) ids
        and (L_i, k) log-probs; zero rows where the layout scores nothing (position 0, and the prompt
        in the prefix layout), which the loss mask leaves out anyway. k is capped at V. The same
        forward also gives the sampled tokens' log-probs, (L_i,), as ``logprobs`` would."""
        ids: list[torch.Tensor | None] = [None] * len(batch)
        lps: list[torch.Tensor | None] = [None] * len(batch)
        sampled: list[torch.Tensor | None] = [None] * len(batch)

        def top(indices: list[int], starts: list[int], logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            values, top_ids = torch.topk(logp, min(k, logp.shape[-1]), dim=-1)
            return top_ids, values

        for mb in plan_micro_batches(batch, self.micro_batch_tokens, self.layout):
            out = token_logprobs(self.model, mb, self.temperature, read=top)
            for s, (i, v), lp in zip(mb.spans, out.reads, out.logprobs, strict=True):
                ids[s.index], lps[s.index], sampled[s.index] = i, v, lp
        return ReferenceTopK(ids, lps, sampled)  # type: ignore[arg-type]


class AdapterOffReference(Reference):
    """The KL reference of a LoRA policy: the same model with its adapters bypassed (the frozen base),
    so no second copy of the model is held. Shares the actor's model, which it never freezes."""

    def __init__(self, model: torch.nn.Module, micro_batch_tokens: int = 4096, temperature: float = 1.0,
                 layout: str = "bucket"):
        self.model = unwrap(model)  # past any DDP wrapper: a gradient-free forward on this rank alone
        self.micro_batch_tokens = micro_batch_tokens
        self.temperature = temperature
        self.layout = layout if layout == "prefix" else "bucket"

    def logprobs(self, batch: RolloutBatch) -> list[torch.Tensor]:
        with adapter_disabled(self.model):
            return super().logprobs(batch)

    def topk(self, batch: RolloutBatch, k: int) -> ReferenceTopK:
        with adapter_disabled(self.model):
            return super().topk(batch, k)
