"""WeightFollower: brings an engine's weights to a WeightStore version by the fewest bytes.

The follower remembers which version (and content hash) the engine's tensors hold. To reach
version ``t`` it reads ``t``'s chain (its nearest full version ``F``, then each delta up to ``t``):

* the engine holds a version ``c`` of that chain with the content the chain names: it fetches
  the deltas after ``c`` and writes them into the engine's tensors in place, when they are
  fewer bytes than ``F`` and all of its deltas (they always are, unless the chain is long and
  dense);
* otherwise it loads ``t`` whole (``WeightStore.load``: ``F`` plus every delta, verified).

A delta is refused when a file fails its digest, its base content is not what the engine
holds, or the engine's tensors afterwards do not hash to ``t``'s content; what it wrote is put
back (the elements it overwrote were kept aside) and the follower loads ``t`` whole instead, so
an engine never serves bits that are not ``t``'s. Versions published with ``full_every = 1``
carry no content hash; the follower then always loads whole versions.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from relax.transfer import weight_delta, weight_files
from relax.transfer.errors import StoreError

log = logging.getLogger(__name__)

# ``swap(write, version)`` runs ``write()`` where the engine's tensors may change (between scheduler steps)
Swap = Callable[[Callable[[], None], str], None]


def _bytes(manifest: Mapping[str, Any]) -> int:
    return sum(int(f.get("bytes", 0)) for f in manifest["files"])


def plan(chain: list[Mapping[str, Any]], version: int | None, content: str | None) -> tuple[str, int]:
    """``("delta", i)``: apply ``chain[i:]`` to what the engine holds; ``("full", 0)``: load the version whole.

    ``chain`` is :meth:`~relax.transfer.weights.WeightStore.chain`'s; ``version``/``content`` are what
    the engine holds (None: unknown)."""
    if content is None or len(chain) < 2:
        return "full", 0
    at = next((i for i, m in enumerate(chain) if m["version"] == version and m.get("content") == content), None)
    if at is None or at == len(chain) - 1:
        return "full", 0
    if sum(map(_bytes, chain[at + 1:])) >= sum(map(_bytes, chain)):
        return "full", 0
    return "delta", at + 1


class WeightFollower:
    """One engine's view of the store: ``update(store, version, tensors, swap, load_full)``."""

    def __init__(self, threads: int = 8):
        self.version: int | None = None
        self.content: str | None = None
        self.digests: dict[str, str] = {}
        self.threads = threads
        self.refused = 0  # deltas refused (then loaded whole)
        self.last_path = ""  # "delta" or "full": how the last update went

    def forget(self) -> None:
        """The engine's weights changed some other way (a broadcast, a folder): trust no delta base."""
        self.version, self.content, self.digests = None, None, {}

    def update(self, store: Any, version: int, tensors: Callable[[], Mapping[str, Any]], swap: Swap,
               load_full: Callable[[Mapping[str, Any]], None], chain: list[dict[str, Any]] | None = None) -> str:
        """Bring the engine to ``version``; returns "delta" or "full", how it went.

        ``tensors()``: the engine's tensors by published name (views of its parameters);
        ``swap(write, label)``: run ``write()`` between scheduler steps and then serve ``label``;
        ``load_full(state)``: swap in a whole state dict (the engine's usual load); ``chain``: the
        store's chain of ``version`` if the caller read it already (each manifest is read once per sync)."""
        chain = chain or store.chain(version)
        how, start = plan(chain, self.version, self.content)
        if how == "delta":
            try:
                self._apply(store, chain, start, tensors, swap)
                self.last_path = "delta"
                return "delta"
            except (StoreError, ValueError) as e:
                self.refused += 1
                log.warning("weight version %s: delta refused (%s); loading it whole", version, e)
        state, _ = store.load(version, chain=chain)
        load_full(state)
        self.forget()
        content = chain[-1].get("content")
        if content is not None:  # what the engine now holds, for the next delta
            held = tensors()
            algorithm = weight_files.algorithm(chain[-1], f"weight version {version}'s manifest")
            digests = weight_delta.digests({n: held[n] for n in state if n in held}, self.threads, algorithm)
            if set(digests) == set(state) and weight_delta.combine(digests, algorithm) == content:
                self.version, self.content, self.digests = version, content, digests
        self.last_path = "full"
        return "full"

    def _apply(self, store: Any, chain: list[Mapping[str, Any]], start: int,
               tensors: Callable[[], Mapping[str, Any]], swap: Swap) -> None:
        if chain[start]["delta"].get("base_content") != self.content:
            raise StoreError(f"delta version {chain[start]['version']} is over content "
                             f"{chain[start]['delta'].get('base_content')}, not the engine's")
        steps = [(m, store.deltas(m)) for m in chain[start:]]  # every file read and verified before any write
        held = tensors()
        for m, deltas in steps:
            for name, d in deltas.items():
                if name not in held or name not in self.digests:
                    raise StoreError(f"delta version {m['version']} changes {name!r}, which the engine does not hold")
                problem = weight_delta.check(d, held[name])
                if problem is not None:
                    raise StoreError(f"delta version {m['version']}, tensor {name!r}: {problem}")
        target = chain[-1]
        algorithm = weight_files.algorithm(target, f"weight version {target['version']}'s manifest")

        def write() -> None:
            undo: list[tuple[str, Any, Any]] = []
            try:
                for _, deltas in steps:
                    for name, d in deltas.items():
                        undo.append((name, d, weight_delta.apply_(held[name], d)))
                # every tensor, not only those the deltas touched: the result is verified whole
                fresh = weight_delta.digests({n: held[n] for n in self.digests}, self.threads, algorithm)
                if weight_delta.combine(fresh, algorithm) != target["content"]:
                    raise StoreError(f"after its deltas the engine's weights do not hash to version "
                                     f"{target['version']}'s content")
            except BaseException:
                for name, d, old in reversed(undo):  # back to the bits it held
                    weight_delta.undo_(held[name], d, old)
                raise
            self.version, self.content, self.digests = target["version"], target["content"], fresh

        swap(write, str(target["version"]))
