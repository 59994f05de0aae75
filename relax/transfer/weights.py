"""WeightStore: published policy versions as checksummed safetensors, atomically visible.

``<root>/runs/<run_id>/weights/<version:08d>/``::

    model-00001-of-00002.safetensors ...   tensors, split at ``max_shard_bytes``
    delta-00001-of-00001.safetensors ...   or, for a delta version, the changed elements
    manifest.json                          written last: files, their digests, sizes, meta

A version exists iff its manifest does, so a reader never sees half a version however
the publisher dies. The store is the truth; in-cluster fast paths (NCCL broadcast to
engines) are optimisations that the rollout side verifies against it.

With ``full_every > 1`` a version may be stored as the exact difference from the version
before it (``relax.transfer.weight_delta``) when that is fewer bytes, and at most
``full_every - 1`` deltas follow a full version. Its manifest then names its ``base`` version,
the base's content hash and its own (``content``), and :meth:`WeightStore.load` rebuilds it
from the nearest full version and verifies the result (docs/weight_sync.md). Files go up and
come down concurrently, ``threads`` at a time; how their bytes are laid out and digested, and
which digest algorithms a manifest may name, is ``relax.transfer.weight_files``.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from relax import objstore
from relax.faults import fault_point
from relax.transfer import weight_delta, weight_files
from relax.transfer.errors import QueueTimeout, StoreError, TransferError
from relax.transfer.polling import Backoff
from relax.transfer.writers import WriterLease

WEIGHT_FILE = re.compile(r"(model|delta)-\d{5}-of-\d{5}\.safetensors")  # what publish() names its files
_INDEX, _VALUES = "/index", "/values"  # a delta file's tensors: <name>/index and <name>/values


@dataclass
class _Base:
    """The publisher's copy of the last version it wrote, which the next one may be a delta from."""

    version: int
    tensors: dict[str, Any]
    content: str
    chain: int  # deltas since the last full version


