"""The queue's data contract: the ``rollouts`` topic, its consumer groups, and the fields each role adds.

Every role of a run reads and writes rows of one topic. The rollout commits ``rollout_fields``;
the column roles (advantage, reward, reference, teacher, critic) each add their fields to the same rows
as a consumer group of their own; the actor trains as the group ``actor_train``. A role names
its groups and fields from here, so the contract is read in one place.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from relax.transfer.columns import Field

ROLLOUT_TOPIC = "rollouts"
ADVANTAGE_GROUP = "advantage"
ACTOR_GROUP = "actor_train"
# data.reward_role: the reward role's group, and the columns it adds (the rollout then omits them)
REWARD_GROUP = "reward"
REWARD_FIELDS = (Field("reward", "float32"), Field("error", kind="str"))
# algorithm.reference_role: the reference role's group, and the column it adds
REFERENCE_GROUP = "reference"
REFERENCE_FIELDS = (Field("ref_logprobs", "float32", (None,)),)  # with kl_topk: topk_reference_fields
# on-policy distillation (algorithm.distill_coef): the teacher role's group, and the column it adds
TEACHER_GROUP = "teacher"
TEACHER_FIELDS = (Field("teacher_logprobs", "float32", (None,)),)
# PPO with GAE: the critic's two groups (values for new rows; training on their returns)
CRITIC_VALUES_GROUP = "critic_values"
CRITIC_TRAIN_GROUP = "critic_train"
# what the rollout writes per sample; the advantage role adds ADVANTAGE_FIELDS
ROLLOUT_FIELDS = (
    Field("tokens", "int64", (None,)),
    Field("loss_mask", "int8", (None,)),
    Field("logprobs", "float32", (None,)),
    Field("reward", "float32"),
    Field("prompt_len", "int32"),
    Field("task", kind="str"),
    Field("response", kind="str"),
    Field("error", kind="str"),
    Field("ended", kind="str"),  # why the episode ended (relax.rollout.episodes.ENDINGS)
    # bytes of images/audio an environment returned in later agent turns
    # (relax.services.roles.media.pack_media)
    Field("turn_media", kind="bytes"),
)
ADVANTAGE_FIELDS = (Field("advantages", "float32", (None,)),)


def topk_reference_fields(k: int, scorer: str = "ref") -> tuple[Field, Field]:
    """The reference role's columns with ``algorithm.kl_topk`` (``scorer`` "ref"; the teacher role's
    with ``algorithm.distill_topk``: "teacher"): its k likeliest tokens and their log-probs, (R, k)
    each, for the last R positions of the row (``topk_response_start`` on).

    Why not every position: the prompt's rows are never in the loss, and at k = 32 they were
    nine tenths of the queue (2.9 of 3.0 GB in a 1200-step run of the omni preset)."""
    return Field(f"{scorer}_topk_ids", "int32", (None, k)), Field(f"{scorer}_topk_logprobs", "float32", (None, k))


def topk_response_start(loss_mask: Sequence[Any]) -> int:
    """The first position a top-k column keeps: the row's first trained token (its length when
    nothing is trained). Every earlier position has loss mask 0, so the KL never reads it."""
    nonzero = np.flatnonzero(np.asarray(loss_mask))
    return int(nonzero[0]) if nonzero.size else len(loss_mask)


def scored_rows(ids: Sequence[str], loss_masks: Sequence[Any], columns: dict[str, Sequence[Any]],
                fields: Sequence[Field]) -> dict[str, dict[str, np.ndarray]]:
    """A scorer role's per-token ``columns`` (name -> one tensor per row) as the rows it commits, each
    cast to its ``fields`` dtype; the top-k columns ((None, k) fields) kept from each row's first
    trained token on (``topk_reference_fields``). The reference and the teacher roles commit this way."""
    starts = [topk_response_start(m) for m in loss_masks]
    rows: dict[str, dict[str, np.ndarray]] = {sid: {} for sid in ids}
    for f in fields:
        topk = len(f.shape) == 2
        for sid, value, start in zip(ids, columns[f.name], starts, strict=True):
            rows[sid][f.name] = value[start if topk else 0:].detach().cpu().numpy().astype(f.dtype)
    return rows


def pad_topk_rows(rows: np.ndarray, length: int) -> np.ndarray:
    """A stored (R, k) top-k column back to the row's (length, k), zeros in front: the layout the
    trainer indexes by position. Rows stored whole (R = length) come back unchanged."""
    if rows.shape[0] > length:
        raise ValueError(f"a top-k column of {rows.shape[0]} rows for a row of {length} tokens")
    if rows.shape[0] == length:
        return rows
    return np.concatenate([np.zeros((length - rows.shape[0], *rows.shape[1:]), dtype=rows.dtype), rows])


def rollout_fields(reward_role: bool, turn_rewards: bool = False) -> tuple[Field, ...]:
    """What the rollout commits: without ``reward``/``error`` when the reward role scores; with
    ``turn_rewards`` (algorithm.turn_reward_coef) each token's turn reward (relax.algorithms.turn_rewards)."""
    return (tuple(f for f in ROLLOUT_FIELDS if not reward_role or f.name not in ("reward", "error"))
            + (TURN_REWARD_FIELDS if turn_rewards else ()))


TURN_REWARD_FIELDS = (Field("turn_rewards", "float32", (None,)),)
# with GAE the critic adds per-token values before the advantage role, which adds the returns
VALUE_FIELDS = (Field("values", "float32", (None,)),)
RETURN_FIELDS = (Field("returns", "float32", (None,)),)


def routes_field(layers: int, k: int) -> Field:
    """algorithm.routing_replay: the engine's experts for every position of the row, (L, layers, k)
    int16 (expert ids; -1 where the engine fed no token: the last one), relax.models.moe_routing."""
    return Field("routed_experts", "int16", (None, layers, k))


def routes_column(routes: Any, length: int, sample_id: str, shape: tuple[int, int] | None = None) -> np.ndarray:
    """A trajectory's recorded routes (positions, layers, k) as its row's (length, layers, k) column,
    -1 after the last recorded position. Flat ids (SGLang's wire form) take ``shape`` = (layers, k).
    An error naming the sample when the engine recorded none or too many."""
    if routes is None:
        raise ValueError(f"sample {sample_id!r}: algorithm.routing_replay is on but its engine returned no "
                         f"routed experts; start engines with --enable-return-routed-experts on an MoE model")
    routes = np.asarray(routes, dtype=np.int16)
    if routes.ndim == 1:
        if shape is None or routes.size % (shape[0] * shape[1]):
            raise ValueError(f"sample {sample_id!r}: {routes.size} routed expert ids do not fill whole positions "
                             f"of {shape} (MoE layers, top-k) of this model")
        routes = routes.reshape(-1, *shape)
    if routes.shape[0] > length:
        raise ValueError(f"sample {sample_id!r}: {routes.shape[0]} routed positions for {length} tokens")
    pad = np.full((length - routes.shape[0], *routes.shape[1:]), -1, dtype=np.int16)
    return np.concatenate([routes, pad])
