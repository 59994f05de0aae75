"""Media inputs for training rows: the images, audio and videos a sample's tokens stand for.

Queue rows carry token ids only (an image is 16-64 placeholder tokens there, its pixels
would be ~75 KB per sample and per copy). The snapshot already holds every image and clip,
content-addressed and checksummed, so the actor rebuilds a row's ``pixel_values`` /
``input_features`` from the row's sample id with the same processor the engine used. The
prompt tokens it recomputes must equal the row's: that check catches a processor or
tokenizer that changed between rollout and training.

Media an environment returned in a later agent turn are in no snapshot, so the rollout stores
their bytes with the row (field ``turn_media``, :func:`pack_media`); a row's media are the
prompt's followed by those, in the order their tokens appear.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Sequence
from typing import Any

import torch

from relax.data.samples import Sample
from relax.models.processors import media_features, merge_media
from relax.rollout.prompts import EncodedPrompt, EncodedPromptCache, encode_prompt
from relax.services.queue_contract import pad_topk_rows
from relax.trainers.torch.batch import RolloutBatch
from relax.transfer.consumer import Batch

# queue field -> RolloutBatch field, for the per-token float fields a batch may carry
_FLOAT_FIELDS = {"logprobs": "old_logprobs", "advantages": "advantages", "values": "values", "returns": "returns",
                 "ref_logprobs": "ref_logprobs"}
# the reference's and the teacher's top-k pairs (TOPK_FIELDS), stored from each row's first trained token on
_TOPK_DTYPES = {"ref_topk_ids": torch.long, "ref_topk_logprobs": torch.float32,
                "teacher_topk_ids": torch.long, "teacher_topk_logprobs": torch.float32}


def pack_media(images: Sequence[bytes], audios: Sequence[bytes]) -> bytes:
    """Images and audio clips as one bytes value (empty when there are none): a 4-byte header
    length, a JSON header of item sizes, then the items back to back."""
    if not images and not audios:
        return b""
    header = json.dumps({"images": [len(b) for b in images], "audios": [len(b) for b in audios]}).encode()
    return struct.pack(">I", len(header)) + header + b"".join([*images, *audios])


def unpack_media(data: bytes) -> tuple[list[bytes], list[bytes]]:
    """The inverse of :func:`pack_media`."""
    if not data:
        return [], []
    data = bytes(data)  # the queue hands out read-only views
    (n,) = struct.unpack(">I", data[:4])
    sizes = json.loads(data[4:4 + n])
    items, at = [], 4 + n
    for size in [*sizes["images"], *sizes["audios"]]:
        items.append(bytes(data[at:at + size]))
        at += size
    if at != len(data):
        raise ValueError(f"turn media: {len(data) - at} bytes after the last item (corrupt row)")
    k = len(sizes["images"])
    return items[:k], items[k:]


def sample_id_of(row_id: str) -> str:
    """Rows are named ``<sample id>@<prompt position>.<index>`` (``rollout.trajectory_row``)."""
    return row_id.rsplit("@", 1)[0]


class MediaInputs:
    """Row id + tokens -> the model's media kwargs for that row (None for a text-only sample).

    ``samples`` is the split the rollout drew prompts from; ``load`` reads a media reference
    (``Snapshot.load_media``). Encodings are remembered by sample id (``EncodedPromptCache``),
    since each prompt comes back ``n_samples_per_prompt`` times per batch and again next epoch.
    """

    def __init__(self, samples: Sequence[Sample], tokenizer: Any, processor: Any, load: Callable[[Any], bytes]):
        self.by_id = {s.id: s for s in samples if s.images or s.audios or s.videos}
        self.tokenizer, self.processor, self.load = tokenizer, processor, load
        self.prompts = EncodedPromptCache(self._encode)

    def _encode(self, sample: Sample) -> EncodedPrompt:
        return encode_prompt(sample, [self.load(r) for r in sample.images], [self.load(r) for r in sample.audios],
                             self.tokenizer, self.processor, [self.load(r) for r in sample.videos])

    @property
    def any(self) -> bool:
        return bool(self.by_id)

    def __call__(self, row_id: str, tokens: Sequence[int], prompt_len: int,
                 turn_media: bytes = b"") -> dict[str, torch.Tensor] | None:
        later = None
        if turn_media:
            if self.processor is None:
                raise ValueError(f"row {row_id!r} holds media from an agent turn, but the model takes no media")
            later, _, _ = media_features(*unpack_media(turn_media), self.processor)
        return merge_media(self._prompt_media(row_id, tokens, prompt_len), later)

    def _prompt_media(self, row_id: str, tokens: Sequence[int], prompt_len: int) -> dict[str, torch.Tensor] | None:
        sid = sample_id_of(row_id)
        sample = self.by_id.get(sid)
        if sample is None:
            return None
        enc = self.prompts(sample)
        prompt, media = enc.input_ids, enc.mm_inputs
        if list(tokens[:prompt_len]) != prompt:
            raise ValueError(f"row {row_id!r}: its prompt tokens differ from the ones its sample encodes to now "
                             f"({prompt_len} vs {len(prompt)} tokens); the tokenizer or media processor changed "
                             f"during the run")
        return media


def effective_masks(masks: Sequence[Any], errors: Sequence[str] | None) -> list[Any]:
    """Loss masks with the rows whose reward failed zeroed (zero weight). The rollout zeroes
    them itself when it scores; with the reward role (relax.services.roles.reward) the consumers do."""
    if errors is None:
        return list(masks)
    return [m * 0 if e else m for m, e in zip(masks, errors, strict=True)]


def to_rollout_batch(batch: Batch, media: MediaInputs | None = None) -> RolloutBatch:
    """A consumer group's batch as the trainer's RolloutBatch: tokens, loss mask and policy
    versions, each row's media rebuilt by ``media``, and whichever of ``logprobs`` (as
    ``old_logprobs``), ``advantages``, ``values`` and ``returns`` the batch carries.
    Shared by the actor, the critic and the advantage role's KL reference."""
    f = batch.fields  # shard arrays are read-only views: torch gets its own copies
    rows = None
    turn = f.get("turn_media") or [b""] * len(batch.ids)  # rows committed before the field existed: none
    if media is not None and (media.any or any(turn)):
        rows = [media(rid, t, int(n), m) for rid, t, n, m in zip(batch.ids, f["tokens"], f["prompt_len"], turn,
                                                                   strict=True)]
    floats = {dst: [torch.tensor(x, dtype=torch.float32) for x in f[src]]
              for src, dst in _FLOAT_FIELDS.items() if src in f}
    for name, dtype in _TOPK_DTYPES.items():  # padded back to (L, k): the trainer indexes by position
        if name in f:
            floats[name] = [torch.tensor(pad_topk_rows(x, len(t)), dtype=dtype)
                            for x, t in zip(f[name], f["tokens"], strict=True)]
    if "routed_experts" in f:  # algorithm.routing_replay (relax.models.moe_routing)
        floats["routed_experts"] = [torch.tensor(x, dtype=torch.long) for x in f["routed_experts"]]
    masks = effective_masks(f["loss_mask"], f.get("error"))  # a failed reward (reward role): zero weight
    return RolloutBatch(ids=list(batch.ids), input_ids=[torch.tensor(t, dtype=torch.long) for t in f["tokens"]],
                        loss_mask=[torch.tensor(m, dtype=torch.float32) for m in masks],
                        media=rows if rows is not None and any(r is not None for r in rows) else None,
                        policy_versions=list(batch.policy_versions), **floats)