class WeightStore:
    def __init__(self, root: str, run_id: str, *, max_shard_bytes: int = 2 << 30, poll_interval_s: float = 0.05,
                 fsync: bool = True, full_every: int = 1, threads: int = 8):
        self.url = objstore.join(objstore.absolute_url(root), "runs", run_id, "weights")
        self.max_shard_bytes = max_shard_bytes
        self.poll_interval_s = poll_interval_s
        self.fsync = fsync
        self.full_every = max(1, full_every)
        self.threads = max(1, threads)
        self._lease: WriterLease | None = None
        self._base: _Base | None = None

    def version_url(self, version: int) -> str:
        return objstore.join(self.url, f"{version:08d}")

    def publish(self, version: int, state_dict: Mapping[str, Any], meta: Mapping[str, Any] | None = None) -> str:
        """Write ``state_dict`` (torch tensors) as version ``version``; returns its URL."""
        if self._lease is None:  # one publisher per run: the actor
            self._lease = WriterLease(objstore.join(self.url, "leases"), "publisher").acquire()
        self._lease.renew()
        have = self.versions()
        if version in have:
            raise TransferError(f"weight version {version} is already published at {self.version_url(version)}; "
                                f"versions are immutable, publish {self.latest() + 1} instead")
        # tied weights (embedding = LM head) share memory: weight_files writes each name's bytes all the same
        tensors = {name: state_dict[name].detach().cpu().contiguous() for name in sorted(state_dict)}
        extra: dict[str, Any] = {}
        content = None
        if self.full_every > 1:
            content = weight_delta.content_hash(tensors, self.threads)
            extra["content"] = content
            deltas = self._delta_from_base(have, tensors)
            if deltas is not None:
                base = self._base
                extra["delta"] = {"base": base.version, "base_content": base.content,
                                  "kinds": {n: d.kind for n, d in deltas.items()}}
                tensors = {f"{n}{part}": t for n, d in deltas.items()
                           for part, t in ((_INDEX, d.index), (_VALUES, d.values))}
        files = self._write_files(version, tensors, "delta" if "delta" in extra else "model")
        fault_point("actor", "publish", version)  # files written, manifest not: the version does not exist yet
        manifest = {"version": version, "time": time.time(), "digest": weight_files.DIGEST, "files": files,
                    "meta": dict(meta or {}), **extra}
        objstore.write_bytes(objstore.join(self.version_url(version), "manifest.json"),
                             json.dumps(manifest, indent=1).encode(), fsync=self.fsync)
        if content is not None:
            self._keep_base(version, state_dict, content, 0 if "delta" not in extra else self._base.chain + 1)
        return self.version_url(version)

    def _delta_from_base(self, have: list[int], tensors: dict[str, Any]) -> dict[str, Any] | None:
        """The deltas from the kept base to ``tensors``, when the base is the newest published version,
        the chain may grow and they are fewer bytes than the full version; else None."""
        base = self._base
        if base is None or not have or have[-1] != base.version or base.chain + 1 >= self.full_every \
                or set(base.tensors) != set(tensors):
            return None
        names = list(tensors)
        with ThreadPoolExecutor(self.threads) as pool:  # numpy's compares free the GIL
            found = pool.map(lambda n: weight_delta.diff(base.tensors[n], tensors[n]), names)
            deltas = {n: d for n, d in zip(names, found, strict=True) if d is not None}
        full = sum(t.numel() * t.element_size() for t in tensors.values())
        return deltas if sum(d.nbytes for d in deltas.values()) < full else None

    def _keep_base(self, version: int, state_dict: Mapping[str, Any], content: str, chain: int) -> None:
        """Copy what was published into the kept base (its buffers reused: the trainer's change in place)."""
        old = self._base.tensors if self._base is not None else {}
        kept = {}
        for name, t in state_dict.items():
            t = t.detach()
            prev = old.get(name)
            if prev is not None and prev.shape == t.shape and prev.dtype == t.dtype:
                kept[name] = prev.copy_(t)
            else:
                kept[name] = t.to("cpu", copy=True)
        self._base = _Base(version, kept, content, chain)

    def _write_files(self, version: int, tensors: dict[str, Any], prefix: str) -> list[dict[str, Any]]:
        """``tensors`` in files of at most ``max_shard_bytes`` (a larger tensor alone), written concurrently."""
        groups: list[dict[str, Any]] = [{}]
        size = 0
        for name, t in tensors.items():
            nbytes = t.numel() * t.element_size()
            if groups[-1] and size + nbytes > self.max_shard_bytes:
                groups.append({})
                size = 0
            groups[-1][name] = t
            size += nbytes

        def write(i: int) -> dict[str, Any]:
            fname = f"{prefix}-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            parts = weight_files.serialize(groups[i], {"format": "pt"})  # views of the tensors: no copy
            objstore.write_bytes(objstore.join(self.version_url(version), fname), parts, fsync=self.fsync)
            return {"name": fname, weight_files.DIGEST: weight_files.digest(parts),
                    "bytes": sum(memoryview(p).nbytes for p in parts), "tensors": sorted(groups[i])}

        with ThreadPoolExecutor(min(self.threads, len(groups))) as pool:
            return list(pool.map(write, range(len(groups))))

    def close(self) -> None:
        """Release the publisher lease, so the next incarnation of the actor may publish at once."""
        if self._lease is not None:
            self._lease.release()
            self._lease = None
        self._base = None

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
        """Version ``version``'s manifest, its list of files checked (names as publish() writes them,
        so none can read outside this version's folder)."""
        where = objstore.join(self.version_url(version), "manifest.json")
        try:
            manifest = json.loads(objstore.read_bytes(where))
        except FileNotFoundError:
            raise StoreError(f"weight version {version} is not published at {self.url} "
                             f"(have {self.versions()})") from None
        except (ValueError, UnicodeDecodeError) as e:  # torn by a power loss, or altered
            raise StoreError(f"weight manifest {where} is not valid JSON ({e}); the version cannot be trusted: "
                             f"publish it again or load another version") from None
        files = manifest.get("files") if isinstance(manifest, dict) else None
        if not isinstance(files, list) or not isinstance(manifest.get("meta", {}), dict):
            raise StoreError(f"{where} is malformed (no list of files); the store was altered")
        algorithm = weight_files.algorithm(manifest, where)  # sha256 for versions written before xxh3_128
        for f in files:
            name = f.get("name") if isinstance(f, dict) else None
            if not isinstance(name, str) or not WEIGHT_FILE.fullmatch(name) or not isinstance(f.get(algorithm), str):
                raise StoreError(f"{where} names weight file {name!r}, not one of model-NNNNN-of-NNNNN.safetensors "
                                 f"(or delta-...) with a {algorithm} digest; nothing was loaded")
        delta = manifest.get("delta")
        if delta is not None and not (isinstance(delta, dict) and isinstance(delta.get("base"), int)
                                      and 0 <= delta["base"] < version and isinstance(delta.get("kinds"), dict)):
            raise StoreError(f"{where} has a malformed delta (a base version below {version} and the kinds of its "
                             f"tensors); the store was altered")
        return manifest

    def chain(self, version: int) -> list[dict[str, Any]]:
        """The manifests that rebuild ``version``: its nearest full version first, then each delta to it."""
        out = [self.manifest(version)]
        while "delta" in out[-1]:
            base = out[-1]["delta"]["base"]
            try:
                out.append(self.manifest(base))
            except StoreError as e:
                raise StoreError(f"weight version {version} is a delta over version {base}, which cannot be "
                                 f"read ({e}); load an earlier full version") from None
            if out[-1].get("content") != out[-2]["delta"].get("base_content"):
                raise StoreError(f"weight version {out[-2]['version']} is a delta over a version {base} whose "
                                 f"content hash differs from the one it names; the store was altered")
        return out[::-1]

    def fetch(self, manifest: Mapping[str, Any]) -> list[bytes]:
        """The bytes of every file of ``manifest``'s version, read concurrently and each checked against
        its digest (with the algorithm the manifest names)."""
        version = manifest["version"]
        algorithm = weight_files.algorithm(manifest, self.version_url(version))

        def read(f: Mapping[str, Any]) -> bytes:
            blob = objstore.read_bytes(objstore.join(self.version_url(version), f["name"]), large=True)
            if weight_files.digest([blob], algorithm) != f[algorithm]:
                raise StoreError(f"weight file {self.version_url(version)}/{f['name']} fails its {algorithm} check")
            return blob

        files = manifest["files"]
        with ThreadPoolExecutor(max(1, min(self.threads, len(files)))) as pool:
            return list(pool.map(read, files))

    def deltas(self, manifest: Mapping[str, Any]) -> dict[str, weight_delta.TensorDelta]:
        """A delta version's tensors, by name (read and verified, not yet applied)."""
        from safetensors.torch import load as st_load

        found: dict[str, Any] = {}
        for blob in self.fetch(manifest):
            found.update(st_load(blob))
        out = {}
        for name, kind in manifest["delta"]["kinds"].items():
            if f"{name}{_INDEX}" not in found or f"{name}{_VALUES}" not in found:
                raise StoreError(f"delta version {manifest['version']} names tensor {name!r} but its files do not "
                                 f"hold it; the store was altered")
            out[name] = weight_delta.TensorDelta(kind, found[f"{name}{_INDEX}"], found[f"{name}{_VALUES}"])
        return out

    def load(self, version: int | None = None,
             chain: list[dict[str, Any]] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(state_dict, meta)`` of ``version`` (default: the latest), every file checksum-verified;
        a delta version rebuilt from its nearest full version and its content hash verified.
        ``chain``: :meth:`chain` of ``version`` if the caller already read it (one read per sync)."""
        from safetensors.torch import load as st_load

        if version is None:
            version = self.latest()
            if version is None:
                raise StoreError(f"no weight version is published at {self.url}")
        if not chain or chain[-1].get("version") != version:
            chain = self.chain(version)
        state: dict[str, Any] = {}
        for blob in self.fetch(chain[0]):
            state.update(st_load(blob))
        for m in chain[1:]:
            for name, d in self.deltas(m).items():
                if name not in state:
                    raise StoreError(f"delta version {m['version']} changes {name!r}, which its base lacks")
                try:
                    weight_delta.apply_(state[name], d)
                except ValueError as e:
                    raise StoreError(f"delta version {m['version']}, tensor {name!r}: {e}") from None
        algorithm = weight_files.algorithm(chain[-1], self.version_url(version))  # the content's, too
        if len(chain) > 1 and weight_delta.content_hash(state, self.threads, algorithm) != chain[-1]["content"]:
            raise StoreError(f"weight version {version}, rebuilt from version {chain[0]['version']} and "
                             f"{len(chain) - 1} deltas, does not match its content hash; the store was altered")
        return state, chain[-1].get("meta", {})

    def retain(self, keep: Iterable[int], keep_latest: int = 2) -> list[int]:
        """Delete versions that are neither in ``keep`` (what checkpoints reference) nor the newest
        ``keep_latest``, nor a version a kept delta is rebuilt from; returns the deleted versions.
        The manifest goes first, so a version being deleted is invisible before its files disappear."""
        versions = self.versions()
        kept = set(keep) | set(versions[-keep_latest:] if keep_latest else [])
        for v in sorted(kept & set(versions)):
            try:
                kept.update(m["version"] for m in self.chain(v))
            except StoreError:
                pass  # a version that cannot be rebuilt keeps nothing else alive
        deleted = []
        for v in versions:
            if v in kept:
                continue
            objstore.delete(objstore.join(self.version_url(v), "manifest.json"))
            objstore.delete(self.version_url(v))
            deleted.append(v)
        return deleted
