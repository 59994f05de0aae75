"""One writer per log: writer leases, incarnations and append-only record logs.

Object stores have no locks and no atomic rename, so Relax never lets two processes write
the same object. Every appending process is a *writer* with a stable id (``rollout-0``)
and a fresh *incarnation* per start; its records go to ``<log>/<id>.<incarnation>/<seq>.json``
so a restarted writer can never collide with its predecessor. A small lease object
``<leases>/<id>.json`` (pid, host, heartbeat) makes a second live process with the same id
refuse to start, naming the first; a dead holder (its pid gone on this host, or no
heartbeat for ``lease_timeout_s`` elsewhere) is taken over.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
import uuid
from collections.abc import Iterator
from typing import Any

from relax import objstore
from relax.transfer.errors import StoreError, WriterConflict

_WRITER_ID = re.compile(r"^[A-Za-z0-9_:@-]+$")


def new_incarnation() -> str:
    """Sortable by start time, unique across hosts: ``<unix ns>-<6 hex>``."""
    return f"{time.time_ns():019d}-{uuid.uuid4().hex[:6]}"


def check_writer_id(writer_id: str) -> str:
    if not _WRITER_ID.match(writer_id or ""):
        raise ValueError(f"writer id {writer_id!r} may only hold letters, digits and _ : @ - (no '.' or '/')")
    return writer_id


def split_key(key: str) -> tuple[str, str]:
    """``rollout-0.1712345678901-ab12cd`` -> (``rollout-0``, incarnation)."""
    writer_id, _, incarnation = key.rpartition(".")
    return writer_id, incarnation


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed child that nobody reaped yet is a zombie: dead for our purposes
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


class WriterLease:
    """Exclusive right of one live process to write under ``writer_id``."""

    def __init__(self, leases_url: str, writer_id: str, lease_timeout_s: float = 30.0):
        self.writer_id = check_writer_id(writer_id)
        self.url = objstore.join(leases_url, f"{writer_id}.json")
        self.timeout = lease_timeout_s
        self.incarnation = new_incarnation()
        self.host = socket.gethostname()
        self._last_beat = 0.0

    @property
    def key(self) -> str:
        return f"{self.writer_id}.{self.incarnation}"

    def holder(self) -> dict[str, Any] | None:
        try:
            return json.loads(objstore.read_bytes(self.url))
        except FileNotFoundError:
            return None
        except (ValueError, OSError):
            return None  # a torn lease (power loss) is treated as no lease

    def holder_alive(self, lease: dict[str, Any]) -> bool:
        if lease.get("host") == self.host:
            return _pid_alive(int(lease.get("pid", -1)))
        return time.time() - float(lease.get("heartbeat", 0)) < self.timeout

    def acquire(self) -> WriterLease:
        lease = self.holder()
        if lease and lease.get("incarnation") != self.incarnation and self.holder_alive(lease):
            raise WriterConflict(self._conflict_message(lease))
        self._write()
        confirmed = self.holder()  # two racing starters: the last write wins, the other backs off
        if not confirmed or confirmed.get("incarnation") != self.incarnation:
            raise WriterConflict(self._conflict_message(confirmed or {}))
        return self

    def renew(self) -> None:
        """Heartbeat, at most every third of the timeout; fails if another process took over."""
        now = time.time()
        if now - self._last_beat < self.timeout / 3:
            return
        lease = self.holder()
        if lease and lease.get("incarnation") != self.incarnation:
            raise WriterConflict(f"writer {self.writer_id!r} was taken over by incarnation "
                                 f"{lease.get('incarnation')} (pid {lease.get('pid')} on {lease.get('host')}); "
                                 f"this process must stop writing")
        self._write()

    def release(self) -> None:
        lease = self.holder()
        if lease and lease.get("incarnation") == self.incarnation:
            objstore.delete(self.url)

    def _write(self) -> None:
        self._last_beat = time.time()
        body = {"writer": self.writer_id, "incarnation": self.incarnation, "pid": os.getpid(), "host": self.host,
                "heartbeat": self._last_beat}
        try:
            objstore.write_bytes(self.url, json.dumps(body).encode(), fsync=False)
        except OSError as e:
            raise StoreError(f"cannot write to {self.url}: {e}; check that the root exists and is writable") from None

    def _conflict_message(self, lease: dict[str, Any]) -> str:
        age = time.time() - float(lease.get("heartbeat", 0))
        return (f"writer {self.writer_id!r} is already live: incarnation {lease.get('incarnation')} "
                f"(pid {lease.get('pid')} on host {lease.get('host')}, last heartbeat {age:.1f} s ago); "
                f"stop that process or give this one another writer id")


class RecordLog:
    """Append-only JSON records of one writer incarnation: ``<dir>/<seq:08d>.json``."""

    def __init__(self, url: str, fsync: bool = False):
        self.url = url
        self.fsync = fsync
        self.next_seq = 0

    def append(self, record: dict[str, Any]) -> int:
        seq = self.next_seq
        objstore.write_bytes(objstore.join(self.url, f"{seq:08d}.json"),
                             json.dumps(record, separators=(",", ":")).encode(), fsync=self.fsync)
        self.next_seq += 1
        return seq


def read_record_range(url: str, start: int, stop: int, chunk: int = 64) -> Iterator[tuple[int, dict[str, Any]]]:
    """Records ``start..stop`` (inclusive) of one log, known to exist, fetched ``chunk`` at a time
    concurrently (``objstore.read_many``); stops at the first one missing, so the caller can name
    the gap."""
    for first in range(start, stop + 1, chunk):
        seqs = range(first, min(first + chunk, stop + 1))
        for seq, blob in zip(seqs, objstore.read_many(url, [f"{s:08d}.json" for s in seqs]), strict=True):
            if blob is None:
                return
            yield seq, _decode_record(url, seq, blob)


def _decode_record(url: str, seq: int, blob: bytes) -> dict[str, Any]:
    try:
        return json.loads(blob)
    except ValueError:
        raise StoreError(f"commit record {url}/{seq:08d}.json is not valid JSON (torn by a power loss?)") from None


def read_records(url: str, start: int = 0) -> Iterator[tuple[int, dict[str, Any]]]:
    """Records ``start, start+1, ...`` of one log until the first that does not exist yet.

    Probing by sequence number (one GET each) instead of listing keeps a poll cheap on
    object stores, where a LIST costs more and may lag behind writes.
    """
    seq = start
    while True:
        try:
            blob = objstore.read_bytes(objstore.join(url, f"{seq:08d}.json"))
        except FileNotFoundError:
            return
        yield seq, _decode_record(url, seq, blob)
        seq += 1
