"""Sharded checkpoints of a Megatron actor (``trainer.checkpoint_format=sharded``): each model-parallel
part is written by the rank that holds it, nothing is gathered.

A checkpoint folder holds::

    trainer.pt                      rank 0: LR schedule, RNG states, optimizer hyper-parameters, the
                                    model's LayoutConfig and parallel sizes ("model" is empty)
    shards/tp<t>-pp<p>-ep<e>.pt     one per tensor x pipeline x expert rank: that rank's megatron-named
                                    weights and optimizer state, as it holds them (whole AdamW moments,
                                    gathered over its data-parallel group under the DistributedOptimizer)
    meta.json                       last: every file's sha256 and bytes, ``"format": "sharded"``

Data-parallel replicas write nothing: a part is written by the rank of expert-data-parallel rank 0
that holds it (without experts: data-parallel rank 0). Resuming at the same layout, each rank reads
its own part (``MegatronPolicy.load_own_shard``). Any other reader (another layout, the PyTorch
backend, an ``init_checkpoint``) gets :func:`consolidate`'s gathered state by Hugging Face name, the
same as a ``trainer.pt`` written whole (relax.trainers.checkpoint.trainer_state), merged with the pure
functions of ``relax.trainers.megatron.convert``/``mlp`` (no megatron-core needed). This is
megatron's ``dist_checkpointing`` idea in a format read without unpickling anything but tensors: file
names are computed from the recorded ranks (integers checked against the recorded sizes), never
taken from storage, and every file's sha256 is checked before it is loaded (checkpoint.files).
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.distributed as dist

from relax.trainers.checkpoint.files import (
    CheckpointError,
    read_verified,
    tensor_file,
    write_file,
    write_meta,
)
from relax.trainers.checkpoint.optim_state import moments_to_hf
from relax.trainers.megatron.convert import (
    LayoutConfig,
    gather_tp,
    megatron_to_hf,
    stage_merge,
)
from relax.trainers.megatron.mlp import expert_merge

SHARDED = "sharded"
SIZES = ("tp", "pp", "ep")


@dataclass(frozen=True)
class Place:
    """Where a part sits: its tensor, pipeline and expert parallel ranks, and the global index of
    its pipeline stage's first layer."""

    tp_rank: int
    pp_rank: int
    ep_rank: int
    first_layer: int

    @property
    def file(self) -> str:
        return f"shards/tp{self.tp_rank}-pp{self.pp_rank}-ep{self.ep_rank}.pt"

    @property
    def key(self) -> tuple[int, int, int]:
        return self.tp_rank, self.pp_rank, self.ep_rank


def write_shard(url: str, place: Place, weights: dict[str, torch.Tensor],
                optimizer: dict[str, dict[str, Any]] | None) -> dict[str, Any]:
    """Write one part (its weights and optimizer state by megatron name); returns its meta.json entry."""
    blob = tensor_file({"model": weights, "optimizer": optimizer, "place": asdict(place)})
    return {"place": asdict(place), **write_file(url, place.file, blob)}


