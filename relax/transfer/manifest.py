"""The state of a topic as a pure function of its commit records.

Every record a writer commits is applied here; the result depends only on *which*
records were applied (the ``heads``: last sequence number per writer log), never on the
order a reader happened to see them in. That is what makes a manifest version a precise
name for a state: ``snapshots/<N>.json`` stores the heads and the folded state, and any
reader that applies the same records gets the same samples, fields and arrival order.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from relax.transfer.errors import StoreError

# <writer id>.<incarnation>/<8-digit seq>.safetensors, as ``Producer._commit`` names them; no component
# can be empty, "." or "..", and nothing is absolute, so a name always stays under the topic's shards/
SHARD_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*(?:\.[A-Za-z0-9_-]+)*/\d{8}\.safetensors")
RECORD_KEYS = ("kind", "shard", "crc32c", "nbytes", "fields", "time")


def check_shard_name(name: Any, where: str) -> str:
    """``name`` if it is a shard name of the layout; else a StoreError naming ``where`` it came from."""
    if not isinstance(name, str) or not SHARD_NAME.fullmatch(name):
        raise StoreError(f"{where} names shard {name!r}, which is not a shard of this topic (<writer key>/<seq>."
                         f"safetensors under its shards/ folder); it was not read, trained on or deleted")
    return name

# (commit time, writer key, seq, index in record): a total order that every reader agrees on
OrderKey = tuple[float, str, int, int]


@dataclass
class SampleMeta:
    """Bookkeeping of one sample; ``locs`` maps each field to the (shard, row) that holds it."""

    id: str
    group: str
    group_size: int
    policy_version: int
    num_tokens: int
    order: OrderKey
    locs: dict[str, tuple[str, int]] = field(default_factory=dict)
    added: dict[str, OrderKey] = field(default_factory=dict)  # commit order of fields added later

    def to_json(self) -> list[Any]:
        return [self.id, self.group, self.group_size, self.policy_version, self.num_tokens, list(self.order),
                {k: list(v) for k, v in self.locs.items()}, {k: list(v) for k, v in self.added.items()}]

    @staticmethod
    def from_json(row: list[Any]) -> SampleMeta:
        sid, group, size, pv, ntok, order, locs, added = row
        return SampleMeta(sid, group, size, pv, ntok, tuple(order), {k: (v[0], v[1]) for k, v in locs.items()},
                          {k: tuple(v) for k, v in added.items()})


@dataclass
class ShardInfo:
    name: str
    crc32c: int
    nbytes: int


@dataclass
class TopicState:
    """All committed samples of a topic, with the fields each one has so far."""

    heads: dict[str, int] = field(default_factory=dict)
    samples: dict[str, SampleMeta] = field(default_factory=dict)
    shards: dict[str, ShardInfo] = field(default_factory=dict)
    # fields committed for ids whose put this state has not seen (yet): order-independence
    pending: dict[str, dict[str, tuple[OrderKey, tuple[str, int]]]] = field(default_factory=dict)
    duplicates: dict[str, list[OrderKey]] = field(default_factory=dict)
    # ids in the order this reader first saw them (not part of the manifest): lets consumers
    # pick up new samples incrementally instead of rescanning everything on every step
    arrivals: list[str] = field(default_factory=list)

    def apply(self, writer_key: str, seq: int, record: dict[str, Any]) -> None:
        """Fold one commit record in. Records of one writer must come in sequence order."""
        expected = self.heads.get(writer_key, -1) + 1
        if seq != expected:
            raise ValueError(f"record {writer_key}/{seq} applied out of order (expected {expected})")
        where = f"record {writer_key}/{seq}"
        if not isinstance(record, dict):
            raise StoreError(f"{where} is malformed: a {type(record).__name__}, not an object")
        missing = [k for k in RECORD_KEYS if k not in record]
        if missing:
            raise StoreError(f"{where} is malformed: no {missing}; the log was altered or torn")
        shard = check_shard_name(record["shard"], where)
        if shard != f"{writer_key}/{seq:08d}.safetensors":  # a writer commits only its own shards
            raise StoreError(f"{where} names shard {shard!r}, not its own {writer_key}/{seq:08d}.safetensors; "
                             f"it was not read, trained on or deleted")
        self.heads[writer_key] = seq
        try:
            self.shards[shard] = ShardInfo(shard, int(record["crc32c"]), int(record["nbytes"]))
            t = float(record["time"])
        except (TypeError, ValueError) as e:
            raise StoreError(f"{where} is malformed: {e}") from None
        if record["kind"] == "put":
            for i, (sid, group, size, pv, ntok) in enumerate(record["samples"]):
                order = (t, writer_key, seq, i)
                meta = SampleMeta(sid, group, size, pv, ntok, order, {f: (shard, i) for f in record["fields"]})
                self._add_sample(meta)
        elif record["kind"] == "fields":
            for i, sid in enumerate(record["ids"]):
                for f in record["fields"]:
                    self._add_field(sid, f, (t, writer_key, seq, i), (shard, i))
        else:
            raise ValueError(f"unknown record kind {record['kind']!r} in {writer_key}/{seq}")

    def _add_sample(self, meta: SampleMeta) -> None:
        old = self.samples.get(meta.id)
        if old is not None:  # the same id put twice: the earlier commit wins on every reader
            keep, lose = (old, meta) if old.order <= meta.order else (meta, old)
            self.duplicates.setdefault(meta.id, []).append(lose.order)
            if keep is old:
                return
            # keep the fields later stages added to this id; drop the losing put's own columns
            for f, order in old.added.items():
                meta.locs[f], meta.added[f] = old.locs[f], order
        if old is None:
            self.arrivals.append(meta.id)
        self.samples[meta.id] = meta
        for f, (order, loc) in self.pending.pop(meta.id, {}).items():
            self._add_field(meta.id, f, order, loc)

    def _add_field(self, sid: str, name: str, order: OrderKey, loc: tuple[str, int]) -> None:
        meta = self.samples.get(sid)
        if meta is None:
            prev = self.pending.setdefault(sid, {}).get(name)
            if prev is None or order < prev[0]:
                self.pending[sid][name] = (order, loc)
            return
        if name in meta.locs and (name not in meta.added or meta.added[name] <= order):
            return  # the earliest commit of a field wins on every reader, whatever order they saw
        meta.locs[name], meta.added[name] = loc, order

    def to_json(self) -> dict[str, Any]:
        return {
            "heads": self.heads,
            **_encode_samples(sorted(self.samples.values(), key=lambda m: m.order)),
            "shards": [[s.name, s.crc32c, s.nbytes] for s in sorted(self.shards.values(), key=lambda s: s.name)],
            "pending": {
                sid: {f: [list(o), list(loc)] for f, (o, loc) in fs.items()} for sid, fs in self.pending.items()
            },
            "duplicates": {k: [list(o) for o in v] for k, v in self.duplicates.items()},
        }

    @staticmethod
    def from_json(d: dict[str, Any]) -> TopicState:
        st = TopicState(heads={k: int(v) for k, v in d["heads"].items()})
        rows = _decode_samples(d) if "tables" in d else [SampleMeta.from_json(row) for row in d["samples"]]
        st.samples = {m.id: m for m in rows}  # stored in order
        st.arrivals = list(st.samples)
        st.shards = {
            check_shard_name(name, "manifest snapshot"): ShardInfo(name, crc, n) for name, crc, n in d["shards"]
        }
        st.pending = {sid: {f: (tuple(o), (loc[0], loc[1])) for f, (o, loc) in fs.items()}
                      for sid, fs in d.get("pending", {}).items()}
        st.duplicates = {k: [tuple(o) for o in v] for k, v in d.get("duplicates", {}).items()}
        return st


# A snapshot holds every sample the topic ever committed, and a run writes one per checkpoint.
# Spelled out, each sample repeats its shard path and writer key once per field (~0.9 kB a
# sample: 180 MB by the last checkpoint of a 1200-step omni-cpu run, 2.2 GB of snapshots in
# all, 7.5 s to write the last). So the snapshot names each writer key, shard and set of
# fields once in ``tables`` and samples point at them by index. Snapshots without ``tables``
# (the spelled-out rows of ``SampleMeta.to_json``) are still read.
def _encode_samples(metas: list[SampleMeta]) -> dict[str, Any]:
    index: dict[str, dict[Any, int]] = {"writers": {}, "shards": {}, "fields": {}}

    def ref(table: str, key: Any) -> int:
        return index[table].setdefault(key, len(index[table]))

    def order(o: OrderKey) -> list[Any]:
        return [o[0], ref("writers", o[1]), o[2], o[3]]

    rows = []
    for m in metas:
        by_loc: dict[tuple[str, int], list[str]] = {}
        for f, loc in m.locs.items():
            by_loc.setdefault(loc, []).append(f)
        by_order: dict[OrderKey, list[str]] = {}
        for f, o in m.added.items():
            by_order.setdefault(o, []).append(f)
        locs = [[ref("fields", tuple(sorted(fs))), ref("shards", loc[0]), loc[1]]
                for loc, fs in sorted(by_loc.items())]
        added = [[ref("fields", tuple(sorted(fs))), *order(o)] for o, fs in sorted(by_order.items())]
        rows.append([m.id, m.group, m.group_size, m.policy_version, m.num_tokens, order(m.order), locs, added])
    return {"tables": {name: [list(k) if name == "fields" else k for k in table] for name, table in index.items()},
            "samples": rows}


def _decode_samples(d: dict[str, Any]) -> list[SampleMeta]:
    writers, shards = d["tables"]["writers"], d["tables"]["shards"]
    fields = [tuple(fs) for fs in d["tables"]["fields"]]

    def order(o: list[Any]) -> OrderKey:
        return (o[0], writers[o[1]], o[2], o[3])

    out = []
    for sid, group, size, pv, ntok, o, locs, added in d["samples"]:
        meta = SampleMeta(sid, group, size, pv, ntok, order(o))
        for fs, shard, row in locs:
            for f in fields[fs]:
                meta.locs[f] = (shards[shard], row)
        for fs, *o_ in added:
            for f in fields[fs]:
                meta.added[f] = order(o_)
        out.append(meta)
    return out
