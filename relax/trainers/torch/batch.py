"""What the trainers consume: one rollout batch as ragged per-sample tensors.

Every per-token field is aligned with ``input_ids`` (prompt + response, length L_i):
``loss_mask[t] = 1`` where token t is trained (response tokens; tool observations and the
prompt are 0), ``old_logprobs[t]`` is the behaviour policy's log-probability of token t
given tokens < t (0 where the mask is 0). Sequence-level fields (``rewards``) are scalars.
Keeping samples ragged lets the packer choose the layout; nothing is padded here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import torch

TOKEN_FIELDS = ("loss_mask", "old_logprobs", "advantages", "ref_logprobs", "prox_logprobs", "values", "returns")
TOPK_FIELDS = ("ref_topk_ids", "ref_topk_logprobs")  # (L_i, k) per sample
TEACHER_TOPK_FIELDS = ("teacher_topk_ids", "teacher_topk_logprobs")  # (L_i, k) per sample
ROUTE_FIELDS = ("routed_experts",)  # (L_i, layers, k) per sample


@dataclass
class RolloutBatch:
    """``input_ids[i]`` is sample i's (L_i,) int64 tokens; every token field is a list of (L_i,) tensors."""

    ids: list[str]
    input_ids: list[torch.Tensor]
    loss_mask: list[torch.Tensor]
    old_logprobs: list[torch.Tensor] | None = None
    advantages: list[torch.Tensor] | None = None
    ref_logprobs: list[torch.Tensor] | None = None
    # algorithm.kl_topk: the reference's k most likely tokens at every position, (L_i, k) ids
    # (int64) and their log-probs (zero rows where nothing was scored)
    ref_topk_ids: list[torch.Tensor] | None = None
    ref_topk_logprobs: list[torch.Tensor] | None = None
    # algorithm.distill_topk: the same pair from the teacher (on-policy distillation)
    teacher_topk_ids: list[torch.Tensor] | None = None
    teacher_topk_logprobs: list[torch.Tensor] | None = None
    prox_logprobs: list[torch.Tensor] | None = None
    # algorithm.routing_replay: the experts the engine routed each position to, (L_i, layers, k)
    # int64 (-1 where none was recorded: the router decides), relax.models.moe_routing
    routed_experts: list[torch.Tensor] | None = None
    values: list[torch.Tensor] | None = None
    returns: list[torch.Tensor] | None = None
    rewards: torch.Tensor | None = None  # (B,)
    # per sample: the model's media inputs (pixel_values/image_grid_thw, input_features/
    # feature_attention_mask) for its image and audio tokens, None for a text-only sample
    media: list[dict[str, torch.Tensor] | None] | None = None
    policy_versions: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        if len(self.ids) != n:
            raise ValueError(f"batch has {len(self.ids)} ids but {n} input_ids")
        if self.media is not None and len(self.media) != n:
            raise ValueError(f"field 'media' has {len(self.media)} entries for {n} samples")
        for name in TOKEN_FIELDS + TOPK_FIELDS + TEACHER_TOPK_FIELDS + ROUTE_FIELDS:
            values = getattr(self, name)
            if values is None:
                continue
            if len(values) != n:
                raise ValueError(f"field {name!r} has {len(values)} entries for {n} samples")
            for sid, v, ids in zip(self.ids, values, self.input_ids, strict=True):
                want = ids.shape if name in TOKEN_FIELDS else (*ids.shape, *v.shape[1:])
                if v.shape != want:
                    raise ValueError(f"sample {sid!r}: {name} has shape {tuple(v.shape)} but input_ids "
                                     f"{tuple(ids.shape)}; token fields align with input_ids")

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def lengths(self) -> list[int]:
        return [int(t.shape[0]) for t in self.input_ids]

    def require(self, names: Sequence[str], why: str) -> None:
        """Fail naming the missing field, e.g. ``values`` for PPO with GAE."""
        missing = [n for n in names if getattr(self, n) is None]
        if missing:
            raise ValueError(f"{why} needs batch field(s) {missing}, which this batch does not carry; "
                             f"present: {[f.name for f in fields(self) if getattr(self, f.name) is not None]}")

    def select(self, indices: Sequence[int]) -> RolloutBatch:
        """The samples at ``indices`` (a data-parallel rank's share)."""
        def pick(v):
            if v is None:
                return None
            if isinstance(v, torch.Tensor):
                return v[list(indices)]
            return [v[i] for i in indices]

        return RolloutBatch(**{f.name: pick(getattr(self, f.name)) for f in fields(self)
                               if f.name != "policy_versions"},
                            policy_versions=[self.policy_versions[i] for i in indices] if self.policy_versions else [])


def data_parallel_share(lengths: Sequence[int], rank: int, world: int) -> list[int]:
    """Rank ``rank``'s sample indices of a batch split over ``world`` data-parallel ranks, balanced by tokens:
    longest first, each to the rank holding the fewest tokens so far (the lower rank on a tie),
    returned in batch order. Every rank computes the same split from the same lengths, so no
    rank needs to be told its share. E.g. lengths (5, 3, 4) over 2 ranks: 5 -> rank 0, 4 -> rank 1,
    3 -> rank 1 (4 < 5): rank 0 gets [0], rank 1 gets [1, 2]."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a data-parallel world of {world}")
    if len(lengths) < world:
        raise ValueError(f"a batch of {len(lengths)} samples cannot give each of {world} data-parallel ranks one; "
                         f"raise rollout.prompts_per_step or lower trainer.data_parallel")
    load, owner = [0] * world, [0] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        owner[i] = min(range(world), key=lambda r: (load[r], r))
        load[owner[i]] += lengths[i]
    return [i for i in range(len(lengths)) if owner[i] == rank]