def write_sharded(url: str, head: dict[str, Any], entries: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """After every part is written (``entries``: :func:`write_shard`'s): rank 0's ``trainer.pt``
    (``head``), then ``meta.json``."""
    written = write_file(url, "trainer.pt", tensor_file({**head, "model": {}, "format": SHARDED}))
    write_meta(url, {**written, **meta, "format": SHARDED, "shards": entries})
    return url


def every_rank(value: Any) -> list[Any]:
    """``value`` from every rank of the default process group, in rank order (``[value]`` without one)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _int(value: Any, low: int, high: int, what: str, url: str) -> int:
    if type(value) is not int or not low <= value < high:
        raise CheckpointError(f"sharded checkpoint {url} records {what}={value!r}, not an integer in [{low}, {high})")
    return value


def sizes_of(head: dict[str, Any], url: str) -> dict[str, int]:
    """The parallel sizes rank 0 recorded in ``trainer.pt``, checked."""
    sizes = head.get("parallel")
    if not isinstance(sizes, dict) or set(sizes) != set(SIZES):
        raise CheckpointError(f"sharded checkpoint {url} records no parallel sizes {list(SIZES)}")
    return {k: _int(sizes[k], 1, 1 << 16, k, url) for k in SIZES}


def places(url: str, meta: dict[str, Any], sizes: dict[str, int], num_layers: int) -> dict[Place, str]:
    """Every part meta.json lists, with its sha256: one per (tp, pp, ep) rank, none missing or twice."""
    entries = meta.get("shards")
    if not isinstance(entries, list):
        raise CheckpointError(f"meta.json of {url} lists no shards: not a sharded checkpoint this code wrote")
    out: dict[Place, str] = {}
    for entry in entries:
        rec = entry.get("place") if isinstance(entry, dict) else None
        if not isinstance(rec, dict) or set(rec) != {f.name for f in fields(Place)}:
            raise CheckpointError(f"meta.json of {url} lists a shard without its place: {str(entry)[:200]}")
        place = Place(_int(rec["tp_rank"], 0, sizes["tp"], "tp_rank", url), _int(rec["pp_rank"], 0, sizes["pp"],
                      "pp_rank", url), _int(rec["ep_rank"], 0, sizes["ep"], "ep_rank", url),
                      _int(rec["first_layer"], 0, num_layers, "first_layer", url))
        if any(p.key == place.key for p in out):
            raise CheckpointError(f"meta.json of {url} lists {place.file} twice")
        out[place] = entry.get("sha256")
    missing = [Place(t, p, e, 0).file for t, p, e in itertools.product(*(range(sizes[k]) for k in SIZES))
               if not any(q.key == (t, p, e) for q in out)]
    if missing:
        raise CheckpointError(f"sharded checkpoint {url} lacks parts {missing[:4]}: it is incomplete")
    return out


def read_shard(url: str, place: Place, sha256: Any) -> dict[str, Any]:
    """One part, verified, holding the place meta.json says it holds."""
    part = read_verified(url, place.file, sha256)
    if part.get("place") != asdict(place) or not isinstance(part["model"], dict):
        raise CheckpointError(f"checkpoint file {url}/{place.file} holds another part ({part.get('place')})")
    return part


def layout_of(head: dict[str, Any], url: str) -> LayoutConfig:
    """The model layout rank 0 recorded (plain ints and bools), checked."""
    rec, names = head.get("layout"), {f.name: f for f in fields(LayoutConfig)}
    if not isinstance(rec, dict) or not set(rec) <= set(names) or any(type(v) not in (int, bool) for v in rec.values()):
        raise CheckpointError(f"sharded checkpoint {url} records no model layout: not a checkpoint this code wrote")
    return LayoutConfig(**rec)


def merge_parts(parts: dict[Place, dict[str, torch.Tensor]], sizes: dict[str, int],
                cfg: LayoutConfig) -> dict[str, torch.Tensor]:
    """Every part's megatron-named tensors (weights, or anything of their shapes) -> one Hugging Face
    state dict: experts merged within a stage, stages merged, then tensor-parallel shards gathered,
    as ``relax.trainers.megatron.model.gather_hf`` does over the process groups."""
    by_key = {p.key: (p, t) for p, t in parts.items()}
    per_tp = []
    for t in range(sizes["tp"]):
        stages = []
        for p in range(sizes["pp"]):
            group = [by_key[(t, p, e)] for e in range(sizes["ep"])]
            stages.append((group[0][0].first_layer, expert_merge([g[1] for g in group], cfg)))
        per_tp.append(stage_merge(stages, cfg) if sizes["pp"] > 1 else stages[0][1])
    return megatron_to_hf(gather_tp(per_tp, cfg) if sizes["tp"] > 1 else per_tp[0], cfg)


def consolidate(url: str, meta: dict[str, Any], head: dict[str, Any]) -> dict[str, Any]:
    """A sharded checkpoint as the gathered ``trainer.pt`` state (``checkpoint.trainer_state``):
    weights and AdamW moments whole, by Hugging Face name. Every part is verified before any is merged."""
    sizes, cfg = sizes_of(head, url), layout_of(head, url)
    parts = {p: read_shard(url, p, sha) for p, sha in places(url, meta, sizes, cfg.num_layers).items()}
    try:
        weights = merge_parts({p: part["model"] for p, part in parts.items()}, sizes, cfg)
        optimizer = None
        if head.get("optimizer") is not None:
            ordered = list(parts)
            state = moments_to_hf([(parts[p]["model"], parts[p]["optimizer"] or {}) for p in ordered],
                                  lambda locals_: merge_parts(dict(zip(ordered, locals_, strict=True)), sizes, cfg))
            optimizer = {**head["optimizer"], "state": state}
    except (ValueError, KeyError) as e:  # ConversionError is a ValueError
        raise CheckpointError(f"sharded checkpoint {url} does not merge into one model: {e}") from None
    return {"model": weights, "optimizer": optimizer, "scheduler": head.get("scheduler"), "rng": head.get("rng")}
