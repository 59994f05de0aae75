"""WeightStore: published policy versions as checksummed safetensors, atomically visible.

``<root>/runs/<run_id>/weights/<version:08d>/``::

    model-00001-of-00002.safetensors ...   tensors, split at ``max_shard_bytes``
    manifest.json                          written last: files, sha256, sizes, meta

A version exists iff its manifest does, so a reader never sees half a version however
the publisher dies. The store is the truth; in-cluster fast paths (NCCL broadcast to
engines) are optimisations that the rollout side verifies against it.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Iterable, Mapping
from typing import Any

from relax import objstore
from relax.faults import fault_point
from relax.transfer.errors import QueueTimeout, StoreError, TransferError
from relax.transfer.polling import Backoff
from relax.transfer.writers import WriterLease

WEIGHT_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")  # what publish() names its files


class WeightStore:
    def __init__(self, root: str, run_id: str, *, max_shard_bytes: int = 2 << 30, poll_interval_s: float = 0.05,
                 fsync: bool = True):
        self.url = objstore.join(objstore.absolute_url(root), "runs", run_id, "weights")
        self.max_shard_bytes = max_shard_bytes
        self.poll_interval_s = poll_interval_s
        self.fsync = fsync
        self._lease: WriterLease | None = None

    def version_url(self, version: int) -> str:
        return objstore.join(self.url, f"{version:08d}")

    def publish(self, version: int, state_dict: Mapping[str, Any], meta: Mapping[str, Any] | None = None) -> str:
        """Write ``state_dict`` (torch tensors) as version ``version``; returns its URL."""
        from safetensors.torch import save as st_save

        if self._lease is None:  # one publisher per run: the actor
            self._lease = WriterLease(objstore.join(self.url, "leases"), "publisher").acquire()
        self._lease.renew()
        if version in self.versions():
            raise TransferError(f"weight version {version} is already published at {self.version_url(version)}; "
                                f"versions are immutable, publish {self.latest() + 1} instead")
        groups: list[dict[str, Any]] = [{}]
        size = 0
        seen: set[int] = set()
        for name in sorted(state_dict):
            t = state_dict[name].detach().cpu().contiguous()
            if t.data_ptr() in seen:  # tied weights (embedding = LM head): safetensors wants separate copies
                t = t.clone()
            seen.add(t.data_ptr())
            nbytes = t.numel() * t.element_size()
            if groups[-1] and size + nbytes > self.max_shard_bytes:
                groups.append({})
                size = 0
            groups[-1][name] = t
            size += nbytes
        files = []
        for i, tensors in enumerate(groups, start=1):
            fname = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
            blob = st_save(tensors, metadata={"format": "pt"})
            objstore.write_bytes(objstore.join(self.version_url(version), fname), blob, fsync=self.fsync)
            files.append({"name": fname, "sha256": hashlib.sha256(blob).hexdigest(), "bytes": len(blob),
                          "tensors": sorted(tensors)})
        fault_point("actor", "publish", version)  # files written, manifest not: the version does not exist yet
        manifest = {"version": version, "time": time.time(), "files": files, "meta": dict(meta or {})}
        objstore.write_bytes(objstore.join(self.version_url(version), "manifest.json"),
                             json.dumps(manifest, indent=1).encode(), fsync=self.fsync)
        return self.version_url(version)

    def close(self) -> None:
        """Release the publisher lease, so the next incarnation of the actor may publish at once."""
        if self._lease is not None:
            self._lease.release()
            self._lease = None

    def versions(self) -> list[int]:
        out = []
        for name in objstore.list_dir(self.url):
            if name.isdigit() and objstore.exists(objstore.join(self.url, name, "manifest.json")):
                out.append(int(name))
        return sorted(out)

    def latest(self) -> int | None:
        v = self.versions()
        return v[-1] if v else None

    def wait_for(self, version: int, timeout: float | None = None) -> int:
        """Block until a version >= ``version`` is published; returns the newest one."""
        deadline = None if timeout is None else time.monotonic() + timeout
        backoff = Backoff(self.poll_interval_s, max(self.poll_interval_s, 1.0))
        while True:
            latest = self.latest()
            if latest is not None and latest >= version:
                return latest
            if deadline is not None and time.monotonic() >= deadline:
                raise QueueTimeout(f"weight version {version} not published within {timeout} s "
                                   f"(latest: {latest}) at {self.url}")
            time.sleep(backoff.next())

    def manifest(self, version: int) -> dict[str, Any]:
        where = objstore.join(self.version_url(version), "manifest.json")
        try:
            return json.loads(objstore.read_bytes(where))
        except FileNotFoundError:
            raise StoreError(f"weight version {version} is not published at {self.url} "
                             f"(have {self.versions()})") from None
        except (ValueError, UnicodeDecodeError) as e:  # torn by a power loss, or altered
            raise StoreError(f"weight manifest {where} is not valid JSON ({e}); the version cannot be trusted: "
                             f"publish it again or load another version") from None

    def load(self, version: int | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(state_dict, meta)`` of ``version`` (default: the latest), every file checksum-verified."""
        from safetensors.torch import load as st_load

        if version is None:
            version = self.latest()
            if version is None:
                raise StoreError(f"no weight version is published at {self.url}")
        manifest = self.manifest(version)
        where = f"{self.version_url(version)}/manifest.json"
        files = manifest.get("files") if isinstance(manifest, dict) else None
        if not isinstance(files, list) or not isinstance(manifest.get("meta", {}), dict):
            raise StoreError(f"{where} is malformed (no list of files); the store was altered")
        for f in files:  # names as publish() writes them, so none can read outside this version's folder
            name = f.get("name") if isinstance(f, dict) else None
            if not isinstance(name, str) or not WEIGHT_FILE.fullmatch(name) or not isinstance(f.get("sha256"), str):
                raise StoreError(f"{where} names weight file {name!r}, not one of model-NNNNN-of-NNNNN.safetensors "
                                 f"with a sha256; nothing was loaded")
        state: dict[str, Any] = {}
        for f in files:
            blob = objstore.read_bytes(objstore.join(self.version_url(version), f["name"]), large=True)
            if hashlib.sha256(blob).hexdigest() != f["sha256"]:
                raise StoreError(f"weight file {self.version_url(version)}/{f['name']} fails its sha256 check")
            state.update(st_load(blob))
        return state, manifest.get("meta", {})

    def retain(self, keep: Iterable[int], keep_latest: int = 2) -> list[int]:
        """Delete versions that are neither in ``keep`` (what checkpoints reference) nor the newest
        ``keep_latest``; returns the deleted versions. The manifest goes first, so a version
        being deleted is invisible before its files disappear."""
        versions = self.versions()
        kept = set(keep) | set(versions[-keep_latest:] if keep_latest else [])
        deleted = []
        for v in versions:
            if v in kept:
                continue
            objstore.delete(objstore.join(self.version_url(v), "manifest.json"))
            objstore.delete(self.version_url(v))
            deleted.append(v)
        return deleted
