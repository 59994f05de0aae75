"""``rollout.weight_sync=broadcast`` falls back to disk when the broadcast cannot happen, and is
refused where there is no engine server to broadcast to."""

from __future__ import annotations

import asyncio

import pytest

from relax.config import ConfigError, load_config
from relax.rollout.weight_sync import BroadcastSync
from relax.services.run_context import RunContext
from relax.services.trainable import check_trainable


def test_an_engine_that_cannot_join_sends_the_version_the_disk_way(tmp_path):
    from relax.transfer.weights import WeightStore

    sync = BroadcastSync(timeout_s=5.0)
    store = WeightStore(f"file://{tmp_path}", "r")
    # nothing listens on port 9 (discard) of the loopback: the group cannot open, so the caller loads from disk
    assert asyncio.run(sync.push(["http://127.0.0.1:9"], store, 1)) is False
    assert (sync.pushed, sync.fallbacks, sync.broadcaster) == (0, 1, None)
    assert asyncio.run(sync.push([], store, 1)) is False  # no engine: nothing to broadcast to


def test_broadcast_needs_engine_servers(tmp_path):
    cfg = load_config(None, [f"root=file://{tmp_path}", "data.tasks=[arithmetic]", "rollout.weight_sync=broadcast"])
    with pytest.raises(ConfigError, match="rollout.weight_sync=broadcast sends weights to engine servers"):
        check_trainable(RunContext(cfg))
