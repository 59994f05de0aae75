"""TransferQueue: a durable, versioned sample queue on any fsspec URL.

Layout of one topic (``<root>/runs/<run_id>/queue/<topic>/``)::

    schema/<writer>.json        fields each writer declared (the topic schema is their union)
    shards/<writer>.<inc>/<seq>.safetensors   immutable column shards (CRC-32C in the record)
    log/<writer>.<inc>/<seq>.json             commit records, one writer incarnation each
    leases/<writer>.json                      who may write as <writer> right now
    cursors/<group>/...                       consumer-group records (consumer.py)
    snapshots/<N>.json                        compacted manifest versions

A sample becomes visible when its commit record exists; the record is written after its
shard, so a crash at any instant leaves either an invisible orphan shard or a committed,
checksummed one. See docs/transfer.md for the API and the invariants.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import google_crc32c

from relax import liveness, objstore
from relax.transfer.columns import RESERVED, Field, TopicSchema, decode_shard, encode_shard
from relax.transfer.errors import SchemaError, StoreError
from relax.transfer.manifest import TopicState, check_shard_name
from relax.transfer.polling import Backoff
from relax.transfer.writers import (
    RecordLog,
    WriterLease,
    check_writer_id,
    read_record_range,
    read_records,
    split_key,
)

log = logging.getLogger(__name__)


class Notifier(Protocol):
    """Wakes waiting consumers when a producer commits to a topic.

    The store stays the truth: a notification only cuts short the wait before the next
    poll, so a lost or spurious one costs latency, never data. The default works inside
    one process; the services layer may pass one that spans a Ray cluster.
    """

    def notify(self, topic_url: str) -> None: ...

    def wait(self, topic_url: str, timeout: float) -> None: ...


class InProcessNotifier:
    """Producers and consumers of the same topic in one process (colocated roles, tests)."""

    def __init__(self) -> None:
        self._conds: dict[str, threading.Condition] = {}
        self._lock = threading.Lock()

    def _cond(self, url: str) -> threading.Condition:
        with self._lock:
            return self._conds.setdefault(url, threading.Condition())

    def notify(self, topic_url: str) -> None:
        cond = self._cond(topic_url)
        with cond:
            cond.notify_all()

    def wait(self, topic_url: str, timeout: float) -> None:
        cond = self._cond(topic_url)
        with cond:
            cond.wait(timeout)


IN_PROCESS = InProcessNotifier()


def checksum(blob: bytes) -> int:
    """CRC-32C: hardware-accelerated (~25 GB/s here, 4x zlib's crc32), so verifying every shard
    on every read costs little next to the I/O. (It takes only ``bytes``, not buffer views.)"""
    return google_crc32c.value(blob)


def topic_url(root: str, run_id: str, topic: str) -> str:
    return objstore.join(objstore.absolute_url(root), "runs", run_id, "queue", topic)


class TransferQueue:
    """A reader of one topic, and the factory of its producers and consumer groups."""

    @classmethod
    def from_config(cls, cfg: Any, topic: str, **kwargs: Any) -> TransferQueue:
        """The topic ``topic`` of the run a ``RelaxConfig`` describes (root, run id, queue knobs)."""
        q = cfg.queue
        return cls(cfg.root, cfg.run_id, topic, poll_interval_s=q.poll_interval_s,
                   max_poll_interval_s=q.max_poll_interval_s, fsync=q.fsync, lease_timeout_s=q.lease_timeout_s,
                   **kwargs)

    def __init__(self, root: str, run_id: str, topic: str, *, poll_interval_s: float = 0.05,
                 max_poll_interval_s: float = 1.0, fsync: bool = False, lease_timeout_s: float = 30.0,
                 cache_bytes: int = 256 << 20, notifier: Notifier = IN_PROCESS):
        self.url = topic_url(root, run_id, topic)
        self.notifier = notifier
        self.topic = topic
        self.poll_interval_s = poll_interval_s
        self.max_poll_interval_s = max_poll_interval_s
        self.fsync = fsync
        self.lease_timeout_s = lease_timeout_s
        self.state = TopicState()
        self.snapshot_version = 0
        self._base: tuple[int, int] | None = None  # the latest full snapshot: (version, samples in it)
        self._cache: OrderedDict[str, dict[str, list[Any]]] = OrderedDict()
        self._cache_bytes = cache_bytes
        self._cached = 0
        try:
            self._load_latest_snapshot()
        except OSError as e:
            raise StoreError(f"cannot open topic at {self.url}: {e}; check that the root is a writable "
                             f"folder or bucket") from None

    # -- schema ---------------------------------------------------------------------------
    def schema(self) -> TopicSchema:
        merged = TopicSchema(())
        for name in objstore.list_dir(objstore.join(self.url, "schema")):
            declared = json.loads(objstore.read_bytes(objstore.join(self.url, "schema", name)))
            merged = merged.merge(TopicSchema.from_json(declared))
        return merged

    # -- producing ------------------------------------------------------------------------
    def producer(self, writer_id: str, fields: Sequence[Field], tokens_field: str | None = "tokens") -> Producer:
        """The only writer of ``writer_id``'s log; declares the fields it writes."""
        return Producer(self, writer_id, TopicSchema(tuple(fields)), tokens_field)

    # -- reading --------------------------------------------------------------------------
    def refresh(self) -> int:
        """Apply every commit record written since the last refresh; returns how many."""
        applied = 0
        for key in objstore.list_dir(objstore.join(self.url, "log")):
            start = self.state.heads.get(key, -1) + 1
            for seq, record in read_records(objstore.join(self.url, "log", key), start):
                self.state.apply(key, seq, record)
                applied += 1
        return applied

    def check_gaps(self) -> None:
        """Raise a StoreError when a writer's log has records after one that is missing.

        Readers apply a log in order and stop at the first record that does not exist, which is
        also how a record not yet written looks; only a listing tells a lost record apart. So this
        runs where waiting has failed (a consumer's timeout) and when a topic is opened, never per poll."""
        for key in objstore.list_dir(objstore.join(self.url, "log")):
            head = self.state.heads.get(key, -1)
            later = sorted(int(n[:-5]) for n in objstore.list_dir(objstore.join(self.url, "log", key))
                           if n.endswith(".json") and n[:-5].isdigit() and int(n[:-5]) > head + 1)
            if later and not objstore.exists(objstore.join(self.url, "log", key, f"{head + 1:08d}.json")):
                missing = [s for s in range(head + 1, later[0])]
                raise StoreError(f"topic {self.topic}: log {key} is missing records {missing[:10]}"
                                 f"{' ...' if len(missing) > 10 else ''} while {len(later)} later ones exist "
                                 f"(from {later[0]}); the store lost data: restore those files, or fork the run "
                                 f"from its last checkpoint")

    def wait_for_new(self, timeout: float) -> bool:
        """Block until new records arrive or ``timeout`` passes; polls with backoff (polling.py)."""
        liveness.mark(liveness.WAITING)  # also when records are there at once: a busy consumer is not hung
        deadline = time.monotonic() + timeout
        backoff = Backoff(self.poll_interval_s, max(self.poll_interval_s, self.max_poll_interval_s))
        while True:
            if self.refresh():
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.notifier.wait(self.url, min(backoff.next(), left))

    def read(self, ids: Sequence[str], fields: Sequence[str]) -> dict[str, list[Any]]:
        """Values of ``fields`` for ``ids`` (in that order), checksums verified.

        Raises ``StoreError`` naming the shard if one is missing or corrupt; consumer groups
        catch it, record the samples as dropped and go on.
        """
        out: dict[str, list[Any]] = {f: [] for f in fields}
        for sid in ids:
            meta = self.state.samples[sid]
            for f in fields:
                shard, row = meta.locs[f]
                out[f].append(self.load_shard(shard)[f][row])
        return out

    def load_shard(self, name: str) -> dict[str, list[Any]]:
        """The decoded columns of one committed shard, checksum-verified (cached, LRU by bytes)."""
        if name in self._cache:
            self._cache.move_to_end(name)
            return self._cache[name]
        info = self.state.shards.get(check_shard_name(name, f"topic {self.url}"))
        if info is None:
            raise StoreError(f"shard {name} is named by a sample but committed by no record of {self.url}")
        try:
            blob = objstore.read_bytes(objstore.join(self.url, "shards", name))
        except FileNotFoundError:
            raise StoreError(f"shard {name} is missing (deleted by retention, or the store lost it)") from None
        if len(blob) != info.nbytes or checksum(blob) != info.crc32c:
            raise StoreError(f"shard {name} is corrupt: {len(blob)} bytes, crc32c {checksum(blob)} "
                             f"(committed: {info.nbytes} bytes, crc32c {info.crc32c})")
        _, columns = decode_shard(blob, name)
        self._cache[name] = columns
        self._cached += len(blob)
        while self._cached > self._cache_bytes and len(self._cache) > 1:
            old, _ = self._cache.popitem(last=False)
            self._cached -= self.state.shards[old].nbytes
        return columns

    # -- manifest versions ----------------------------------------------------------------
    def compact(self, writer_id: str = "compactor") -> int:
        """Write ``snapshots/<N+1>.json`` and return N+1: the heads and the folded state, or, while
        the topic holds fewer than twice the samples of the last full snapshot, the heads and
        that snapshot's version only (a *delta*: the state is the base plus the log records up
        to the heads). Every snapshot holds the whole topic, so writing each one in full would
        cost a run time quadratic in its length; with deltas the full ones add up to at most
        twice the final state, and opening a topic folds at most the records since the base."""
        lease = WriterLease(objstore.join(self.url, "leases"), writer_id, self.lease_timeout_s).acquire()
        try:
            self.refresh()
            latest = self._snapshot_versions()
            version = (latest[-1] if latest else 0) + 1
            body: dict[str, Any] = {"version": version, "topic": self.topic, "time": time.time()}
            if self._base is not None and len(self.state.samples) < 2 * self._base[1]:
                body.update(heads=dict(self.state.heads), base=self._base[0])
            else:
                body.update(self.state.to_json())
                self._base = (version, len(self.state.samples))
            objstore.write_bytes(objstore.join(self.url, "snapshots", f"{version:08d}.json"),
                                 json.dumps(body, separators=(",", ":")).encode(), fsync=self.fsync)
            self.snapshot_version = version
            return version
        finally:
            lease.release()

    def state_at(self, version: int) -> TopicState:
        """The manifest of snapshot ``version`` (what a checkpoint names)."""
        return self._read_snapshot(version)[0]

    def _read_snapshot(self, version: int) -> tuple[TopicState, tuple[int, int]]:
        """The state of snapshot ``version`` and its full base (version, sample count)."""
        where = objstore.join(self.url, "snapshots", f"{version:08d}.json")
        try:
            body = json.loads(objstore.read_bytes(where))
        except FileNotFoundError:
            raise StoreError(f"topic {self.topic}: no manifest version {version} "
                             f"(have {self._snapshot_versions()})") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise StoreError(f"manifest snapshot {where} is not valid JSON ({e}): torn or altered") from None
        if "base" not in body:
            try:
                state = TopicState.from_json(body)
            except (KeyError, TypeError, ValueError) as e:
                raise StoreError(f"manifest snapshot {where} is malformed ({type(e).__name__}: {e})") from None
            return state, (version, len(state.samples))
        state, base = self._read_snapshot(int(body["base"]))
        for key, head in body["heads"].items():
            start = state.heads.get(key, -1) + 1
            # the delta names how far each log goes, so the records are fetched together, not probed one by one
            for seq, record in read_record_range(objstore.join(self.url, "log", key), start, head):
                state.apply(key, seq, record)
            if state.heads.get(key, -1) != head:
                raise StoreError(f"topic {self.topic}: manifest version {version} names record {head} of log "
                                 f"{key}, which ends at {state.heads.get(key, -1)}; the log lost records")
        # as a full snapshot stores them: in commit order, which is also the arrival order
        state.samples = dict(sorted(state.samples.items(), key=lambda kv: kv[1].order))
        state.arrivals = list(state.samples)
        return state, base

    def _snapshot_versions(self) -> list[int]:
        return sorted(int(n.split(".")[0]) for n in objstore.list_dir(objstore.join(self.url, "snapshots"))
                      if n.endswith(".json"))

    def _load_latest_snapshot(self) -> None:
        """Start from the newest snapshot that reads back; a torn or unreadable one is skipped with
        a warning (the logs hold everything it held), down to a fold of the whole logs."""
        for version in reversed(self._snapshot_versions()):
            try:
                self.state, self._base = self._read_snapshot(version)
            except StoreError as e:
                log.warning("topic %s: skipping manifest version %d (%s); folding the logs from an older one",
                            self.topic, version, e)
                self.state, self._base = TopicState(), None
                continue
            self.snapshot_version = version
            break
        self.refresh()
        self.check_gaps()


class Producer:
    """Appends samples (``put``) and fields of existing samples (``add_fields``) to a topic."""

    def __init__(self, queue: TransferQueue, writer_id: str, schema: TopicSchema, tokens_field: str | None):
        self.queue = queue
        self.writer_id = check_writer_id(writer_id)
        self.schema = schema
        self.fields = {f.name: f for f in schema.fields}
        self.tokens_field = tokens_field
        try:
            queue.schema().merge(schema)  # fail on a contradicting declaration before writing
        except OSError as e:
            raise StoreError(f"cannot read topic {queue.url}: {e}") from None
        self.lease = WriterLease(objstore.join(queue.url, "leases"), writer_id, queue.lease_timeout_s).acquire()
        objstore.write_bytes(objstore.join(queue.url, "schema", f"{writer_id}.json"),
                             json.dumps(schema.to_json(), sort_keys=True).encode(), fsync=queue.fsync)
        self.log = RecordLog(objstore.join(queue.url, "log", self.lease.key), fsync=queue.fsync)

    def put(self, samples: Sequence[Mapping[str, Any]], meta: Mapping[str, Any] | None = None) -> list[str]:
        """Commit ``samples`` as one shard. Each sample maps ``id``, ``group``, ``group_size``,
        ``policy_version`` (and optionally ``num_tokens``) plus every declared field."""
        if not samples:
            return []
        rows, columns = [], {name: [] for name in self.fields}
        seen: set[str] = set()
        for i, s in enumerate(samples):
            sid = str(s.get("id", f"{self.lease.key}:{self.log.next_seq}:{i}"))
            if sid in seen:
                raise SchemaError(f"sample id {sid!r} appears twice in one put")
            seen.add(sid)
            missing = [f for f in self.fields if f not in s]
            extra = [k for k in s if k not in self.fields and k not in RESERVED]
            if missing or extra:
                raise SchemaError(f"sample {sid!r}: missing fields {missing}, undeclared fields {extra}; "
                                  f"declared: {list(self.fields)}")
            size = s.get("group_size", 1)
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                # a group that can never be complete would crash every consumer on every restart
                raise SchemaError(f"sample {sid!r}: group_size must be an integer >= 1, got {size!r}")
            for name, f in self.fields.items():
                columns[name].append(f.check(s[name], sid))
            ntok = s.get("num_tokens")
            if ntok is None:
                ntok = len(columns[self.tokens_field][-1]) if self.tokens_field in self.fields else 0
            rows.append([sid, str(s.get("group", sid)), int(s.get("group_size", 1)), int(s.get("policy_version", 0)),
                         int(ntok)])
        return self._commit("put", rows, columns, [r[0] for r in rows], meta)

    def add_fields(self, values: Mapping[str, Mapping[str, Any]], meta: Mapping[str, Any] | None = None) -> int:
        """Commit new fields for existing samples: ``{sample_id: {field: value}}``."""
        if not values:
            return 0
        names = sorted({f for v in values.values() for f in v})
        columns = {name: [] for name in names}
        for sid, fields in values.items():
            if sorted(fields) != names:
                raise SchemaError(f"sample {sid!r}: add_fields needs the same fields for every sample ({names})")
            for name in names:
                if name not in self.fields:
                    raise SchemaError(f"field {name!r} is not declared by writer {self.writer_id!r}; "
                                      f"declared: {list(self.fields)}")
                columns[name].append(self.fields[name].check(fields[name], sid))
        self._commit("fields", None, columns, list(values), meta)
        return len(values)

    def _commit(self, kind: str, rows: list | None, columns: dict, ids: list[str], meta: Mapping | None) -> Any:
        self.lease.renew()
        blob = b"".join(encode_shard(columns, self.fields, ids))
        shard = f"{self.lease.key}/{self.log.next_seq:08d}.safetensors"
        objstore.write_bytes(objstore.join(self.queue.url, "shards", shard), blob, fsync=self.queue.fsync)
        record: dict[str, Any] = {"kind": kind, "shard": shard, "crc32c": checksum(blob), "nbytes": len(blob),
                                  "fields": list(columns), "time": time.time(), "meta": dict(meta or {})}
        if kind == "put":
            record["samples"] = rows
        else:
            record["ids"] = ids
        seq = self.log.append(record)
        self.queue.state.apply(self.lease.key, seq, record)  # our own commits are visible to us at once
        self.queue.notifier.notify(self.queue.url)
        return ids

    def last_meta(self) -> dict[str, Any] | None:
        """``meta`` of this writer id's newest commit, across incarnations: where to resume from."""
        self.queue.refresh()
        newest: tuple[float, dict[str, Any]] | None = None
        for key, head in self.queue.state.heads.items():
            if split_key(key)[0] != self.writer_id:
                continue
            for _, record in read_records(objstore.join(self.queue.url, "log", key), head):
                if newest is None or record["time"] >= newest[0]:
                    newest = (record["time"], record.get("meta", {}))
        return None if newest is None else newest[1]

    def close(self) -> None:
        self.lease.release()


def samples_of(state: TopicState, fields: Iterable[str]) -> list[str]:
    """Ids of samples that have every one of ``fields``, in arrival order."""
    need = list(fields)
    return [m.id for m in sorted(state.samples.values(), key=lambda m: m.order) if all(f in m.locs for f in need)]
