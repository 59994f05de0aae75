"""``rollout.weight_sync=broadcast``: the rollout sends each weight version to its engines over one
process group (SGLang's ``/update_weights_from_distributed``; NCCL between GPUs, gloo on CPU)
instead of having every engine read the version's folder (``/update_weights_from_disk``).

The rollout reads the version from the WeightStore once and broadcasts it: N engines cost one
read and one broadcast rather than N reads of the store, which matters when the store is remote
or the engines are many. The group is opened with the engines the pool routes to and opened
again when that set changes (a replacement, a scale-out). Any failure (an engine that cannot
join, a refused bucket) closes the group and the version goes the disk way for that load, so a
broadcast never leaves an engine on the wrong weights: what the pool routes to has either
confirmed the version over the group or loaded it from its folder. Engines admitted later load
their first version from disk as before.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from relax.engines.weight_broadcast import DEFAULT_BUCKET_BYTES, WeightBroadcaster
from relax.transfer.weights import WeightStore

log = logging.getLogger(__name__)

WEIGHT_SYNCS = ("disk", "broadcast")


class BroadcastSync:
    """The pool's broadcaster (one per :class:`relax.rollout.remote_engines.RemoteEngines`), on its loop."""

    def __init__(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout_s: float = 120.0):
        self.bucket_bytes, self.timeout_s = bucket_bytes, timeout_s
        self.broadcaster: WeightBroadcaster | None = None
        self.urls: tuple[str, ...] = ()
        self.pushed = 0  # versions that reached every engine over the group
        self.fallbacks = 0  # versions that went the disk way after a failure here

    async def push(self, urls: Sequence[str], store: WeightStore, version: int) -> bool:
        """Send ``version`` to ``urls``; True when every one confirmed it, False (after closing
        the group) when the caller must load it from disk instead."""
        if not urls:
            return False
        try:
            if self.broadcaster is None or tuple(sorted(urls)) != self.urls:
                await self.close()
                broadcaster = WeightBroadcaster(timeout_s=self.timeout_s)
                try:
                    await broadcaster.connect(sorted(urls))
                except BaseException:
                    await broadcaster.close()  # its HTTP clients
                    raise
                self.broadcaster, self.urls = broadcaster, tuple(sorted(urls))
            state, _ = await asyncio.to_thread(store.load, version)
            await self.broadcaster.push(state, version, bucket_bytes=self.bucket_bytes)
        except Exception as e:  # noqa: BLE001 - the disk path is the fallback for any failure here
            log.warning("broadcasting weight version %s to %s failed (%s); loading it from disk", version,
                        ", ".join(urls), e)
            self.fallbacks += 1
            await self.close()
            return False
        self.pushed += 1
        return True

    async def close(self) -> None:
        broadcaster, self.broadcaster, self.urls = self.broadcaster, None, ()
        if broadcaster is not None:
            try:
                await broadcaster.close()
            except Exception as e:  # noqa: BLE001 - an engine already gone cannot leave the group
                log.warning("closing the weight broadcast group: %s", e)
