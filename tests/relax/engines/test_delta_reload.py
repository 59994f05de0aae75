"""A native engine server follows WeightStore versions by deltas (relax.transfer.weight_updates) and lands
on the published bits, versions skipped or not."""

from __future__ import annotations

import asyncio

import torch

from relax.engines.client import EngineClient
from relax.engines.server import build_native_engine, create_app
from relax.transfer.weights import WeightStore
from tests.relax.engines.contract import InProcessServer
from tests.relax.engines.test_tied_reload import save_tied_model


def test_a_server_follows_versions_by_deltas(tmp_path):
    model_dir = save_tied_model(tmp_path / "tied")
    engine, processor = build_native_engine(str(model_dir), max_batch_size=4)
    engine.start()
    root = f"file://{tmp_path}/root"
    store = WeightStore(root, "r", full_every=8)
    state = {k: v.clone() for k, v in engine.model.state_dict().items()}
    versions, g = [], torch.Generator().manual_seed(0)
    for v in range(4):
        if v:  # a few elements of one matrix move, as a small RL step moves them
            flat = state["model.layers.0.mlp.up_proj.weight"].view(-1)
            flat[torch.randint(0, flat.numel(), (20,), generator=g)] += 0.5
        store.publish(v, state)
        versions.append({k: t.clone() for k, t in state.items()})
    assert "delta" in store.manifest(1) and "delta" in store.manifest(3)

    async def go(url: str) -> list[str]:
        paths = []
        async with EngineClient(url, timeout_s=60, retries=0) as c:
            for v in (0, 1, 3):  # 3 after 1: the engine applies the deltas of 2 and 3
                r = await c.update_weights_from_disk(store.version_url(v))
                assert r["success"] is True, r
                paths.append(r["message"].rsplit("(", 1)[-1].rstrip(")"))
                held = engine.model.state_dict()
                assert all(torch.equal(held[k], versions[v][k]) for k in versions[v]), v
                info = await c.model_info()
                assert info["weight_version"] == str(v)
        return paths

    try:
        with InProcessServer(create_app(engine, str(model_dir), root, "r", processor=processor)) as srv:
            assert asyncio.run(go(srv.url)) == ["full", "delta", "delta"]
    finally:
        engine.stop()
